// SPDX-License-Identifier: MIT
// Passing a forbidden_mask where attention expects an allowed set must not compile: the message names to_allowed.
// expect-error: attend::to_allowed
#include <attend/sdpa.hpp>

float run() {
    attend::tensor<float, 3> q(1, 3, 2), k(1, 3, 2), v(1, 3, 1);
    q.setZero();
    k.setZero();
    v.setConstant(1.f);
    attend::tensor<bool, 2> blocked(3, 3);
    blocked.setConstant(false);
    const auto forbidden = attend::forbidden_mask::query_key_grid(blocked);
    return attend::scaled_dot_product_attention(q, k, v, forbidden).out(0, 0, 0);
}
