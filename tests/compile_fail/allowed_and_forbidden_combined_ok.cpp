// SPDX-License-Identifier: MIT
// Twin of allowed_and_forbidden_combined_ko.cpp: the explicit conversion makes the intersection compile.
#include <attend/mask.hpp>

std::string draw() {
    attend::tensor<bool, 2> blocked(3, 3);
    blocked.setConstant(false);
    const auto forbidden = attend::forbidden_mask::query_key_grid(blocked);
    const auto causal = attend::causal(attend::alignment::top_left);
    return attend::to_string(causal && attend::to_allowed(forbidden), {1, 1, 3, 3});
}
