// SPDX-License-Identifier: MIT
// The scale and dropout options of scaled_dot_product_attention (sdpa.hpp): scale against a premultiplied query,
// dropout off outside training, kept weights rescaled, never reviving a forbidden key, a pure function of seed and
// position, and unbiased over many seeds. The configurations, the oracle, the masks and the tolerances are in
// support/sdpa_properties.hpp.

#include <cmath>
#include <cstdint>
#include <iostream>
#include <optional>
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
using attend_test::near;
using attend_test::rng;

// ---------------------------------------------------------------------------------------------------------------
// Scale
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, ScaleOptionEqualsPremultiplyingQueryByTheScale) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(11000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        static const index_t square_dims[] = {1, 4, 16, 64};  // 1/sqrt(head_dim) is a power of two
        if (n % 2 == 0) c.head_dim = square_dims[g.uniform_int(0, 3)];
        SCOPED_TRACE(describe(c));
        const auto x = random_inputs<T>(c);
        const auto mask = random_bool_grid(g, c, 0.7, true);
        const auto run_scaled = [&](double factor, std::optional<double> scale) {
            auto y = x;
            for (index_t e = 0; e < y.q.size(); ++e)
                y.q.data()[e] = static_cast<T>(y.q.data()[e] * static_cast<T>(factor));
            attend::sdpa_options o;
            o.scale = scale;
            return run(c, y, as_allowed(mask), o);
        };
        // A power-of-two factor scales exactly, so (s q).k == s (q.k) bit for bit: identical results.
        const double s = std::ldexp(1.0, static_cast<int>(g.uniform_int(-4, 3)));
        {
            SCOPED_TRACE("scale " + std::to_string(s));
            const auto a = run_scaled(1.0, s), b = run_scaled(s, 1.0);
            ASSERT_TRUE(identical(a.out, b.out));
            ASSERT_TRUE(identical(a.weights, b.weights));
            ASSERT_TRUE(identical(a.lse, b.lse));
        }
        // The default is 1/sqrt(head_dim); for square head_dim that is a power of two: identical again.
        const double d = default_scale(c);
        if (std::ldexp(1.0, std::ilogb(d)) == d) {
            SCOPED_TRACE("default scale, head_dim " + std::to_string(c.head_dim));
            const auto a = run_scaled(1.0, std::nullopt), b = run_scaled(d, 1.0);
            ASSERT_TRUE(identical(a.out, b.out));
            ASSERT_TRUE(identical(a.lse, b.lse));
        } else {
            const auto a = run_scaled(1.0, std::nullopt), b = run_scaled(1.0, d);
            ASSERT_TRUE(identical(a.out, b.out)) << "default scale must be 1/sqrt(head_dim)";
        }
        // Any other scale: equal within rounding, and equal to the oracle.
        const double any = g.uniform(0.1, 2.5);
        const auto a = run_scaled(1.0, any);
        ASSERT_TRUE(near(a.out, run_scaled(any, 1.0).out, tol_oracle<T>()));
        ASSERT_TRUE(
            matches_oracle(a, oracle(c, x, any, boolean_grid_bias(mask)), boolean_grid_bias(mask), tol_oracle<T>()));
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------------------------------------------

TYPED_TEST(SdpaProperty, DropoutIsOffOutsideTrainingEvenWithProbabilitySet) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(15000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn&) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            attend::sdpa_options eval = zero_rows(), none = zero_rows();
            eval.dropout.probability = 0.5;
            eval.dropout.seed = c.seed;
            eval.dropout.training = false;
            eval.weights_after_dropout = true;
            const auto a = run(c, x, mask, eval), b = run(c, x, mask, none);
            ASSERT_TRUE(identical(a.out, b.out));
            ASSERT_TRUE(identical(a.weights, b.weights));
            ASSERT_TRUE(identical(a.lse, b.lse));
        });
    }
}

TYPED_TEST(SdpaProperty, TrainingDropoutKeepsScaledProbabilitiesDropsToZeroAndNeverRevivesForbiddenKeys) {
    using T = TypeParam;
    std::int64_t kept = 0, dropped = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(16000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        const double p = g.uniform(0.05, 0.9);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn& bias) {
            SCOPED_TRACE(describe(c) + ", p " + std::to_string(p) + ", mask " + name);
            attend::sdpa_options o = zero_rows();
            o.dropout = {p, c.seed * 7 + 1, true};
            const auto before = run(c, x, mask, o);  // weights: probabilities before dropout
            o.weights_after_dropout = true;
            const auto after = run(c, x, mask, o);
            ASSERT_TRUE(identical(before.out, after.out));
            ASSERT_TRUE(identical(before.lse, after.lse));
            // Probabilities are those of the no-dropout call.
            ASSERT_TRUE(identical(before.weights, run(c, x, mask, zero_rows()).weights));
            const double keep_scale = 1.0 / (1.0 - p);
            for (index_t b = 0; b < c.batch; ++b)
                for (index_t h = 0; h < c.heads; ++h)
                    for (index_t i = 0; i < c.query_len; ++i) {
                        std::vector<double> used(at(c.key_len));
                        for (index_t j = 0; j < c.key_len; ++j) {
                            const double w = static_cast<double>(before.weights(b, h, i, j));
                            const double u = static_cast<double>(after.weights(b, h, i, j));
                            used[at(j)] = u;
                            if (bias(b, h, i, j) == minus_inf) {
                                ASSERT_EQ(u, 0.0) << "forbidden weight revived by dropout at j " << j;
                                continue;
                            }
                            if (u == 0.0) {
                                ++dropped;
                            } else {
                                ++kept;
                                ASSERT_NEAR(u, w * keep_scale, 4 * eps<T>() * w * keep_scale)
                                    << "kept weight must be probability / (1 - p) at j " << j;
                            }
                        }
                        // The output uses exactly the dropped and rescaled weights.
                        for (index_t d = 0; d < c.value_dim; ++d) {
                            double o_expected = 0;
                            for (index_t j = 0; j < c.key_len; ++j)
                                o_expected += used[at(j)] * static_cast<double>(x.v(b, c.kv_head(h), j, d));
                            ASSERT_NEAR(static_cast<double>(after.out(b, h, i, d)), o_expected,
                                        tol_oracle<T>() * keep_scale);
                        }
                    }
        });
    }
    // Both outcomes must be common (the dropped fraction itself is tested in SdpaDropoutStatistics).
    EXPECT_GT(kept, 1000);
    EXPECT_GT(dropped, 1000);
}

TYPED_TEST(SdpaProperty, DropoutIsAPureFunctionOfSeedAndPosition) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(17000 + static_cast<std::uint64_t>(n));
        SCOPED_TRACE(describe(c));
        const auto x = random_inputs<T>(c);
        attend::sdpa_options o;
        o.dropout = {0.5, 1000 + c.seed, true};
        o.weights_after_dropout = true;
        const auto a = run(c, x, attend::no_mask{}, o);
        // Same seed: identical, whatever the thread count or kernel.
        for (const int threads : {1, 2}) {
            attend::sdpa_options t = o;
            t.threads = threads;
            const auto b = run(c, x, attend::no_mask{}, t);
            ASSERT_TRUE(identical(a.out, b.out)) << threads << " threads";
            ASSERT_TRUE(identical(a.weights, b.weights)) << threads << " threads";
        }
        config other_kernel = c;
        other_kernel.kernel = c.kernel == attend::kernel::reference ? attend::kernel::automatic
                                                                    : attend::kernel::reference;
        const auto k2 = run(other_kernel, x, attend::no_mask{}, o);
        for (index_t e = 0; e < a.weights.size(); ++e)
            ASSERT_EQ(a.weights.data()[e] == T(0), k2.weights.data()[e] == T(0)) << "kernels drop different weights";
        // The drop pattern depends on neither the query values nor how many queries the call has: a call with the
        // first half of the query positions, holding other values, drops the same (b, h, i, j).
        config c2 = c;
        c2.query_len = std::max<index_t>(1, c.query_len / 2);
        inputs<T> z{tensor<T, 4>(c.batch, c.heads, c2.query_len, c.head_dim), x.k, x.v};
        attend_test::fill_uniform(z.q, c.seed + 99);
        const auto b = run(c2, z, attend::no_mask{}, o);
        for (index_t bb = 0; bb < c.batch; ++bb)
            for (index_t h = 0; h < c.heads; ++h)
                for (index_t i = 0; i < c2.query_len; ++i)
                    for (index_t j = 0; j < c.key_len; ++j)
                        ASSERT_EQ(a.weights(bb, h, i, j) == T(0), b.weights(bb, h, i, j) == T(0))
                            << "position (" << bb << ',' << h << ',' << i << ',' << j << ')';
    }
    // Another seed, another pattern: with >= 8 positions at p = 0.5, two seeds agree everywhere with odds <= 2^-8
    // per configuration, so at least 90% of the configurations must differ.
    int differ = 0, total = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(17500 + static_cast<std::uint64_t>(n));
        if (c.batch * c.heads * c.query_len * c.key_len < 8) continue;
        const auto x = random_inputs<T>(c);
        attend::sdpa_options o;
        o.dropout = {0.5, 1, true};
        const auto a = run(c, x, attend::no_mask{}, o);
        o.dropout.seed = 2;
        const auto b = run(c, x, attend::no_mask{}, o);
        ++total;
        differ += identical(a.out, b.out) ? 0 : 1;
    }
    ASSERT_GT(total, 0);
    EXPECT_GE(differ * 10, total * 9) << differ << " of " << total << " configurations differ between seeds 1 and 2";
}

// The mean of the dropout output over n seeds estimates the no-dropout output. For one output element,
//   out = sum_j w_j v_j m_j / (1 - p),  m_j ~ Bernoulli(1 - p) independent,
// so E[out] = sum_j w_j v_j and Var[out] = p / (1 - p) * sum_j (w_j v_j)^2 (Var[m_j / (1 - p)] = p / (1 - p)).
// The mean of n independent seeds has variance Var[out] / n; we accept |mean - expected| <= 5 sigma + 1e-9,
// sigma = sqrt(Var[out] / n). Over the ~100 checked elements a false alarm has probability ~100 * 5.7e-7.
// The seeds are fixed, so the outcome is deterministic; it fails if dropout is biased (e.g. no 1/(1-p) rescale,
// which shifts the mean by a factor 1 - p, i.e. by tens of sigma here).
TEST(SdpaDropoutStatistics, MeanOutputOverManySeedsEqualsNoDropoutOutputWithinFiveSigma) {
    config c;
    c.batch = 1;
    c.heads = 2;
    c.kv_heads = 1;
    c.query_len = 5;
    c.key_len = 9;
    c.head_dim = 4;
    c.value_dim = 3;
    c.seed = 77;
    const auto x = random_inputs<double>(c);
    const double p = 0.3;
    const int seeds = 4000;  // fixed, not scaled: the bound depends on it
    const auto plain = run(c, x, attend::causal(attend::alignment::bottom_right));
    std::vector<double> mean(at(plain.out.size()), 0.0);
    attend::sdpa_options o;
    o.dropout.probability = p;
    o.dropout.training = true;
    for (int s = 0; s < seeds; ++s) {
        o.dropout.seed = static_cast<std::uint64_t>(s) * 7919 + 3;
        const auto r = run(c, x, attend::causal(attend::alignment::bottom_right), o);
        for (index_t e = 0; e < r.out.size(); ++e) mean[at(e)] += r.out.data()[e] / seeds;
    }
    double worst_sigmas = 0;
    for (index_t h = 0; h < c.heads; ++h)
        for (index_t i = 0; i < c.query_len; ++i)
            for (index_t d = 0; d < c.value_dim; ++d) {
                double var = 0;
                for (index_t j = 0; j < c.key_len; ++j) {
                    const double wv = plain.weights(0, h, i, j) * x.v(0, 0, j, d);
                    var += p / (1 - p) * wv * wv;
                }
                const double sigma = std::sqrt(var / seeds);
                const double diff =
                    std::abs(mean[at(((h * c.query_len) + i) * c.value_dim + d)] - plain.out(0, h, i, d));
                worst_sigmas = std::max(worst_sigmas, sigma > 0 ? diff / sigma : 0.0);
                EXPECT_LE(diff, 5 * sigma + 1e-9) << "element (" << h << ',' << i << ',' << d << ')';
            }
    RecordProperty("worst_deviation_in_sigmas", std::to_string(worst_sigmas));
    std::cout << "dropout mean over " << seeds << " seeds: worst deviation " << worst_sigmas << " sigma\n";
}

TEST(SdpaDropoutStatistics, DroppedFractionEqualsProbabilityWithinFiveSigma) {
    config c;
    c.batch = 2;
    c.heads = 3;
    c.kv_heads = 3;
    c.query_len = 40;
    c.key_len = 50;
    c.head_dim = 3;
    c.value_dim = 2;
    c.seed = 5;
    const auto x = random_inputs<double>(c);
    for (const double p : {0.1, 0.5, 0.8}) {
        attend::sdpa_options o;
        o.dropout = {p, 42, true};
        o.weights_after_dropout = true;
        const auto r = run(c, x, attend::no_mask{}, o);
        // N = 12000 independent positions; the dropped count is Binomial(N, p): sigma = sqrt(N p (1 - p)).
        const double N = static_cast<double>(r.weights.size());
        double dropped = 0;
        for (index_t e = 0; e < r.weights.size(); ++e) dropped += r.weights.data()[e] == 0.0 ? 1 : 0;
        EXPECT_NEAR(dropped, N * p, 5 * std::sqrt(N * p * (1 - p))) << "p " << p;
    }
}

}  // namespace
