// SPDX-License-Identifier: MIT
// Regression tests of what the fuzzers in tests/fuzz found (docs/fuzzing.md lists each finding). Each input
// that failed is also in the fuzzers' committed corpus; these tests say the same thing in a readable form.
#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/errors.hpp"

namespace {

using attend::index_t;

/// q, k = 1 and v = 1: every allowed weighting of v gives out = 1, so any saturated bias must still give 1.
template <class T>
struct constant_inputs {
    attend::tensor<T, 4> q{1, 1, 2, 2}, k{1, 1, 3, 2}, v{1, 1, 3, 2};
    constant_inputs() {
        q.setConstant(1);
        k.setConstant(1);
        v.setConstant(1);
    }
};

template <class T, class Mask>
void expect_saturated_rows(const constant_inputs<T>& x, const Mask& mask, index_t saturated_key) {
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::sdpa_options o;
        o.kernel = kernel;
        o.need_weights = true;
        o.need_lse = true;
        const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
        for (index_t i = 0; i < 2; ++i) {
            EXPECT_EQ(r.out(0, 0, i, 0), T(1)) << "query " << i;
            EXPECT_TRUE(std::isfinite(r.lse(0, 0, i))) << "query " << i;
        }
        // Query 0 has one key at the top of T's range: it takes all the weight.
        EXPECT_EQ(r.weights(0, 0, 0, saturated_key), T(1));
    }
}

// A finite additive entry above the largest float (a double mask on float inputs) used to become +inf, and
// inf - inf gave NaN (reference) or a zero row (tiled).
TEST(FuzzFindings, DoubleAdditiveAboveFloatRangeSaturates) {
    constant_inputs<float> x;
    attend::tensor<double, 2> bias(2, 3);
    bias.setZero();
    bias(0, 1) = 1e300;
    bias(1, 1) = 1e300;
    bias(1, 2) = 1e300;
    expect_saturated_rows(x, attend::additive_mask<double>::query_key_grid(bias), 1);
}

// Two float max() entries added used to overflow to +inf in the same way.
TEST(FuzzFindings, SumOfLargestFloatsSaturates) {
    constant_inputs<float> x;
    attend::tensor<float, 2> bias(2, 3);
    bias.setZero();
    bias(0, 2) = std::numeric_limits<float>::max();
    bias(1, 0) = std::numeric_limits<float>::max();
    bias(1, 1) = std::numeric_limits<float>::max();
    const auto mask = attend::additive_mask<float>::query_key_grid(bias);
    expect_saturated_rows(x, mask + mask, 2);
}

// A scale finite in double but inf (1e300) or 0 (1e-50) as a float passed the check and made every score inf,
// NaN or 0; it is now the same error as any other bad scale.
TEST(FuzzFindings, ScaleOutsideTheInputScalarTypeIsAnError) {
    constant_inputs<float> x;
    for (const double scale : {1e300, 1e-50}) {
        attend::sdpa_options o;
        o.scale = scale;
        attend_test::expect_error<attend::value_error>(
            [&] { (void)attend::scaled_dot_product_attention(x.q, x.k, x.v, o); }, "attend.value.scale");
    }
    constant_inputs<double> y;
    attend::sdpa_options o;
    o.scale = 1e-50;  // representable in double: accepted
    const auto r = attend::scaled_dot_product_attention(y.q, y.k, y.v, o);
    EXPECT_EQ(r.out(0, 0, 0, 0), 1.0);
}

// With batch 0 the tiled backward returned before zeroing d_score_bias: the caller got whatever the
// buffer held. It is an output of the call, and with no query at all it is zero, as the reference kernel says.
TEST(FuzzFindings, BackwardWithBatchZeroZeroesTheScoreBiasGradient) {
    attend::tensor<float, 4> q(0, 2, 3, 4), k(0, 2, 5, 4), v(0, 2, 5, 4), d_out(0, 2, 3, 4);
    attend::sdpa_options o;
    o.score_bias = attend::score_bias::alibi(attend::alibi_slopes(2), attend::alignment::top_left);
    o.need_lse = true;
    const auto f = attend::scaled_dot_product_attention(q, k, v, o);
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        o.kernel = kernel;
        attend::tensor<float, 4> dq(q.dimensions()), dk(k.dimensions()), dv(v.dimensions());
        attend::tensor<float, 2> bias_gradient(2, 3 + 5 - 1);
        bias_gradient.setConstant(7.0f);  // a sentinel the call must overwrite
        attend::scaled_dot_product_attention_backward_into(q, k, v, attend::no_mask{}, f.out, f.lse, d_out, o, dq, dk,
                                                           dv, bias_gradient);
        for (index_t n = 0; n < bias_gradient.size(); ++n) EXPECT_EQ(bias_gradient.data()[n], 0.0f) << n;
    }
}

// Rows whose lse is too large for P = exp(s - lse) to be exact get their statistics recomputed per query tile;
// that pass indexed one scratch per thread although scratch exists only for as many threads as there are
// (batch, kv head, key chunk) units: 2 threads, 3 query tiles and 1 key chunk read past the scratch (ASan).
TEST(FuzzFindings, BackwardWithLargeLseAndMoreQueryTilesThanUnitsStaysInBounds) {
    const index_t L = 300, S = 7, D = 4;
    attend::tensor<float, 4> q(1, 1, L, D), k(1, 1, S, D), v(1, 1, S, D), d_out(1, 1, L, D);
    q.setConstant(10.0f);  // q . k * scale = 400 * 0.5 = 200: lse ~ 202, beyond the exact range of float
    k.setConstant(10.0f);
    for (index_t n = 0; n < v.size(); ++n) v.data()[n] = static_cast<float>(n % 5) - 2.0f;
    for (index_t n = 0; n < d_out.size(); ++n) d_out.data()[n] = static_cast<float>(n % 3) - 1.0f;
    attend::sdpa_options o;
    o.need_lse = true;
    const auto f = attend::scaled_dot_product_attention(q, k, v, o);
    ASSERT_GT(f.lse(0, 0, 0), 200.0f);
    o.kernel = attend::kernel::reference;
    const auto reference = attend::scaled_dot_product_attention_backward(q, k, v, f.out, f.lse, d_out, o);
    o.kernel = attend::kernel::tiled;
    o.threads = 2;
    const auto tiled = attend::scaled_dot_product_attention_backward(q, k, v, f.out, f.lse, d_out, o);
    for (index_t n = 0; n < reference.d_value.size(); ++n)
        EXPECT_NEAR(tiled.d_value.data()[n], reference.d_value.data()[n],
                    1e-3f * (1.0f + std::abs(reference.d_value.data()[n])));
    for (index_t n = 0; n < reference.d_query.size(); ++n)
        EXPECT_NEAR(tiled.d_query.data()[n], reference.d_query.data()[n], 1e-3f);
}

// An ALiBi slope finite in double but beyond float's range (times the distances) became inf in a float call, and
// inf * 0 on the diagonal NaN; a double relative-position table value beyond float's range likewise. Both are
// now errors of the call whose scalar type cannot hold them, and accepted where it can.
TEST(FuzzFindings, ScoreBiasBeyondTheScoresScalarTypeIsAnError) {
    constant_inputs<float> x;
    attend::sdpa_options o;
    o.score_bias = attend::score_bias::alibi({1e300}, attend::alignment::top_left);
    attend_test::expect_error<attend::value_error>(
        [&] { (void)attend::scaled_dot_product_attention(x.q, x.k, x.v, o); }, "attend.value.alibi_slopes");
    attend::relative_position_bias<double> table(1, true, 4, 8);
    table.table().setConstant(1e300);
    o.score_bias = attend::score_bias::relative(table, attend::alignment::top_left);
    attend_test::expect_error<attend::value_error>(
        [&] { (void)attend::scaled_dot_product_attention(x.q, x.k, x.v, o); }, "attend.value.score_bias_table");
    constant_inputs<double> y;
    const auto r = attend::scaled_dot_product_attention(y.q, y.k, y.v, o);  // 1e300 fits in double
    EXPECT_EQ(r.out(0, 0, 0, 0), 1.0);
}

}  // namespace
