// SPDX-License-Identifier: MIT
// Tests of attend/cache.hpp and multi_head_attention::forward_cached: a fixed-capacity cache that never
// reallocates, errors that leave it unchanged, and decoding token by token (or in chunks) that reproduces one
// full causal forward pass, with and without rotary positions and with grouped-query heads; forward_cached over an
// int8 cache, which holds the quantized projections and is read as float attention over its values.
#include <attend/cache.hpp>
#include <attend/mha.hpp>
#include <attend/q8_cache.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/q8_blocks.hpp"
#include "support/random.hpp"

namespace {

using attend_test::expect_error;

using attend::index_t;
using attend::tensor;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// Everything a cache shows, for comparing before and after a failed call.
template <class T>
std::vector<T> snapshot(const attend::kv_cache<T>& c) {
    std::vector<T> s;
    for (const auto& view : {c.keys(), c.values()})
        for (index_t b = 0; b < view.dims[0]; ++b)
            for (index_t h = 0; h < view.dims[1]; ++h)
                for (index_t i = 0; i < view.dims[2]; ++i)
                    for (index_t d = 0; d < view.dims[3]; ++d) s.push_back(view.row(b, h, i)[d]);
    return s;
}

/// x[:, begin:begin+len, :]
template <class T>
tensor<T, 3> slice_tokens(const tensor<T, 3>& x, index_t begin, index_t len) {
    tensor<T, 3> s(x.dimension(0), len, x.dimension(2));
    for (index_t b = 0; b < x.dimension(0); ++b)
        for (index_t i = 0; i < len; ++i)
            for (index_t e = 0; e < x.dimension(2); ++e) s(b, i, e) = x(b, begin + i, e);
    return s;
}

// ---------------------------------------------------------------------------------------------------------
// kv_cache

TEST(KvCache, AppendsIntoFixedStorageAndViewsStayValid) {
    attend::kv_cache<double> c(
        attend::kv_cache_config{}.with_batch(2).with_kv_heads(3).with_capacity(7).with_head_dim(4).with_value_dim(5));
    EXPECT_EQ(c.length(), 0);
    EXPECT_EQ(c.capacity(), 7);
    EXPECT_EQ(c.remaining(), 7);
    EXPECT_EQ(c.keys().dims[2], 0);
    const auto k1 = attend_test::random_tensor<double>(1, 2, 3, 2, 4),
               v1 = attend_test::random_tensor<double>(2, 2, 3, 2, 5);
    c.append(k1, v1);
    const auto keys_before = c.keys();
    const auto values_before = c.values();
    const auto k2 = attend_test::random_tensor<double>(3, 2, 3, 3, 4),
               v2 = attend_test::random_tensor<double>(4, 2, 3, 3, 5);
    c.append(k2, v2);
    EXPECT_EQ(c.length(), 5);
    EXPECT_EQ(c.remaining(), 2);
    const auto keys = c.keys(), values = c.values();
    EXPECT_EQ(keys.data, keys_before.data);  // never reallocated
    EXPECT_EQ(values.data, values_before.data);
    EXPECT_EQ(keys.dims, (std::array<index_t, 4>{2, 3, 5, 4}));
    EXPECT_EQ(values.dims, (std::array<index_t, 4>{2, 3, 5, 5}));
    EXPECT_EQ(keys.strides, (std::array<index_t, 4>{3 * 7 * 4, 7 * 4, 4, 1}));
    for (index_t b = 0; b < 2; ++b)
        for (index_t h = 0; h < 3; ++h) {
            for (index_t i = 0; i < 2; ++i) {
                for (index_t d = 0; d < 4; ++d) EXPECT_EQ(keys.row(b, h, i)[d], k1(b, h, i, d));
                for (index_t d = 0; d < 5; ++d) EXPECT_EQ(values.row(b, h, i)[d], v1(b, h, i, d));
                // The earlier view still shows the same positions.
                for (index_t d = 0; d < 4; ++d) EXPECT_EQ(keys_before.row(b, h, i)[d], k1(b, h, i, d));
            }
            for (index_t i = 0; i < 3; ++i) {
                for (index_t d = 0; d < 4; ++d) EXPECT_EQ(keys.row(b, h, 2 + i)[d], k2(b, h, i, d));
                for (index_t d = 0; d < 5; ++d) EXPECT_EQ(values.row(b, h, 2 + i)[d], v2(b, h, i, d));
            }
        }
    c.clear();
    EXPECT_EQ(c.length(), 0);
    EXPECT_EQ(c.capacity(), 7);
    c.append(k2, v2);
    EXPECT_EQ(c.keys().data, keys_before.data);
    EXPECT_EQ(c.keys().row(1, 2, 0)[3], k2(1, 2, 0, 3));
}

TEST(KvCache, AppendsStridedViewsOfAProjectedBuffer) {
    // The projected keys of 2 tokens [batch 1, len 2, kv_heads 2 * head_dim 3], heads read through split_heads.
    std::vector<float> projected{0, 1, 2, 10, 11, 12, 100, 101, 102, 110, 111, 112};
    attend::kv_cache<float> c(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(4).with_head_dim(3));
    const auto view = attend::split_heads(static_cast<const float*>(projected.data()), 1, 2, 2, 3);
    c.append(view, view);
    EXPECT_EQ(c.keys().row(0, 1, 0)[0], 10.f);   // head 1 of token 0
    EXPECT_EQ(c.keys().row(0, 0, 1)[2], 102.f);  // head 0 of token 1
    EXPECT_EQ(c.values().row(0, 1, 1)[1], 111.f);
}

TEST(KvCache, OverflowIsAPositionErrorAndAppendsNothing) {
    attend::kv_cache<float> c(attend::kv_cache_config{}.with_kv_heads(2).with_capacity(5).with_head_dim(3));
    c.append(attend_test::random_tensor<float>(1, 1, 2, 4, 3), attend_test::random_tensor<float>(2, 1, 2, 4, 3));
    const auto before = snapshot(c);
    const auto msg = expect_error<attend::position_error>(
        [&] {
            c.append(attend_test::random_tensor<float>(3, 1, 2, 2, 3),
                     attend_test::random_tensor<float>(4, 1, 2, 2, 3));
        },
        "attend.position.cache_full");
    EXPECT_TRUE(contains(msg, "length 4") && contains(msg, "2 new tokens") && contains(msg, "capacity 5")) << msg;
    EXPECT_EQ(c.length(), 4);
    EXPECT_EQ(snapshot(c), before);
    // Exactly filling it is fine.
    c.append(attend_test::random_tensor<float>(5, 1, 2, 1, 3), attend_test::random_tensor<float>(6, 1, 2, 1, 3));
    EXPECT_EQ(c.remaining(), 0);
    expect_error<attend::position_error>(
        [&] {
            c.append(attend_test::random_tensor<float>(5, 1, 2, 1, 3),
                     attend_test::random_tensor<float>(6, 1, 2, 1, 3));
        },
        "attend.position.cache_full");
}

TEST(KvCache, ShapeErrorsAppendNothing) {
    attend::kv_cache<double> c(
        attend::kv_cache_config{}.with_batch(2).with_kv_heads(2).with_capacity(6).with_head_dim(4).with_value_dim(3));
    c.append(attend_test::random_tensor<double>(1, 2, 2, 1, 4), attend_test::random_tensor<double>(2, 2, 2, 1, 3));
    const auto before = snapshot(c);
    const auto k = attend_test::random_tensor<double>(3, 2, 2, 2, 4),
               v = attend_test::random_tensor<double>(4, 2, 2, 2, 3);
    auto msg = expect_error<attend::shape_error>(
        [&] { c.append(attend_test::random_tensor<double>(5, 2, 2, 2, 5), v); }, "attend.shape.cache");
    EXPECT_TRUE(contains(msg, "[2,2,2,5]") && contains(msg, "[2,2,2,4]")) << msg;
    expect_error<attend::shape_error>([&] { c.append(attend_test::random_tensor<double>(5, 1, 2, 2, 4), v); },
                                      "attend.shape.cache");  // batch
    expect_error<attend::shape_error>([&] { c.append(attend_test::random_tensor<double>(5, 2, 1, 2, 4), v); },
                                      "attend.shape.cache");  // kv_heads
    msg = expect_error<attend::shape_error>([&] { c.append(k, attend_test::random_tensor<double>(6, 2, 2, 3, 3)); },
                                            "attend.shape.cache");  // values for 3 tokens, keys for 2
    EXPECT_TRUE(contains(msg, "[2,2,3,3]")) << msg;
    expect_error<attend::shape_error>([&] { c.append(k, attend_test::random_tensor<double>(6, 2, 2, 2, 4)); },
                                      "attend.shape.cache");  // value_dim
    EXPECT_EQ(c.length(), 1);
    EXPECT_EQ(snapshot(c), before);
}

TEST(KvCache, TruncateForgetsTrailingPositionsAndRejectsGrowth) {
    attend::kv_cache<float> cache(attend::kv_cache_config{}.with_capacity(6).with_head_dim(2));
    attend::tensor<float, 4> kv(1, 1, 4, 2);
    for (index_t n = 0; n < kv.size(); ++n) kv.data()[n] = static_cast<float>(n);
    cache.append(kv, kv);
    cache.truncate(2);
    EXPECT_EQ(cache.length(), 2);
    EXPECT_EQ(cache.keys().row(0, 0, 1)[1], 3.0f);
    for (const index_t bad : {index_t(-1), index_t(3), std::numeric_limits<index_t>::max()}) {
        attend_test::expect_error<attend::position_error>([&] { cache.truncate(bad); }, "attend.position.truncate");
        EXPECT_EQ(cache.length(), 2);
    }
    // Appending after a rollback overwrites the forgotten positions.
    cache.append(kv, kv);
    EXPECT_EQ(cache.length(), 6);
    EXPECT_EQ(cache.keys().row(0, 0, 2)[0], 0.0f);
}

TEST(KvCache, SizesMustBePositive) {
    expect_error<attend::value_error>(
        [] {
            attend::kv_cache<float>(
                attend::kv_cache_config{}.with_batch(0).with_kv_heads(1).with_capacity(1).with_head_dim(1));
        },
        "attend.value.size");
    expect_error<attend::value_error>(
        [] { attend::kv_cache<float>(attend::kv_cache_config{}.with_capacity(0).with_head_dim(1)); },
        "attend.value.size");
    expect_error<attend::value_error>(
        [] { attend::kv_cache<float>(attend::kv_cache_config{}.with_capacity(1).with_head_dim(1).with_value_dim(-2)); },
        "attend.value.size");
}

// ---------------------------------------------------------------------------------------------------------
// Decoding with forward_cached equals one full causal pass

struct decode_case {
    index_t model_dim, heads, kv_heads;
    bool rotary;
    std::vector<index_t> chunks;  ///< new tokens per forward_cached call
    index_t position_offset = 0;
};

template <class T>
double decode_vs_full(const decode_case& dc, std::uint64_t seed) {
    attend::mha_config config{dc.model_dim, dc.heads, dc.kv_heads};
    auto p = attend::multi_head_attention<T>(config, seed).to_torch();
    attend_test::fill_uniform(p.in_proj_bias, seed + 1, -0.5, 0.5);  // non-zero biases
    attend_test::fill_uniform(p.out_proj_bias, seed + 2, -0.5, 0.5);
    const auto m = attend::multi_head_attention<T>::from_torch(config, p);
    index_t total = 0;
    for (index_t n : dc.chunks) total += n;
    const index_t batch = 2;
    const auto x = attend_test::random_tensor<T>(seed + 3, batch, total, dc.model_dim);
    attend::mha_options o;
    if (dc.rotary) o.rotary = attend::rotary_embedding{m.head_dim() - m.head_dim() % 2};
    o.position_offset = dc.position_offset;
    const auto full = m.forward(x, x, x, attend::causal(attend::alignment::top_left), o);

    auto cache = m.make_cache(batch, total + 3);
    double worst = 0;
    index_t pos = 0;
    for (index_t n : dc.chunks) {
        const auto step = m.forward_cached(slice_tokens(x, pos, n), cache, o);
        EXPECT_EQ(cache.length(), pos + n);
        for (index_t b = 0; b < batch; ++b)
            for (index_t i = 0; i < n; ++i)
                for (index_t e = 0; e < dc.model_dim; ++e)
                    worst = std::max(worst, std::abs(static_cast<double>(step.out(b, i, e)) -
                                                     static_cast<double>(full.out(b, pos + i, e))));
        pos += n;
    }
    return worst;
}

TEST(ForwardCached, TokenByTokenEqualsTheFullCausalPass) {
    const std::vector<decode_case> cases{
        {8, 2, 2, false, std::vector<index_t>(8, 1)},
        {8, 2, 2, true, std::vector<index_t>(8, 1)},
        {12, 4, 2, true, std::vector<index_t>(8, 1)},  // grouped-query
        {12, 4, 1, true, std::vector<index_t>(9, 1)},  // multi-query
        {8, 2, 2, false, {3, 1, 4}},                   // chunked
        {12, 4, 2, true, {3, 1, 4}},
        {12, 6, 3, true, {3, 1, 4}, 5},  // rotary positions start at 5
    };
    std::uint64_t seed = 100;
    for (const auto& dc : cases) {
        const double e_float = decode_vs_full<float>(dc, seed), e_double = decode_vs_full<double>(dc, seed);
        std::cout << "  heads " << dc.heads << ", kv_heads " << dc.kv_heads << (dc.rotary ? ", rotary" : "")
                  << ", chunks " << dc.chunks.size() << ": max |step - full| float " << e_float << ", double "
                  << e_double << '\n';
        EXPECT_LE(e_float, 1e-5);
        EXPECT_LE(e_double, 1e-12);
        seed += 10;
    }
}

TEST(ForwardCached, CachedKeysAreRotatedAtTheirGlobalPositions) {
    // Token 1 of a sequence is stored rotated by position 1, not by 0 as a per-call numbering would do.
    attend::multi_head_attention<double> m({8, 2}, 3);
    const auto x = attend_test::random_tensor<double>(4, 1, 2, 8);
    attend::mha_options o;
    o.rotary = attend::rotary_embedding{4};
    auto cache = m.make_cache(1, 2);
    m.forward_cached(slice_tokens(x, 0, 1), cache, o);
    const auto second = m.forward_cached(slice_tokens(x, 1, 1), cache, o);
    tensor<double, 4> k(1, 2, 1, 4);  // token 1's projected key heads, rotated at position 1
    for (index_t h = 0; h < 2; ++h)
        for (index_t d = 0; d < 4; ++d) {
            double s = m.k_bias()(h * 4 + d);
            for (index_t e = 0; e < 8; ++e) s += x(0, 1, e) * m.k_weight()(h * 4 + d, e);
            k(0, h, 0, d) = s;
        }
    auto at_zero = k;
    o.rotary->apply(k, 1);
    double diff_global = 0, diff_local = 0;
    for (index_t h = 0; h < 2; ++h)
        for (index_t d = 0; d < 4; ++d) {
            diff_global = std::max(diff_global, std::abs(cache.keys().row(0, h, 1)[d] - k(0, h, 0, d)));
            diff_local = std::max(diff_local, std::abs(cache.keys().row(0, h, 1)[d] - at_zero(0, h, 0, d)));
        }
    EXPECT_LE(diff_global, 1e-12);
    EXPECT_GT(diff_local, 1e-6);
    const auto full = m.forward(x, x, x, attend::causal(attend::alignment::top_left), o);
    for (index_t e = 0; e < 8; ++e) EXPECT_NEAR(second.out(0, 0, e), full.out(0, 1, e), 1e-12);
}

TEST(ForwardCached, CombinesKeyPaddingAndTheCallersMask) {
    // Batch 1 is a left-padded prompt: keys 0 and 1 are padding for every query (its first two queries have no
    // key at all, so the empty-row policy is zero). The caller also limits attention to a window of 2 past keys.
    attend::multi_head_attention<double> m({8, 2}, 13);
    const index_t len = 6;
    const auto x = attend_test::random_tensor<double>(14, 2, len, 8);
    tensor<bool, 2> blocked(2, len);
    blocked.setConstant(false);
    blocked(1, 0) = blocked(1, 1) = true;
    attend::mha_options o;
    o.attention.empty_rows = attend::empty_rows::zero;
    o.key_padding = attend::forbidden_mask::key_padding(blocked);
    const auto full = m.forward(
        x, x, x,
        attend::causal(attend::alignment::top_left) && attend::sliding_window(2, 0, attend::alignment::top_left), o);
    auto cache = m.make_cache(2, len);
    double worst = 0;
    for (index_t pos = 0; pos < len; ++pos) {
        tensor<bool, 2> so_far(2, pos + 1);  // the key padding mask covers every key of this call
        for (index_t b = 0; b < 2; ++b)
            for (index_t j = 0; j <= pos; ++j) so_far(b, j) = blocked(b, j);
        attend::mha_options step_options = o;
        step_options.key_padding = attend::forbidden_mask::key_padding(so_far);
        const auto step = m.forward_cached(slice_tokens(x, pos, 1), cache,
                                           attend::sliding_window(2, 0, attend::alignment::bottom_right), step_options);
        for (index_t b = 0; b < 2; ++b)
            for (index_t e = 0; e < 8; ++e) worst = std::max(worst, std::abs(step.out(b, 0, e) - full.out(b, pos, e)));
    }
    EXPECT_LE(worst, 1e-12);
    // The window matters: without it the last outputs differ.
    const auto unwindowed = m.forward(x, x, x, attend::causal(attend::alignment::top_left), o);
    double diff = 0;
    for (index_t e = 0; e < 8; ++e)
        diff = std::max(diff, std::abs(unwindowed.out(0, len - 1, e) - full.out(0, len - 1, e)));
    EXPECT_GT(diff, 1e-6);
}

TEST(ForwardCached, ErrorsLeaveTheCacheUnchanged) {
    attend::multi_head_attention<double> m({8, 2, 1}, 5);
    const auto x = attend_test::random_tensor<double>(6, 2, 3, 8);
    auto cache = m.make_cache(2, 4);
    m.forward_cached(slice_tokens(x, 0, 2), cache);
    const auto before = snapshot(cache);
    const auto unchanged = [&] {
        EXPECT_EQ(cache.length(), 2);
        EXPECT_EQ(snapshot(cache), before);
    };
    auto msg = expect_error<attend::position_error>([&] { m.forward_cached(x, cache); }, "attend.position.cache_full");
    EXPECT_TRUE(contains(msg, "length 2") && contains(msg, "3 new tokens") && contains(msg, "capacity 4")) << msg;
    unchanged();
    msg = expect_error<attend::shape_error>(
        [&] { m.forward_cached(attend_test::random_tensor<double>(7, 2, 1, 6), cache); }, "attend.shape.model_dim");
    EXPECT_TRUE(contains(msg, "[2,1,6]") && contains(msg, "[2,1,8]")) << msg;
    unchanged();
    auto wrong = attend::kv_cache<double>(
        attend::kv_cache_config{}.with_batch(2).with_kv_heads(2).with_capacity(4).with_head_dim(
            4));  // kv_heads 2, module has 1
    expect_error<attend::shape_error>([&] { m.forward_cached(slice_tokens(x, 0, 1), wrong); }, "attend.shape.cache");
    EXPECT_EQ(wrong.length(), 0);
    expect_error<attend::shape_error>([&] { m.forward_cached(attend_test::random_tensor<double>(7, 3, 1, 8), cache); },
                                      "attend.shape.cache");
    unchanged();
    attend::mha_options o;
    o.rotary = attend::rotary_embedding{6};  // > head_dim 4
    expect_error<attend::shape_error>([&] { m.forward_cached(slice_tokens(x, 0, 1), cache, o); },
                                      "attend.shape.rotary_dim");
    unchanged();
    o.rotary = attend::rotary_embedding{4};
    o.position_offset = -1;
    expect_error<attend::position_error>([&] { m.forward_cached(slice_tokens(x, 0, 1), cache, o); },
                                         "attend.position.negative_offset");
    unchanged();
    o.position_offset = 0;
    o.rotary.reset();
    o.key_padding = {0, 3};  // batch 0 has no real key
    expect_error<attend::mask_error>([&] { m.forward_cached(slice_tokens(x, 0, 1), cache, o); },
                                     "attend.mask.empty_row");
    unchanged();
    o.key_padding = {3};
    expect_error<attend::mask_error>([&] { m.forward_cached(slice_tokens(x, 0, 1), cache, o); },
                                     "attend.mask.lengths_batch");
    unchanged();
    o.key_padding = {};
    // The attention's own options are checked with the rest: a bad dropout probability or sinks besides the
    // module's leave the cache as it was.
    o.attention.dropout = {1.0, 3, true};
    expect_error<attend::value_error>([&] { m.forward_cached(slice_tokens(x, 0, 1), cache, o); },
                                      "attend.value.dropout");
    unchanged();
    o.attention.dropout = {};
    o.attention.sinks = attend::attention_sinks{0.5, 0.5};
    expect_error<attend::value_error>([&] { m.forward_cached(slice_tokens(x, 0, 1), cache, o); },
                                      "attend.value.layer_sinks");
    unchanged();
    o.attention.sinks = {};
    auto bad = slice_tokens(x, 0, 1);
    bad(1, 0, 2) = std::numeric_limits<double>::infinity();
    expect_error<attend::value_error>([&] { m.forward_cached(bad, cache, o); }, "attend.value.non_finite");
    unchanged();
    attend::mha_config kd{8, 2};
    kd.key_dim = 5;
    const attend::multi_head_attention<double> cross(kd, 1);
    auto cross_cache = cross.make_cache(2, 4);
    expect_error<attend::shape_error>([&] { cross.forward_cached(slice_tokens(x, 0, 1), cross_cache); },
                                      "attend.shape.self_attention");
    EXPECT_EQ(cross_cache.length(), 0);
    // And the cache still works afterwards.
    EXPECT_NO_THROW(m.forward_cached(slice_tokens(x, 0, 2), cache));
    EXPECT_EQ(cache.length(), 4);
}

// ---------------------------------------------------------------------------------------------------------
// forward_cached over an int8 (q8_0) cache

/// A float module with head_dim 32 (one q8_0 block per row), rotary positions from 3 and non-zero biases.
struct q8_decoder {
    attend::mha_config config{128, 4, 2};
    attend::multi_head_attention<float> module;
    attend::mha_options options;
    explicit q8_decoder(std::uint64_t seed) : module(make(config, seed)) {
        options.rotary = attend::rotary_embedding{32};
        options.position_offset = 3;
    }
    static attend::multi_head_attention<float> make(const attend::mha_config& c, std::uint64_t seed) {
        auto p = attend::multi_head_attention<float>(c, seed).to_torch();
        attend_test::fill_uniform(p.in_proj_bias, seed + 1, -0.5, 0.5);
        return attend::multi_head_attention<float>::from_torch(c, p);
    }
};

/// A cache view's rows as a tensor `[batch, kv_heads, length, dim]` of float: 16-bit values widened exactly.
template <class View>
tensor<float, 4> widened_rows(const View& x) {
    tensor<float, 4> t(x.dims[0], x.dims[1], x.dims[2], x.dims[3]);
    for (index_t b = 0; b < x.dims[0]; ++b)
        for (index_t h = 0; h < x.dims[1]; ++h)
            for (index_t i = 0; i < x.dims[2]; ++i)
                for (index_t d = 0; d < x.dims[3]; ++d) t(b, h, i, d) = static_cast<float>(x.row(b, h, i)[d]);
    return t;
}

/// A float module decoding over a cache of another storage (q8_kv_cache, q4_kv_cache, or kv_cache<half / bfloat16>
/// from make_cache<S>): the cache holds exactly what storing the float run's rotated keys and values gives (the same
/// projections at the same global positions, quantized or rounded once), and the queries read it as float attention
/// over its values; with the newest key stored as well, the outputs stay within `tolerance` of the float cache's.
template <class Cache, class MakeCache>
void expect_cache_holds_stored_projections_read_as_floats(MakeCache&& make_cache, std::uint64_t seed,
                                                          double tolerance) {
    const q8_decoder d(seed);
    const index_t batch = 2, total = 9, kv_heads = d.config.kv_heads;
    const auto x = attend_test::random_tensor<float>(seed + 1, batch, total, d.config.model_dim);
    Cache stored = make_cache(d.module, batch, total);
    auto exact = d.module.make_cache(batch, total);
    index_t pos = 0;
    for (const index_t n : {3, 1, 2, 1, 1}) {  // a prompt, then tokens and a chunk
        d.module.forward_cached(slice_tokens(x, pos, n), stored, d.options);
        d.module.forward_cached(slice_tokens(x, pos, n), exact, d.options);
        pos += n;
    }
    attend::kv_cache<float> widened(
        attend::kv_cache_config{}.with_batch(batch).with_kv_heads(kv_heads).with_capacity(total).with_head_dim(
            32));  // a float cache of the stored values
    if constexpr (std::is_same_v<Cache, attend::q8_kv_cache> || std::is_same_v<Cache, attend::q4_kv_cache>) {
        Cache quantized(
            attend::kv_cache_config{}.with_batch(batch).with_kv_heads(kv_heads).with_capacity(total).with_head_dim(32));
        quantized.append(exact.keys(), exact.values());
        EXPECT_EQ(attend_test::state_of(stored), attend_test::state_of(quantized));
        widened.append(attend_test::dequantized(stored, true), attend_test::dequantized(stored, false));
    } else {
        using S = std::decay_t<decltype(*stored.keys().row(0, 0, 0))>;  // the cache's storage type
        const tensor<S, 4> keys = widened_rows(exact.keys()).template cast<S>(),
                           values = widened_rows(exact.values()).template cast<S>();
        EXPECT_TRUE(attend_test::bit_equal(widened_rows(stored.keys()), tensor<float, 4>(keys.template cast<float>())));
        EXPECT_TRUE(
            attend_test::bit_equal(widened_rows(stored.values()), tensor<float, 4>(values.template cast<float>())));
        widened.append(widened_rows(stored.keys()), widened_rows(stored.values()));
    }
    // The last token again over both: with the newest key forbidden (the one position whose values differ between
    // the two, the float cache appending the token as it is), the outputs are the same bits.
    stored.truncate(total - 1);
    widened.truncate(total - 1);
    tensor<bool, 4> allowed(1, 1, 1, total);
    allowed.setConstant(true);
    allowed(0, 0, 0, total - 1) = false;
    const auto before_newest = attend::allowed_mask::true_means_allowed(allowed);
    const auto token = slice_tokens(x, total - 1, 1);
    const auto from_stored = d.module.forward_cached(token, stored, before_newest, d.options);
    const auto from_float = d.module.forward_cached(token, widened, before_newest, d.options);
    EXPECT_TRUE(attend_test::bit_equal(from_stored.out, from_float.out));
    // Without the mask the newest key differs (stored against not): the outputs do too, by little.
    stored.truncate(total - 1);
    widened.truncate(total - 1);
    const auto all_stored = d.module.forward_cached(token, stored, d.options);
    const auto all_float = d.module.forward_cached(token, widened, d.options);
    EXPECT_FALSE(attend_test::bit_equal(all_stored.out, all_float.out));
    EXPECT_LE(attend_test::max_rel_diff(all_stored.out, all_float.out, 0.1), tolerance);
}

TEST(ForwardCachedQ8, TheCacheHoldsTheQuantizedProjectionsAndQueriesReadItAsFloatsOfItsValues) {
    expect_cache_holds_stored_projections_read_as_floats<attend::q8_kv_cache>(
        [](const auto& m, index_t batch, index_t capacity) {
            return m.template make_cache<attend::q8_0_block>(batch, capacity);
        },
        31, 2e-2);
}

TEST(ForwardCachedQ4, TheCacheHoldsTheQuantizedProjectionsAndQueriesReadItAsFloatsOfItsValues) {
    // One int4 key and value in 32 positions is off by up to 3 / 16 of its block's largest magnitude.
    expect_cache_holds_stored_projections_read_as_floats<attend::q4_kv_cache>(
        [](const auto& m, index_t batch, index_t capacity) {
            return m.template make_cache<attend::q4_0_block>(batch, capacity);
        },
        33, 0.1);
}

TEST(ForwardCached16, AFloatModulesSixteenBitCacheHoldsTheProjectionsRoundedOnceAndIsReadAsFloats) {
    expect_cache_holds_stored_projections_read_as_floats<attend::kv_cache<Eigen::half>>(
        [](const auto& m, index_t batch, index_t capacity) {
            return m.template make_cache<Eigen::half>(batch, capacity);
        },
        51, 2e-2);
    expect_cache_holds_stored_projections_read_as_floats<attend::kv_cache<Eigen::bfloat16>>(
        [](const auto& m, index_t batch, index_t capacity) {
            return m.template make_cache<Eigen::bfloat16>(batch, capacity);
        },
        61, 2e-2);
}

TEST(ForwardCached16, AProjectionBeyondFp16IsRefusedBeforeTheCacheChanges) {
    const q8_decoder d(71);
    const auto x = attend_test::random_tensor<float>(72, 2, 3, d.config.model_dim);
    auto cache = d.module.make_cache<Eigen::half>(2, 4);
    d.module.forward_cached(slice_tokens(x, 0, 2), cache, d.options);
    const auto before = snapshot(cache);
    tensor<float, 3> huge = slice_tokens(x, 2, 1);  // finite in float, inf in fp16
    for (index_t e = 0; e < huge.size(); ++e) huge.data()[e] *= 1e6f;
    const std::string message = expect_error<attend::value_error>(
        [&] { d.module.forward_cached(huge, cache, d.options); }, "attend.value.non_finite");
    EXPECT_TRUE(contains(message, "rounded to the cache's type")) << message;
    EXPECT_EQ(cache.length(), 2);
    EXPECT_EQ(snapshot(cache), before);
    // bf16 has float's range: the same token fits there.
    auto wide_range = d.module.make_cache<Eigen::bfloat16>(2, 4);
    EXPECT_NO_THROW(d.module.forward_cached(huge, wide_range, d.options));
    EXPECT_EQ(wide_range.length(), 1);
}

TEST(ForwardCachedQ8, ErrorsLeaveTheCacheUnchanged) {
    const q8_decoder d(41);
    const auto x = attend_test::random_tensor<float>(42, 2, 3, d.config.model_dim);
    auto cache = d.module.make_cache<attend::q8_0_block>(2, 4);
    d.module.forward_cached(slice_tokens(x, 0, 2), cache, d.options);
    const auto before = attend_test::state_of(cache);
    // Projections beyond what a q8_0 block holds (127 x 65504) are refused before anything is appended.
    tensor<float, 3> huge = slice_tokens(x, 2, 1);
    for (index_t e = 0; e < huge.size(); ++e) huge.data()[e] *= 1e8f;
    expect_error<attend::value_error>([&] { d.module.forward_cached(huge, cache, d.options); },
                                      "attend.value.quantized_range");
    EXPECT_EQ(attend_test::state_of(cache), before);
    expect_error<attend::position_error>([&] { d.module.forward_cached(x, cache, d.options); },
                                         "attend.position.cache_full");
    EXPECT_EQ(attend_test::state_of(cache), before);
    attend::q8_kv_cache wrong(attend::kv_cache_config{}.with_batch(2).with_kv_heads(4).with_capacity(4).with_head_dim(
        32));  // kv_heads 4, the module has 2
    expect_error<attend::shape_error>([&] { d.module.forward_cached(slice_tokens(x, 0, 1), wrong, d.options); },
                                      "attend.shape.cache");
    EXPECT_EQ(wrong.length(), 0);
    // head_dim 16 is half a block.
    const attend::multi_head_attention<float> narrow({64, 4}, 3);
    expect_error<attend::value_error>([&] { narrow.make_cache<attend::q8_0_block>(1, 4); },
                                      "attend.value.quantized_dim");
    // And the cache still works afterwards.
    EXPECT_NO_THROW(d.module.forward_cached(slice_tokens(x, 2, 1), cache, d.options));
    EXPECT_EQ(cache.length(), 3);
}

}  // namespace
