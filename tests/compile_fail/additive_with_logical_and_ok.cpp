// SPDX-License-Identifier: MIT
// Twin of additive_with_logical_and_ko.cpp: additive terms combine with +.
#include <attend/mask.hpp>

std::string draw() {
    attend::tensor<float, 2> bias(3, 3);
    bias.setZero();
    const auto additive = attend::additive_mask<float>::query_key_grid(bias);
    return attend::to_string(additive + attend::causal(attend::alignment::top_left), {1, 1, 3, 3});
}
