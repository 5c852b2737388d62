// SPDX-License-Identifier: MIT
#pragma once
/// The quantizers' own test (q8_cache_test, q4_cache_test): rows of rounding cases, and the bytes of a cache's append
/// against a quantizer written a value at a time. A gtest header, apart from q8_blocks.hpp, which the fuzzers include.

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstring>

#include <attend/q8_cache.hpp>

namespace attend_test {

/// Rows 0 .. 255 of k `[1, 1, rows, dim]` made of a quantizer's rounding cases for blocks whose step is 1/16: value j
/// of row r is the tie (n + 1/2) / 16 for n = lowest + (r + j) % count, or the float just below or above it, in
/// turn; each block's first value is `first` in even rows and `-first` in odd ones (it sets the step's size).
inline void ties_and_neighbours(attend::tensor<float, 4>& k, int lowest, int count, float first) {
    for (attend::index_t r = 0; r < 256; ++r)
        for (attend::index_t j = 0; j < k.dimension(3); ++j) {
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
attend::index_t quantized_as_by_hand(const attend::tensor<float, 4>& k, attend::index_t tie_rows,
                                     const ByHand& by_hand) {
    using attend::index_t;
    const index_t rows = k.dimension(2), dim = k.dimension(3);
    attend::quantized_kv_cache<Block> from_float(attend::kv_cache_config{}.with_capacity(rows).with_head_dim(dim)),
        from_double(attend::kv_cache_config{}.with_capacity(rows).with_head_dim(dim)),
        from_bf16(attend::kv_cache_config{}.with_capacity(rows).with_head_dim(dim));
    from_float.append(k, k);
    from_double.append(attend::tensor<double, 4>(k.cast<double>()), attend::tensor<double, 4>(k.cast<double>()));
    const attend::tensor<Eigen::bfloat16, 4> k16 = k.cast<Eigen::bfloat16>();
    from_bf16.append(k16, k16);
    const attend::tensor<float, 4> k16_values = k16.cast<float>();
    index_t ties = 0;
    for (index_t r = 0; r < rows; ++r)
        for (index_t b = 0; b < dim / 32; ++b) {
            const auto at = static_cast<std::size_t>(r * (dim / 32) + b);
            const Block want = by_hand(&k(0, 0, r, b * 32)), want16 = by_hand(&k16_values(0, 0, r, b * 32));
            for (const auto* got :
                 {&from_float.key_blocks()[at], &from_float.value_blocks()[at], &from_double.key_blocks()[at]})
                EXPECT_EQ(std::memcmp(got, &want, sizeof want), 0) << "row " << r << " block " << b;
            EXPECT_EQ(std::memcmp(&from_bf16.key_blocks()[at], &want16, sizeof want16), 0) << "row " << r;
            if (::testing::Test::HasFailure()) return ties;  // the first block that differs, not thousands
            for (index_t j = 0; j < 32; ++j) {
                const float y = k(0, 0, r, b * 32 + j) * 16.0f;
                ties += r < tie_rows && y - std::trunc(y) == (y > 0 ? 0.5f : -0.5f) ? 1 : 0;
            }
        }
    return ties;
}

}  // namespace attend_test
