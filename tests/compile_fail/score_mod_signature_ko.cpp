// SPDX-License-Identifier: MIT
// Twin of score_mod_signature_ok.cpp: a function of the score alone is not a score modifier; the message says
// which signature score_mod takes.
// expect-error: score_mod takes a function (score, batch, head, query, key) -> score
#include <attend/score_function.hpp>

attend::score_function halve() {
    return attend::score_mod([](auto s) { return s / 2; });
}
