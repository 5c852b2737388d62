// SPDX-License-Identifier: MIT
// Twin of score_mod_signature_ko.cpp: a score modifier takes the score and its (batch, head, query, key), for
// float and double scores.
#include <attend/score_function.hpp>

attend::score_function halve() {
    return attend::score_mod(
        [](auto s, attend::index_t, attend::index_t, attend::index_t, attend::index_t) { return s / 2; });
}
