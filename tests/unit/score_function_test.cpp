// SPDX-License-Identifier: MIT
// Score modifiers (score_mod, score_function.hpp): a function of (score, batch, head, query, key) applied after
// the scale and softcap, before score_bias and the mask. Proven against the built-in ALiBi it can reproduce,
// by finite differences through the user's derivative, tiled against reference with every other score feature,
// and on its error path.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/finite_differences.hpp"
#include "support/kernel_agreement.hpp"
#include "support/random.hpp"
#include "support/scalar_names.hpp"
#include "support/score_feature_golden.hpp"

namespace {

using attend::alignment;
using attend::index_t;

/// ALiBi (top-left) as a score modifier: s - slope[h] |i - j|, with derivative 1; generic indices, which arrive
/// as mod_index (wavy below declares them index, which works as well).
attend::score_function alibi_as_function(const std::vector<double>& slopes) {
    return attend::score_mod(
        [slopes](auto s, auto, auto h, auto i, auto j) {
            using S = decltype(s);
            static_assert(std::is_same_v<decltype(i), attend::mod_index>);
            return s - static_cast<S>(slopes[static_cast<std::size_t>(h)] * static_cast<double>(std::abs(i - j)));
        },
        [](auto, auto, auto, auto, auto) { return 1.0; });
}

template <class T>
class ScoreMod : public ::testing::Test {};
TYPED_TEST_SUITE(ScoreMod, attend_test::scalar_types, attend_test::scalar_names);

TYPED_TEST(ScoreMod, AlibiAsAFunctionEqualsTheBuiltInBiasForwardAndBackward) {
    using T = TypeParam;
    const double tolerance = std::is_same_v<T, float> ? 3e-6 : 1e-13;
    const index_t B = 2, H = 4, G = 2, L = 150, S = 170, D = 16;
    const auto q = attend_test::random_tensor<T>(1, B, H, L, D), k = attend_test::random_tensor<T>(2, B, G, S, D),
               v = attend_test::random_tensor<T>(3, B, G, S, D), d_out = attend_test::random_tensor<T>(4, B, H, L, D);
    const auto slopes = attend::alibi_slopes(H);
    const auto mask = attend::causal(alignment::bottom_right);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::sdpa_options builtin, function;
        builtin.kernel = function.kernel = kernel;
        builtin.score_bias = attend::score_bias::alibi(slopes, attend::alignment::top_left);
        function.score_mod = alibi_as_function(slopes);
        const auto want = attend::scaled_dot_product_attention(q, k, v, mask, builtin);
        const auto got = attend::scaled_dot_product_attention(q, k, v, mask, function);
        EXPECT_LE(attend_test::max_abs_diff(got.out, want.out), tolerance);
        EXPECT_LE(attend_test::max_abs_diff(got.lse, want.lse), 10 * tolerance);
        const auto gw = attend::scaled_dot_product_attention_backward(q, k, v, mask, want, d_out, builtin);
        const auto gg = attend::scaled_dot_product_attention_backward(q, k, v, mask, got, d_out, function);
        EXPECT_LE(attend_test::max_abs_diff(gg.d_query, gw.d_query), 20 * tolerance);
        EXPECT_LE(attend_test::max_abs_diff(gg.d_key, gw.d_key), 20 * tolerance);
        EXPECT_LE(attend_test::max_abs_diff(gg.d_value, gw.d_value), 20 * tolerance);
    }
}

/// s + a sin(s) (h + 1) / (1 + |i - j|): nonlinear in the score and position-dependent, with its derivative.
attend::score_function wavy() {
    return attend::score_mod(
        [](auto s, index_t, index_t h, index_t i, index_t j) {
            return s + decltype(s)(0.3) * std::sin(s) * static_cast<decltype(s)>(h + 1) /
                           static_cast<decltype(s)>(1 + std::abs(i - j));
        },
        [](auto s, index_t, index_t h, index_t i, index_t j) {
            return decltype(s)(1) + decltype(s)(0.3) * std::cos(s) * static_cast<decltype(s)>(h + 1) /
                                        static_cast<decltype(s)>(1 + std::abs(i - j));
        });
}

TEST(ScoreModBackward, GradientsThroughTheUsersDerivativeEqualFiniteDifferences) {
    const index_t B = 2, H = 4, G = 2, L = 4, S = 6, D = 3;
    attend::tensor<double, 4> q = attend_test::random_tensor<double>(5, B, H, L, D) * 2.0;
    attend::tensor<double, 4> k = attend_test::random_tensor<double>(6, B, G, S, D) * 2.0;
    attend::tensor<double, 4> v = attend_test::random_tensor<double>(7, B, G, S, D);
    const auto w = attend_test::random_tensor<double>(8, B, H, L, D);
    attend::sdpa_options o;
    o.score_mod = wavy();
    o.softcap = 2.5;  // composes: the slope is the cap's times the function's
    o.dropout = {0.2, 3, true};
    const auto mask = attend::causal(alignment::bottom_right) && attend::key_padding({6, 4});
    const auto loss = [&] {
        auto r = o;
        r.kernel = attend::kernel::reference;
        return attend_test::linear_loss(attend::scaled_dot_product_attention(q, k, v, mask, r).out, w);
    };
    const auto fd_q = attend_test::fd_gradient(q, loss);
    const auto fd_k = attend_test::fd_gradient(k, loss);
    const auto fd_v = attend_test::fd_gradient(v, loss);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        o.kernel = kernel;
        const auto f = attend::scaled_dot_product_attention(q, k, v, mask, o);
        const auto g = attend::scaled_dot_product_attention_backward(q, k, v, mask, f, w, o);
        attend_test::expect_close_to_fd(g.d_query, fd_q, "dq");
        attend_test::expect_close_to_fd(g.d_key, fd_k, "dk");
        attend_test::expect_close_to_fd(g.d_value, fd_v, "dv");
    }
}

/// Tiled against reference with every score feature: a score function, softcap, sinks, ALiBi on top, packed
/// segments with a window, grouped heads and dropout.
TEST(ScoreModCombined, TiledEqualsReferenceWithSoftcapSinksAlibiPackedSegmentsGqaAndDropout) {
    const index_t B = 2, H = 4, G = 2, L = 300, D = 16;  // past one double key tile (256) and one query block
    const auto q = attend_test::random_tensor<double>(9, B, H, L, D),
               k = attend_test::random_tensor<double>(10, B, G, L, D),
               v = attend_test::random_tensor<double>(11, B, G, L, D),
               d_out = attend_test::random_tensor<double>(12, B, H, L, D);
    attend::sdpa_options o;
    o.score_mod = wavy();
    o.softcap = 4.0;
    o.sinks = attend::attention_sinks{0.5, -1.0, 2.0, 0.0};
    o.score_bias = attend::score_bias::alibi(attend::alibi_slopes(H), attend::alignment::top_left);
    o.dropout = {0.1, 4, true};
    o.need_weights = true;
    const auto mask = attend::packed_segments(attend::segment_offsets({0, 100, 270, 300}),
                                              attend::segment_offsets({0, 100, 270, 300}))
                          .window(60, 0, attend::alignment::top_left);
    attend_test::expect_kernels_agree(attend_test::run_every_kernel(q, k, v, d_out, mask, o));
}

TEST(ScoreModGolden, AScoreFunctionMatchesFlexAttentionAndPyTorchAutogradInDouble) {
    attend::sdpa_options o;
    o.score_mod = wavy();
    attend_test::expect_score_feature_golden("flex_score_mod_wavy_causal_bottom_right",
                                             attend::causal(alignment::bottom_right), o);
}

TEST(ScoreModErrors, BackwardWithoutADerivativeIsRejectedBeforeAnyWrite) {
    const index_t B = 1, H = 2, L = 5, D = 4;
    const auto q = attend_test::random_tensor<double>(1, B, H, L, D),
               k = attend_test::random_tensor<double>(2, B, H, L, D),
               v = attend_test::random_tensor<double>(3, B, H, L, D);
    attend::sdpa_options o;
    o.score_mod = attend::score_mod([](auto s, index_t, index_t, index_t, index_t) { return s * decltype(s)(0.5); });
    const auto f = attend::scaled_dot_product_attention(q, k, v, o);  // the forward needs no derivative
    attend::tensor<double, 4> dq(q.dimensions()), dk(k.dimensions()), dv(v.dimensions());
    dq.setConstant(42);
    attend_test::expect_error<attend::value_error>(
        [&] {
            attend::scaled_dot_product_attention_backward_into(q, k, v, attend::no_mask{}, f.out, f.lse, f.out, o, dq,
                                                               dk, dv);
        },
        "attend.value.score_mod_derivative");
    EXPECT_TRUE(std::all_of(dq.data(), dq.data() + dq.size(), [](double x) { return x == 42; }));
}

/// Keys and values of 2^31 rows that all share one row's memory (stride 0): a valid call that only a mask_mod or a
/// score_mod cannot take, since they receive key positions as mod_index. Checks the error and that out is unwritten.
template <class Mask>
void expect_positions_beyond_mod_index_rejected(const Mask& mask, const attend::sdpa_options& options) {
    std::vector<float> row(4, 0.5f), out(4, 42.0f);
    attend::strided_view<const float> q, kv;
    q.data = kv.data = row.data();
    q.dims = {1, 1, 1, 4};
    q.strides = {4, 4, 4, 1};
    kv.dims = {1, 1, index_t{1} << 31, 4};
    kv.strides = {0, 0, 0, 1};
    Eigen::TensorMap<attend::tensor<float, 4>> o(out.data(), 1, 1, 1, 4);
    attend_test::expect_error<attend::shape_error>(
        [&] { attend::scaled_dot_product_attention_into(q, kv, kv, mask, options, o); }, "attend.shape.mod_positions");
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 42.0f; }));
}

TEST(ScoreModErrors, PositionsBeyondThirtyTwoBitsAreRejectedBeforeAnyWrite) {
    attend::sdpa_options options;
    options.check_finite = false;
    options.score_mod = attend::score_mod([](auto s, auto, auto, auto, auto) { return s; });
    expect_positions_beyond_mod_index_rejected(attend::no_mask{}, options);
}

TEST(MaskModErrors, PositionsBeyondThirtyTwoBitsAreRejectedBeforeAnyWriteAsForScoreMod) {
    attend::sdpa_options options;
    options.check_finite = false;
    expect_positions_beyond_mod_index_rejected(attend::mask_mod([](auto, auto, auto, auto) { return true; }), options);
}

}  // namespace
