// SPDX-License-Identifier: MIT
// Numerics at the edges, for kernel::reference and kernel::tiled, forward and backward, in float and double:
// scores of +-1e30 (with ties at the maximum), all-equal scores, a single allowed key per row, and finite
// "large negative" additive fills (float lowest(), -1e9, -1e30) that must neither overflow to -inf nor turn into
// NaN. Every result is compared with an oracle written out here in long double loops: softmax with the maximum
// subtracted, and the textbook backward.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/errors.hpp"
#include "support/random.hpp"
#include "support/scalar_names.hpp"

namespace {

using attend::index_t;
using real = long double;

/// One head: q [L, D], k [S, D], v [S, Dv] as rank-3 tensors with batch 1.
template <class T>
struct problem {
    attend::tensor<T, 3> q, k, v, d_out;
    std::vector<real> bias;  ///< [L, S] added to the scaled scores (-inf forbids), as the mask does
    double scale = 1;

    problem(index_t L, index_t S, index_t D, std::uint64_t seed)
        : q(1, L, D), k(1, S, D), v(1, S, D), d_out(1, L, D), bias(static_cast<std::size_t>(L * S), 0) {
        attend_test::fill_uniform(q, seed);
        attend_test::fill_uniform(k, seed + 1);
        attend_test::fill_uniform(v, seed + 2);
        attend_test::fill_uniform(d_out, seed + 3);
        scale = 1.0 / std::sqrt(static_cast<double>(D));
    }
    index_t L() const { return q.dimension(1); }
    index_t S() const { return k.dimension(1); }
    index_t D() const { return q.dimension(2); }
    real& at(index_t i, index_t j) { return bias[static_cast<std::size_t>(i * S() + j)]; }
};

/// The oracle's forward and backward of one head, in long double.
struct oracle {
    std::vector<real> p, out, d_query, d_key, d_value;  ///< P [L, S]; out, d_query [L, D]; d_key, d_value [S, D]
};

template <class T>
oracle solve(const problem<T>& x) {
    const index_t L = x.L(), S = x.S(), D = x.D();
    const auto q = [&](index_t i, index_t d) { return static_cast<real>(x.q(0, i, d)); };
    const auto k = [&](index_t j, index_t d) { return static_cast<real>(x.k(0, j, d)); };
    const auto v = [&](index_t j, index_t d) { return static_cast<real>(x.v(0, j, d)); };
    const auto g = [&](index_t i, index_t d) { return static_cast<real>(x.d_out(0, i, d)); };
    const auto n = [](index_t a, index_t b, index_t cols) { return static_cast<std::size_t>(a * cols + b); };
    oracle o;
    o.p.assign(static_cast<std::size_t>(L * S), 0);
    o.out.assign(static_cast<std::size_t>(L * D), 0);
    o.d_query.assign(static_cast<std::size_t>(L * D), 0);
    o.d_key.assign(static_cast<std::size_t>(S * D), 0);
    o.d_value.assign(static_cast<std::size_t>(S * D), 0);
    for (index_t i = 0; i < L; ++i) {
        std::vector<real> s(static_cast<std::size_t>(S));
        real max = -std::numeric_limits<real>::infinity();
        for (index_t j = 0; j < S; ++j) {
            real dot = 0;
            for (index_t d = 0; d < D; ++d) dot += q(i, d) * k(j, d);
            s[static_cast<std::size_t>(j)] = static_cast<real>(x.scale) * dot + x.bias[n(i, j, S)];
            max = std::max(max, s[static_cast<std::size_t>(j)]);
        }
        real sum = 0;
        for (index_t j = 0; j < S; ++j) sum += std::exp(s[static_cast<std::size_t>(j)] - max);
        for (index_t j = 0; j < S; ++j) o.p[n(i, j, S)] = std::exp(s[static_cast<std::size_t>(j)] - max) / sum;
        std::vector<real> dp(static_cast<std::size_t>(S));
        real delta = 0;
        for (index_t j = 0; j < S; ++j) {
            for (index_t d = 0; d < D; ++d) {
                o.out[n(i, d, D)] += o.p[n(i, j, S)] * v(j, d);
                dp[static_cast<std::size_t>(j)] += g(i, d) * v(j, d);
            }
            delta += o.p[n(i, j, S)] * dp[static_cast<std::size_t>(j)];
        }
        for (index_t j = 0; j < S; ++j) {
            const real ds = o.p[n(i, j, S)] * (dp[static_cast<std::size_t>(j)] - delta);
            for (index_t d = 0; d < D; ++d) {
                o.d_value[n(j, d, D)] += o.p[n(i, j, S)] * g(i, d);
                o.d_query[n(i, d, D)] += static_cast<real>(x.scale) * ds * k(j, d);
                o.d_key[n(j, d, D)] += static_cast<real>(x.scale) * ds * q(i, d);
            }
        }
    }
    return o;
}

/// The largest |element| of a tensor, at least 1: the scale rounding errors of products with it grow with.
template <class Tensor>
real magnitude(const Tensor& t) {
    real largest = 1;
    for (index_t n = 0; n < t.size(); ++n) largest = std::max(largest, static_cast<real>(std::fabs(t.data()[n])));
    return largest;
}

/// Every element finite and within tol * max(1, largest |expected|, scale) of the oracle; `scale` is the size of
/// the factors a result is a sum of products with (k for dq, q for dk), whose rounding a zero result inherits.
template <class Tensor>
void expect_near(const Tensor& got, const std::vector<real>& want, double tol, const std::string& what,
                 real scale = 1) {
    ASSERT_EQ(static_cast<std::size_t>(got.size()), want.size()) << what;
    real largest = scale;
    for (real w : want) largest = std::max(largest, std::fabs(w));
    for (index_t n = 0; n < got.size(); ++n) {
        const auto x = got.data()[n];
        ASSERT_TRUE(std::isfinite(x)) << what << "[" << n << "] = " << x;
        ASSERT_LE(std::fabs(static_cast<real>(x) - want[static_cast<std::size_t>(n)]), tol * largest)
            << what << "[" << n << "] = " << x << ", oracle " << static_cast<double>(want[static_cast<std::size_t>(n)]);
    }
}

template <class T>
double tolerance() {
    return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

/// Forward (out, weights) and backward (dq, dk, dv) of attend under `mask` against the oracle, for one kernel.
template <class T, class Mask>
void expect_matches_oracle(const problem<T>& x, const Mask& mask, attend::kernel kernel) {
    SCOPED_TRACE(kernel == attend::kernel::reference ? "kernel::reference" : "kernel::tiled");
    attend::sdpa_options o;
    o.kernel = kernel;
    o.scale = x.scale;
    o.need_weights = true;
    o.need_lse = true;
    o.threads = 2;
    const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
    const oracle want = solve(x);
    const double tol = tolerance<T>();
    expect_near(r.out, want.out, tol, "out");
    expect_near(r.weights, want.p, tol, "weights");
    const auto g = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, r.out, r.lse, x.d_out, o);
    expect_near(g.d_query, want.d_query, 10 * tol, "dq", magnitude(x.k));
    expect_near(g.d_key, want.d_key, 10 * tol, "dk", magnitude(x.q));
    expect_near(g.d_value, want.d_value, 10 * tol, "dv");
}

template <class T, class Mask>
void expect_both_kernels_match_oracle(const problem<T>& x, const Mask& mask) {
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) expect_matches_oracle(x, mask, kernel);
}

template <class T>
class NumericsStress : public ::testing::Test {};
TYPED_TEST_SUITE(NumericsStress, attend_test::scalar_types, attend_test::scalar_names);

/// q, k whose dot products reach +-1e30 before scaling: only the first feature is non-zero in q, so every score
/// is one exact product, and keys come in identical pairs, so the maximum of a row is attained twice.
template <class T>
problem<T> huge_scores(index_t L, index_t S, std::uint64_t seed) {
    problem<T> x(L, S, 4, seed);
    attend_test::rng g(seed);
    for (index_t i = 0; i < L; ++i) {
        for (index_t d = 0; d < 4; ++d) x.q(0, i, d) = T(0);
        x.q(0, i, 0) = static_cast<T>((g.bernoulli(0.5) ? 1e15 : -1e15) * g.uniform(0.5, 1));
    }
    for (index_t j = 0; j + 1 < S; j += 2) {
        x.k(0, j, 0) = static_cast<T>((g.bernoulli(0.5) ? 1e15 : -1e15) * g.uniform(0.5, 1));
        for (index_t d = 0; d < 4; ++d) x.k(0, j + 1, d) = x.k(0, j, d);
    }
    return x;
}

TYPED_TEST(NumericsStress, ScoresOfPlusMinusTenToTheThirtyWithTiedMaximaMatchTheOracle) {
    for (const index_t S : {6, 130, 600}) {
        SCOPED_TRACE("key_len " + std::to_string(S));
        const problem<TypeParam> x = huge_scores<TypeParam>(9, S, 10 + static_cast<std::uint64_t>(S));
        expect_both_kernels_match_oracle(x, attend::no_mask{});
    }
}

TYPED_TEST(NumericsStress, AllEqualScoresGiveExactlyUniformWeights) {
    for (const index_t S : {1, 3, 7, 300, 1000}) {
        SCOPED_TRACE("key_len " + std::to_string(S));
        problem<TypeParam> x(5, S, 8, 20);
        x.q.setZero();  // every score exactly 0
        expect_both_kernels_match_oracle(x, attend::no_mask{});
        for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
            attend::sdpa_options o;
            o.kernel = kernel;
            o.need_weights = true;
            const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, o);
            for (index_t n = 0; n < r.weights.size(); ++n)
                ASSERT_EQ(r.weights.data()[n], TypeParam(1) / static_cast<TypeParam>(S)) << n;
        }
    }
}

TYPED_TEST(NumericsStress, ASingleAllowedKeyPerRowGivesWeightOneAndExactlyThatValueRow) {
    const index_t L = 40, S = 700;
    problem<TypeParam> x(L, S, 8, 30);
    attend::tensor<bool, 2> allowed(L, S);
    allowed.setConstant(false);
    std::vector<index_t> only(static_cast<std::size_t>(L));
    attend_test::rng g(31);
    for (index_t i = 0; i < L; ++i) {
        only[static_cast<std::size_t>(i)] = g.uniform_int(0, S - 1);
        allowed(i, only[static_cast<std::size_t>(i)]) = true;
        for (index_t j = 0; j < S; ++j)
            if (j != only[static_cast<std::size_t>(i)]) x.at(i, j) = -std::numeric_limits<real>::infinity();
    }
    const auto mask = attend::allowed_mask::query_key_grid(allowed);
    expect_both_kernels_match_oracle(x, mask);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        o.need_weights = true;
        const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
        for (index_t i = 0; i < L; ++i) {
            const index_t j = only[static_cast<std::size_t>(i)];
            ASSERT_EQ(r.weights(0, i, j), TypeParam(1));
            for (index_t d = 0; d < 8; ++d) ASSERT_EQ(r.out(0, i, d), x.v(0, j, d)) << "query " << i;
        }
    }
}

/// An additive mask filling about half of each row with `fill` and leaving at least one key of each row at 0.
template <class T>
attend::tensor<T, 2> partly_filled(problem<T>& x, T fill, std::uint64_t seed) {
    attend::tensor<T, 2> m(x.L(), x.S());
    attend_test::rng g(seed);
    for (index_t i = 0; i < x.L(); ++i) {
        const index_t kept = g.uniform_int(0, x.S() - 1);
        for (index_t j = 0; j < x.S(); ++j) {
            const bool filled = j != kept && g.bernoulli(0.5);
            m(i, j) = filled ? fill : T(0);
            x.at(i, j) = filled ? static_cast<real>(fill) : 0;
        }
    }
    return m;
}

TYPED_TEST(NumericsStress, FiniteLargeNegativeFillsMatchTheOracleWithoutOverflow) {
    using T = TypeParam;
    for (const T fill : {std::numeric_limits<T>::lowest(), T(-1e9), T(-1e30)}) {
        SCOPED_TRACE("fill " + std::to_string(static_cast<double>(fill)));
        for (const index_t S : {9, 700}) {
            problem<T> x(11, S, 8, 40);
            const auto m = partly_filled(x, fill, 41);
            expect_both_kernels_match_oracle(x, attend::additive_mask<T>::query_key_grid(m));
            // Added twice the fill saturates at lowest() instead of reaching -inf: the same keys stay at weight 0
            // and no row empties.
            expect_both_kernels_match_oracle(x, attend::additive_mask<T>::query_key_grid(m) +
                                                    attend::additive_mask<T>::query_key_grid(m));
        }
    }
}

TYPED_TEST(NumericsStress, RowsFilledEntirelyWithAFiniteFillAreUniformNotNaN) {
    // In T, every score plus the fill rounds to the fill (or saturates at lowest()): the row is allowed, and its
    // softmax is uniform. The oracle, which keeps the scores' differences in long double, does not apply; the
    // backward of both kernels is compared with the same uniform probabilities.
    using T = TypeParam;
    for (const T fill : {std::numeric_limits<T>::lowest(), T(-1e30)}) {
        SCOPED_TRACE("fill " + std::to_string(static_cast<double>(fill)));
        for (const index_t S : {9, 700}) {
            problem<T> x(6, S, 8, 50);
            attend::tensor<T, 2> m(x.L(), S);
            m.setConstant(fill);
            const auto mask = attend::additive_mask<T>::query_key_grid(m);
            problem<T> uniform = x;  // the same problem with every score equal and no bias
            uniform.q.setZero();
            const oracle want = solve(uniform);
            for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
                SCOPED_TRACE(kernel == attend::kernel::reference ? "kernel::reference" : "kernel::tiled");
                attend::sdpa_options o;
                o.kernel = kernel;
                o.need_weights = true;
                o.need_lse = true;
                const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
                expect_near(r.weights, want.p, tolerance<T>(), "weights");
                expect_near(r.out, want.out, tolerance<T>(), "out");
                const auto g =
                    attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, r.out, r.lse, x.d_out, o);
                expect_near(g.d_value, want.d_value, 10 * tolerance<T>(), "dv");
                expect_near(g.d_query, want.d_query, 10 * tolerance<T>(), "dq");  // dq = scale dS k: P and k only
                for (index_t n = 0; n < g.d_key.size(); ++n) ASSERT_TRUE(std::isfinite(g.d_key.data()[n])) << n;
            }
        }
    }
}

// ---- scores that overflow the scores' type -----------------------------------------------------------------------
// One rule for both kernels and the backward (detail/input_scan.hpp): with check_finite on, a call whose scores
// could leave half of T's range is attend.value.score_overflow before anything is written; a call whose per-row
// magnitudes look dangerous but whose every pair stays in range is computed.

namespace score_range {

/// q, k `[1, 1, 2, 2]` filled with `magnitude`, v with 1: every score is 2 magnitude^2 (before the scale 1/sqrt 2).
template <class T>
problem<T> uniform_magnitude(T magnitude) {
    problem<T> x(2, 2, 2, 40);
    x.q.setConstant(magnitude);
    x.k.setConstant(magnitude);
    return x;
}

}  // namespace score_range

TYPED_TEST(NumericsStress, FiniteInputsWhoseScoresOverflowAreAScoreOverflowErrorInEveryKernel) {
    using T = TypeParam;
    // sqrt(max): q.k = 2 max, beyond the type, for finite q and k.
    const T magnitude = std::sqrt(std::numeric_limits<T>::max());
    const problem<T> x = score_range::uniform_magnitude(magnitude);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        attend::tensor<T, 3> out(1, 2, 2);
        out.setConstant(T(-7));
        attend_test::expect_error<attend::value_error>(
            [&] { attend::scaled_dot_product_attention_into(x.q, x.k, x.v, attend::no_mask{}, o, out); },
            "attend.value.score_overflow");
        for (index_t n = 0; n < out.size(); ++n) EXPECT_EQ(out.data()[n], T(-7));  // nothing written
        attend::tensor<T, 2> lse(1, 2);
        lse.setZero();
        attend::tensor<T, 3> fake_out(1, 2, 2);
        fake_out.setZero();
        attend_test::expect_error<attend::value_error>(
            [&] {
                (void)attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, attend::no_mask{}, fake_out, lse,
                                                                    x.d_out, o);
            },
            "attend.value.score_overflow");
    }
    // A scale that pushes scale * q past half the range, with k tiny.
    problem<T> y = score_range::uniform_magnitude(std::numeric_limits<T>::max() / 4);
    y.k.setConstant(std::numeric_limits<T>::min());
    attend::sdpa_options big;
    big.scale = 4.0;
    attend_test::expect_error<attend::value_error>(
        [&] { (void)attend::scaled_dot_product_attention(y.q, y.k, y.v, big); }, "attend.value.score_overflow");
}

TYPED_TEST(NumericsStress, LargeRowsThatNeverMeetAreComputedExactlyByBothKernels) {
    using T = TypeParam;
    // q row 0 is large in feature 0 only, k row 0 large in feature 1 only: the per-row bound ||q||_1 max|k| is
    // far beyond the range, but every actual product q_d k_d is small, so the pairs are checked and accepted.
    const T large = std::sqrt(std::numeric_limits<T>::max());
    problem<T> x(3, 4, 2, 41);
    x.q(0, 0, 0) = large;
    x.q(0, 0, 1) = T(0);
    x.k(0, 0, 0) = T(0);
    x.k(0, 0, 1) = large;
    expect_both_kernels_match_oracle(x, attend::no_mask{});
    // Just inside the limit: scores of exactly a quarter of the range are computed, and finite.
    problem<T> y(1, 2, 1, 42);
    y.q(0, 0, 0) = std::sqrt(std::numeric_limits<T>::max() / 4);
    y.k(0, 0, 0) = y.q(0, 0, 0);
    y.k(0, 1, 0) = -y.q(0, 0, 0);
    y.scale = 1;
    expect_both_kernels_match_oracle(y, attend::no_mask{});
}

TYPED_TEST(NumericsStress, AQueryRowWhoseMagnitudesSumPastTheTypeHasItsPairsChecked) {
    using T = TypeParam;
    // Row 0 of q holds three elements of max / 2: their sum of magnitudes overflows T, so the row's bound is
    // infinite and its pairs decide, whatever the other rows' bounds. Keys of about 2^-120 (float; 2^-1016 double)
    // give scores of a few hundred: computed. Keys of 4 give scores past the range: rejected, nothing written.
    problem<T> x(2, 5, 4, 43);
    for (index_t d = 0; d < 4; ++d) x.q(0, 0, d) = d < 3 ? std::numeric_limits<T>::max() / 2 : T(0);
    for (index_t j = 0; j < 5; ++j)
        for (index_t d = 0; d < 4; ++d)
            x.k(0, j, d) = std::ldexp(T(0.5) + T(0.1) * static_cast<T>((3 * j + d) % 5),
                                      -(std::numeric_limits<T>::max_exponent - 8)) *
                           ((j + d) % 2 != 0 ? T(1) : T(-1));
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, o);
        for (index_t n = 0; n < r.out.size(); ++n) ASSERT_TRUE(std::isfinite(r.out.data()[n])) << n;
        problem<T> y = x;
        y.k.setConstant(T(4));
        attend::tensor<T, 3> out(1, 2, 4);
        out.setConstant(T(-7));
        attend_test::expect_error<attend::value_error>(
            [&] { attend::scaled_dot_product_attention_into(y.q, y.k, y.v, attend::no_mask{}, o, out); },
            "attend.value.score_overflow");
        for (index_t n = 0; n < out.size(); ++n) EXPECT_EQ(out.data()[n], T(-7));
    }
}

TYPED_TEST(NumericsStress, CheckFiniteOffSkipsTheScoreRangeScan) {
    using T = TypeParam;
    const problem<T> x = score_range::uniform_magnitude(std::sqrt(std::numeric_limits<T>::max()));
    attend::sdpa_options o;
    o.check_finite = false;  // the caller's promise: no scan, whatever the kernels make of it
    o.empty_rows = attend::empty_rows::zero;
    o.kernel = attend::kernel::tiled;
    EXPECT_NO_THROW((void)attend::scaled_dot_product_attention(x.q, x.k, x.v, o));
}

}  // namespace
