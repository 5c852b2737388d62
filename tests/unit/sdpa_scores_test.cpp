// SPDX-License-Identifier: MIT
// The scores output (sdpa_options::need_scores, ONNX Attention's qk_matmul_output modes 0 to 2) and
// accumulation::float64 (ONNX's softmax_precision = DOUBLE): each stage against its definition in long double,
// both kernels, 16-bit storage and rank 3; a float64 call is the double call rounded once; every error path
// before any write.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"
#include "support/scalar_names.hpp"

namespace {

using attend::alignment;
using attend::index_t;
using attend::score_stage;
using attend_test::expect_error;
using ld = long double;

/// q `[batch, heads, query_len, head_dim]` with scores large enough for the cap to bend them, GQA k and v, ALiBi
/// and a score_mod, causal bottom-right with key padding.
template <class T>
struct scores_case {
    index_t batch = 2, heads = 4, kv_heads = 2, query_len = 37, key_len = 53, dim = 16;
    attend::tensor<T, 4> q, k, v;
    attend::sdpa_options options;
    std::vector<index_t> key_lengths{53, 40};

    explicit scores_case(std::uint64_t seed) {
        q = attend_test::random_tensor<T>(seed, batch, heads, query_len, dim) * T(3);
        k = attend_test::random_tensor<T>(seed + 1, batch, kv_heads, key_len, dim) * T(3);
        v = attend_test::random_tensor<T>(seed + 2, batch, kv_heads, key_len, dim);
        options.softcap = 2.5;
        options.score_bias = attend::score_bias::alibi(attend::alibi_slopes(heads), alignment::bottom_right);
        options.score_mod = attend::score_mod([](auto score, auto, auto head, auto, auto key) {
            return score + static_cast<decltype(score)>(0.01 * static_cast<double>(head * key % 7));
        });
    }
    auto mask() const { return attend::causal(alignment::bottom_right) && attend::key_padding(key_lengths); }

    /// The score of (b, h, i, j) at a stage, by its definition in long double.
    template <class Bound>
    ld expected(const Bound& bound, index_t b, index_t h, index_t i, index_t j, score_stage stage) const {
        const index_t kvh = h / (heads / kv_heads);
        ld dot = 0;
        for (index_t d = 0; d < dim; ++d) dot += static_cast<ld>(q(b, h, i, d)) * static_cast<ld>(k(b, kvh, j, d));
        ld s = dot / std::sqrt(static_cast<ld>(dim));
        if (stage == score_stage::scaled) return s;
        const ld cap = static_cast<ld>(*options.softcap);
        s = cap * std::tanh(s / cap);
        if (stage == score_stage::softcapped) return s;
        if (!bound.allowed(b, h, i, j)) return -std::numeric_limits<ld>::infinity();
        return s + static_cast<ld>(0.01 * static_cast<double>(h * j % 7)) +
               options.score_bias.template value<double>(h, i, j, query_len, key_len);
    }
};

template <class T>
attend::attention_shape shape_of(const scores_case<T>& c) {
    return attend::detail::check_views(attend::detail::as_view(c.q), attend::detail::as_view(c.k),
                                       attend::detail::as_view(c.v));
}

template <class T>
class Scores : public ::testing::Test {};
TYPED_TEST_SUITE(Scores, attend_test::scalar_types, attend_test::scalar_names);

TYPED_TEST(Scores, EveryStageOfBothKernelsEqualsItsDefinitionInLongDouble) {
    using T = TypeParam;
    const scores_case<T> c(3);
    const auto bound = c.mask().bind(shape_of(c));
    const double tolerance = std::is_same_v<T, float> ? 4e-6 : 1e-13;
    bool bent = false;
    for (const auto stage : {score_stage::scaled, score_stage::softcapped, score_stage::masked})
        for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
            auto o = c.options;
            o.kernel = kernel;
            o.need_scores = stage;
            o.need_weights = true;
            const auto r = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o);
            ASSERT_EQ(r.scores.dimensions(), r.weights.dimensions());
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i)
                        for (index_t j = 0; j < c.key_len; ++j) {
                            const ld want = c.expected(bound, b, h, i, j, stage);
                            const double got = static_cast<double>(r.scores(b, h, i, j));
                            if (std::isinf(static_cast<double>(want))) {
                                ASSERT_EQ(got, -std::numeric_limits<double>::infinity());
                                ASSERT_EQ(r.weights(b, h, i, j), T(0));
                                continue;
                            }
                            ASSERT_NEAR(got, static_cast<double>(want),
                                        tolerance * std::max(1.0, std::abs(static_cast<double>(want))))
                                << "stage " << static_cast<int>(stage) << " batch " << b << " head " << h << " query "
                                << i << " key " << j;
                            if (stage == score_stage::softcapped)
                                bent = bent || std::abs(static_cast<double>(want)) <
                                                   0.9 * std::abs(static_cast<double>(
                                                             c.expected(bound, b, h, i, j, score_stage::scaled)));
                        }
        }
    EXPECT_TRUE(bent);  // the cap bends some score: softcapped differs from scaled
}

TYPED_TEST(Scores, TheSoftmaxOfTheMaskedScoresIsTheWeightsAndTheirLogSumExpTheLse) {
    using T = TypeParam;
    const scores_case<T> c(11);
    auto o = c.options;
    o.need_scores = score_stage::masked;
    o.need_weights = true;
    const auto r = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o);
    const double tolerance = std::is_same_v<T, float> ? 2e-6 : 1e-14;
    for (index_t b = 0; b < c.batch; ++b)
        for (index_t h = 0; h < c.heads; ++h)
            for (index_t i = 0; i < c.query_len; ++i) {
                ld max = -std::numeric_limits<ld>::infinity(), sum = 0;
                for (index_t j = 0; j < c.key_len; ++j) max = std::max<ld>(max, r.scores(b, h, i, j));
                for (index_t j = 0; j < c.key_len; ++j) sum += std::exp(static_cast<ld>(r.scores(b, h, i, j)) - max);
                ASSERT_NEAR(static_cast<double>(r.lse(b, h, i)), static_cast<double>(max + std::log(sum)),
                            4 * tolerance * std::max(1.0, std::abs(static_cast<double>(max))));
                for (index_t j = 0; j < c.key_len; ++j)
                    ASSERT_NEAR(static_cast<double>(r.weights(b, h, i, j)),
                                static_cast<double>(std::exp(static_cast<ld>(r.scores(b, h, i, j)) - max) / sum),
                                tolerance);
            }
}

TEST(Scores, AnEmptyRowUnderTheZeroPolicyHasMinusInfinityMaskedScoresAndFiniteEarlierStages) {
    scores_case<float> c(5);
    c.key_lengths = {53, 0};
    auto o = c.options;
    o.empty_rows = attend::empty_rows::zero;
    o.need_scores = score_stage::masked;
    const auto masked = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o);
    o.need_scores = score_stage::softcapped;
    const auto capped = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o);
    for (index_t h = 0; h < c.heads; ++h)
        for (index_t i = 0; i < c.query_len; ++i)
            for (index_t j = 0; j < c.key_len; ++j) {
                ASSERT_EQ(masked.scores(1, h, i, j), -std::numeric_limits<float>::infinity());
                ASSERT_TRUE(std::isfinite(capped.scores(1, h, i, j)));
                ASSERT_LE(std::abs(capped.scores(1, h, i, j)), 2.5f);
            }
    EXPECT_EQ(attend_test::max_abs(masked.out), attend_test::max_abs(capped.out));
}

TEST(Scores, SixteenBitScoresAreTheFloatScoresOfTheWidenedInputsRoundedOnce) {
    const scores_case<float> wide(7);
    const attend::tensor<Eigen::half, 4> q = wide.q.cast<Eigen::half>(), k = wide.k.cast<Eigen::half>(),
                                         v = wide.v.cast<Eigen::half>();
    const attend::tensor<float, 4> qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>();
    for (const auto stage : {score_stage::scaled, score_stage::softcapped, score_stage::masked}) {
        auto o = wide.options;
        o.need_scores = stage;
        const auto narrow = attend::scaled_dot_product_attention(q, k, v, wide.mask(), o);
        const auto full = attend::scaled_dot_product_attention(qf, kf, vf, wide.mask(), o);
        const attend::tensor<Eigen::half, 4> rounded = full.scores.cast<Eigen::half>();
        EXPECT_TRUE(attend_test::bit_equal(narrow.scores, rounded)) << "stage " << static_cast<int>(stage);
    }
}

TEST(Scores, RankThreeInputsGiveTheScoresOfOneHead) {
    const auto q = attend_test::random_tensor<double>(1, 2, 9, 8), k = attend_test::random_tensor<double>(2, 2, 12, 8),
               v = attend_test::random_tensor<double>(3, 2, 12, 8);
    attend::sdpa_options o;
    o.need_scores = score_stage::masked;
    const auto three = attend::scaled_dot_product_attention(q, k, v, attend::causal(alignment::bottom_right), o);
    const attend::tensor<double, 4> q4 = q.reshape(std::array<index_t, 4>{2, 1, 9, 8}),
                                    k4 = k.reshape(std::array<index_t, 4>{2, 1, 12, 8}),
                                    v4 = v.reshape(std::array<index_t, 4>{2, 1, 12, 8});
    const auto four = attend::scaled_dot_product_attention(q4, k4, v4, attend::causal(alignment::bottom_right), o);
    ASSERT_EQ(three.scores.dimension(2), 12);
    const attend::tensor<double, 3> flat = four.scores.reshape(std::array<index_t, 3>{2, 9, 12});
    EXPECT_TRUE(attend_test::bit_equal(three.scores, flat));
}

TEST(Scores, IntoWritesWhatTheAllocatingCallReturns) {
    const scores_case<float> c(13);
    auto o = c.options;
    o.need_scores = score_stage::softcapped;
    o.need_weights = true;
    const auto r = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o);
    attend::tensor<float, 4> out(c.batch, c.heads, c.query_len, c.dim),
        weights(c.batch, c.heads, c.query_len, c.key_len), scores(c.batch, c.heads, c.query_len, c.key_len);
    attend::tensor<float, 3> lse(c.batch, c.heads, c.query_len);
    attend::scaled_dot_product_attention_into(c.q, c.k, c.v, c.mask(), o, out, weights, lse, scores);
    EXPECT_TRUE(attend_test::bit_equal(out, r.out));
    EXPECT_TRUE(attend_test::bit_equal(weights, r.weights));
    EXPECT_TRUE(attend_test::bit_equal(lse, r.lse));
    EXPECT_TRUE(attend_test::bit_equal(scores, r.scores));
}

TEST(ScoresErrors, AScoresOutputAndNeedScoresComeTogetherAndNothingIsWritten) {
    const scores_case<float> c(17);
    attend::tensor<float, 4> out(c.batch, c.heads, c.query_len, c.dim),
        scores(c.batch, c.heads, c.query_len, c.key_len);
    out.setConstant(7);
    scores.setConstant(7);
    auto o = c.options;
    expect_error<attend::value_error>(
        [&] { attend::scaled_dot_product_attention_into(c.q, c.k, c.v, c.mask(), o, out, nullptr, nullptr, scores); },
        "attend.value.need_scores");
    o.need_scores = score_stage::scaled;
    expect_error<attend::value_error>(
        [&] { attend::scaled_dot_product_attention_into(c.q, c.k, c.v, c.mask(), o, out); },
        "attend.value.need_scores");
    attend::tensor<float, 4> short_scores(c.batch, c.heads, c.query_len, c.key_len - 1);
    const auto msg = expect_error<attend::shape_error>(
        [&] {
            attend::scaled_dot_product_attention_into(c.q, c.k, c.v, c.mask(), o, out, nullptr, nullptr, short_scores);
        },
        "attend.shape.scores_output");
    EXPECT_NE(msg.find("[2,4,37,52]"), std::string::npos) << msg;
    // scores over the same memory as out
    Eigen::TensorMap<attend::tensor<float, 4>> over_out(out.data(), c.batch, c.heads, c.query_len, c.key_len);
    attend::tensor<float, 4> big_out(c.batch, c.heads, c.query_len, c.key_len);
    big_out.setConstant(7);
    Eigen::TensorMap<attend::tensor<float, 4>> out_view(big_out.data(), c.batch, c.heads, c.query_len, c.dim);
    expect_error<attend::shape_error>(
        [&] {
            attend::scaled_dot_product_attention_into(
                c.q, c.k, c.v, c.mask(), o, out_view, nullptr, nullptr,
                Eigen::TensorMap<attend::tensor<float, 4>>(big_out.data(), c.batch, c.heads, c.query_len, c.key_len));
        },
        "attend.shape.aliasing");
    EXPECT_EQ(attend_test::max_abs(out), 7.0);
    EXPECT_EQ(attend_test::max_abs(scores), 7.0);
    EXPECT_EQ(attend_test::max_abs(big_out), 7.0);
}

TEST(ScoresErrors, OnlyScaledDotProductAttentionServesScoresAndFloat64) {
    const attend::multi_head_attention<float> m({8, 2}, 3);
    const auto x = attend_test::random_tensor<float>(1, 2, 3, 8);
    attend::mha_options o;
    o.attention.need_scores = score_stage::scaled;
    expect_error<attend::value_error>([&] { m.forward(x, x, x, o); }, "attend.value.sdpa_only");
    o.attention.need_scores.reset();
    o.attention.accumulation = attend::accumulation::float64;
    expect_error<attend::value_error>([&] { m.forward(x, x, x, o); }, "attend.value.sdpa_only");
    const scores_case<float> c(19);
    attend::sdpa_options so;
    const auto f = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), so);
    so.need_scores = score_stage::masked;
    expect_error<attend::value_error>(
        [&] { attend::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.mask(), f.out, f.lse, f.out, so); },
        "attend.value.sdpa_only");
}

/// out, weights, scores and lse of one call.
template <class T>
attend::sdpa_options all_outputs(attend::sdpa_options o, attend::kernel kernel) {
    o.kernel = kernel;
    o.need_weights = true;
    o.need_scores = score_stage::masked;
    return o;
}

TEST(Float64Accumulation, AFloatCallIsTheDoubleCallOnTheSameValuesRoundedOnce) {
    scores_case<float> c(23);
    c.options.sinks = attend::attention_sinks{0.5, -1.0, 2.0, 0.0};
    const attend::tensor<double, 4> qd = c.q.cast<double>(), kd = c.k.cast<double>(), vd = c.v.cast<double>();
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        auto o = all_outputs<float>(c.options, kernel);
        const auto wide = attend::scaled_dot_product_attention(qd, kd, vd, c.mask(), o);
        o.accumulation = attend::accumulation::float64;
        const auto r = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o);
        EXPECT_TRUE(attend_test::bit_equal(r.out, attend::tensor<float, 4>(wide.out.cast<float>())));
        EXPECT_TRUE(attend_test::bit_equal(r.weights, attend::tensor<float, 4>(wide.weights.cast<float>())));
        EXPECT_TRUE(attend_test::bit_equal(r.scores, attend::tensor<float, 4>(wide.scores.cast<float>())));
        EXPECT_TRUE(attend_test::bit_equal(r.lse, attend::tensor<float, 3>(wide.lse.cast<float>())));
    }
}

TEST(Float64Accumulation, AHalfCallIsTheDoubleCallRoundedThroughFloat) {
    const scores_case<float> c(29);
    const attend::tensor<Eigen::bfloat16, 4> q = c.q.cast<Eigen::bfloat16>(), k = c.k.cast<Eigen::bfloat16>(),
                                             v = c.v.cast<Eigen::bfloat16>();
    const attend::tensor<double, 4> qd = q.cast<float>().cast<double>(), kd = k.cast<float>().cast<double>(),
                                    vd = v.cast<float>().cast<double>();
    auto o = all_outputs<float>(c.options, attend::kernel::tiled);
    const auto wide = attend::scaled_dot_product_attention(qd, kd, vd, c.mask(), o);
    o.accumulation = attend::accumulation::float64;
    const auto r = attend::scaled_dot_product_attention(q, k, v, c.mask(), o);
    EXPECT_TRUE(attend_test::bit_equal(
        r.out, attend::tensor<Eigen::bfloat16, 4>(wide.out.cast<float>().cast<Eigen::bfloat16>())));
    EXPECT_TRUE(attend_test::bit_equal(
        r.scores, attend::tensor<Eigen::bfloat16, 4>(wide.scores.cast<float>().cast<Eigen::bfloat16>())));
    EXPECT_TRUE(attend_test::bit_equal(r.lse, attend::tensor<float, 3>(wide.lse.cast<float>())));
}

TEST(Float64Accumulation, IsWithinHalfAnUlpOfTheExactResultWhereFloatAccumulationIsNot) {
    // 4096 keys of nearly equal scores: float accumulation of the weighted values drifts by several ulps.
    const index_t S = 4096, D = 8, L = 4;
    const attend::tensor<float, 4> q = attend_test::random_tensor<float>(31, 1, 1, L, D) * 0.1f,
                                   k = attend_test::random_tensor<float>(32, 1, 1, S, D) * 0.1f,
                                   v = attend_test::random_tensor<float>(33, 1, 1, S, D) + 3.0f;
    attend::sdpa_options o;
    const auto standard = attend::scaled_dot_product_attention(q, k, v, o);
    o.accumulation = attend::accumulation::float64;
    const auto wide = attend::scaled_dot_product_attention(q, k, v, o);
    double worst_standard = 0, worst_wide = 0;  // in units of the last place of the exact result
    for (index_t i = 0; i < L; ++i) {
        std::vector<ld> p(static_cast<std::size_t>(S));
        ld max = -std::numeric_limits<ld>::infinity(), sum = 0;
        for (index_t j = 0; j < S; ++j) {
            ld dot = 0;
            for (index_t d = 0; d < D; ++d) dot += static_cast<ld>(q(0, 0, i, d)) * static_cast<ld>(k(0, 0, j, d));
            p[static_cast<std::size_t>(j)] = dot / std::sqrt(static_cast<ld>(D));
            max = std::max(max, p[static_cast<std::size_t>(j)]);
        }
        for (auto& x : p) sum += x = std::exp(x - max);
        for (index_t d = 0; d < D; ++d) {
            ld exact = 0;
            for (index_t j = 0; j < S; ++j)
                exact += p[static_cast<std::size_t>(j)] / sum * static_cast<ld>(v(0, 0, j, d));
            const float nearest = static_cast<float>(exact);
            const double ulp = std::nextafter(nearest, std::numeric_limits<float>::infinity()) - nearest;
            worst_standard =
                std::max(worst_standard, std::abs(static_cast<double>(standard.out(0, 0, i, d) - exact)) / ulp);
            worst_wide = std::max(worst_wide, std::abs(static_cast<double>(wide.out(0, 0, i, d) - exact)) / ulp);
        }
    }
    EXPECT_LE(worst_wide, 0.5 + 1e-6);
    EXPECT_GT(worst_standard, 0.5);  // the case tells the two apart
}

TEST(Float64Accumulation, ErrorsComeFromTheDoubleCallBeforeAnyWrite) {
    scores_case<float> c(37);
    c.k(1, 0, 3, 2) = std::numeric_limits<float>::quiet_NaN();
    auto o = c.options;
    o.accumulation = attend::accumulation::float64;
    attend::tensor<float, 4> out(c.batch, c.heads, c.query_len, c.dim);
    out.setConstant(7);
    const auto msg = expect_error<attend::value_error>(
        [&] { attend::scaled_dot_product_attention_into(c.q, c.k, c.v, c.mask(), o, out); }, "attend.value.non_finite");
    EXPECT_NE(msg.find("[1,0,3,2]"), std::string::npos) << msg;
    EXPECT_EQ(attend_test::max_abs(out), 7.0);
    c.k(1, 0, 3, 2) = 0;
    o.scale = -1.0;
    expect_error<attend::value_error>(
        [&] { attend::scaled_dot_product_attention_into(c.q, c.k, c.v, c.mask(), o, out); }, "attend.value.scale");
    EXPECT_EQ(attend_test::max_abs(out), 7.0);
}

}  // namespace
