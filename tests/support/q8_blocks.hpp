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

#include <gtest/gtest.h>

#include <attend/q8_cache.hpp>

#include "random.hpp"

namespace attend_test {

/// Value j of a block widened by hand: d q (q8_0), d (nibble - 8) with value j < 16 in the low four bits of byte j
/// and value j + 16 in its high four bits (q4_0).
inline float widened_by_hand(const attend::q8_0_block& block, attend::index j) {
    return static_cast<float>(block.scale) * static_cast<float>(block.values[j]);
}
inline float widened_by_hand(const attend::q4_0_block& block, attend::index j) {
    const int byte = block.nibbles[j % 16];
    return static_cast<float>(block.scale) * static_cast<float>((j < 16 ? byte & 0x0F : byte >> 4) - 8);
}

/// The cache's keys (or values) `[batch, kv_heads, length, dim]` widened to float by hand.
template <class Block>
attend::tensor<float, 4> dequantized(const attend::quantized_kv_cache<Block>& c, bool keys) {
    using attend::index;
    const index dim = keys ? c.head_dim() : c.value_dim(), blocks = dim / Block::size;
    const auto& storage = keys ? c.key_blocks() : c.value_blocks();
    attend::tensor<float, 4> t(c.batch(), c.kv_heads(), c.length(), dim);
    for (index b = 0; b < c.batch(); ++b)
        for (index h = 0; h < c.kv_heads(); ++h)
            for (index i = 0; i < c.length(); ++i)
                for (index d = 0; d < dim; ++d) {
                    const Block& block = storage[static_cast<std::size_t>(
                        ((b * c.kv_heads() + h) * c.capacity() + i) * blocks + d / Block::size)];
                    t(b, h, i, d) = widened_by_hand(block, d % Block::size);
                }
    return t;
}

/// Values in [-1, 1) times a magnitude that changes from row to row, 10^lowest .. 10^(lowest + powers - 1), so the
/// blocks of a quantized cache get very different scales.
inline attend::tensor<float, 4> rows_of_many_magnitudes(std::uint64_t seed, attend::index b, attend::index h,
                                                        attend::index len, attend::index dim, int lowest, int powers) {
    attend::tensor<float, 4> t(b, h, len, dim);
    fill_uniform(t, seed);
    for (attend::index r = 0; r < b * h * len; ++r) {
        const float magnitude = std::pow(10.0f, static_cast<float>(r % powers + lowest));
        for (attend::index d = 0; d < dim; ++d) t.data()[r * dim + d] *= magnitude;
    }
    return t;
}

/// The cache's state: its length and every byte of its blocks.
template <class Block>
std::vector<unsigned char> state_of(const attend::quantized_kv_cache<Block>& c) {
    std::vector<unsigned char> bytes(sizeof(attend::index));
    const attend::index length = c.length();
    std::memcpy(bytes.data(), &length, sizeof(attend::index));
    for (const auto* blocks : {&c.key_blocks(), &c.value_blocks()}) {
        const auto* p = reinterpret_cast<const unsigned char*>(blocks->data());
        bytes.insert(bytes.end(), p, p + blocks->size() * sizeof(Block));
    }
    return bytes;
}

/// Rows 0 .. 255 of k `[1, 1, rows, dim]` made of a quantizer's rounding cases for blocks whose step is 1/16: value j
/// of row r is the tie (n + 1/2) / 16 for n = lowest + (r + j) % count, or the float just below or above it, in
/// turn; each block's first value is `first` in even rows and `-first` in odd ones (it sets the step's size).
inline void ties_and_neighbours(attend::tensor<float, 4>& k, int lowest, int count, float first) {
    for (attend::index r = 0; r < 256; ++r)
        for (attend::index j = 0; j < k.dimension(3); ++j) {
            const float tie = (static_cast<float>(lowest + static_cast<int>((r + j) % count)) + 0.5f) / 16.0f;
            const int side = static_cast<int>((r / 64 + j) % 3);  // tie, below, above
            k(0, 0, r, j) = side == 0 ? tie : std::nextafter(tie, side == 1 ? -1e9f : 1e9f);
            if (j % 32 == 0) k(0, 0, r, j) = r % 2 == 0 ? first : -first;
        }
}

/// Rows `[1, 1, rows, dim]` appended to caches of Block from float, double and bf16 give, block for block, the bytes of
/// `by_hand` (a quantizer of one block of 32 floats, a value at a time) applied to the same values (to the bf16
/// values for the bf16 cache). Returns how many values of the first `tie_rows` rows are exact ties x * 16 = n + 1/2,
/// so that a test can show its ties were there to round.
template <class Block, class ByHand>
attend::index quantized_as_by_hand(const attend::tensor<float, 4>& k, attend::index tie_rows, const ByHand& by_hand) {
    using attend::index;
    const index rows = k.dimension(2), dim = k.dimension(3);
    attend::quantized_kv_cache<Block> from_float(1, 1, rows, dim, dim), from_double(1, 1, rows, dim, dim),
        from_bf16(1, 1, rows, dim, dim);
    from_float.append(k, k);
    from_double.append(attend::tensor<double, 4>(k.cast<double>()), attend::tensor<double, 4>(k.cast<double>()));
    const attend::tensor<Eigen::bfloat16, 4> k16 = k.cast<Eigen::bfloat16>();
    from_bf16.append(k16, k16);
    const attend::tensor<float, 4> k16_values = k16.cast<float>();
    index ties = 0;
    for (index r = 0; r < rows; ++r)
        for (index b = 0; b < dim / 32; ++b) {
            const auto at = static_cast<std::size_t>(r * (dim / 32) + b);
            const Block want = by_hand(&k(0, 0, r, b * 32)), want16 = by_hand(&k16_values(0, 0, r, b * 32));
            for (const auto* got :
                 {&from_float.key_blocks()[at], &from_float.value_blocks()[at], &from_double.key_blocks()[at]})
                EXPECT_EQ(std::memcmp(got, &want, sizeof want), 0) << "row " << r << " block " << b;
            EXPECT_EQ(std::memcmp(&from_bf16.key_blocks()[at], &want16, sizeof want16), 0) << "row " << r;
            if (::testing::Test::HasFailure()) return ties;  // the first block that differs, not thousands
            for (index j = 0; j < 32; ++j) {
                const float y = k(0, 0, r, b * 32 + j) * 16.0f;
                ties += r < tie_rows && y - std::trunc(y) == (y > 0 ? 0.5f : -0.5f) ? 1 : 0;
            }
        }
    return ties;
}

}  // namespace attend_test
