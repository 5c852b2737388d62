// SPDX-License-Identifier: MIT
// A rank-2 bool tensor through a broadcasting constructor must not compile: it may be a [query_len, key_len] grid
// or PyTorch's key_padding_mask [batch, key_len] (which broadcasting would read as the grid when batch ==
// query_len). The message names both constructors.
// expect-error: forbidden_mask::key_padding(t)
// expect-error: query_key_grid(t)
#include <attend/mask.hpp>

attend::forbidden_mask padding(const attend::tensor<bool, 2>& key_padding_mask) {
    return attend::forbidden_mask::from_torch_mha(key_padding_mask);
}
