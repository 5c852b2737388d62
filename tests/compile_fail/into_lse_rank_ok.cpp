// SPDX-License-Identifier: MIT
// Twin of into_lse_rank_ko.cpp: lse has one rank less than the query, [batch, heads, query_len].
#include <attend/sdpa.hpp>

void attend_into() {
    attend::tensor<float, 4> q(1, 2, 3, 4), k(1, 2, 5, 4), v(1, 2, 5, 4), out(1, 2, 3, 4), weights(1, 2, 3, 5);
    attend::tensor<float, 3> lse(1, 2, 3);
    attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, {}, out, weights, lse);
}
