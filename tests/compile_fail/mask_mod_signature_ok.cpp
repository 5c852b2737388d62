// SPDX-License-Identifier: MIT
// Twin of mask_mod_signature_ko.cpp: a mask function takes (batch, head, query, key) and says whether the query
// may attend the key.
#include <attend/mask_function.hpp>

auto even_keys() {
    return attend::mask_mod(
        [](attend::index_t, attend::index_t, attend::index_t, attend::index_t j) { return j % 2 == 0; });
}
