// SPDX-License-Identifier: MIT
// What attention must not depend on (sdpa.hpp): the K and V of a key a query may not see, and the order of the keys
// (permuted together with their values) or of the queries. The configurations, the oracle, the masks and the
// tolerances are in support/sdpa_properties.hpp.

#include <cstdint>
#include <numeric>
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
using attend_test::near;
using attend_test::rng;

// ---------------------------------------------------------------------------------------------------------------
// Forbidden keys are invisible; permutations
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, ChangingKeyOrValueAtAForbiddenPositionLeavesThatQueryOutputIdentical) {
    using T = TypeParam;
    int protected_rows = 0, exposed_rows_changed = 0;
    const int runs = attend_test::repeat(200);
    for (int n = 0; n < runs; ++n) {
        const config c = random_config(4000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn& bias) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            const index_t b0 = g.uniform_int(0, c.batch - 1), g0 = g.uniform_int(0, c.kv_heads - 1),
                          j0 = g.uniform_int(0, c.key_len - 1);
            auto y = x;
            // Large values: were the key visible, it would dominate the softmax and the output. Half the time the
            // value is huge but finite (1e37 in float, 1e300 in double): a forbidden weight that is merely tiny
            // instead of exactly 0 would then leak into the output.
            const double huge = std::is_same_v<T, float> ? 1e37 : 1e300;
            const bool use_huge = g.bernoulli(0.5);
            for (index_t d = 0; d < c.head_dim; ++d) y.k(b0, g0, j0, d) = static_cast<T>(g.uniform(-40.0, 40.0));
            for (index_t d = 0; d < c.value_dim; ++d)
                y.v(b0, g0, j0, d) =
                    static_cast<T>(use_huge ? (g.bernoulli(0.5) ? huge : -huge) : g.uniform(50.0, 100.0));
            const auto r0 = run(c, x, mask, zero_rows());
            const auto r1 = run(c, y, mask, zero_rows());
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i) {
                        const bool touched = b == b0 && c.kv_head(h) == g0;
                        const bool exposed = touched && bias(b, h, i, j0) != minus_inf;
                        bool changed = false;
                        for (index_t d = 0; d < c.value_dim; ++d) changed |= r0.out(b, h, i, d) != r1.out(b, h, i, d);
                        for (index_t j = 0; j < c.key_len; ++j)
                            changed |= r0.weights(b, h, i, j) != r1.weights(b, h, i, j);
                        changed |= r0.lse(b, h, i) != r1.lse(b, h, i);
                        if (exposed) {
                            exposed_rows_changed += changed ? 1 : 0;
                            EXPECT_TRUE(changed) << "row (" << b << ',' << h << ',' << i << ") sees key " << j0
                                                 << " whose K and V changed, yet its result did not move";
                        } else {
                            protected_rows += touched ? 1 : 0;
                            ASSERT_FALSE(changed) << "row (" << b << ',' << h << ',' << i << ") does not see key " << j0
                                                  << " (or another kv head / batch) but its result changed";
                        }
                    }
        });
    }
    EXPECT_GT(protected_rows, runs);  // as many as the runs made (ATTEND_TEST_REPEAT_SCALE)
    EXPECT_GT(exposed_rows_changed, runs);
}

std::vector<index_t> random_permutation(rng& g, index_t n) {
    std::vector<index_t> p(at(n));
    std::iota(p.begin(), p.end(), index_t(0));
    for (index_t i = n - 1; i > 0; --i) std::swap(p[at(i)], p[at(g.uniform_int(0, i))]);
    return p;
}

/// The grid with its key axis (last) permuted: new[..., j] = old[..., perm[j]].
dense_grid permute_keys(const dense_grid& m, const std::vector<index_t>& perm) {
    dense_grid r = m;
    const std::size_t S = at(m.dims.back());
    for (std::size_t row = 0; row < m.values.size() / S; ++row)
        for (std::size_t j = 0; j < S; ++j) r.values[row * S + j] = m.values[row * S + at(perm[j])];
    return r;
}

/// The grid with its query axis (second to last) permuted; a broadcast query axis (size 1) stays.
dense_grid permute_queries(const dense_grid& m, const std::vector<index_t>& perm) {
    dense_grid r = m;
    const std::size_t L = at(m.dims[m.dims.size() - 2]), S = at(m.dims.back());
    if (L == 1) return r;
    for (std::size_t outer = 0; outer < m.values.size() / (L * S); ++outer)
        for (std::size_t i = 0; i < L; ++i)
            for (std::size_t j = 0; j < S; ++j)
                r.values[(outer * L + i) * S + j] = m.values[(outer * L + at(perm[i])) * S + j];
    return r;
}

TYPED_TEST(SdpaProperty, PermutingKeysTogetherWithValuesLeavesOutputsUnchanged) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(5000 + static_cast<std::uint64_t>(n));
        SCOPED_TRACE(describe(c));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        const auto perm = random_permutation(g, c.key_len);
        auto y = x;
        for (index_t b = 0; b < c.batch; ++b)
            for (index_t h = 0; h < c.kv_heads; ++h)
                for (index_t j = 0; j < c.key_len; ++j) {
                    for (index_t d = 0; d < c.head_dim; ++d) y.k(b, h, j, d) = x.k(b, h, perm[at(j)], d);
                    for (index_t d = 0; d < c.value_dim; ++d) y.v(b, h, j, d) = x.v(b, h, perm[at(j)], d);
                }
        const auto check = [&](const outputs<T>& r0, const outputs<T>& r1, const dense_grid* mask) {
            ASSERT_TRUE(near(r0.out, r1.out, tol_oracle<T>()));
            ASSERT_TRUE(near(r0.lse, r1.lse, tol_oracle<T>()));
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i)
                        for (index_t j = 0; j < c.key_len; ++j) {
                            const double w0 = static_cast<double>(r0.weights(b, h, i, perm[at(j)]));
                            const double w1 = static_cast<double>(r1.weights(b, h, i, j));
                            if (mask && mask->value(b, h, i, perm[at(j)]) == 0.0) {
                                ASSERT_EQ(w1, 0.0);
                            }
                            ASSERT_NEAR(w0, w1, tol_oracle<T>());
                        }
        };
        {
            SCOPED_TRACE("no mask");
            check(run(c, x, attend::no_mask{}), run(c, y, attend::no_mask{}), nullptr);
        }
        {
            SCOPED_TRACE("dense allowed_mask permuted along its key axis");
            const auto m = random_bool_grid(g, c, 0.6, true);
            check(run(c, x, as_allowed(m)), run(c, y, as_allowed(permute_keys(m, perm))), &m);
        }
    }
}

TYPED_TEST(SdpaProperty, PermutingQueriesPermutesOutputs) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(6000 + static_cast<std::uint64_t>(n));
        SCOPED_TRACE(describe(c));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        const auto perm = random_permutation(g, c.query_len);
        auto y = x;
        for (index_t b = 0; b < c.batch; ++b)
            for (index_t h = 0; h < c.heads; ++h)
                for (index_t i = 0; i < c.query_len; ++i)
                    for (index_t d = 0; d < c.head_dim; ++d) y.q(b, h, i, d) = x.q(b, h, perm[at(i)], d);
        const auto check = [&](const outputs<T>& r0, const outputs<T>& r1) {
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i) {
                        const index_t p = perm[at(i)];
                        ASSERT_NEAR(static_cast<double>(r1.lse(b, h, i)), static_cast<double>(r0.lse(b, h, p)),
                                    tol_same<T>() * 10);
                        for (index_t d = 0; d < c.value_dim; ++d)
                            ASSERT_NEAR(static_cast<double>(r1.out(b, h, i, d)),
                                        static_cast<double>(r0.out(b, h, p, d)), tol_same<T>());
                        for (index_t j = 0; j < c.key_len; ++j)
                            ASSERT_NEAR(static_cast<double>(r1.weights(b, h, i, j)),
                                        static_cast<double>(r0.weights(b, h, p, j)), tol_same<T>());
                    }
        };
        {
            SCOPED_TRACE("no mask");
            check(run(c, x, attend::no_mask{}), run(c, y, attend::no_mask{}));
        }
        {
            SCOPED_TRACE("dense allowed_mask permuted along its query axis");
            const auto m = random_bool_grid(g, c, 0.6, true);
            check(run(c, x, as_allowed(m)), run(c, y, as_allowed(permute_queries(m, perm))));
        }
    }
}

}  // namespace
