// SPDX-License-Identifier: MIT
// A forbidden_mask (true = blocked) combined with an allowed set must not compile: the message names to_allowed.
// expect-error: attend::to_allowed
#include <attend/mask.hpp>

std::string draw() {
    attend::tensor<bool, 2> blocked(3, 3);
    blocked.setConstant(false);
    const auto forbidden = attend::forbidden_mask::query_key_grid(blocked);
    const auto causal = attend::causal(attend::alignment::top_left);
    return attend::to_string(causal && forbidden, {1, 1, 3, 3});
}
