// SPDX-License-Identifier: MIT
// Twin of relative_bias_without_alignment_ko.cpp: the bias names its alignment.
#include <attend/score_bias.hpp>

attend::score_bias relative(const attend::relative_position_bias<float>& table) {
    return attend::score_bias::relative(table, attend::alignment::top_left);
}
