// SPDX-License-Identifier: MIT
// Twin of into_weights_rank_ko.cpp: weights have the query's rank, [batch, heads, query_len, key_len].
#include <attend/sdpa.hpp>

void attend_into() {
    attend::tensor<float, 4> q(1, 2, 3, 4), k(1, 2, 5, 4), v(1, 2, 5, 4), out(1, 2, 3, 4), weights(1, 2, 3, 5);
    attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, {}, out, weights);
}
