// SPDX-License-Identifier: MIT
// Twin of into_lse_rank_ok.cpp: an lse of the query's rank would be read past its end at run time; the rank is
// part of the type, so it is refused at compile time.
// expect-error: lse must be row-major in the accumulation type of the query
#include <attend/sdpa.hpp>

void attend_into() {
    attend::tensor<float, 4> q(1, 2, 3, 4), k(1, 2, 5, 4), v(1, 2, 5, 4), out(1, 2, 3, 4), weights(1, 2, 3, 5);
    attend::tensor<float, 4> lse(1, 2, 3, 1);
    attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, {}, out, weights, lse);
}
