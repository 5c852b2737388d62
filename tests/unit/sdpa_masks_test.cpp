// SPDX-License-Identifier: MIT
// Masks as scaled_dot_product_attention (sdpa.hpp) applies them: causal top_left and bottom_right against hand-built
// triangles, intersections, the seed's 3x3 example and the inverted-convention trap, additive masks added before
// softmax, and finite fill values against -inf. The configurations, the oracle, the masks and the tolerances are in
// support/sdpa_properties.hpp.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/random.hpp"
#include "support/sdpa_properties.hpp"

namespace {

using namespace attend_test::sdpa_properties;
using attend::index_t;
using attend_test::identical;
using attend_test::near;
using attend_test::rng;

// ---------------------------------------------------------------------------------------------------------------
// Causal alignment and intersections
// ---------------------------------------------------------------------------------------------------------------

/// A [query_len, key_len] allowed grid, or [batch, query_len, key_len] ... built by hand from a predicate.
dense_grid hand_grid(const config& c, std::vector<index_t> dims,
                     const std::function<bool(index_t, index_t, index_t)>& allowed) {
    dense_grid m;
    m.rank3_call = c.rank3;
    m.dims = std::move(dims);
    const bool per_batch = m.dims.size() >= 3;
    const index_t B = per_batch ? m.dims[0] : 1, L = m.dims[m.dims.size() - 2], S = m.dims.back();
    for (index_t b = 0; b < B; ++b)
        for (index_t i = 0; i < L; ++i)
            for (index_t j = 0; j < S; ++j) m.values.push_back(allowed(b, i, j) ? 1.0 : 0.0);
    return m;
}

TYPED_TEST(SdpaProperty, CausalTopLeftAndBottomRightEqualHandBuiltTriangles) {
    using T = TypeParam;
    int shapes[3] = {0, 0, 0};  // L < S, L == S, L > S
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(8000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const int relation = n % 3;  // cycle through L < S, L == S, L > S
        if (relation == 0) c.key_len = c.query_len + g.uniform_int(1, 7);
        if (relation == 1) c.key_len = c.query_len;
        if (relation == 2) {
            c.query_len = std::max<index_t>(c.query_len, 2);
            c.key_len = g.uniform_int(1, c.query_len - 1);
        }
        ++shapes[relation];
        const auto x = random_inputs<T>(c);
        const index_t L = c.query_len, S = c.key_len;
        for (const auto align : {attend::alignment::top_left, attend::alignment::bottom_right}) {
            SCOPED_TRACE(describe(c) + ", causal " + name_of(align));
            // Written from the seeds' tril picture: top_left is tril(diagonal 0), bottom_right tril(diagonal S - L).
            const index_t diagonal = align == attend::alignment::top_left ? 0 : S - L;
            const auto triangle =
                hand_grid(c, {L, S}, [&](index_t, index_t i, index_t j) { return j - i <= diagonal; });
            const auto rule = run(c, x, attend::causal(align), zero_rows());
            const auto hand = run(c, x, as_allowed(triangle), zero_rows());
            ASSERT_TRUE(near(rule.out, hand.out, tol_same<T>()));
            ASSERT_TRUE(near(rule.weights, hand.weights, tol_same<T>()));
            ASSERT_TRUE(near(rule.lse, hand.lse, tol_same<T>() * 10));
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < L; ++i) {
                        const bool empty = i + diagonal < 0;  // only bottom_right with L > S
                        if (empty) {
                            ASSERT_EQ(rule.lse(b, h, i), -std::numeric_limits<T>::infinity());
                        }
                        for (index_t j = 0; j < S; ++j)
                            if (j - i > diagonal) {
                                ASSERT_EQ(rule.weights(b, h, i, j), T(0));
                            }
                    }
            if (align == attend::alignment::bottom_right && L > S) {
                // Under the default policy the first L - S queries are empty rows: loud, and naming query 0.
                try {
                    (void)run(c, x, attend::causal(align));
                    ADD_FAILURE() << "bottom_right causal with query_len > key_len must throw under empty_rows::error";
                } catch (const attend::mask_error& e) {
                    EXPECT_EQ(e.id(), "attend.mask.empty_row");
                    EXPECT_NE(std::string(e.what()).find("query 0"), std::string::npos) << e.what();
                }
            }
        }
        if (L != S) {
            // The alignments differ exactly when L != S: a swapped alignment would be caught above.
            const auto tl = run(c, x, attend::causal(attend::alignment::top_left), zero_rows());
            const auto br = run(c, x, attend::causal(attend::alignment::bottom_right), zero_rows());
            EXPECT_FALSE(near(tl.weights, br.weights, 1e-3)) << describe(c);
        }
    }
    EXPECT_GT(shapes[0], 0);
    EXPECT_GT(shapes[1], 0);
    EXPECT_GT(shapes[2], 0);
}

TYPED_TEST(SdpaProperty, CausalAndKeyPaddingEqualsHandBuiltIntersection) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(9000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        std::vector<index_t> lengths;
        for (index_t b = 0; b < c.batch; ++b) lengths.push_back(g.uniform_int(0, c.key_len));
        for (const auto align : {attend::alignment::top_left, attend::alignment::bottom_right}) {
            SCOPED_TRACE(describe(c) + ", causal " + name_of(align));
            const index_t shift = diagonal_shift(align, c);
            // [batch, 1, query_len, key_len] (rank 4) or [batch, query_len, key_len] (rank 3).
            std::vector<index_t> dims = c.rank3 ? std::vector<index_t>{c.batch, c.query_len, c.key_len}
                                                : std::vector<index_t>{c.batch, 1, c.query_len, c.key_len};
            const auto both = hand_grid(c, dims, [&](index_t b, index_t i, index_t j) {
                return j <= i + shift && j < lengths[at(b)];
            });
            const auto rule = run(c, x, attend::causal(align) && attend::key_padding(lengths), zero_rows());
            const auto hand = run(c, x, as_allowed(both), zero_rows());
            ASSERT_TRUE(near(rule.out, hand.out, tol_same<T>()));
            ASSERT_TRUE(near(rule.weights, hand.weights, tol_same<T>()));
            ASSERT_TRUE(near(rule.lse, hand.lse, tol_same<T>() * 10));
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i)
                        for (index_t j = 0; j < c.key_len; ++j)
                            if (both.value(b, h, i, j) == 0.0) {
                                ASSERT_EQ(rule.weights(b, h, i, j), T(0));
                            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The seed's 3x3 example and the inverted-convention trap
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, SeedThreeByThreeCausalExampleGivesTwoThreeFourteenThirds) {
    using T = TypeParam;
    tensor<T, 3> q(1, 3, 2), k(1, 3, 2), v(1, 3, 1);
    q.setZero();
    k.setZero();
    v.setValues({{{T(2)}, {T(4)}, {T(8)}}});
    attend::sdpa_options o;
    o.need_weights = true;
    o.need_lse = true;

    const auto r = attend::scaled_dot_product_attention(q, k, v, attend::causal(attend::alignment::top_left), o);
    EXPECT_EQ(r.out(0, 0, 0), T(2));
    EXPECT_EQ(r.out(0, 1, 0), T(3));
    if constexpr (std::is_same_v<T, float>) EXPECT_FLOAT_EQ(r.out(0, 2, 0), 14.0f / 3.0f);
    else EXPECT_DOUBLE_EQ(r.out(0, 2, 0), 14.0 / 3.0);
    const T third = T(1) / T(3);
    const T expected[3][3] = {{T(1), T(0), T(0)}, {T(0.5), T(0.5), T(0)}, {third, third, third}};
    for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) {
            if (j > i) {
                EXPECT_EQ(r.weights(0, i, j), T(0)) << "future key " << j << " of query " << i;
            }
            if constexpr (std::is_same_v<T, float>) EXPECT_FLOAT_EQ(r.weights(0, i, j), expected[i][j]);
            else EXPECT_DOUBLE_EQ(r.weights(0, i, j), expected[i][j]);
        }

    // nn.MultiheadAttention's convention: true = blocked, the strict upper triangle; to_allowed says so.
    tensor<bool, 2> upper(3, 3), lower(3, 3);
    for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) {
            upper(i, j) = j > i;
            lower(i, j) = j <= i;
        }
    const auto from_mha = attend::scaled_dot_product_attention(
        q, k, v, attend::to_allowed(attend::forbidden_mask::query_key_grid(upper)), o);
    const auto from_sdpa =
        attend::scaled_dot_product_attention(q, k, v, attend::allowed_mask::query_key_grid(lower), o);
    EXPECT_TRUE(identical(from_mha.out, from_sdpa.out));
    EXPECT_TRUE(identical(from_mha.weights, from_sdpa.weights));
    EXPECT_TRUE(near(from_mha.out, r.out, 4 * eps<T>() * 5));
    EXPECT_TRUE(near(from_mha.weights, r.weights, 4 * eps<T>()));

    // The trap: the same upper triangle read in the SDPA convention (true = may attend) means the opposite.
    // Query 2 then has no key at all: loud under the default policy ...
    try {
        (void)attend::scaled_dot_product_attention(q, k, v, attend::allowed_mask::query_key_grid(upper), o);
        ADD_FAILURE() << "the inverted mask leaves query 2 without keys and must throw";
    } catch (const attend::mask_error& e) {
        EXPECT_EQ(e.id(), "attend.mask.empty_row");
        EXPECT_NE(std::string(e.what()).find("query 2"), std::string::npos) << e.what();
    }
    // ... and visibly different numbers under empty_rows::zero: 6, 8, 0 instead of 2, 3, 14/3.
    o.empty_rows = attend::empty_rows::zero;
    const auto inverted = attend::scaled_dot_product_attention(q, k, v, attend::allowed_mask::query_key_grid(upper), o);
    EXPECT_EQ(inverted.out(0, 0, 0), T(6));
    EXPECT_EQ(inverted.out(0, 1, 0), T(8));
    EXPECT_EQ(inverted.out(0, 2, 0), T(0));
    EXPECT_FALSE(near(inverted.out, r.out, 0.5));
}

// ---------------------------------------------------------------------------------------------------------------
// Masks act before softmax; fill values
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, AdditiveMaskIsAddedBeforeSoftmaxAndMinusInfinityGivesExactZeros) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(10000 + static_cast<std::uint64_t>(n));
        SCOPED_TRACE(describe(c));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        const auto m = random_additive_grid(g, c, g.uniform(0.4, 1.0), true);
        const auto r = run(c, x, as_additive<T>(m));
        // weights == softmax(scale * q.k + bias) by the oracle; -inf entries exactly 0 (checked in matches_oracle).
        ASSERT_TRUE(matches_oracle(r, oracle(c, x, default_scale(c), grid_bias(m)), grid_bias(m), tol_oracle<T>()));
        // Multiplying weights by the mask after softmax would leave rows summing to less than 1; here they sum to 1.
        for (index_t b = 0; b < c.batch; ++b)
            for (index_t h = 0; h < c.heads; ++h)
                for (index_t i = 0; i < c.query_len; ++i) {
                    double sum = 0;
                    for (index_t j = 0; j < c.key_len; ++j) sum += static_cast<double>(r.weights(b, h, i, j));
                    ASSERT_NEAR(sum, 1.0, tol_row_sum<T>(c.key_len));
                }
    }
}

TYPED_TEST(SdpaProperty, FiniteLargeNegativeFillIsNotExactZeroButMinusInfinityIs) {
    using T = TypeParam;
    attend::sdpa_options o;
    o.need_weights = true;
    o.scale = 1.0;
    // head_dim 1, q = 1: key 0 scores 0 and is allowed; key 1 is masked by the fill, but its raw score equals the
    // fill's magnitude (1e4 and 1e9 are exact in float and double), so its masked score is exactly 0.
    for (const double fill : {-1e4, -1e9}) {
        SCOPED_TRACE("fill " + std::to_string(fill));
        tensor<T, 3> q(1, 1, 1), k(1, 2, 1), v(1, 2, 1);
        q.setValues({{{T(1)}}});
        k.setValues({{{T(0)}, {static_cast<T>(-fill)}}});
        v.setValues({{{T(1)}, {T(-1)}}});
        tensor<T, 2> finite(1, 2), infinite(1, 2);
        finite.setValues({{T(0), static_cast<T>(fill)}});
        infinite.setValues({{T(0), -std::numeric_limits<T>::infinity()}});
        const auto with_fill =
            attend::scaled_dot_product_attention(q, k, v, attend::additive_mask<T>::query_key_grid(finite), o);
        const auto with_inf =
            attend::scaled_dot_product_attention(q, k, v, attend::additive_mask<T>::query_key_grid(infinite), o);
        EXPECT_GT(with_fill.weights(0, 0, 1), T(0.1)) << "a finite fill only shifts the score; it does not forbid";
        EXPECT_EQ(with_inf.weights(0, 0, 1), T(0));
        EXPECT_EQ(with_inf.weights(0, 0, 0), T(1));
        EXPECT_EQ(with_inf.out(0, 0, 0), T(1));
    }
    // A row whose keys are all "masked" with a finite fill is not empty: it attends uniformly to the padding (the
    // classic padded-row bug), whereas -inf makes it an empty row that attend reports.
    tensor<T, 3> q(1, 1, 2), k(1, 3, 2), v(1, 3, 1);
    attend_test::fill_uniform(q, 1);
    k.setZero();  // every key scores 0, so each masked score is exactly the fill
    v.setValues({{{T(1)}, {T(2)}, {T(6)}}});
    tensor<T, 2> finite(1, 3), infinite(1, 3);
    finite.setConstant(T(-1e4));
    infinite.setConstant(-std::numeric_limits<T>::infinity());
    const auto padded_row =
        attend::scaled_dot_product_attention(q, k, v, attend::additive_mask<T>::query_key_grid(finite), o);
    // (Loose on purpose: the point is "about 1/3, not 0"; accuracy is WeightsStayAccurateUnderALargeCommonOffset.)
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(static_cast<double>(padded_row.weights(0, 0, j)), 1.0 / 3, 1e-3);
    EXPECT_NEAR(static_cast<double>(padded_row.out(0, 0, 0)), 3.0, 1e-3);
    EXPECT_THROW((void)attend::scaled_dot_product_attention(q, k, v, attend::additive_mask<T>::query_key_grid(infinite),
                                                            o),
                 attend::mask_error);
}

// softmax(s + c) == softmax(s). With integer scores and an integer offset c every score is exact in float and
// double, so each kernel must return the softmax of the small integer scores to a few ulps: the offset may not
// cost accuracy. (Computing weights as exp(s - lse) with lse rounded near |c| would lose |c| * eps relative.)
TYPED_TEST(SdpaProperty, WeightsStayAccurateUnderALargeCommonOffset) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(50); ++n) {
        config c = random_config(20000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        c.head_dim = g.uniform_int(1, 4);
        inputs<T> x = random_inputs<T>(c);
        for (auto* t : {&x.q, &x.k})
            for (index_t e = 0; e < t->size(); ++e) t->data()[e] = static_cast<T>(g.uniform_int(-2, 2));
        const double offset = g.bernoulli(0.5) ? -10000.0 : -4096.0;
        dense_grid m = random_additive_grid(g, c, 1.0, true);
        for (double& v : m.values) v = offset;
        for (const auto k : {attend::kernel::reference, attend::kernel::tiled}) {
            c.kernel = k;
            SCOPED_TRACE(describe(c) + ", offset " + std::to_string(offset));
            attend::sdpa_options o;
            o.scale = 1.0;
            const auto r = run(c, x, as_additive<T>(m), o);
            const auto e = oracle(c, x, 1.0, grid_bias(m));
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i) {
                        double sum = 0;
                        for (index_t j = 0; j < c.key_len; ++j) {
                            const double w = static_cast<double>(r.weights(b, h, i, j));
                            sum += w;
                            // exp and the division cost a few ulps; the row sum up to key_len / 2 more.
                            ASSERT_NEAR(w, e.w(b, h, i, j),
                                        static_cast<double>(c.key_len + 8) * eps<T>() * e.w(b, h, i, j))
                                << "weight (" << b << ',' << h << ',' << i << ',' << j << ')';
                        }
                        ASSERT_NEAR(sum, 1.0, tol_row_sum<T>(c.key_len));
                    }
        }
    }
}

// A finite additive bias may round to -inf in the score type: a double mask holding -1e300 applied to float
// inputs, or two float masks each holding lowest() (Hugging Face's finfo.min fill) added together. The row then
// is NOT empty by the mask's meaning (every entry is finite), so under empty_rows::error attend must either give
// the exact softmax (equal finite shifts cancel) or report the row; a silent zero row with lse -inf is neither.
TEST(SdpaFillValues, FiniteAdditiveFillThatOverflowsTheScoreTypeNeverGivesASilentZeroRow) {
    tensor<float, 3> q(1, 2, 1), k(1, 3, 1), v(1, 3, 1);
    q.setValues({{{0.5f}, {1.0f}}});
    k.setValues({{{1.0f}, {2.0f}, {-1.0f}}});
    v.setValues({{{1.0f}, {2.0f}, {3.0f}}});
    attend::sdpa_options o;
    o.need_weights = true;
    o.need_lse = true;
    const auto check = [&](const auto& mask, const char* what) {
        SCOPED_TRACE(what);
        try {
            const auto r = attend::scaled_dot_product_attention(q, k, v, mask, o);
            double sum = 0;
            for (int j = 0; j < 3; ++j) sum += static_cast<double>(r.weights(0, 0, j));
            EXPECT_NEAR(sum, 1.0, 1e-5) << "query 0: every bias is finite, so its weights must sum to 1 (got out "
                                        << r.out(0, 0, 0) << ", lse " << r.lse(0, 0) << ')';
            EXPECT_NE(r.lse(0, 0), -std::numeric_limits<float>::infinity());
        } catch (const attend::mask_error& e) {
            EXPECT_EQ(e.id(), "attend.mask.empty_row");  // reporting the row is the other acceptable answer
        }
    };
    tensor<double, 2> huge(2, 3);
    huge.setValues({{-1e300, -1e300, -1e300}, {0, 0, 0}});
    check(attend::additive_mask<double>::query_key_grid(huge), "additive_mask<double> -1e300 on float inputs");
    tensor<float, 2> lowest(2, 3);
    lowest.setValues({{std::numeric_limits<float>::lowest(), std::numeric_limits<float>::lowest(),
                       std::numeric_limits<float>::lowest()},
                      {0, 0, 0}});
    const auto m = attend::additive_mask<float>::query_key_grid(lowest);
    check(m + m, "two additive_mask<float> of lowest() added");
}

}  // namespace
