// SPDX-License-Identifier: MIT
// Twin of mha_key_padding_allowed_ko.cpp: key_padding takes nn.MultiheadAttention's convention (true = ignore
// this key), so an allowed_mask goes through to_forbidden first.
#include <attend/mha.hpp>

attend::mha_options padding(const attend::tensor<bool, 2>& may_attend) {
    attend::mha_options options;
    options.key_padding = attend::to_forbidden(attend::allowed_mask::key_padding(may_attend));
    return options;
}
