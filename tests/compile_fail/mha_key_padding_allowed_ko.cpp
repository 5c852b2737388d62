// SPDX-License-Identifier: MIT
// Twin of mha_key_padding_allowed_ok.cpp: an allowed_mask (true = may attend) as key_padding (true = ignore)
// would flip its meaning silently, so it does not compile, and the message names the conversion.
// expect-error: attend::to_forbidden(mask)
#include <attend/mha.hpp>

attend::mha_options padding(const attend::tensor<bool, 2>& may_attend) {
    attend::mha_options options;
    options.key_padding = attend::allowed_mask::key_padding(may_attend);
    return options;
}
