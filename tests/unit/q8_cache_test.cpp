// SPDX-License-Identifier: MIT
// The int8 KV cache (q8_cache.hpp, ggml's q8_0 layout). The invariants:
// - attention over it is float attention over its dequantized values d q, bit for bit, for the tiled kernel's
//   block, GEMV and split-key decode paths and for the reference kernel: the int8 storage changes the inputs
//   (quantization), never the arithmetic;
// - each value is within d / 2 of what was appended (the documented bound), and blocks are ggml's bytes;
// - it takes 34 / 128 of a float cache's bytes;
// - every bad append is refused before anything changes.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
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
using attend::q8_0_block;
using attend_test::bit_equal;
using attend_test::dequantized;
using attend_test::state_of;

/// Rows of values whose magnitudes change from row to row, 10^-3 .. 1e3, so blocks get very different scales.
attend::tensor<float, 4> random_rows(std::uint64_t seed, index_t b, index_t h, index_t len, index_t dim) {
    return attend_test::rows_of_many_magnitudes(seed, b, h, len, dim, -3, 7);
}

TEST(Q8Cache, AttentionOverTheCacheIsFloatAttentionOverItsDequantizedValues) {
    const index_t B = 2, G = 2, H = 8, D = 64;
    attend::q8_kv_cache cache(
        attend::kv_cache_config{}.with_batch(B).with_kv_heads(G).with_capacity(6000).with_head_dim(D));
    cache.append(random_rows(1, B, G, 5000, D), random_rows(2, B, G, 5000, D));
    const auto keys = dequantized(cache, true), values = dequantized(cache, false);
    const auto mask = attend::causal(attend::alignment::bottom_right);
    // Tiled: 1 query (split-key decode with GEMV rows) and 40 queries (GEMM blocks over causal tiles). The reference
    // kernel has no such paths (it widens the cache, then computes whole score matrices): at 40 queries it took 37 s
    // of this group's 81 s under the sanitizers, for nothing the 1-query call does not prove.
    for (const auto& [L, kernel] :
         {std::pair{index_t(1), attend::kernel::tiled}, std::pair{index_t(40), attend::kernel::tiled},
          std::pair{index_t(1), attend::kernel::reference}}) {
        attend::tensor<float, 4> q(B, H, L, D);
        attend_test::fill_uniform(q, 10 + static_cast<std::uint64_t>(L), -2, 2);
        attend::sdpa_options o;
        o.kernel = kernel;
        o.threads = 2;
        const auto got = attend::scaled_dot_product_attention(q, cache.keys(), cache.values(), mask, o);
        const auto want = attend::scaled_dot_product_attention(q, keys, values, mask, o);
        EXPECT_TRUE(bit_equal(got.out, want.out)) << "L " << L;
        EXPECT_TRUE(bit_equal(got.lse, want.lse)) << "L " << L;
        attend::tensor<float, 4> into(B, H, L, D);
        attend::scaled_dot_product_attention_into(q, cache.keys(), cache.values(), mask, o, into);
        EXPECT_TRUE(bit_equal(into, want.out)) << "L " << L;
    }
}

TEST(Q8Cache, SixteenBitQueriesGiveTheFloatQueriesResultOfTheirValuesRoundedOnce) {
    // An fp16 or bf16 model over an int8 cache: its queries widen to float exactly, everything after is the float
    // call's arithmetic, and the output is rounded once; lse is the float call's. Over a q8_kv_cache and over an int8
    // paged pool holding the same blocks, for the decode, GEMV and block paths.
    const index_t G = 2, H = 4, D = 64, S = 2500;
    attend::q8_kv_cache cache(attend::kv_cache_config{}.with_kv_heads(G).with_capacity(S).with_head_dim(D));
    const auto k = random_rows(3, 1, G, S, D), v = random_rows(4, 1, G, S, D);
    cache.append(k, v);
    attend::paged_cache_config pc;
    pc.kv_heads = G;
    pc.head_dim = D;
    pc.blocks = S / 16 + 1;
    attend::paged_kv_cache<q8_0_block> pool(pc);
    const index_t id = pool.add_sequence();
    pool.append(id, k, v);
    const auto mask = attend::causal(attend::alignment::bottom_right);
    const auto check = [&](auto type) {
        using T = decltype(type);
        for (const index_t L : {1, 3, 200})
            for (const int threads : {1, 2}) {
                SCOPED_TRACE(std::string(std::is_same_v<T, Eigen::half> ? "fp16" : "bf16") + ", L " +
                             std::to_string(L) + ", threads " + std::to_string(threads));
                attend::tensor<T, 4> q(1, H, L, D);
                attend_test::fill_uniform(q, 20 + static_cast<std::uint64_t>(L), -2, 2);
                const attend::tensor<float, 4> widened = q.template cast<float>();
                attend::sdpa_options o;
                o.threads = threads;
                const auto want = attend::scaled_dot_product_attention(widened, cache.keys(), cache.values(), mask, o);
                const attend::tensor<T, 4> rounded = want.out.template cast<T>();
                const auto got = attend::scaled_dot_product_attention(q, cache.keys(), cache.values(), mask, o);
                EXPECT_TRUE(bit_equal(got.out, rounded));
                EXPECT_TRUE(bit_equal(got.lse, want.lse));
                attend::tensor<T, 4> into(1, H, L, D);
                attend::scaled_dot_product_attention_into(q, cache.keys(), cache.values(), mask, o, into);
                EXPECT_TRUE(bit_equal(into, rounded));
                const auto paged = attend::paged_attention(q, pool, {id}, {L}, o);
                EXPECT_TRUE(bit_equal(paged.out, rounded));
                EXPECT_TRUE(bit_equal(paged.lse, want.lse));
            }
    };
    check(Eigen::half{});
    check(Eigen::bfloat16{});
}

TEST(Q8Cache, EveryValueIsWithinHalfItsBlockScaleOfWhatWasAppended) {
    const index_t D = 96;
    attend::q8_kv_cache cache(attend::kv_cache_config{}.with_kv_heads(3).with_capacity(50).with_head_dim(D));
    auto k = random_rows(3, 1, 3, 50, D);
    k(0, 1, 7, 40) = 1e-9f;  // a block of tiny and zero values: stored as zeros
    for (index_t d = 32; d < 64; ++d) k(0, 2, 9, d) = d == 40 ? 1e-9f : 0.0f;
    cache.append(k, random_rows(4, 1, 3, 50, D));
    const auto widened = dequantized(cache, true);
    double worst = 0;  // error in units of the block's scale
    for (index_t h = 0; h < 3; ++h)
        for (index_t i = 0; i < 50; ++i)
            for (index_t blk = 0; blk < D / 32; ++blk) {
                const q8_0_block& block = cache.key_blocks()[static_cast<std::size_t>((h * 50 + i) * (D / 32) + blk)];
                const double d = static_cast<double>(static_cast<float>(block.scale));
                double amax = 0;
                for (index_t j = 0; j < 32; ++j) amax = std::max(amax, std::abs(double(k(0, h, i, blk * 32 + j))));
                EXPECT_LE(d, amax / 127 * (1 + std::ldexp(1.0, -11)) + std::ldexp(1.0, -24));
                for (index_t j = 0; j < 32; ++j) {
                    const double error = std::abs(double(widened(0, h, i, blk * 32 + j)) - k(0, h, i, blk * 32 + j));
                    if (d == 0) {
                        EXPECT_LE(error, amax);
                        EXPECT_LT(amax, 127 * std::ldexp(1.0, -25));
                        continue;
                    }
                    EXPECT_LE(error, d / 2) << h << ' ' << i << ' ' << blk << ' ' << j;
                    worst = std::max(worst, error / d);
                }
            }
    EXPECT_GT(worst, 0.45);  // the bound is the real one: rounding to the nearest step reaches about half a step
    EXPECT_EQ(static_cast<float>(cache.key_blocks()[(2 * 50 + 9) * 3 + 1].scale), 0.0f);
}

// Where amax / 127 is an fp16 subnormal (amax below 127 x 2^-14), fp16's spacing of 2^-24 can round it down by up
// to a third; d rounded to nearest then left the block's largest values clamped at 127 d, up to 1.05 d from what was
// appended (found by the differential fuzzer). The scale is then the next fp16 up. Swept over most of that range.
TEST(Q8Cache, BlocksWithAnFp16SubnormalScaleHoldEveryValueWithinHalfAStep) {
    const index_t blocks = 2000;
    attend::tensor<float, 4> k(1, 1, blocks, 32);
    for (index_t n = 0; n < blocks; ++n) {
        const float amax = 127.0f * std::ldexp(1.0f, -24) * 0.6f * std::pow(1.0035f, static_cast<float>(n));
        for (index_t j = 0; j < 32; ++j)
            k(0, 0, n, j) = amax * (j == 0 ? 1.0f : static_cast<float>((j * 37) % 64 - 32) / 32.0f);
    }
    attend::q8_kv_cache cache(attend::kv_cache_config{}.with_capacity(blocks).with_head_dim(32));
    cache.append(k, k);
    index_t raised = 0;  // blocks whose scale rounded to nearest would have clamped their largest value
    for (index_t n = 0; n < blocks; ++n) {
        const q8_0_block& block = cache.key_blocks()[static_cast<std::size_t>(n)];
        const float amax = k(0, 0, n, 0);
        const double d = static_cast<double>(static_cast<float>(block.scale));
        ASSERT_GT(d, 0) << n;
        ASSERT_LT(d, std::ldexp(1.0, -14)) << n;  // subnormal, as meant
        raised += d > static_cast<double>(static_cast<float>(Eigen::half(amax / 127.0f))) ? 1 : 0;
        EXPECT_LE(static_cast<double>(amax), 127.5 * d) << n;
        for (index_t j = 0; j < 32; ++j) {
            const double error = std::abs(d * block.values[j] - static_cast<double>(k(0, 0, n, j)));
            ASSERT_LE(error, d * (0.5 + std::ldexp(1.0, -16))) << "block " << n << " value " << j;
        }
    }
    EXPECT_GT(raised, 100);
}

TEST(Q8Cache, BlocksAreGgmlsQ8_0Bytes) {
    EXPECT_EQ(sizeof(q8_0_block), 34u);
    EXPECT_EQ(offsetof(q8_0_block, values), 2u);  // ggml_half d, then int8_t qs[32]
    attend::q8_kv_cache cache(attend::kv_cache_config{}.with_capacity(4).with_head_dim(32));
    attend::tensor<float, 4> k(1, 1, 1, 32), v(1, 1, 1, 32);
    for (index_t j = 0; j < 32; ++j) {
        k(0, 0, 0, j) = 0.5f * static_cast<float>(j) - 3.0f;  // -3 .. 12.5: amax 12.5
        v(0, 0, 0, j) = -static_cast<float>(j);
    }
    cache.append(k, v);
    const q8_0_block& block = cache.key_blocks()[0];
    const Eigen::half d(12.5f / 127.0f);
    EXPECT_EQ(std::memcmp(&block.scale, &d, 2), 0);
    for (index_t j = 0; j < 32; ++j)
        EXPECT_EQ(block.values[j], static_cast<std::int8_t>(std::round(k(0, 0, 0, j) / static_cast<float>(d))));
    EXPECT_EQ(block.values[31], 127);
    EXPECT_EQ(cache.value_blocks()[0].values[31], -127);
}

/// q8_0 of one block of float values, a value at a time as ggml's reference quantizer: d = fp16(amax / 127), the
/// next fp16 up where that leaves amax above 127.5 d (fp16-subnormal scales), q = std::round(x / d) (half away from
/// zero) clamped to [-127, 127].
q8_0_block quantized_one_at_a_time(const float* x) {
    float amax = 0;
    for (index_t j = 0; j < 32; ++j) amax = std::max(amax, std::abs(x[j]));
    q8_0_block block{};
    block.scale = Eigen::half(amax / 127.0f);
    if (static_cast<float>(block.scale) > 0 && amax > 127.5f * static_cast<float>(block.scale))
        block.scale =
            Eigen::half_impl::raw_uint16_to_half(static_cast<std::uint16_t>(attend::detail::bits_of(block.scale) + 1));
    const float d = static_cast<float>(block.scale), inverse = d > 0 ? 1.0f / d : 0.0f;
    for (index_t j = 0; j < 32; ++j)
        block.values[j] = static_cast<std::int8_t>(std::clamp(std::round(x[j] * inverse), -127.0f, 127.0f));
    return block;
}

// The append quantizes a block at a time in packets (rounding by an add and a truncation); these rows make every
// rounding case happen: exact ties k + 1/2 of the step on both signs (d = 2^-4, so x / d is exact), the floats on
// either side of each tie, values whose quotient lands past 127 (d rounded down), blocks of zeros, of tiny values
// (d rounds to 0) and of fp16-subnormal scales, and random rows of every magnitude; from float, double and bf16.
TEST(Q8Cache, QuantizingInPacketsGivesTheBytesOfAValueAtATimeRoundingHalfAwayFromZero) {
    const index_t D = 64, rows = 300;
    attend::tensor<float, 4> k = random_rows(21, 1, 1, rows, D);
    attend_test::ties_and_neighbours(k, -127, 254, 127.0f / 16.0f);  // rows 0 .. 255; amax 127 / 16: d = 2^-4
    for (index_t j = 0; j < D; ++j) {
        k(0, 0, 256, j) = 0.0f;                                      // zeros
        k(0, 0, 257, j) = 1e-9f * static_cast<float>(j % 5 - 2);     // d rounds to 0: zeros
        k(0, 0, 258, j) = 3e-6f * static_cast<float>(j % 7 - 3);     // d an fp16 subnormal
        k(0, 0, 259, j) = 100.0f * static_cast<float>(j) / (D - 1);  // q up to 127 where x / d is 127.0x
        k(0, 0, 260, j) = -std::nextafter(1000.0f, 0.0f) * static_cast<float>(j % 32 == 31);
    }
    const index_t ties = attend_test::quantized_as_by_hand<q8_0_block>(k, 256, quantized_one_at_a_time);
    EXPECT_GT(ties, 4000);  // the ties were there to round
}

TEST(Q8Cache, TakesAboutAQuarterOfAFloatCachesBytes) {
    const auto sizes =
        attend::kv_cache_config{}.with_batch(2).with_kv_heads(4).with_capacity(1000).with_head_dim(128).with_value_dim(
            64);
    const attend::kv_cache<float> f(sizes);
    const attend::q8_kv_cache q(sizes);
    EXPECT_EQ(q.storage_bytes() * 128, f.storage_bytes() * 34);
}

TEST(Q8Cache, SixteenBitInputsQuantizeAsTheirFloatValues) {
    attend::q8_kv_cache from_float(
        attend::kv_cache_config{}.with_kv_heads(2).with_capacity(10).with_head_dim(64).with_value_dim(32)),
        from_bf16(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(10).with_head_dim(64).with_value_dim(32));
    const attend::tensor<Eigen::bfloat16, 4> k = random_rows(5, 1, 2, 10, 64).cast<Eigen::bfloat16>();
    const attend::tensor<Eigen::bfloat16, 4> v = random_rows(6, 1, 2, 10, 32).cast<Eigen::bfloat16>();
    from_bf16.append(k, v);
    from_float.append(attend::tensor<float, 4>(k.cast<float>()), attend::tensor<float, 4>(v.cast<float>()));
    EXPECT_EQ(std::memcmp(from_bf16.key_blocks().data(), from_float.key_blocks().data(),
                          from_float.key_blocks().size() * sizeof(q8_0_block)),
              0);
}

// check_finite over an int8 cache: its values are finite and at most 128 x 65504 in magnitude, so when q's side of
// the score rule fits against that bound the cache is not read for the scan at all; when it does not, the keys are
// scanned and a score that would overflow is rejected with the message a float cache of the same values gets,
// before anything is written (the decode path, whose pass notes the keys, and the reference kernel).
TEST(Q8Cache, ScoresThatCanOverflowAreRejectedAsOverAFloatCacheAndBoundedOnesNeedNoScan) {
    const index_t B = 1, G = 2, H = 8, D = 64, S = 3000;
    attend::q8_kv_cache cache(
        attend::kv_cache_config{}.with_batch(B).with_kv_heads(G).with_capacity(S).with_head_dim(D));
    auto k = random_rows(21, B, G, S, D);
    for (index_t d = 0; d < D; ++d) k(0, 1, 2500, d) = 8e6f;  // 64 x 1e31 x 8e6 / 8 = 6.4e38: beyond half of float's
    cache.append(k, random_rows(22, B, G, S, D));
    const auto keys = dequantized(cache, true), values = dequantized(cache, false);
    attend::tensor<float, 4> small(B, H, 1, D), large(B, H, 1, D);
    attend_test::fill_uniform(small, 23, -2, 2);
    large.setConstant(1e31f);
    const auto s = attend::check_shapes(small, keys, values);
    const float scale = 1.0f / 8.0f;
    const auto fits = [&](const attend::tensor<float, 4>& q, const auto& view) {
        const auto queries = attend::detail::head_magnitudes(attend::detail::as_view(q), "query", 1);
        return attend::detail::settled_by_format(queries, view, s, scale);
    };
    EXPECT_TRUE(fits(small, cache.keys()));
    EXPECT_FALSE(fits(large, cache.keys()));
    EXPECT_FALSE(fits(small, attend::detail::as_view(keys)));  // a float cache can hold anything
    for (const auto kernel : {attend::kernel::automatic, attend::kernel::reference}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        o.threads = 2;
        attend::tensor<float, 4> out(B, H, 1, D);
        out.setConstant(-5.0f);
        const std::string message = attend_test::expect_error<attend::value_error>(
            [&] {
                attend::scaled_dot_product_attention_into(large, cache.keys(), cache.values(), attend::no_mask{}, o,
                                                          out);
            },
            "attend.value.score_overflow");
        EXPECT_NE(message.find("key 2500"), std::string::npos) << message;
        const std::string as_float = attend_test::expect_error<attend::value_error>(
            [&] { (void)attend::scaled_dot_product_attention(large, keys, values, o); }, "attend.value.score_overflow");
        EXPECT_EQ(message, as_float);
        for (index_t n = 0; n < out.size(); ++n) ASSERT_EQ(out.data()[n], -5.0f);
    }
}

TEST(Q8Cache, ShapeErrorsNameItsViewsWithTheirBlocks) {
    attend::q8_kv_cache cache(
        attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(64).with_value_dim(32));
    cache.append(random_rows(31, 1, 2, 5, 64), random_rows(32, 1, 2, 5, 32));
    attend::tensor<float, 4> q(1, 4, 1, 32), out(1, 4, 1, 32);
    q.setConstant(0.5f);
    out.setConstant(-5.0f);
    const std::string message = attend_test::expect_error<attend::shape_error>(
        [&] { attend::scaled_dot_product_attention_into(q, cache.keys(), cache.values(), attend::no_mask{}, {}, out); },
        "attend.shape.key_dim");
    EXPECT_NE(message.find("query [1,4,1,32], key [1,2,5,64] (q8_0 blocks))"), std::string::npos) << message;
    for (index_t n = 0; n < out.size(); ++n) ASSERT_EQ(out.data()[n], -5.0f);
}

TEST(Q8Cache, EveryBadAppendIsRefusedBeforeAnythingChanges) {
    using attend_test::expect_error;
    expect_error<attend::value_error>(
        [] {
            attend::q8_kv_cache(
                attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(48).with_value_dim(64));
        },
        "attend.value.quantized_dim");
    expect_error<attend::value_error>(
        [] {
            attend::q8_kv_cache(
                attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(64).with_value_dim(40));
        },
        "attend.value.quantized_dim");
    expect_error<attend::value_error>(
        [] { attend::q8_kv_cache(attend::kv_cache_config{}.with_kv_heads(0).with_capacity(8).with_head_dim(64)); },
        "attend.value.size");
    attend::q8_kv_cache cache(
        attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(32).with_value_dim(64));
    cache.append(random_rows(7, 1, 2, 3, 32), random_rows(8, 1, 2, 3, 64));
    const auto before = state_of(cache);
    const auto k = random_rows(9, 1, 2, 2, 32), v = random_rows(10, 1, 2, 2, 64);
    auto huge = v;
    huge(0, 1, 1, 5) = 1e7f;
    std::string message =
        expect_error<attend::value_error>([&] { cache.append(k, huge); }, "attend.value.quantized_range");
    EXPECT_NE(message.find("[0,1,1,5]"), std::string::npos) << message;
    // check_append throws what append throws and, when nothing is wrong, appends nothing either.
    EXPECT_EQ(expect_error<attend::value_error>([&] { cache.check_append(k, huge); }, "attend.value.quantized_range"),
              message);
    cache.check_append(k, v);
    EXPECT_EQ(state_of(cache), before);
    auto nan = k;
    nan(0, 0, 1, 3) = std::numeric_limits<float>::quiet_NaN();
    expect_error<attend::value_error>([&] { cache.append(nan, v); }, "attend.value.non_finite");
    nan(0, 0, 0, 1) = -1e7f;  // a value out of range before the NaN: the NaN is named, as a finiteness scan first
    message = expect_error<attend::value_error>([&] { cache.append(nan, v); }, "attend.value.non_finite");
    EXPECT_NE(message.find("[0,0,1,3]"), std::string::npos) << message;
    attend::tensor<Eigen::bfloat16, 4> huge16 = huge.cast<Eigen::bfloat16>(), k16 = k.cast<Eigen::bfloat16>();
    huge16(0, 0, 0, 9) = Eigen::bfloat16(-3e7f);
    message = expect_error<attend::value_error>([&] { cache.append(k16, huge16); }, "attend.value.quantized_range");
    EXPECT_NE(message.find("[0,0,0,9]"), std::string::npos) << message;
    attend::tensor<double, 4> k64 = k.cast<double>(), v64 = v.cast<double>();
    k64(0, 1, 0, 31) = std::nextafter(attend::q8_kv_cache::max_magnitude, 1e300);  // just past the bound
    expect_error<attend::value_error>([&] { cache.append(k64, v64); }, "attend.value.quantized_range");
    k64(0, 1, 0, 31) = attend::q8_kv_cache::max_magnitude;  // the bound itself fits
    attend::q8_kv_cache roomy(
        attend::kv_cache_config{}.with_kv_heads(2).with_capacity(8).with_head_dim(32).with_value_dim(64));
    roomy.append(k64, v64);
    expect_error<attend::shape_error>([&] { cache.append(v, v); }, "attend.shape.cache");
    expect_error<attend::position_error>(
        [&] { cache.append(random_rows(11, 1, 2, 6, 32), random_rows(12, 1, 2, 6, 64)); },
        "attend.position.cache_full");
    expect_error<attend::position_error>([&] { cache.truncate(4); }, "attend.position.truncate");
    EXPECT_EQ(state_of(cache), before);
    // What was refused did not half-happen: the next good append lands right after the first three positions.
    cache.truncate(2);
    cache.append(k, v);
    EXPECT_EQ(cache.length(), 4);
}

}  // namespace
