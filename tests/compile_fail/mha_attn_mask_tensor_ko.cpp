// SPDX-License-Identifier: MIT
// A bare bool tensor as the mask of multi-head attention does not say whether true means blocked (PyTorch's
// attn_mask) or allowed (PyTorch's SDPA), so it does not compile, and the message names both wrappers.
// expect-error: forbidden_mask::from_torch_mha
#include <attend/mha.hpp>

double run(const attend::multi_head_attention<double>& m, const attend::tensor<double, 3>& x,
           const attend::tensor<bool, 2>& attn_mask) {
    return m.forward(x, x, x, attn_mask).out(0, 0, 0);
}
