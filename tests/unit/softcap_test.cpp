// SPDX-License-Identifier: MIT
// Logit soft-capping (sdpa_options::softcap): the scaled scores s become c tanh(s / c) before score_bias and the
// mask are added (ONNX Attention's order). Proven against the definition evaluated in long double, by finite
// differences for the backward, and on its error path.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <attend/attend.hpp>

#include "support/errors.hpp"
#include "support/finite_differences.hpp"
#include "support/random.hpp"
#include "support/scalar_names.hpp"
#include "support/soft_cap_check.hpp"

namespace {

using attend::alignment;
using attend::index_t;
using ld = long double;

/// q `[batch, heads, query_len, head_dim]` with scores large enough for the cap to bend them, k and v
/// `[batch, kv_heads, key_len, head_dim]`, ALiBi bottom-right, causal bottom-right with key padding.
template <class T>
struct softcap_case {
    index_t batch = 2, heads = 4, kv_heads = 2, query_len = 37, key_len = 53, dim = 16;
    attend::tensor<T, 4> q, k, v;
    attend::sdpa_options options;
    std::vector<index_t> key_lengths{53, 40};

    explicit softcap_case(std::uint64_t seed) {
        q = attend_test::random_tensor<T>(seed, batch, heads, query_len, dim) * T(3);
        k = attend_test::random_tensor<T>(seed + 1, batch, kv_heads, key_len, dim) * T(3);
        v = attend_test::random_tensor<T>(seed + 2, batch, kv_heads, key_len, dim);
        options.softcap = 2.5;
        options.need_lse = true;
        options.score_bias = attend::score_bias::alibi(attend::alibi_slopes(heads), alignment::bottom_right);
    }
    auto mask() const { return attend::causal(alignment::bottom_right) && attend::key_padding(key_lengths); }
};

template <class T>
class Softcap : public ::testing::Test {};
TYPED_TEST_SUITE(Softcap, attend_test::scalar_types, attend_test::scalar_names);

TYPED_TEST(Softcap, ForwardOfBothKernelsEqualsTheDefinitionInLongDouble) {
    using T = TypeParam;
    const softcap_case<T> c(5);
    const auto shape = attend::detail::check_views(attend::detail::as_view(c.q), attend::detail::as_view(c.k),
                                                   attend::detail::as_view(c.v));
    const auto bound = c.mask().bind(shape);
    const double scale = 1 / std::sqrt(static_cast<double>(c.dim)), cap = *c.options.softcap;
    const double tolerance = std::is_same_v<T, float> ? 2e-5 : 1e-12;
    std::vector<attend::attention_result<T, 4>> results;
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled})
        for (const int threads : {1, 2}) {
            auto o = c.options;
            o.kernel = kernel;
            o.threads = threads;
            results.push_back(attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o));
        }
    bool bent = false;  // some score changed by more than 10 % under the cap: the case tests the cap
    for (index_t b = 0; b < c.batch; ++b)
        for (index_t h = 0; h < c.heads; ++h)
            for (index_t i = 0; i < c.query_len; ++i) {
                const index_t kvh = h / (c.heads / c.kv_heads);
                std::vector<ld> s(static_cast<std::size_t>(c.key_len), -std::numeric_limits<ld>::infinity());
                ld max = -std::numeric_limits<ld>::infinity();
                for (index_t j = 0; j < c.key_len; ++j) {
                    if (!bound.allowed(b, h, i, j)) continue;
                    ld dot = 0;
                    for (index_t d = 0; d < c.dim; ++d)
                        dot += static_cast<ld>(c.q(b, h, i, d)) * static_cast<ld>(c.k(b, kvh, j, d));
                    const ld scaled = static_cast<ld>(scale) * dot;
                    const ld capped = static_cast<ld>(cap) * std::tanh(scaled / static_cast<ld>(cap));
                    bent = bent || std::abs(capped) < 0.9L * std::abs(scaled);
                    s[static_cast<std::size_t>(j)] =
                        capped + c.options.score_bias.template value<double>(h, i, j, c.query_len, c.key_len);
                    max = std::max(max, s[static_cast<std::size_t>(j)]);
                }
                ld sum = 0;
                for (auto& x : s) sum += x = std::exp(x - max);
                for (const auto& r : results) {
                    for (index_t d = 0; d < c.dim; ++d) {
                        ld want = 0;
                        for (index_t j = 0; j < c.key_len; ++j)
                            want += s[static_cast<std::size_t>(j)] / sum * static_cast<ld>(c.v(b, kvh, j, d));
                        ASSERT_NEAR(static_cast<double>(r.out(b, h, i, d)), static_cast<double>(want), tolerance)
                            << "batch " << b << " head " << h << " query " << i;
                    }
                    ASSERT_NEAR(static_cast<double>(r.lse(b, h, i)), static_cast<double>(max + std::log(sum)),
                                tolerance * 10);
                }
            }
    EXPECT_TRUE(bent);
    // Bit-identical for 1 and 2 threads, as every tiled result.
    EXPECT_TRUE(
        std::equal(results[2].out.data(), results[2].out.data() + results[2].out.size(), results[3].out.data()));
}

TEST(SoftcapBackward, GradientsOfBothKernelsEqualFiniteDifferences) {
    softcap_case<double> c(7);
    c.query_len = 5;
    c.key_len = 6;
    c.dim = 4;
    c.key_lengths = {6, 4};
    c.q = attend_test::random_tensor<double>(8, c.batch, c.heads, c.query_len, c.dim) * 3.0;
    c.k = attend_test::random_tensor<double>(9, c.batch, c.kv_heads, c.key_len, c.dim) * 3.0;
    c.v = attend_test::random_tensor<double>(10, c.batch, c.kv_heads, c.key_len, c.dim);
    c.options.softcap = 0.7;
    const auto w = attend_test::random_tensor<double>(11, c.batch, c.heads, c.query_len, c.dim);
    auto reference = c.options;
    reference.kernel = attend::kernel::reference;
    const auto loss = [&] {
        return attend_test::linear_loss(attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), reference).out,
                                        w);
    };
    const auto fd_q = attend_test::fd_gradient(c.q, loss);
    const auto fd_k = attend_test::fd_gradient(c.k, loss);
    const auto fd_v = attend_test::fd_gradient(c.v, loss);
    attend::tensor<double, 2> bias_gradient[2];
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        auto o = c.options;
        o.kernel = kernel;
        const auto f = attend::scaled_dot_product_attention(c.q, c.k, c.v, c.mask(), o);
        const auto g = attend::scaled_dot_product_attention_backward(c.q, c.k, c.v, c.mask(), f.out, f.lse, w, o);
        attend_test::expect_close_to_fd(g.d_query, fd_q, "dq");
        attend_test::expect_close_to_fd(g.d_key, fd_k, "dk");
        attend_test::expect_close_to_fd(g.d_value, fd_v, "dv");
        bias_gradient[kernel == attend::kernel::tiled] = g.d_score_bias;
    }
    // The bias is added after the cap: its gradient is d loss / d score, not through the tanh slope.
    double worst = 0, scale = 0;
    for (index_t n = 0; n < bias_gradient[0].size(); ++n) {
        worst = std::max(worst, std::abs(bias_gradient[0].data()[n] - bias_gradient[1].data()[n]));
        scale = std::max(scale, std::abs(bias_gradient[0].data()[n]));
    }
    EXPECT_GT(scale, 0);
    EXPECT_LE(worst, 1e-12 * std::max(scale, 1.0));
}

// The kernels' cap (detail::soft_cap) on runs of every length around the packet sizes; the micro-kernel test runs the
// same check once per instruction set.
TYPED_TEST(Softcap, KernelsCapOfEveryRunLengthIsWithinFourEpsilonsOfTheDefinition) {
    attend_test::expect_soft_cap_within_four_epsilons<TypeParam>();
}

TEST(SoftcapErrors, NonPositiveOrNonFiniteCapIsRejectedBeforeAnyWrite) {
    const softcap_case<float> c(3);
    attend::tensor<float, 4> out(c.batch, c.heads, c.query_len, c.dim);
    out.setConstant(42.0f);
    for (const double cap : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                             std::numeric_limits<double>::infinity(), 1e300, 1e-300}) {
        SCOPED_TRACE(cap);
        auto o = c.options;
        o.softcap = cap;
        o.need_lse = false;
        attend_test::expect_error<attend::value_error>(
            [&] { attend::scaled_dot_product_attention_into(c.q, c.k, c.v, c.mask(), o, out); },
            "attend.value.softcap");
        EXPECT_TRUE(std::all_of(out.data(), out.data() + out.size(), [](float x) { return x == 42.0f; }));
    }
    // Multi-head attention checks it as well, through the same options.
    attend::mha_config config;
    config.model_dim = 8;
    config.heads = 2;
    attend::multi_head_attention<double> m(config);
    const auto x = attend_test::random_tensor<double>(1, 1, 3, 8);
    attend::mha_options mo;
    mo.attention.softcap = -2;
    attend_test::expect_error<attend::value_error>([&] { m.forward(x, x, x, mo); }, "attend.value.softcap");
}

}  // namespace
