// SPDX-License-Identifier: MIT
// Twin of alibi_without_alignment_ko.cpp: the bias names its alignment.
#include <attend/score_bias.hpp>

attend::score_bias alibi() {
    return attend::score_bias::alibi(attend::alibi_slopes(4), attend::alignment::bottom_right);
}
