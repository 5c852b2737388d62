// SPDX-License-Identifier: MIT
// Attention sinks (sdpa_options::sinks, sinks.hpp): one logit per query head in every row's softmax denominator,
// with no value. Proven against its definition as one more key (a zero key with a zero value whose additive mask
// entry is the sink), by finite differences for every gradient including the sinks', tiled against reference
// with every other score feature at once, through merge_partials, and on its error paths.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/finite_differences.hpp"
#include "support/golden.hpp"
#include "support/kernel_agreement.hpp"
#include "support/random.hpp"
#include "support/scalar_names.hpp"
#include "support/score_feature_golden.hpp"

namespace {

using attend::alignment;
using attend::index_t;

/// q `[batch, heads, query_len, dim]`, k and v `[batch, kv_heads, key_len, dim]` (grouped-query heads), sinks
/// `[heads]` on both sides of the scores' range, so some rows put most of their mass on the sink.
template <class T>
struct sink_case {
    index_t batch = 2, heads = 4, kv_heads = 2, query_len = 37, key_len = 53, dim = 16;
    attend::tensor<T, 4> q, k, v;
    attend::sdpa_options options;
    std::vector<index_t> key_lengths{53, 40};

    sink_case(std::uint64_t seed, index_t query_len_, index_t key_len_) : query_len(query_len_), key_len(key_len_) {
        key_lengths = {key_len, std::max<index_t>(1, key_len - 13)};
        q = attend_test::random_tensor<T>(seed, batch, heads, query_len, dim) * T(2);
        k = attend_test::random_tensor<T>(seed + 1, batch, kv_heads, key_len, dim) * T(2);
        v = attend_test::random_tensor<T>(seed + 2, batch, kv_heads, key_len, dim);
        options.sinks = attend::attention_sinks{-1.5, 0.25, 2.0, 6.0};
        options.need_lse = true;
    }
    auto mask() const { return attend::causal(alignment::bottom_right) && attend::key_padding(key_lengths); }
};

/// The sink as a key: k and v grow by one zero row at key_len (score 0, value 0), and an additive mask
/// `[batch, heads, query_len, key_len + 1]` holds the case's mask (0 or -inf) and, in the last column, the sink.
template <class T>
struct sink_as_key {
    attend::tensor<T, 4> k, v;
    attend::additive_mask<T> mask;
};

template <class T>
sink_as_key<T> sink_as_key_of(const sink_case<T>& c) {
    const index_t S = c.key_len;
    attend::tensor<T, 4> k(c.batch, c.kv_heads, S + 1, c.dim), v(c.batch, c.kv_heads, S + 1, c.dim);
    k.setZero();
    v.setZero();
    for (index_t b = 0; b < c.batch; ++b)
        for (index_t g = 0; g < c.kv_heads; ++g)
            for (index_t j = 0; j < S; ++j)
                for (index_t d = 0; d < c.dim; ++d) {
                    k(b, g, j, d) = c.k(b, g, j, d);
                    v(b, g, j, d) = c.v(b, g, j, d);
                }
    const auto shape = attend::detail::check_views(attend::detail::as_view(c.q), attend::detail::as_view(c.k),
                                                   attend::detail::as_view(c.v));
    const auto bound = c.mask().bind(shape);
    attend::tensor<T, 4> values(c.batch, c.heads, c.query_len, S + 1);
    for (index_t b = 0; b < c.batch; ++b)
        for (index_t h = 0; h < c.heads; ++h)
            for (index_t i = 0; i < c.query_len; ++i) {
                for (index_t j = 0; j < S; ++j)
                    values(b, h, i, j) = bound.allowed(b, h, i, j) ? T(0) : -std::numeric_limits<T>::infinity();
                values(b, h, i, S) = static_cast<T>(c.options.sinks[h]);
            }
    return {k, v, attend::additive_mask<T>::from_values(values)};
}

template <class T>
class Sinks : public ::testing::Test {};
TYPED_TEST_SUITE(Sinks, attend_test::scalar_types, attend_test::scalar_names);

TYPED_TEST(Sinks, ForwardEqualsOneMoreKeyWithZeroValueWhoseMaskIsTheSink) {
    using T = TypeParam;
    const double tolerance = std::is_same_v<T, float> ? 3e-6 : 1e-13;
    // A prefill shape, and a decode shape long enough for the tiled kernel's split-key path.
    for (const auto& [query_len, key_len] : {std::pair<index_t, index_t>{37, 53}, {1, 5000}}) {
        SCOPED_TRACE(key_len);
        sink_case<T> c(5, query_len, key_len);
        c.options.softcap = 3.0;  // capping leaves the zero key's score 0, so the equivalence holds with it
        const auto as_key = sink_as_key_of(c);
        auto plain = c.options;
        plain.sinks = {};
        plain.kernel = attend::kernel::reference;
        plain.need_weights = true;
        const auto want = attend::scaled_dot_product_attention(c.q, as_key.k, as_key.v, as_key.mask, plain);
        std::vector<attend::attention_result<T, 4>> got;
        for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled})
            for (const int threads : {1, 2}) {
                auto o = c.options;
                o.kernel = kernel;
                o.threads = threads;
                o.need_weights = query_len > 1;
                got.push_back(attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o));
            }
        for (const auto& r : got) {
            EXPECT_LE(attend_test::max_abs_diff(r.out, want.out), tolerance);
            EXPECT_LE(attend_test::max_abs_diff(r.lse, want.lse), tolerance * 10);
            if (query_len == 1) continue;
            double worst = 0;  // the first key_len columns of the wider weights
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i)
                        for (index_t j = 0; j < c.key_len; ++j)
                            worst = std::max(worst, std::abs(static_cast<double>(r.weights(b, h, i, j)) -
                                                             static_cast<double>(want.weights(b, h, i, j))));
            EXPECT_LE(worst, tolerance);
        }
        EXPECT_TRUE(attend_test::bit_equal(got[2].out, got[3].out));  // the tiled kernel, 1 and 2 threads
        EXPECT_TRUE(attend_test::bit_equal(got[2].lse, got[3].lse));
        // The sinks matter: the same call without them differs.
        auto none = c.options;
        none.sinks = {};
        EXPECT_GT(attend_test::max_abs_diff(attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), none).out,
                                            got[0].out),
                  100 * tolerance);
    }
}

TYPED_TEST(Sinks, RowWithEveryKeyForbiddenIsZeroWithTheSinkAsLseUnderTheZeroPolicy) {
    using T = TypeParam;
    sink_case<T> c(9, 6, 8);
    c.key_lengths = {8, 0};  // batch 1: every key is padding
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        auto o = c.options;
        o.kernel = kernel;
        o.need_weights = true;
        // The default policy still reports it: a sink has no value, so such a row is most likely a mask bug.
        attend_test::expect_error<attend::mask_error>(
            [&] { attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o); }, "attend.mask.empty_row");
        o.empty_rows = attend::empty_rows::zero;
        const auto r = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o);
        for (index_t h = 0; h < c.heads; ++h)
            for (index_t i = 0; i < c.query_len; ++i) {
                EXPECT_EQ(r.lse(1, h, i), static_cast<T>(c.options.sinks[h]));
                for (index_t d = 0; d < c.dim; ++d) EXPECT_EQ(r.out(1, h, i, d), T(0));
                for (index_t j = 0; j < c.key_len; ++j) EXPECT_EQ(r.weights(1, h, i, j), T(0));
            }
        // Its gradients are zero, never NaN, and so is its share of the sinks' gradient.
        const auto d_out = attend_test::random_tensor<T>(3, c.batch, c.heads, c.query_len, c.dim);
        const auto g = attend::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.mask(), r, d_out, o);
        EXPECT_TRUE(attend_test::all_finite(g.d_query) && attend_test::all_finite(g.d_key) &&
                    attend_test::all_finite(g.d_sinks));
        for (index_t h = 0; h < c.heads; ++h)
            for (index_t i = 0; i < c.query_len; ++i)
                for (index_t d = 0; d < c.dim; ++d) EXPECT_EQ(g.d_query(1, h, i, d), T(0));
    }
}

TYPED_TEST(Sinks, PaddedQueriesKeepAZeroRowAndMinusInfinityLse) {
    using T = TypeParam;
    sink_case<T> c(4, 9, 12);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        auto o = c.options;
        o.kernel = kernel;
        const auto r =
            attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask() && attend::query_padding({9, 5}), o);
        for (index_t h = 0; h < c.heads; ++h)
            for (index_t i = 5; i < c.query_len; ++i) {
                EXPECT_EQ(r.lse(1, h, i), -std::numeric_limits<T>::infinity());
                EXPECT_EQ(r.out(1, h, i, 0), T(0));
            }
    }
}

TYPED_TEST(Sinks, SinksOnOnePartOfASplitOverKeysMergeIntoTheWholeCall) {
    using T = TypeParam;
    const double tolerance = std::is_same_v<T, float> ? 3e-6 : 1e-13;
    sink_case<T> c(11, 7, 30);
    const index_t split = 12;
    const auto keys = [&](const attend::tensor<T, 4>& x, index_t begin, index_t end) {
        attend::tensor<T, 4> part(c.batch, c.kv_heads, end - begin, c.dim);
        for (index_t b = 0; b < c.batch; ++b)
            for (index_t g = 0; g < c.kv_heads; ++g)
                for (index_t j = begin; j < end; ++j)
                    for (index_t d = 0; d < c.dim; ++d) part(b, g, j - begin, d) = x(b, g, j, d);
        return part;
    };
    const auto whole = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.options);
    auto without = c.options;
    without.sinks = {};
    const auto a = attend::scaled_dot_product_attention(c.q, keys(c.k, 0, split), keys(c.v, 0, split), without);
    const auto b =
        attend::scaled_dot_product_attention(c.q, keys(c.k, split, c.key_len), keys(c.v, split, c.key_len), c.options);
    const auto merged = attend::merge_partials(a.out, a.lse, b.out, b.lse);
    EXPECT_LE(attend_test::max_abs_diff(merged.out, whole.out), tolerance);
    EXPECT_LE(attend_test::max_abs_diff(merged.lse, whole.lse), tolerance * 10);
}

/// Tiled against reference with every score feature at once: sinks, softcap, ALiBi, a sliding window, grouped
/// heads, key padding and dropout; forward outputs and every gradient, the sinks' included.
TEST(SinksCombined, TiledEqualsReferenceWithSoftcapAlibiWindowGqaPaddingAndDropout) {
    sink_case<double> c(21, 150, 700);
    c.options.softcap = 4.0;
    c.options.score_bias = attend::score_bias::alibi(attend::alibi_slopes(c.heads), alignment::bottom_right);
    c.options.dropout = {0.2, 77, true};
    c.options.need_weights = true;
    c.options.weights_after_dropout = true;
    const auto mask = attend::sliding_window(96, 0, alignment::bottom_right) && attend::key_padding(c.key_lengths);
    const auto d_out = attend_test::random_tensor<double>(5, c.batch, c.heads, c.query_len, c.dim);
    const auto runs = attend_test::run_every_kernel(c.q, c.k, c.v, d_out, mask, c.options);
    attend_test::expect_kernels_agree(runs);
    ASSERT_EQ(runs.backward[0].d_sinks.size(), c.heads);
    EXPECT_GT(attend_test::max_abs(runs.backward[0].d_sinks), 1e-3);  // the sinks matter here
}

TEST(SinksBackward, GradientsOfBothKernelsEqualFiniteDifferencesIncludingTheSinks) {
    sink_case<double> c(31, 5, 6);
    c.dim = 4;
    c.q = attend_test::random_tensor<double>(8, c.batch, c.heads, c.query_len, c.dim) * 2.0;
    c.k = attend_test::random_tensor<double>(9, c.batch, c.kv_heads, c.key_len, c.dim) * 2.0;
    c.v = attend_test::random_tensor<double>(10, c.batch, c.kv_heads, c.key_len, c.dim);
    c.options.softcap = 1.5;
    c.options.dropout = {0.25, 5, true};
    const auto w = attend_test::random_tensor<double>(11, c.batch, c.heads, c.query_len, c.dim);
    attend::tensor<double, 1> sinks(c.heads);
    for (index_t h = 0; h < c.heads; ++h) sinks(h) = c.options.sinks[h] * 0.3;  // within reach of the scores
    const auto loss = [&] {
        auto o = c.options;
        o.sinks = sinks;
        o.kernel = attend::kernel::reference;
        return attend_test::linear_loss(attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o).out, w);
    };
    const auto fd_q = attend_test::fd_gradient(c.q, loss);
    const auto fd_k = attend_test::fd_gradient(c.k, loss);
    const auto fd_v = attend_test::fd_gradient(c.v, loss);
    const auto fd_sinks = attend_test::fd_gradient(sinks, loss);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        auto o = c.options;
        o.sinks = sinks;
        o.kernel = kernel;
        const auto f = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o);
        const auto g = attend::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.mask(), f, w, o);
        attend_test::expect_close_to_fd(g.d_query, fd_q, "dq");
        attend_test::expect_close_to_fd(g.d_key, fd_k, "dk");
        attend_test::expect_close_to_fd(g.d_value, fd_v, "dv");
        attend_test::expect_close_to_fd(g.d_sinks, fd_sinks, "d_sinks");
        // The _into form writes the same sink gradient into a caller's tensor.
        attend::tensor<double, 4> dq(c.q.dimensions()), dk(c.k.dimensions()), dv(c.v.dimensions());
        attend::tensor<double, 1> d_sinks(c.heads);
        attend::scaled_dot_product_attention_backward_into(c.q, c.k, c.v, c.mask(), f.out, f.lse, w, o, dq, dk, dv,
                                                           nullptr, d_sinks);
        EXPECT_TRUE(attend_test::bit_equal(d_sinks, g.d_sinks));
    }
}

TEST(SinksErrors, WrongCountOrNonFiniteSinksAreRejectedBeforeAnyWrite) {
    const sink_case<float> c(3, 4, 9);
    attend::tensor<float, 4> out(c.batch, c.heads, c.query_len, c.dim);
    out.setConstant(42.0f);
    const auto untouched = [&] {
        return std::all_of(out.data(), out.data() + out.size(), [](float x) { return x == 42.0f; });
    };
    auto o = c.options;
    o.need_lse = false;
    o.sinks = attend::attention_sinks{1.0, 2.0};  // 2 sinks for 4 heads (kv_heads is 2: sinks are per query head)
    attend_test::expect_error<attend::shape_error>(
        [&] { attend::scaled_dot_product_attention_into(c.q, c.k, c.v, c.mask(), o, out); }, "attend.shape.sinks");
    EXPECT_TRUE(untouched());
    for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity(), 1e300}) {
        SCOPED_TRACE(bad);
        o.sinks = attend::attention_sinks{0.0, bad, 0.0, 0.0};
        attend_test::expect_error<attend::value_error>(
            [&] { attend::scaled_dot_product_attention_into(c.q, c.k, c.v, c.mask(), o, out); }, "attend.value.sinks");
        EXPECT_TRUE(untouched());
    }
    // The backward checks them too, and the shape of a caller's sink gradient.
    const auto f = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), c.options);
    attend::tensor<float, 4> dq(c.q.dimensions()), dk(c.k.dimensions()), dv(c.v.dimensions());
    attend::tensor<float, 1> d_sinks(3);
    d_sinks.setConstant(7.0f);
    attend_test::expect_error<attend::shape_error>(
        [&] {
            attend::scaled_dot_product_attention_backward_into(c.q, c.k, c.v, c.mask(), f.out, f.lse, f.out, c.options,
                                                               dq, dk, dv, nullptr, d_sinks);
        },
        "attend.shape.backward_sinks");
    EXPECT_TRUE(std::all_of(d_sinks.data(), d_sinks.data() + 3, [](float x) { return x == 7.0f; }));
    auto bad = c.options;
    bad.sinks = attend::attention_sinks{1.0};
    attend_test::expect_error<attend::shape_error>(
        [&] { attend::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.mask(), f, f.out, bad); },
        "attend.shape.sinks");
}

/// `[batch, len, heads * dim]` (heads side by side, as multi-head attention keeps them) as `[batch, heads, len, dim]`.
attend::tensor<double, 4> heads_first(const attend::tensor<double, 3>& x, index_t heads) {
    const index_t B = x.dimension(0), L = x.dimension(1), D = x.dimension(2) / heads;
    return x.reshape(std::array<index_t, 4>{B, L, heads, D}).shuffle(std::array<int, 4>{0, 2, 1, 3});
}

TEST(MhaSinks, ForwardIsAttentionOfTheProjectedHeadsWithTheModulesSinksAndDecodingAgrees) {
    const index_t B = 2, L = 7, E = 16, H = 4;
    const auto config = attend::mha_config{E, H}.with_kv_heads(2).with_sinks(true);
    attend::multi_head_attention<double> m(config, 3);
    const attend::multi_head_attention<double> plain(attend::mha_config{E, H}.with_kv_heads(2), 3);
    EXPECT_EQ(m.parameter_count(), plain.parameter_count() + H);
    auto params = m.parameters();
    ASSERT_EQ(std::string(params.back().name), "sinks");
    ASSERT_EQ(params.back().size, H);
    for (index_t h = 0; h < H; ++h) EXPECT_EQ(m.sinks()(h), 0.0);  // initialised to 0
    for (index_t h = 0; h < H; ++h) params.back().data[h] = 0.75 * static_cast<double>(h) - 1;
    const auto x = attend_test::random_tensor<double>(1, B, L, E);
    const auto mask = attend::causal(alignment::top_left);
    attend::mha_saved<double> saved;
    const auto r = m.forward(x, x, x, mask, {}, saved);
    attend::sdpa_options o;
    o.sinks = m.sinks();
    const auto want = attend::scaled_dot_product_attention(heads_first(saved.q, H), heads_first(saved.k, 2),
                                                           heads_first(saved.v, 2), mask, o);
    EXPECT_LE(attend_test::max_abs_diff(heads_first(saved.attention, H), want.out), 1e-14);
    EXPECT_LE(attend_test::max_abs_diff(saved.lse, want.lse), 1e-13);
    // Decoding token by token through a cache gives the same outputs: the sinks join every step's softmax.
    auto cache = m.make_cache(B, L);
    for (index_t i = 0; i < L; ++i) {
        attend::tensor<double, 3> token(B, 1, E);
        for (index_t b = 0; b < B; ++b)
            for (index_t e = 0; e < E; ++e) token(b, 0, e) = x(b, i, e);
        const auto step = m.forward_cached(token, cache);
        for (index_t b = 0; b < B; ++b)
            for (index_t e = 0; e < E; ++e) EXPECT_NEAR(step.out(b, 0, e), r.out(b, i, e), 1e-13);
    }
}

TEST(SinksGolden, ForwardAndEveryGradientMatchPyTorchAutogradInDouble) {
    attend::sdpa_options o;  // the sinks, and softcap when the case has it, come from the file
    attend_test::expect_score_feature_golden("sinks_gqa_H4_Hkv2_causal_bottom_right_L3_S5",
                                             attend::causal(alignment::bottom_right), o);
    attend_test::expect_score_feature_golden("sinks_softcap_1.5_L4_S6", attend::no_mask{}, o);
}

}  // namespace
