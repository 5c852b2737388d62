// SPDX-License-Identifier: MIT
#pragma once
/// Reading an int8 (q8_0) cache back in the tests: its values widened by hand (d q per value) and its whole state
/// as bytes, to show that a refused call changed nothing.

#include <cstddef>
#include <cstring>
#include <vector>

#include <attend/q8_cache.hpp>

namespace attend_test {

/// The cache's keys (or values) `[batch, kv_heads, length, dim]` widened to float by hand: d q per value.
inline attend::tensor<float, 4> dequantized(const attend::q8_kv_cache& c, bool keys) {
    using attend::index;
    using attend::q8_0_block;
    const index dim = keys ? c.head_dim() : c.value_dim(), blocks = dim / q8_0_block::size;
    const auto& storage = keys ? c.key_blocks() : c.value_blocks();
    attend::tensor<float, 4> t(c.batch(), c.kv_heads(), c.length(), dim);
    for (index b = 0; b < c.batch(); ++b)
        for (index h = 0; h < c.kv_heads(); ++h)
            for (index i = 0; i < c.length(); ++i)
                for (index d = 0; d < dim; ++d) {
                    const q8_0_block& block = storage[static_cast<std::size_t>(
                        ((b * c.kv_heads() + h) * c.capacity() + i) * blocks + d / q8_0_block::size)];
                    t(b, h, i, d) = static_cast<float>(block.scale) * static_cast<float>(block.values[d % 32]);
                }
    return t;
}

/// The cache's state: its length and every byte of its blocks.
inline std::vector<unsigned char> state_of(const attend::q8_kv_cache& c) {
    std::vector<unsigned char> bytes(sizeof(attend::index));
    const attend::index length = c.length();
    std::memcpy(bytes.data(), &length, sizeof(attend::index));
    for (const auto* blocks : {&c.key_blocks(), &c.value_blocks()}) {
        const auto* p = reinterpret_cast<const unsigned char*>(blocks->data());
        bytes.insert(bytes.end(), p, p + blocks->size() * sizeof(attend::q8_0_block));
    }
    return bytes;
}

}  // namespace attend_test
