// SPDX-License-Identifier: MIT
// Twin of mha_attn_mask_tensor_ko.cpp: nn.MultiheadAttention's bool attn_mask (true = blocked) passes to forward
// wrapped by forbidden_mask::from_torch_mha, the wrapper key_padding takes too.
#include <attend/mha.hpp>

double run(const attend::multi_head_attention<double>& m, const attend::tensor<double, 3>& x,
           const attend::tensor<bool, 2>& attn_mask) {
    attend::mha_options options;
    options.key_padding = attend::forbidden_mask::key_padding(attend::tensor<bool, 2>(x.dimension(0), x.dimension(1)));
    return m.forward(x, x, x, attend::forbidden_mask::query_key_grid(attn_mask), options).out(0, 0, 0);
}
