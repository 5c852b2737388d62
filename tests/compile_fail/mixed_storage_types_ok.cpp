// SPDX-License-Identifier: MIT
// Twin of mixed_storage_types_ko.cpp: float queries over bfloat16 keys and values (a 16-bit cache) are a call.
#include <attend/sdpa.hpp>

auto attend_over_a_bf16_cache() {
    attend::tensor<float, 4> q(1, 2, 1, 8);
    attend::tensor<Eigen::bfloat16, 4> k(1, 2, 5, 8), v(1, 2, 5, 8);
    return attend::scaled_dot_product_attention(q, k, v);
}
