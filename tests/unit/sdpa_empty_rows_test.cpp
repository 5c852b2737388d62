// SPDX-License-Identifier: MIT
// Rows without an allowed key (sdpa.hpp): under empty_rows::error a mask_error naming the first such row, with
// nothing written; under empty_rows::zero zero output, zero weights and lse -inf; query padding rows, zero under
// either policy. The configurations, the oracle, the masks and the tolerances are in support/sdpa_properties.hpp.

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
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
using attend_test::rng;

// ---------------------------------------------------------------------------------------------------------------
// Empty rows and query padding
// ---------------------------------------------------------------------------------------------------------------

template <class T, int Rank>
bool has_nan(const tensor<T, Rank>& t) {
    for (index_t n = 0; n < t.size(); ++n)
        if (std::isnan(t.data()[n])) return true;
    return false;
}

template <class T, int Rank>
tensor<T, Rank> sentinel_like(const std::array<index_t, Rank>& dims, T value) {
    tensor<T, Rank> t(dims);
    t.setConstant(value);
    return t;
}

template <class T, int Rank>
bool all_equal(const tensor<T, Rank>& t, T value) {
    for (index_t n = 0; n < t.size(); ++n)
        if (!(t.data()[n] == value)) return false;
    return true;
}

TYPED_TEST(SdpaProperty, EmptyRowUnderDefaultPolicyThrowsNamingFirstRowAndWritesNothing) {
    using T = TypeParam;
    const T sentinel = T(-12345.5);
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(12000 + static_cast<std::uint64_t>(n));
        c.rank3 = false;
        SCOPED_TRACE(describe(c));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        // A full [B, H, L, S] grid with every row allowed somewhere, then one or two rows emptied.
        dense_grid m;
        m.dims = {c.batch, c.heads, c.query_len, c.key_len};
        for (index_t e = 0; e < c.batch * c.heads * c.query_len * c.key_len; ++e) m.values.push_back(1.0);
        const index_t b0 = g.uniform_int(0, c.batch - 1), h0 = g.uniform_int(0, c.heads - 1),
                      i0 = g.uniform_int(0, c.query_len - 1);
        for (index_t j = 0; j < c.key_len; ++j) m.values[m.flat(b0, h0, i0, j)] = 0.0;
        // A later row emptied too: the message must still name the first one in (batch, head, query) order.
        const index_t b1 = g.uniform_int(b0, c.batch - 1);
        const index_t h1 = b1 > b0 ? g.uniform_int(0, c.heads - 1) : g.uniform_int(h0, c.heads - 1);
        const index_t i1 = b1 > b0 || h1 > h0 ? g.uniform_int(0, c.query_len - 1) : g.uniform_int(i0, c.query_len - 1);
        for (index_t j = 0; j < c.key_len; ++j) m.values[m.flat(b1, h1, i1, j)] = 0.0;

        auto out = sentinel_like<T, 4>({c.batch, c.heads, c.query_len, c.value_dim}, sentinel);
        auto weights = sentinel_like<T, 4>({c.batch, c.heads, c.query_len, c.key_len}, sentinel);
        auto lse = sentinel_like<T, 3>({c.batch, c.heads, c.query_len}, sentinel);
        try {
            attend::scaled_dot_product_attention_into(x.q, x.k, x.v, as_allowed(m), attend::sdpa_options{}, out,
                                                      weights, lse);
            FAIL() << "row (" << b0 << ',' << h0 << ',' << i0 << ") has no allowed key: expected mask_error";
        } catch (const attend::mask_error& e) {
            const std::string what = e.what();
            EXPECT_EQ(e.id(), "attend.mask.empty_row");
            EXPECT_EQ(what, e.message() + " [attend.mask.empty_row]") << what;
            for (const std::string& part :
                 {"batch " + std::to_string(b0), "head " + std::to_string(h0), "query " + std::to_string(i0)})
                EXPECT_NE(what.find(part), std::string::npos) << "message should name " << part << ": " << what;
        }
        EXPECT_TRUE(all_equal(out, sentinel)) << "out was written before the error";
        EXPECT_TRUE(all_equal(weights, sentinel)) << "weights were written before the error";
        EXPECT_TRUE(all_equal(lse, sentinel)) << "lse was written before the error";
        // The allocating form throws the same.
        EXPECT_THROW((void)run(c, x, as_allowed(m)), attend::mask_error);
    }
}

TYPED_TEST(SdpaProperty, EmptyRowsUnderZeroPolicyGiveZeroOutputZeroWeightsMinusInfLseAndNoNaN) {
    using T = TypeParam;
    int empty = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(13000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        // Sparse masks without the per-row guarantee, or key padding with zero lengths: many empty rows.
        const auto m = random_bool_grid(g, c, 0.15, false);
        std::vector<index_t> lengths;
        for (index_t b = 0; b < c.batch; ++b) lengths.push_back(g.bernoulli(0.5) ? 0 : g.uniform_int(0, c.key_len));
        const auto check = [&](const outputs<T>& r, const bias_fn& bias) {
            ASSERT_FALSE(has_nan(r.out));
            ASSERT_FALSE(has_nan(r.weights));
            ASSERT_FALSE(has_nan(r.lse));
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i) {
                        bool any = false;
                        for (index_t j = 0; j < c.key_len; ++j) any |= bias(b, h, i, j) != minus_inf;
                        if (any) continue;
                        ++empty;
                        ASSERT_EQ(r.lse(b, h, i), -std::numeric_limits<T>::infinity());
                        for (index_t d = 0; d < c.value_dim; ++d) ASSERT_EQ(r.out(b, h, i, d), T(0));
                        for (index_t j = 0; j < c.key_len; ++j) ASSERT_EQ(r.weights(b, h, i, j), T(0));
                    }
            // The other rows are ordinary.
            ASSERT_TRUE(matches_oracle(r, oracle(c, x, default_scale(c), bias), bias, tol_oracle<T>()));
        };
        {
            SCOPED_TRACE(describe(c) + ", sparse dense mask");
            check(run(c, x, as_allowed(m), zero_rows()), boolean_grid_bias(m));
        }
        {
            SCOPED_TRACE(describe(c) + ", key_padding with zero lengths");
            check(run(c, x, attend::key_padding(lengths), zero_rows()),
                  allowed_if([&](index_t b, index_t, index_t, index_t j) { return j < lengths[at(b)]; }));
        }
    }
    EXPECT_GT(empty, 200);
}

TYPED_TEST(SdpaProperty, QueryPaddingRowsAreZeroUnderAnyPolicyAndRealRowsIgnorePaddedQueryContent) {
    using T = TypeParam;
    int padded_rows = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(14000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        std::vector<index_t> q_lengths, k_lengths;
        for (index_t b = 0; b < c.batch; ++b) {
            q_lengths.push_back(g.uniform_int(0, c.query_len));
            // Batches without real queries may have no keys either: their rows are all padding, still no throw.
            k_lengths.push_back(q_lengths.back() == 0 ? 0 : g.uniform_int(1, c.key_len));
        }
        const auto padded = [&](index_t b, index_t i) { return i >= q_lengths[at(b)]; };
        const auto mask = attend::query_padding(q_lengths) && attend::key_padding(k_lengths);
        const bias_fn bias = allowed_if(
            [&](index_t b, index_t, index_t i, index_t j) { return i < q_lengths[at(b)] && j < k_lengths[at(b)]; });
        for (const auto policy : {attend::empty_rows::error, attend::empty_rows::zero}) {
            SCOPED_TRACE(describe(c) + (policy == attend::empty_rows::error ? ", empty_rows::error" : ", zero"));
            attend::sdpa_options o;
            o.empty_rows = policy;
            outputs<T> r;
            ASSERT_NO_THROW(r = run(c, x, mask, o));
            ASSERT_FALSE(has_nan(r.out));
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i) {
                        if (!padded(b, i)) continue;
                        ++padded_rows;
                        ASSERT_EQ(r.lse(b, h, i), -std::numeric_limits<T>::infinity());
                        for (index_t d = 0; d < c.value_dim; ++d) ASSERT_EQ(r.out(b, h, i, d), T(0));
                        for (index_t j = 0; j < c.key_len; ++j) ASSERT_EQ(r.weights(b, h, i, j), T(0));
                    }
            ASSERT_TRUE(matches_oracle(r, oracle(c, x, default_scale(c), bias, padded), bias, tol_oracle<T>()));
            // Rewrite the padded queries with large values: real rows must not move at all.
            auto y = x;
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = q_lengths[at(b)]; i < c.query_len; ++i)
                        for (index_t d = 0; d < c.head_dim; ++d) y.q(b, h, i, d) = static_cast<T>(g.uniform(-50, 50));
            const auto r2 = run(c, y, mask, o);
            ASSERT_TRUE(identical(r.out, r2.out));
            ASSERT_TRUE(identical(r.weights, r2.weights));
            ASSERT_TRUE(identical(r.lse, r2.lse));
        }
    }
    EXPECT_GT(padded_rows, 200);
}

}  // namespace
