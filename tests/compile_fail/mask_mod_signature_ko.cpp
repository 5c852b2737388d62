// SPDX-License-Identifier: MIT
// Twin of mask_mod_signature_ok.cpp: a function of (query, key) alone is not a mask function; the message says
// which signature mask_mod takes.
// expect-error: mask_mod takes a function (batch, head, query, key) -> bool
#include <attend/mask_function.hpp>

auto even_keys() {
    return attend::mask_mod([](attend::index_t, attend::index_t j) { return j % 2 == 0; });
}
