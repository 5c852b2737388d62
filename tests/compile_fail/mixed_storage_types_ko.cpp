// SPDX-License-Identifier: MIT
// Twin of mixed_storage_types_ok.cpp: double queries over float keys would compute in neither type cleanly; the
// only mixed calls are float queries over 16-bit keys and values, and float or 16-bit queries over an int8 cache.
// expect-error: float queries with Eigen::half or Eigen::bfloat16
#include <attend/sdpa.hpp>

auto attend_double_over_float() {
    attend::tensor<double, 4> q(1, 2, 1, 8);
    attend::tensor<float, 4> k(1, 2, 5, 8), v(1, 2, 5, 8);
    return attend::scaled_dot_product_attention(q, k, v);
}
