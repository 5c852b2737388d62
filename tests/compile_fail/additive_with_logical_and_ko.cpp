// SPDX-License-Identifier: MIT
// An additive mask under && must not compile: additive terms add to scores, they are not sets.
// expect-error: additive masks combine with +
#include <attend/mask.hpp>

std::string draw() {
    attend::tensor<float, 2> bias(3, 3);
    bias.setZero();
    const auto additive = attend::additive_mask<float>::query_key_grid(bias);
    return attend::to_string(additive && attend::causal(attend::alignment::top_left), {1, 1, 3, 3});
}
