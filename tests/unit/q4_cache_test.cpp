// SPDX-License-Identifier: MIT
// The int4 KV cache (q4_kv_cache, ggml's q4_0 layout; q8_cache.hpp). The invariants:
// - blocks are ggml's q4_0 bytes: an fp16 scale, then 16 bytes, value j in the low four bits of byte j and value
//   j + 16 in its high four bits, each value d (nibble - 8);
// - each value is within the documented bound of what was appended: within |d| / 2 (+ 2^-19 |d|), those the
//   format's [-8, 7] clamps within 1.5 |d|, and the block's extreme m exactly -8 d where d is a normal fp16;
// - the quantizer, which works in packets, gives the bytes of ggml's rule applied a value at a time;
// - attention over it is float attention over the values it holds, bit for bit, for the tiled kernel's block and
//   split-key decode paths and the reference kernel, and 16-bit queries give that rounded once; a paged int4 pool
//   holds the same blocks and attends to the same bits;
// - it takes 18 / 128 of a float cache's bytes;
// - every bad append is refused before anything changes.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include <attend/attend.hpp>
#include <attend/paged_attention.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/q8_blocks.hpp"
#include "support/quantizer_cases.hpp"
#include "support/random.hpp"

namespace {

using attend::index_t;
using attend::q4_0_block;
using attend_test::bit_equal;
using attend_test::dequantized;
using attend_test::state_of;

/// Rows of values whose magnitudes change from row to row, 10^-6 .. 1e3, so blocks get very different scales.
attend::tensor<float, 4> random_rows(std::uint64_t seed, index_t b, index_t h, index_t len, index_t dim) {
    return attend_test::rows_of_many_magnitudes(seed, b, h, len, dim, -6, 10);
}

TEST(Q4Cache, BlocksAreGgmlsQ4_0Bytes) {
    static_assert(sizeof(q4_0_block) == 18 && offsetof(q4_0_block, nibbles) == 2, "ggml's block_q4_0");
    attend::q4_kv_cache cache(attend::kv_cache_config{}.with_capacity(1).with_head_dim(32));
    attend::tensor<float, 4> k(1, 1, 1, 32);
    for (index_t j = 0; j < 32; ++j) k(0, 0, 0, j) = static_cast<float>(j % 16 - 8) * 0.25f;  // -2 .. 1.75, twice
    k(0, 0, 0, 20) = -2.0f;  // the first value of largest magnitude is k[0] = -2: d = -2 / -8 = 0.25
    cache.append(k, k);
    const q4_0_block& block = cache.key_blocks()[0];
    EXPECT_EQ(static_cast<float>(block.scale), 0.25f);
    for (index_t j = 0; j < 16; ++j) {
        const index_t low = j, high = j == 4 ? 0 : j;  // nibble = value / d + 8
        EXPECT_EQ(index_t(block.nibbles[j]), low | (high << 4)) << "byte " << j;
    }
}

TEST(Q4Cache, EveryValueIsWithinTheDocumentedBoundOfWhatWasAppended) {
    const index_t D = 96, G = 3, S = 60;
    attend::q4_kv_cache cache(attend::kv_cache_config{}.with_kv_heads(G).with_capacity(S).with_head_dim(D));
    auto k = random_rows(3, 1, G, S, D);
    for (index_t d = 32; d < 64; ++d) k(0, 2, 9, d) = d == 40 ? -1e-7f : 0.0f;    // |m| below 2^-22: zeros
    for (index_t d = 0; d < 32; ++d) k(0, 1, 4, d) = d % 2 == 0 ? 1.0f : -0.99f;  // many clamped: 7.92 d
    // m / -8 = 1.49 x 2^-24, an fp16 subnormal that rounds to 2^-24, where m would be 11.9 d: d is 2^-23 instead.
    for (index_t d = 64; d < 96; ++d)
        k(0, 0, 5, d) = std::ldexp(d == 64 ? 11.92f : 0.37f * static_cast<float>(d % 9), -24);
    cache.append(k, random_rows(4, 1, G, S, D));
    const auto widened = dequantized(cache, true);
    index_t clamped = 0;
    for (index_t h = 0; h < G; ++h)
        for (index_t i = 0; i < S; ++i)
            for (index_t blk = 0; blk < D / 32; ++blk) {
                const q4_0_block& block = cache.key_blocks()[static_cast<std::size_t>((h * S + i) * (D / 32) + blk)];
                const double d = static_cast<double>(static_cast<float>(block.scale));
                double m = 0;
                for (index_t j = 0; j < 32; ++j)
                    if (std::abs(double(k(0, h, i, blk * 32 + j))) > std::abs(m)) m = k(0, h, i, blk * 32 + j);
                for (index_t j = 0; j < 32; ++j) {
                    const double x = k(0, h, i, blk * 32 + j), w = widened(0, h, i, blk * 32 + j);
                    if (d == 0) {  // a block whose m / -8 rounds to 0 in fp16
                        EXPECT_LE(std::abs(m), std::ldexp(1.0, -22));
                        EXPECT_EQ(w, 0.0);
                        continue;
                    }
                    if (x == m && std::abs(d) >= std::ldexp(1.0, -14)) {  // a normal fp16 scale: m is -8 d
                        EXPECT_EQ(w, -8 * d);
                    }
                    if (x / d > 7.5) {  // m's opposite sign, beyond what [-8, 7] holds
                        ++clamped;
                        EXPECT_EQ(w, 7 * d);
                        EXPECT_LE(std::abs(w - x), 1.5 * std::abs(d));
                    } else {
                        EXPECT_LE(std::abs(w - x), (0.5 + std::ldexp(1.0, -19)) * std::abs(d))
                            << x << " held as " << w << ", d " << d;
                    }
                }
            }
    EXPECT_GE(clamped, 16);
}

/// q4_0 of one block of float values, a value at a time as ggml's reference quantizer: m the first value of largest
/// magnitude, d = fp16(m / -8), the next fp16 away from zero where that leaves |m| above 8.5 |d| (fp16-subnormal
/// scales), q = (int)(x / d + 8.5) clamped to [0, 15], value j in the low four bits of byte j, value j + 16 in its
/// high four bits.
q4_0_block quantized_one_at_a_time(const float* x) {
    float m = 0;
    for (index_t j = 0; j < 32; ++j)
        if (std::abs(x[j]) > std::abs(m)) m = x[j];
    q4_0_block block{};
    block.scale = Eigen::half(m / -8.0f);
    if (static_cast<float>(block.scale) != 0 && std::abs(m) > 8.5f * std::abs(static_cast<float>(block.scale)))
        block.scale =
            Eigen::half_impl::raw_uint16_to_half(static_cast<std::uint16_t>(attend::detail::bits_of(block.scale) + 1));
    const float d = static_cast<float>(block.scale), inverse = d != 0 ? 1.0f / d : 0.0f;
    const auto integer = [&](float value) { return std::clamp(static_cast<int>(value * inverse + 8.5f), 0, 15); };
    for (index_t j = 0; j < 16; ++j)
        block.nibbles[j] = static_cast<std::uint8_t>(integer(x[j]) | integer(x[j + 16]) << 4);
    return block;
}

// The append quantizes a block at a time in packets (clamping in floats, then truncating); these rows make every
// case happen: exact ties k + 1/2 of the step for every k in [-8, 7] and both signs of d (d = -+2^-4, so x / d is
// exact), the floats on either side of each tie, values the format clamps, a largest magnitude held by values of
// both signs, blocks of zeros, of tiny values (d rounds to 0) and of fp16-subnormal scales, and random rows of every
// magnitude; from float, double and bf16.
TEST(Q4Cache, QuantizingInPacketsGivesTheBytesOfAValueAtATimeRoundingHalfUp) {
    const index_t D = 64, rows = 300;
    attend::tensor<float, 4> k = random_rows(21, 1, 1, rows, D);
    attend_test::ties_and_neighbours(k, -8, 16, -0.5f);  // rows 0 .. 255; m = -+1/2: d = +-2^-4
    for (index_t j = 0; j < D; ++j) {
        k(0, 0, 256, j) = j % 31 == 1 ? -0.0f : 0.0f;                           // zeros, some -0: d = -0, as ggml
        k(0, 0, 257, j) = 1e-9f * static_cast<float>(j % 5 - 2);                // d rounds to 0: zeros
        k(0, 0, 258, j) = 3e-6f * static_cast<float>(j % 7 - 3);                // d an fp16 subnormal
        k(0, 0, 259, j) = 100.0f * static_cast<float>(j) / (D - 1);             // every integer of a ramp
        k(0, 0, 260, j) = j % 32 == 0 ? -1.0f : (j % 2 == 0 ? 0.99f : -0.97f);  // 7.92 d: clamped to 7 d
        // the largest magnitude with both signs: m is the first of them, + in block 0, - in block 1
        k(0, 0, 261, j) = j == 5 || j == 52 ? 0.75f : j == 9 || j == 35 ? -0.75f : 0.05f * static_cast<float>(j % 7);
    }
    const index_t ties = attend_test::quantized_as_by_hand<q4_0_block>(k, 256, quantized_one_at_a_time);
    EXPECT_GT(ties, 4000);  // the ties were there to round
}

TEST(Q4Cache, AttentionOverTheCacheIsFloatAttentionOverTheValuesItHolds) {
    const index_t B = 2, G = 2, H = 8, D = 64, S = 3000;
    attend::q4_kv_cache cache(
        attend::kv_cache_config{}.with_batch(B).with_kv_heads(G).with_capacity(S).with_head_dim(D));
    cache.append(random_rows(1, B, G, S, D), random_rows(2, B, G, S, D));
    const auto keys = dequantized(cache, true), values = dequantized(cache, false);
    attend::paged_cache_config pc;
    pc.kv_heads = G;
    pc.head_dim = D;
    pc.blocks = S / 16 + 1;
    attend::paged_kv_cache<q4_0_block> pool(pc);
    const index_t id = pool.add_sequence();
    pool.append(
        id,
        attend::tensor<float, 4>(
            random_rows(1, B, G, S, D).slice(std::array<index_t, 4>{0, 0, 0, 0}, std::array<index_t, 4>{1, G, S, D})),
        attend::tensor<float, 4>(
            random_rows(2, B, G, S, D).slice(std::array<index_t, 4>{0, 0, 0, 0}, std::array<index_t, 4>{1, G, S, D})));
    const auto mask = attend::causal(attend::alignment::bottom_right);
    for (const auto& [L, kernel] :
         {std::pair{index_t(1), attend::kernel::tiled}, std::pair{index_t(40), attend::kernel::tiled},
          std::pair{index_t(1), attend::kernel::reference}}) {
        SCOPED_TRACE("L " + std::to_string(L));
        attend::tensor<float, 4> q(B, H, L, D);
        attend_test::fill_uniform(q, 10 + static_cast<std::uint64_t>(L), -2, 2);
        attend::sdpa_options o;
        o.kernel = kernel;
        o.threads = 2;
        const auto got = attend::scaled_dot_product_attention(q, cache.keys(), cache.values(), mask, o);
        const auto want = attend::scaled_dot_product_attention(q, keys, values, mask, o);
        EXPECT_TRUE(bit_equal(got.out, want.out));
        EXPECT_TRUE(bit_equal(got.lse, want.lse));
        // fp16 queries: the float call on their values, rounded once.
        const attend::tensor<Eigen::half, 4> q16 = q.cast<Eigen::half>();
        const attend::tensor<float, 4> q16_values = q16.cast<float>();
        const auto got16 = attend::scaled_dot_product_attention(q16, cache.keys(), cache.values(), mask, o);
        const auto want16 = attend::scaled_dot_product_attention(q16_values, keys, values, mask, o);
        EXPECT_TRUE(bit_equal(got16.out, attend::tensor<Eigen::half, 4>(want16.out.cast<Eigen::half>())));
        EXPECT_TRUE(bit_equal(got16.lse, want16.lse));
        // The paged pool holds batch row 0's blocks: the same bits for that row.
        const attend::tensor<float, 4> q0 =
            q.slice(std::array<index_t, 4>{0, 0, 0, 0}, std::array<index_t, 4>{1, H, L, D});
        const auto paged = attend::paged_attention(q0, pool, {id}, {L}, o);
        const attend::tensor<float, 4> want0 =
            want.out.slice(std::array<index_t, 4>{0, 0, 0, 0}, std::array<index_t, 4>{1, H, L, D});
        EXPECT_TRUE(bit_equal(paged.out, want0));
    }
}

TEST(Q4Cache, TakesEighteenBytesFor32ValuesAFloatCache128) {
    const auto sizes =
        attend::kv_cache_config{}.with_batch(2).with_kv_heads(4).with_capacity(1000).with_head_dim(128).with_value_dim(
            64);
    const attend::kv_cache<float> f(sizes);
    const attend::q4_kv_cache q(sizes);
    EXPECT_EQ(q.storage_bytes() * 128, f.storage_bytes() * 18);
}

TEST(Q4Cache, EveryBadAppendIsRefusedBeforeAnythingChanges) {
    using attend_test::expect_error;
    const std::string dim_message = expect_error<attend::value_error>(
        [] {
            attend::q4_kv_cache(
                attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(48).with_value_dim(64));
        },
        "attend.value.quantized_dim");
    EXPECT_NE(dim_message.find("int4 (q4_0)"), std::string::npos) << dim_message;
    attend::q4_kv_cache cache(
        attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(32).with_value_dim(64));
    cache.append(random_rows(7, 1, 2, 3, 32), random_rows(8, 1, 2, 3, 64));
    const auto before = state_of(cache);
    const auto k = random_rows(9, 1, 2, 2, 32), v = random_rows(10, 1, 2, 2, 64);
    auto huge = v;
    huge(0, 1, 1, 5) = 6e5f;  // beyond 8 x 65504, though an int8 block would hold it
    const std::string message =
        expect_error<attend::value_error>([&] { cache.append(k, huge); }, "attend.value.quantized_range");
    EXPECT_NE(message.find("[0,1,1,5]"), std::string::npos) << message;
    EXPECT_NE(message.find("int4 (q4_0)"), std::string::npos) << message;
    auto nan = k;
    nan(0, 0, 1, 3) = std::numeric_limits<float>::infinity();
    expect_error<attend::value_error>([&] { cache.append(nan, v); }, "attend.value.non_finite");
    attend::tensor<double, 4> k64 = k.cast<double>(), v64 = v.cast<double>();
    k64(0, 1, 0, 31) = std::nextafter(attend::q4_kv_cache::max_magnitude, 1e300);  // just past the bound
    expect_error<attend::value_error>([&] { cache.append(k64, v64); }, "attend.value.quantized_range");
    expect_error<attend::position_error>(
        [&] { cache.append(random_rows(11, 1, 2, 6, 32), random_rows(12, 1, 2, 6, 64)); },
        "attend.position.cache_full");
    EXPECT_EQ(state_of(cache), before);
    k64(0, 1, 0, 31) = attend::q4_kv_cache::max_magnitude;  // the bound itself fits
    cache.append(k64, v64);
    EXPECT_EQ(cache.length(), 5);
}

}  // namespace
