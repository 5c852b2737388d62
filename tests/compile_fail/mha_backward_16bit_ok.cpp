// SPDX-License-Identifier: MIT
// Twin of mha_backward_16bit_ko.cpp: the same calls on a float module compile.
#include <attend/mha_backward.hpp>

auto attend_backward_of_a_float_module() {
    const attend::multi_head_attention<float> m(attend::mha_config{8, 2});
    attend::tensor<float, 3> x(1, 3, 8);
    attend::mha_saved<float> saved;
    (void)m.forward(x, x, x, attend::no_mask{}, {}, saved);
    return attend::multi_head_attention_backward(m, x, x, x, attend::no_mask{}, saved, x);
}
