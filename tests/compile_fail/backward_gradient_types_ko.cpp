// SPDX-License-Identifier: MIT
// Twin of backward_gradient_types_ok.cpp: with 16-bit inputs the gradients are all of the inputs' type or all
// float; a float d_query beside bf16 d_key and d_value is refused at compile time, not half-written in two precisions.
// expect-error: d_query, d_key and d_value must have the query's scalar type (with 16-bit inputs: all of it, or all float)
#include <attend/backward.hpp>

void attend_backward_gradients_of_two_types() {
    using bf16 = Eigen::bfloat16;
    attend::tensor<bf16, 4> q(1, 2, 3, 4), k(1, 2, 5, 4), v(1, 2, 5, 4), out(1, 2, 3, 4), d_out(1, 2, 3, 4);
    attend::tensor<float, 3> lse(1, 2, 3);
    attend::tensor<float, 4> dq(q.dimensions());
    attend::tensor<bf16, 4> dk(k.dimensions()), dv(v.dimensions());
    attend::scaled_dot_product_attention_backward_into(q, k, v, attend::no_mask{}, out, lse, d_out, dq, dk, dv);
}
