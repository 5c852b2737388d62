// SPDX-License-Identifier: MIT
// 16-bit storage (Eigen::half, Eigen::bfloat16) with float accumulation. The invariants:
// - 16-bit q, k, v give the float computation on the same (already rounded) values, rounded to 16 bits once:
//   out and weights are bit for bit the float results cast to the storage type, lse is the float lse itself. So
//   nothing is accumulated in 16 bits, and the only 16-bit rounding after the inputs is the one of the output;
// - against double on the same rounded inputs that meets the accuracy targets (bf16 2^-7, fp16 2^-10 of each
//   output row's largest magnitude);
// - fp16 scores beyond 65504 are fine: accumulated in float, neither an error nor inf;
// - float queries over 16-bit keys and values (a 16-bit kv_cache) equal float keys and values holding the same
//   values, bit for bit, and a 16-bit kv_cache takes half the bytes;
// - rotary embeddings rotate 16-bit features in float and round them once;
// - a 16-bit additive mask is the float mask of the same values, and finite fills beyond the 16-bit range saturate;
// - non-finite 16-bit inputs are rejected before anything is written;
// - and, for every instruction set this file is built for (tests/CMakeLists.txt: the default target, x86-64-v3,
//   and native where it has AVX-512): the same call gives the same bits wherever the heap puts the kernels'
//   scratch (AVX builds once summed an unaligned buffer's head element by element), and wherever the caller's q,
//   k and v start (a decode over K and V 16 bytes past a cache line is slower, never different).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <attend/attend.hpp>
#include <attend/detail/micro_kernel_amx.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/kept_scratch.hpp"
#include "support/random.hpp"
#include "support/storage16.hpp"

namespace {

using attend::index_t;
using attend_test::bit_equal;
using attend_test::random16;
using attend_test::worst_row_error;
using bf16 = Eigen::bfloat16;
using half = Eigen::half;

template <class T>
attend::tensor<float, 4> widen(const attend::tensor<T, 4>& t) {
    return t.template cast<float>();
}

/// One case of attention inputs in storage type T: q `[batch, heads, query_len, dim]`, k and v `[batch, kv_heads,
/// key_len, dim]`.
template <class T>
struct inputs16 {
    attend::tensor<T, 4> q, k, v;
    inputs16(index_t heads, index_t kv_heads, index_t L, index_t S, index_t dim, std::uint64_t seed, double range = 2)
        : q(random16<T>(seed, 2, heads, L, dim, -range, range)),
          k(random16<T>(seed + 1, 2, kv_heads, S, dim, -range, range)),
          v(random16<T>(seed + 2, 2, kv_heads, S, dim)) {}
};

/// The option sets every invariant runs under: plain, causal tiles with sinks and soft-capping, and weights.
std::vector<attend::sdpa_options> option_sets(index_t heads) {
    std::vector<attend::sdpa_options> sets(3);
    sets[1].softcap = 5.0;
    std::vector<double> sinks;
    for (index_t h = 0; h < heads; ++h) sinks.push_back(0.5 * static_cast<double>(h));
    sets[1].sinks = attend::attention_sinks(sinks);
    sets[2].need_weights = true;
    sets[2].kernel = attend::kernel::reference;
    return sets;
}

/// Whether bf16 slabs of many rows take the pair path on this target and machine (AVX-512 BF16,
/// micro_kernel_bf16.hpp; AMX tiles where the target has them, micro_kernel_amx.hpp): P is rounded to bf16 before
/// P V, as in PyTorch's bf16 CPU flash kernel, so there the output is the float result within the bf16 target
/// (2^-7 of each row's largest magnitude; 2.8 x 2^-9 was the worst seen over a sweep of ranges, lengths and masks),
/// no longer that result rounded once.
template <class T>
bool pair_kernels(index_t head_dim, index_t value_dim) {
    return std::is_same_v<T, bf16> && attend::detail::bf16_pairs_for(head_dim, value_dim);
}

/// `pair_slabs`: whether the case has slabs that the pair kernels take (more rows than the GEMV path's).
template <class T>
void expect_float_result_rounded_once(const inputs16<T>& in, const attend::sdpa_options& options, bool pair_slabs) {
    const auto mask = attend::causal(attend::alignment::bottom_right);
    const bool pairs = pair_kernels<T>(in.q.dimension(3), in.v.dimension(3)) && pair_slabs &&
                       options.kernel != attend::kernel::reference;
    attend::tensor<T, 4> first;
    for (const int threads : {1, 2}) {
        attend::sdpa_options o = options;
        o.threads = threads;
        const auto got = attend::scaled_dot_product_attention(in.q, in.k, in.v, mask, o);
        const auto want = attend::scaled_dot_product_attention(widen(in.q), widen(in.k), widen(in.v), mask, o);
        const attend::tensor<T, 4> rounded = want.out.template cast<T>();
        if (pairs) {
            const attend::tensor<double, 4> exact = want.out.template cast<double>();
            EXPECT_LE(worst_row_error(got.out, exact), std::ldexp(1.0, -7)) << "threads " << threads;
            EXPECT_FALSE(bit_equal(got.out, rounded)) << "the pair kernels ran: P was rounded";
            for (index_t n = 0; n < want.lse.size(); ++n)
                ASSERT_NEAR(got.lse.data()[n], want.lse.data()[n],
                            1e-5f * std::max(1.0f, std::abs(want.lse.data()[n])));
            if (threads == 1) first = got.out;
            else EXPECT_TRUE(bit_equal(got.out, first)) << "the same bits for any thread count";
            continue;
        }
        EXPECT_TRUE(bit_equal(got.out, rounded)) << "threads " << threads;
        EXPECT_TRUE(bit_equal(got.lse, want.lse)) << "threads " << threads;  // lse stays float
        if (o.need_weights) {
            const attend::tensor<T, 4> weights = want.weights.template cast<T>();
            EXPECT_TRUE(bit_equal(got.weights, weights)) << "threads " << threads;
        }
    }
}

template <class T>
class Storage16 : public ::testing::Test {};
TYPED_TEST_SUITE(Storage16, attend_test::storage16_types, attend_test::storage16_names);

TYPED_TEST(Storage16, OutputIsTheFloatResultOnTheSameValuesRoundedOnce) {
    using T = TypeParam;
    const inputs16<T> prefill(4, 2, 300, 700, 64, 11);  // causal tiles: full, mixed, skipped; GQA groups of 2
    const inputs16<T> decode(8, 2, 1, 5000, 64, 12);    // split-key decode path, GEMV rows
    for (const auto& options : option_sets(4)) expect_float_result_rounded_once(prefill, options, true);
    for (const auto& options : option_sets(8)) expect_float_result_rounded_once(decode, options, false);
    // Dropout: applied to each row of probabilities before the pair path rounds it to bf16.
    attend::sdpa_options dropout;
    dropout.dropout.training = true;
    dropout.dropout.probability = 0.25;
    dropout.dropout.seed = 7;
    expect_float_result_rounded_once(prefill, dropout, true);
}

TYPED_TEST(Storage16, MeetsItsAccuracyTargetAgainstDoubleOnTheSameInputs) {
    using T = TypeParam;
    const double target = std::is_same_v<T, bf16> ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
    const inputs16<T> in(4, 2, 257, 3000, 64, 21);
    for (const auto& options : option_sets(4)) {
        const auto mask = attend::causal(attend::alignment::bottom_right);
        const auto got = attend::scaled_dot_product_attention(in.q, in.k, in.v, mask, options);
        const attend::tensor<double, 4> qd = in.q.template cast<double>(), kd = in.k.template cast<double>(),
                                        vd = in.v.template cast<double>();
        const auto want = attend::scaled_dot_product_attention(qd, kd, vd, mask, options);
        const double error = worst_row_error(got.out, want.out);
        EXPECT_LE(error, target);
        // Not vacuous: the error is the 16-bit rounding of the output, not float's (which is 2^-24).
        EXPECT_GE(error, target / 8);
        for (index_t n = 0; n < want.lse.size(); ++n)
            ASSERT_NEAR(static_cast<double>(got.lse.data()[n]), want.lse.data()[n],
                        1e-5 * std::max(1.0, std::abs(want.lse.data()[n])));
    }
}

TYPED_TEST(Storage16, HeadDimsAndRaggedEdgesGiveTheFloatResultOnTheSameValues) {
    // The pair path's edges (AMX tiles on targets with them: row groups of 16 and 32, steps of 16 pairs, panels of
    // 32 keys; head dims of one to four tiles' 32 values) and the float kernels' for fp16, under every option set.
    using T = TypeParam;
    for (const index_t dim : {index_t(32), index_t(96), index_t(128)}) {
        const inputs16<T> small(2, 1, 37, 45, dim, 40 + static_cast<std::uint64_t>(dim));
        const inputs16<T> ragged(4, 2, 129, 513, dim, 50 + static_cast<std::uint64_t>(dim));
        for (const auto& options : option_sets(2)) expect_float_result_rounded_once(small, options, true);
        for (const auto& options : option_sets(4)) expect_float_result_rounded_once(ragged, options, true);
    }
}

TEST(Storage16Half, ScoresBeyondTheHalfRangeStayFiniteInFloat) {
    // Entries up to 400: scaled scores up to 64 x 400 x 400 / 8 = 1.3e6, and the largest reached (the lse checked
    // below) beyond fp16's 65504: infinite in fp16 arithmetic, fine in float.
    const inputs16<half> in(2, 2, 40, 90, 64, 31, 400.0);
    const auto got = attend::scaled_dot_product_attention(in.q, in.k, in.v);
    const auto want = attend::scaled_dot_product_attention(widen(in.q), widen(in.k), widen(in.v));
    EXPECT_GT(attend_test::max_abs(want.lse), 65504.0);
    EXPECT_TRUE(attend_test::all_finite(got.lse));
    const attend::tensor<half, 4> rounded = want.out.cast<half>();
    EXPECT_TRUE(bit_equal(got.out, rounded));
}

template <class T>
void expect_float_queries_over_16bit_keys_equal_float_keys(std::uint64_t seed) {
    const attend::tensor<float, 4> q = widen(random16<T>(seed, 2, 8, 3, 64));
    const inputs16<T> kv(8, 2, 1, 6000, 64, seed + 10);
    for (const auto kernel : {attend::kernel::tiled, attend::kernel::reference}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        const auto got =
            attend::scaled_dot_product_attention(q, kv.k, kv.v, attend::causal(attend::alignment::bottom_right), o);
        const auto want = attend::scaled_dot_product_attention(q, widen(kv.k), widen(kv.v),
                                                               attend::causal(attend::alignment::bottom_right), o);
        EXPECT_TRUE(bit_equal(got.out, want.out));
        EXPECT_TRUE(bit_equal(got.lse, want.lse));
    }
}

TEST(Storage16Mixed, FloatQueriesOverSixteenBitKeysEqualFloatKeysHoldingTheSameValues) {
    expect_float_queries_over_16bit_keys_equal_float_keys<half>(41);
    expect_float_queries_over_16bit_keys_equal_float_keys<bf16>(42);
}

TEST(Storage16Mixed, DecodingOverASixteenBitCacheEqualsAFloatCacheOfTheSameValues) {
    const index_t B = 2, G = 2, H = 8, D = 64, prompt = 3000;
    attend::kv_cache<bf16> cache16(
        attend::kv_cache_config{}.with_batch(B).with_kv_heads(G).with_capacity(4096).with_head_dim(D));
    attend::kv_cache<float> cache32(
        attend::kv_cache_config{}.with_batch(B).with_kv_heads(G).with_capacity(4096).with_head_dim(D));
    const auto k = random16<bf16>(51, B, G, prompt, D), v = random16<bf16>(52, B, G, prompt, D);
    cache16.append(k, v);
    cache32.append(widen(k), widen(v));
    for (index_t step = 0; step < 3; ++step) {
        const auto seed = static_cast<std::uint64_t>(60 + 2 * step);
        const auto k1 = random16<bf16>(seed, B, G, 1, D), v1 = random16<bf16>(seed + 1, B, G, 1, D);
        cache16.append(k1, v1);
        cache32.append(widen(k1), widen(v1));
        const auto q = widen(random16<bf16>(seed + 10, B, H, 1, D));
        const auto got = attend::scaled_dot_product_attention(q, cache16.keys(), cache16.values());
        const auto want = attend::scaled_dot_product_attention(q, cache32.keys(), cache32.values());
        EXPECT_TRUE(bit_equal(got.out, want.out)) << "step " << step;
    }
}

/// Float keys and values appended to a 16-bit cache (contiguous and paged) are stored as the same values rounded
/// first and appended as T, bit for bit; NaN, inf and a float T rounds to inf are refused before anything changes.
template <class T>
void expect_float_appends_round_once(std::uint64_t seed) {
    const index_t G = 2, L = 5, D = 32;
    const auto k = attend_test::random_tensor<float>(seed, 1, G, L, D);
    const auto v = attend_test::random_tensor<float>(seed + 1, 1, G, L, D);
    const attend::tensor<T, 4> k16 = k.template cast<T>(), v16 = v.template cast<T>();
    const auto same_rows = [&](const auto& a, const auto& b) {
        for (index_t h = 0; h < G; ++h)
            for (index_t i = 0; i < L; ++i)
                if (std::memcmp(a(h, i), b(h, i), static_cast<std::size_t>(D) * sizeof(T)) != 0) return false;
        return true;
    };
    const auto config = attend::kv_cache_config{}.with_kv_heads(G).with_capacity(2 * L).with_head_dim(D);
    attend::kv_cache<T> from_float(config), from_rounded(config);
    from_float.append(k, v);
    from_rounded.append(k16, v16);
    EXPECT_TRUE(same_rows([&](index_t h, index_t i) { return from_float.keys().row(0, h, i); },
                          [&](index_t h, index_t i) { return from_rounded.keys().row(0, h, i); }));
    EXPECT_TRUE(same_rows([&](index_t h, index_t i) { return from_float.values().row(0, h, i); },
                          [&](index_t h, index_t i) { return from_rounded.values().row(0, h, i); }));
    const auto paged_config = attend::paged_cache_config{}.with_kv_heads(G).with_head_dim(D).with_blocks(4);
    attend::paged_kv_cache<T> paged_float(paged_config), paged_rounded(paged_config);
    const index_t a = paged_float.add_sequence(), b = paged_rounded.add_sequence();
    paged_float.append(a, k, v);
    paged_rounded.append(b, k16, v16);
    EXPECT_TRUE(same_rows([&](index_t h, index_t i) { return paged_float.key_row(a, h, i); },
                          [&](index_t h, index_t i) { return paged_rounded.key_row(b, h, i); }));
    EXPECT_TRUE(same_rows([&](index_t h, index_t i) { return paged_float.value_row(a, h, i); },
                          [&](index_t h, index_t i) { return paged_rounded.value_row(b, h, i); }));
    // Beyond the 16-bit type's range (fp16: 65504; bf16: float's largest value rounds up to inf), NaN and inf.
    const float too_large = std::is_same_v<T, Eigen::half> ? 1e5f : std::numeric_limits<float>::max();
    for (const float bad :
         {too_large, -too_large, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        attend::tensor<float, 4> hostile = v;
        hostile(0, 1, 3, 7) = bad;
        attend_test::expect_error<attend::value_error>([&] { from_float.append(k, hostile); },
                                                       "attend.value.non_finite");
        attend_test::expect_error<attend::value_error>([&] { paged_float.append(a, hostile, v); },
                                                       "attend.value.non_finite");
        EXPECT_EQ(from_float.length(), L);
        EXPECT_EQ(paged_float.length(a), L);
    }
}

TEST(Storage16Mixed, FloatAppendsIntoASixteenBitCacheAreRoundedOnceOrRefusedWhenTheyWouldBeInfinite) {
    expect_float_appends_round_once<half>(71);
    expect_float_appends_round_once<bf16>(72);
}

template <class T>
void expect_paged_16bit_cache_equals_float_cache(std::uint64_t seed) {
    attend::paged_cache_config config;
    config.kv_heads = 2;
    config.head_dim = 64;
    config.block_size = 16;
    config.blocks = 400;
    config.max_sequences = 2;
    attend::paged_kv_cache<T> cache16(config);
    attend::paged_kv_cache<float> cache32(config);
    const std::vector<index_t> lengths{3000, 700}, counts{1, 3};
    std::vector<index_t> ids;
    for (std::size_t n = 0; n < lengths.size(); ++n) {
        ids.push_back(cache16.add_sequence());
        cache32.add_sequence();
        const auto k = random16<T>(seed + n, 1, 2, lengths[n], 64), v = random16<T>(seed + 9 + n, 1, 2, lengths[n], 64);
        cache16.append(ids.back(), k, v);
        cache32.append(ids.back(), widen(k), widen(v));
    }
    const auto q16 = random16<T>(seed + 20, 2, 8, 3, 64);
    // Float queries over the 16-bit blocks: exactly the float cache of the same values.
    const auto got = attend::paged_attention(widen(q16), cache16, ids, counts);
    const auto want = attend::paged_attention(widen(q16), cache32, ids, counts);
    EXPECT_TRUE(bit_equal(got.out, want.out));
    EXPECT_TRUE(bit_equal(got.lse, want.lse));
    // 16-bit queries: the float result rounded once.
    const auto got16 = attend::paged_attention(q16, cache16, ids, counts);
    const attend::tensor<T, 4> rounded = want.out.template cast<T>();
    EXPECT_TRUE(bit_equal(got16.out, rounded));
    EXPECT_TRUE(bit_equal(got16.lse, want.lse));
}

TEST(Storage16Mixed, APagedSixteenBitCacheEqualsAPagedFloatCacheOfTheSameValues) {
    expect_paged_16bit_cache_equals_float_cache<half>(111);
    expect_paged_16bit_cache_equals_float_cache<bf16>(112);
}

TEST(Storage16Mixed, ASixteenBitCacheTakesHalfTheBytesOfAFloatOne) {
    const auto sizes =
        attend::kv_cache_config{}.with_batch(2).with_kv_heads(4).with_capacity(1000).with_head_dim(64).with_value_dim(
            32);
    const attend::kv_cache<float> f(sizes);
    const attend::kv_cache<double> d(sizes);
    const attend::kv_cache<half> h(sizes);
    const attend::kv_cache<bf16> b(sizes);
    EXPECT_EQ(f.storage_bytes(), std::size_t{2 * 4 * 1000 * (64 + 32) * 4});
    EXPECT_EQ(d.storage_bytes(), 2 * f.storage_bytes());
    EXPECT_EQ(h.storage_bytes(), f.storage_bytes() / 2);
    EXPECT_EQ(b.storage_bytes(), f.storage_bytes() / 2);
}

TYPED_TEST(Storage16, EveryBitPatternWidensToItsExactFloat) {
    // All 65536 values through the kernels' widening loops (F16C, or the integer rebias where the target has no
    // F16C; bf16's shift), against Eigen's scalar conversion; NaN payloads as NaN.
    using T = TypeParam;
    std::vector<T> all(65536);
    for (std::uint32_t b = 0; b < 65536; ++b) {
        const auto bits = static_cast<std::uint16_t>(b);
        std::memcpy(static_cast<void*>(&all[b]), &bits, 2);
    }
    std::vector<float> wide(all.size());
    attend::detail::widen(all.data(), static_cast<index_t>(all.size()), wide.data());
    for (std::size_t b = 0; b < all.size(); ++b) {
        const auto want = static_cast<float>(all[b]);
        float one = 0;  // alone: the loops' tail (a q8_0 block's scale is widened this way)
        attend::detail::widen(&all[b], 1, &one);
        if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(wide[b]) && std::isnan(one)) << b;
            ASSERT_TRUE(attend::detail::any_non_finite_16(&all[b], 1)) << b;
            continue;
        }
        ASSERT_EQ(std::memcmp(&wide[b], &want, 4), 0) << "bits " << b << ": " << wide[b] << " vs " << want;
        ASSERT_EQ(std::memcmp(&one, &want, 4), 0) << "bits " << b << " alone: " << one << " vs " << want;
        ASSERT_EQ(attend::detail::any_non_finite_16(&all[b], 1), std::isinf(want)) << b;
    }
}

TYPED_TEST(Storage16, NarrowingRoundsEveryFloatAsEigensConversionDoes) {
    // The outputs' rounding back to 16 bits (F16C, or Eigen's own conversion where the target has none; bf16 in
    // integer arithmetic), against Eigen's scalar conversion: every 16-bit value and the floats around it (each
    // value's neighbours and the midpoints to the next, where ties round to even), the overflow edge, and a sweep
    // of all float bit patterns 65521 apart; in runs of 8 (the vector loop) and alone (its tail). NaN stays NaN.
    using T = TypeParam;
    std::vector<float> floats;
    for (std::uint32_t b = 0; b < 65536; ++b) {
        const auto bits = static_cast<std::uint16_t>(b);
        T value;
        std::memcpy(static_cast<void*>(&value), &bits, 2);
        const float x = static_cast<float>(value);
        if (!std::isfinite(x)) continue;
        floats.push_back(x);
        floats.push_back(std::nextafter(x, std::numeric_limits<float>::infinity()));
        floats.push_back(std::nextafter(x, -std::numeric_limits<float>::infinity()));
        T next_bits = value;
        const auto up = static_cast<std::uint16_t>(b + 1);
        std::memcpy(static_cast<void*>(&next_bits), &up, 2);
        const float next = static_cast<float>(next_bits);
        if (std::isfinite(next) && std::signbit(next) == std::signbit(x)) {
            const float mid = x + (next - x) / 2;  // exact: 16-bit neighbours are far apart in float
            floats.push_back(mid);
            floats.push_back(std::nextafter(mid, next));
            floats.push_back(std::nextafter(mid, x));
        }
    }
    for (float x : {65504.0f, 65519.996f, 65520.0f, 3.3895314e38f, std::numeric_limits<float>::max()}) {
        floats.push_back(x);
        floats.push_back(-x);
    }
    for (std::uint64_t b = 0; b < (std::uint64_t{1} << 32); b += 65521) {
        const auto bits = static_cast<std::uint32_t>(b);
        float x;
        std::memcpy(&x, &bits, 4);
        floats.push_back(x);
    }
    std::vector<T> runs(floats.size());
    attend::detail::narrow(floats.data(), static_cast<index_t>(floats.size()), runs.data());
    for (std::size_t j = 0; j < floats.size(); ++j) {
        const T want = static_cast<T>(floats[j]);
        T alone;
        attend::detail::narrow(&floats[j], 1, &alone);
        if (std::isnan(floats[j])) {
            ASSERT_TRUE(std::isnan(static_cast<float>(runs[j])) && std::isnan(static_cast<float>(alone))) << j;
            continue;
        }
        ASSERT_EQ(std::memcmp(&runs[j], &want, 2), 0) << floats[j] << " (float bits " << j << ")";
        ASSERT_EQ(std::memcmp(&alone, &want, 2), 0) << floats[j] << " alone";
    }
}

TYPED_TEST(Storage16, RotaryRotatesInFloatAndRoundsOnce) {
    using T = TypeParam;
    for (const auto layout : {attend::rotary_layout::half_split, attend::rotary_layout::interleaved}) {
        const attend::rotary_embedding rope{48, 10000, layout};
        attend::tensor<T, 4> x = random16<T>(71, 2, 3, 17, 64, -3, 3);
        attend::tensor<float, 4> wide = widen(x);
        rope.apply(x, 1000);
        rope.apply(wide, 1000);
        const attend::tensor<T, 4> rounded = wide.cast<T>();
        EXPECT_TRUE(bit_equal(x, rounded));
    }
}

/// Expects attention over q, k, v (options) to throw value_error attend.value.non_finite naming `element`, with
/// nothing written into a sentinel-filled out [batch, heads, query_len, value_dim].
template <class T>
void expect_non_finite_named_before_any_write(const attend::tensor<T, 4>& q, const attend::tensor<T, 4>& k,
                                              const attend::tensor<T, 4>& v, const std::string& element,
                                              const attend::sdpa_options& options = {}) {
    const T sentinel(0.75f);
    attend::tensor<T, 4> out(q.dimension(0), q.dimension(1), q.dimension(2), v.dimension(3));
    out.setConstant(sentinel);
    const std::string message = attend_test::expect_error<attend::value_error>(
        [&] { attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, options, out); },
        "attend.value.non_finite");
    EXPECT_NE(message.find(element), std::string::npos) << message;
    for (index_t n = 0; n < out.size(); ++n) ASSERT_TRUE(out.data()[n] == sentinel);
}

TYPED_TEST(Storage16, NonFiniteInputsAreRejectedBeforeAnyWrite) {
    using T = TypeParam;
    for (const int which : {0, 1, 2})
        for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
            inputs16<T> in(2, 1, 5, 7, 8, 81);
            attend::tensor<T, 4>& target = which == 0 ? in.q : which == 1 ? in.k : in.v;
            target(1, 0, 3, 2) = T(bad);
            expect_non_finite_named_before_any_write(in.q, in.k, in.v, "[1,0,3,2]");
        }
}

// A decode of 16 queries on 4 query heads per kv head has 64 rows per block: more than the GEMV path takes, so its
// slabs pack keys and values (into bf16 pairs where the target has AVX-512 BF16) and the pass notes them for
// check_finite's deferred scan. A NaN or inf past the first decode chunk is found there, before any write.
TYPED_TEST(Storage16, ADecodeOfManyRowsFindsANonFiniteKeyOrValueBeforeAnyWrite) {
    using T = TypeParam;
    attend::sdpa_options options;
    options.threads = 2;
    for (const int which : {1, 2})
        for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
            inputs16<T> in(8, 2, 16, 5000, 64, 83);
            (which == 1 ? in.k : in.v)(1, 1, 4321, 7) = T(bad);
            expect_non_finite_named_before_any_write(in.q, in.k, in.v, "[1,1,4321,7]", options);
        }
}

// A decode of one query on 2 query heads per kv head takes the row kernels, head_dim 32 (two packets a row on
// AVX-512): there bf16 keys are noted for check_finite two widened packets at a time, where a NaN loses to the other
// packet's value and is told by the scores it makes, and fp16 keys on their bits. Either way a NaN, inf or -inf key
// is named, wherever it sits in its row and in its two chunks, before any write.
TYPED_TEST(Storage16, ADecodeOnTheRowKernelsNamesANonFiniteKeyWhereverItSits) {
    using T = TypeParam;
    const inputs16<T> in(4, 2, 1, 2600, 32, 91);
    for (const index_t key : {index_t(0), index_t(5), index_t(1023), index_t(2300), index_t(2599)})
        for (const index_t dim : {index_t(0), index_t(2), index_t(17), index_t(31)})
            for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                    -std::numeric_limits<float>::infinity()}) {
                SCOPED_TRACE("key " + std::to_string(key) + ", dim " + std::to_string(dim) + " holds " +
                             std::to_string(bad));
                attend::tensor<T, 4> k = in.k;
                k(1, 1, key, dim) = T(bad);
                expect_non_finite_named_before_any_write(
                    in.q, k, in.v, "[1,1," + std::to_string(key) + "," + std::to_string(dim) + "]");
            }
}

TYPED_TEST(Storage16, ASixteenBitAdditiveMaskIsTheFloatMaskOfTheSameValues) {
    using T = TypeParam;
    const inputs16<T> in(4, 2, 70, 90, 16, 61);
    attend::tensor<T, 4> bias = random16<T>(62, 2, 4, 70, 90, -4, 4);
    for (index_t n = 0; n < bias.size(); n += 7) bias.data()[n] = T(-std::numeric_limits<float>::infinity());
    for (index_t i = 0; i < 70; ++i) bias(0, 0, i, 0) = T(0);  // every row keeps a key
    for (index_t i = 0; i < 70; ++i) bias(1, 3, i, 0) = T(0);
    const attend::tensor<float, 4> wide = bias.template cast<float>();
    for (const auto kernel : {attend::kernel::tiled, attend::kernel::reference}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        o.empty_rows = attend::empty_rows::zero;
        const auto got =
            attend::scaled_dot_product_attention(in.q, in.k, in.v, attend::additive_mask<T>::from_values(bias), o);
        const auto want =
            attend::scaled_dot_product_attention(in.q, in.k, in.v, attend::additive_mask<float>::from_values(wide), o);
        EXPECT_TRUE(bit_equal(got.out, want.out));
        EXPECT_TRUE(bit_equal(got.lse, want.lse));
    }
    // Finite fills beyond the 16-bit range saturate instead of becoming -inf (which would empty the row: fp16's
    // -1e9 trap) or +inf; NaN is rejected.
    attend::tensor<float, 2> fill(1, 3);
    fill.setValues({{-1e30f, -std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}});
    const auto one_key = attend::additive_mask<T>::query_key_grid(fill);
    const inputs16<T> small(1, 1, 1, 3, 8, 63);
    const auto r = attend::scaled_dot_product_attention(small.q, small.k, small.v, one_key);  // not an empty row
    for (index_t d = 0; d < 8; ++d) EXPECT_TRUE(r.out(0, 0, 0, d) == small.v(0, 0, 0, d));
    fill(0, 0) = 1e30f;
    const auto large =
        attend::scaled_dot_product_attention(small.q, small.k, small.v, attend::additive_mask<T>::query_key_grid(fill));
    for (index_t d = 0; d < 8; ++d) EXPECT_TRUE(large.out(0, 0, 0, d) == small.v(0, 0, 0, d));
    attend::tensor<T, 2> nan_mask(2, 2);
    nan_mask.setConstant(T(0));
    nan_mask(1, 0) = T(std::numeric_limits<float>::quiet_NaN());
    attend_test::expect_error<attend::value_error>([&] { (void)attend::additive_mask<T>::query_key_grid(nan_mask); },
                                                   "attend.value.additive_mask");
}

TYPED_TEST(Storage16, MergingTwoKeyHalvesEqualsAttentionOverAllKeys) {
    using T = TypeParam;
    const inputs16<T> in(4, 2, 6, 800, 32, 91);
    const Eigen::array<index_t, 4> at{0, 0, 0, 0}, half_keys{2, 2, 400, 32}, rest{0, 0, 400, 0};
    const attend::tensor<T, 4> k0 = in.k.slice(at, half_keys), k1 = in.k.slice(rest, half_keys);
    const attend::tensor<T, 4> v0 = in.v.slice(at, half_keys), v1 = in.v.slice(rest, half_keys);
    const auto a = attend::scaled_dot_product_attention(in.q, k0, v0);
    const auto b = attend::scaled_dot_product_attention(in.q, k1, v1);
    const auto merged = attend::merge_partials(a.out, a.lse, b.out, b.lse);
    const auto whole = attend::scaled_dot_product_attention(in.q, in.k, in.v);
    const attend::tensor<double, 4> want = whole.out.template cast<double>();
    // Three 16-bit roundings (each part's output, the merged output) against one.
    const double target = std::is_same_v<T, bf16> ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
    EXPECT_LE(worst_row_error(merged.out, want), 2 * target);
    for (index_t n = 0; n < whole.lse.size(); ++n)
        EXPECT_NEAR(merged.lse.data()[n], whole.lse.data()[n], 1e-5 * std::abs(whole.lse.data()[n]));
}

template <class T>
void expect_same_bits_wherever_the_scratch_lands(std::uint64_t seed) {
    const inputs16<T> in(4, 2, 300, 700, 64, seed);
    attend::sdpa_options o;
    o.threads = 1;
    const auto mask = attend::causal(attend::alignment::bottom_right);
    const auto first = attend::scaled_dot_product_attention(in.q, in.k, in.v, mask, o);
    for (std::size_t shift = 8; shift <= 56; shift += 16) {
        const std::vector<char> moves_the_heap(4096 + shift);  // the next allocations land elsewhere
        const auto again = attend::scaled_dot_product_attention(in.q, in.k, in.v, mask, o);
        EXPECT_TRUE(bit_equal(again.out, first.out)) << "shift " << shift << ", " << moves_the_heap.size();
        EXPECT_TRUE(bit_equal(again.lse, first.lse)) << "shift " << shift;
    }
}

/// q, k and v copied to `offset` elements past an aligned allocation and mapped there (TensorMap), as a caller's
/// memory is read in place: the decode (row kernels) and a causal prefill (micro-kernels, panels packed from the
/// mapped rows) give the bits of the same call on attend's own, aligned tensors.
template <class T>
void expect_same_bits_wherever_the_inputs_start(std::uint64_t seed) {
    using map = Eigen::TensorMap<Eigen::Tensor<const T, 4, Eigen::RowMajor>>;
    for (const index_t L : {index_t{1}, index_t{300}}) {
        const inputs16<T> in(4, 2, L, 700, 64, seed + static_cast<std::uint64_t>(L));
        attend::sdpa_options o;
        o.threads = 1;
        const auto mask = attend::causal(attend::alignment::bottom_right);
        const auto want = attend::scaled_dot_product_attention(in.q, in.k, in.v, mask, o);
        for (const index_t offset : {1, 4, 8, 12}) {
            std::vector<std::vector<T, Eigen::aligned_allocator<T>>> copies;
            copies.reserve(3);  // the maps point into them
            const auto placed = [&](const attend::tensor<T, 4>& t) {
                copies.emplace_back(static_cast<std::size_t>(t.size() + offset));
                std::copy(t.data(), t.data() + t.size(), copies.back().data() + offset);
                return map(copies.back().data() + offset, t.dimensions());
            };
            const map q = placed(in.q), k = placed(in.k), v = placed(in.v);
            const auto got = attend::scaled_dot_product_attention(q, k, v, mask, o);
            EXPECT_TRUE(bit_equal(got.out, want.out)) << "query_len " << L << ", " << offset << " elements in";
            EXPECT_TRUE(bit_equal(got.lse, want.lse)) << "query_len " << L << ", " << offset << " elements in";
        }
    }
}

/// The weights' second pass takes the forward pass's steps (slabs, strips, kernels), so a score reaches the
/// weights with the bits it had in the softmax. Here because this file is built for every instruction set: with
/// multiply-adds fused, a row kernel's and a micro-kernel's sums of the same products can differ in the last bit,
/// and a single allowed key had got a weight of 1 - 2^-24 where the weights pass recomputed its score otherwise.
template <class T>
void expect_a_single_allowed_key_to_get_weight_one(std::uint64_t seed) {
    const index_t L = 40, S = 700;  // 40 queries: a mixed tile's slabs of 32 rows (micro-kernel) and 8 (row kernels)
    const inputs16<T> in(2, 1, L, S, 8, seed);
    attend::tensor<bool, 2> allowed(L, S);
    allowed.setConstant(false);
    std::vector<index_t> only(static_cast<std::size_t>(L));
    for (index_t i = 0; i < L; ++i) {
        only[static_cast<std::size_t>(i)] = (i * 97 + 13) % S;
        allowed(i, only[static_cast<std::size_t>(i)]) = true;
    }
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.need_weights = true;
    const auto r =
        attend::scaled_dot_product_attention(in.q, in.k, in.v, attend::allowed_mask::query_key_grid(allowed), o);
    for (index_t b = 0; b < 2; ++b)
        for (index_t h = 0; h < 2; ++h)
            for (index_t i = 0; i < L; ++i) {
                const index_t j = only[static_cast<std::size_t>(i)];
                ASSERT_EQ(static_cast<double>(r.weights(b, h, i, j)), 1.0)
                    << "batch " << b << ", head " << h << ", query " << i;
                for (index_t d = 0; d < 8; ++d) ASSERT_EQ(r.out(b, h, i, d), in.v(b, 0, j, d)) << "query " << i;
            }
}

TEST(Storage16Weights, ASingleAllowedKeyGetsWeightOneOnEveryInstructionSet) {
    expect_a_single_allowed_key_to_get_weight_one<float>(111);
    expect_a_single_allowed_key_to_get_weight_one<bf16>(112);
}

TEST(Storage16Determinism, TheSameCallGivesTheSameBitsWhereverTheHeapPutsItsScratch) {
    expect_same_bits_wherever_the_scratch_lands<float>(101);
    expect_same_bits_wherever_the_scratch_lands<bf16>(102);
}

/// The tiled kernel's workspaces start with whatever the kept scratch held (kept_scratch.hpp); here because this file
/// is built for every instruction set, so with AVX-512 BF16 the bf16 pair kernels' rounding of P to pairs reads
/// only scores it wrote: a causal prefill (slabs, partial panels, an odd last tile) and a decode.
template <class T>
void expect_scratch_full_of_nan_to_change_no_bit(std::uint64_t seed) {
    for (const index_t L : {index_t{1}, index_t{201}}) {
        const inputs16<T> in(4, 2, L, 333, 64, seed + static_cast<std::uint64_t>(L));
        attend::sdpa_options o;
        o.threads = 2;
        attend_test::expect_scratch_full_of_nan_changes_no_bit(
            [&] {
                return attend::scaled_dot_product_attention(in.q, in.k, in.v,
                                                            attend::causal(attend::alignment::bottom_right), o);
            },
            "query_len " + std::to_string(L));
    }
}

TEST(Storage16Determinism, ScratchFullOfNanChangesNoBit) {
    expect_scratch_full_of_nan_to_change_no_bit<bf16>(106);
    expect_scratch_full_of_nan_to_change_no_bit<half>(107);
}

TEST(Storage16Determinism, TheSameCallGivesTheSameBitsWhereverTheCallersMemoryStarts) {
    expect_same_bits_wherever_the_inputs_start<float>(103);
    expect_same_bits_wherever_the_inputs_start<bf16>(104);
    expect_same_bits_wherever_the_inputs_start<half>(105);
}

}  // namespace
