// SPDX-License-Identifier: MIT
// Twin of mha_backward_16bit_ok.cpp: a 16-bit module runs forward, but its backward would hand back 16-bit
// parameter gradients; training takes a float copy of the module.
// expect-error: trains float or double modules
#include <attend/mha_backward.hpp>

auto attend_backward_of_a_bf16_module() {
    const attend::multi_head_attention<Eigen::bfloat16> m(attend::mha_config{8, 2});
    attend::tensor<Eigen::bfloat16, 3> x(1, 3, 8);
    attend::mha_saved<Eigen::bfloat16> saved;
    (void)m.forward(x, x, x, attend::no_mask{}, {}, saved);
    return attend::multi_head_attention_backward(m, x, x, x, attend::no_mask{}, saved, x);
}
