// SPDX-License-Identifier: MIT
// Twin of forbidden_passed_to_attention_ko.cpp: attention takes the allowed set after an explicit conversion.
#include <attend/sdpa.hpp>

float run() {
    attend::tensor<float, 3> q(1, 3, 2), k(1, 3, 2), v(1, 3, 1);
    q.setZero();
    k.setZero();
    v.setConstant(1.f);
    attend::tensor<bool, 2> blocked(3, 3);
    blocked.setConstant(false);
    const auto forbidden = attend::forbidden_mask::query_key_grid(blocked);
    return attend::scaled_dot_product_attention(q, k, v, attend::to_allowed(forbidden)).out(0, 0, 0);
}
