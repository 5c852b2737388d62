// SPDX-License-Identifier: MIT
#pragma once
/// Reading a quantized (int8 q8_0, int4 q4_0) cache back in the tests: its values widened by hand, as ggml's
/// dequantize_row_q8_0 / q4_0 do, and its whole state as bytes, to show that a refused call changed nothing.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <attend/q8_cache.hpp>

#include "random.hpp"

namespace attend_test {

/// Value j of a block widened by hand: d q (q8_0), d (nibble - 8) with value j < 16 in the low four bits of byte j
/// and value j + 16 in its high four bits (q4_0).
inline float widened_by_hand(const attend::q8_0_block& block, attend::index_t j) {
    return static_cast<float>(block.scale) * static_cast<float>(block.values[j]);
}
inline float widened_by_hand(const attend::q4_0_block& block, attend::index_t j) {
    const int byte = block.nibbles[j % 16];
    return static_cast<float>(block.scale) * static_cast<float>((j < 16 ? byte & 0x0F : byte >> 4) - 8);
}

/// The cache's keys (or values) `[batch, kv_heads, length, dim]` widened to float by hand.
template <class Block>
attend::tensor<float, 4> dequantized(const attend::quantized_kv_cache<Block>& c, bool keys) {
    using attend::index_t;
    const index_t dim = keys ? c.head_dim() : c.value_dim(), blocks = dim / Block::size;
    const auto& storage = keys ? c.key_blocks() : c.value_blocks();
    attend::tensor<float, 4> t(c.batch(), c.kv_heads(), c.length(), dim);
    for (index_t b = 0; b < c.batch(); ++b)
        for (index_t h = 0; h < c.kv_heads(); ++h)
            for (index_t i = 0; i < c.length(); ++i)
                for (index_t d = 0; d < dim; ++d) {
                    const Block& block = storage[static_cast<std::size_t>(
                        ((b * c.kv_heads() + h) * c.capacity() + i) * blocks + d / Block::size)];
                    t(b, h, i, d) = widened_by_hand(block, d % Block::size);
                }
    return t;
}

/// Values in [-1, 1) times a magnitude that changes from row to row, 10^lowest .. 10^(lowest + powers - 1), so the
/// blocks of a quantized cache get very different scales.
inline attend::tensor<float, 4> rows_of_many_magnitudes(std::uint64_t seed, attend::index_t b, attend::index_t h,
                                                        attend::index_t len, attend::index_t dim, int lowest,
                                                        int powers) {
    attend::tensor<float, 4> t(b, h, len, dim);
    fill_uniform(t, seed);
    for (attend::index_t r = 0; r < b * h * len; ++r) {
        const float magnitude = std::pow(10.0f, static_cast<float>(r % powers + lowest));
        for (attend::index_t d = 0; d < dim; ++d) t.data()[r * dim + d] *= magnitude;
    }
    return t;
}

/// The cache's state: its length and every byte of its blocks.
template <class Block>
std::vector<unsigned char> state_of(const attend::quantized_kv_cache<Block>& c) {
    std::vector<unsigned char> bytes(sizeof(attend::index_t));
    const attend::index_t length = c.length();
    std::memcpy(bytes.data(), &length, sizeof(attend::index_t));
    for (const auto* blocks : {&c.key_blocks(), &c.value_blocks()}) {
        const auto* p = reinterpret_cast<const unsigned char*>(blocks->data());
        bytes.insert(bytes.end(), p, p + blocks->size() * sizeof(Block));
    }
    return bytes;
}

}  // namespace attend_test
