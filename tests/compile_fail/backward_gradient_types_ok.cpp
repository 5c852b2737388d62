// SPDX-License-Identifier: MIT
// Twin of backward_gradient_types_ko.cpp: bf16 inputs with dq, dk and dv all bf16, or all float, compile.
#include <attend/backward.hpp>

void attend_backward_gradients_of_one_type() {
    using bf16 = Eigen::bfloat16;
    attend::tensor<bf16, 4> q(1, 2, 3, 4), k(1, 2, 5, 4), v(1, 2, 5, 4), out(1, 2, 3, 4), d_out(1, 2, 3, 4);
    attend::tensor<float, 3> lse(1, 2, 3);
    attend::tensor<bf16, 4> dq(q.dimensions()), dk(k.dimensions()), dv(v.dimensions());
    attend::scaled_dot_product_attention_backward_into(q, k, v, attend::no_mask{}, out, lse, d_out, dq, dk, dv);
    attend::tensor<float, 4> fq(q.dimensions()), fk(k.dimensions()), fv(v.dimensions());
    attend::scaled_dot_product_attention_backward_into(q, k, v, attend::no_mask{}, out, lse, d_out, fq, fk, fv);
}
