// SPDX-License-Identifier: MIT
// Twin of into_weights_rank_ok.cpp: weights of another rank would be read past their end at run time; the rank
// is part of the type, so it is refused at compile time.
// expect-error: weights must be row-major with the scalar type and rank of the query
#include <attend/sdpa.hpp>

void attend_into() {
    attend::tensor<float, 4> q(1, 2, 3, 4), k(1, 2, 5, 4), v(1, 2, 5, 4), out(1, 2, 3, 4);
    attend::tensor<float, 2> weights(3, 5);
    attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, {}, out, weights);
}
