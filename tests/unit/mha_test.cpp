// SPDX-License-Identifier: MIT
// Tests of attend/mha.hpp: nn.MultiheadAttention goldens, the head split (reshape vs transpose), grouped-query
// heads, self vs cross attention, dropout, initialisation, and every error id with nothing computed on error.
#include <attend/mha.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/golden.hpp"
#include "support/mha_golden.hpp"
#include "support/random.hpp"

namespace {

using attend_test::bit_equal;
using attend_test::expect_error;
using attend_test::max_abs_diff;

using attend::index_t;
using attend::tensor;
using attend_test::json;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

template <class T>
tensor<T, 3> random3(std::uint64_t seed, index_t b, index_t l, index_t d) {
    return attend_test::random_tensor<T>(seed, b, l, d);
}

// ---------------------------------------------------------------------------------------------------------
// An independent oracle: nn.MultiheadAttention written with explicit loops, one head at a time, reading head h
// of a projection as rows [h * D, (h + 1) * D) of the weight, i.e. q_h = x W_q[h*D:(h+1)*D]^T + b_q[h*D:(h+1)*D].

struct oracle_options {
    std::function<bool(index_t, index_t, index_t)> allowed;  ///< (batch, query, key); empty = all allowed
    std::optional<attend::rotary_embedding> rotary;
    index_t position_offset = 0;
};

struct oracle_result {
    tensor<double, 3> out;
    tensor<double, 4> head_weights;
};

template <class T>
oracle_result explicit_mha(const attend::multi_head_attention<T>& m, const tensor<T, 3>& query, const tensor<T, 3>& key,
                           const tensor<T, 3>& value, const oracle_options& o = {}) {
    const auto& c = m.config();
    const index_t B = query.dimension(0), L = query.dimension(1), S = key.dimension(1);
    const index_t H = c.heads, G = c.kv_heads, D = m.head_dim(), E = c.model_dim;
    const auto bias = [](const tensor<T, 1>& b, index_t r) { return b.size() ? static_cast<double>(b(r)) : 0.0; };
    const auto project_head = [&](const tensor<T, 3>& x, index_t b, index_t len, const tensor<T, 2>& w,
                                  const tensor<T, 1>& bv, index_t head) {
        tensor<double, 4> y(1, 1, len, D);
        for (index_t i = 0; i < len; ++i)
            for (index_t d = 0; d < D; ++d) {
                double s = bias(bv, head * D + d);
                for (index_t e = 0; e < x.dimension(2); ++e)
                    s += static_cast<double>(x(b, i, e)) * static_cast<double>(w(head * D + d, e));
                y(0, 0, i, d) = s;
            }
        return y;
    };
    tensor<double, 3> concat(B, L, H * D);
    oracle_result r;
    r.head_weights = tensor<double, 4>(B, H, L, S);
    r.head_weights.setZero();
    for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h) {
            const index_t g = h / (H / G);
            auto q = project_head(query, b, L, m.q_weight(), m.q_bias(), h);
            auto k = project_head(key, b, S, m.k_weight(), m.k_bias(), g);
            const auto v = project_head(value, b, S, m.v_weight(), m.v_bias(), g);
            if (o.rotary) {
                o.rotary->apply(q, o.position_offset);
                o.rotary->apply(k, o.position_offset);
            }
            for (index_t i = 0; i < L; ++i) {
                std::vector<double> p(static_cast<std::size_t>(S), -std::numeric_limits<double>::infinity());
                double mx = -std::numeric_limits<double>::infinity();
                for (index_t j = 0; j < S; ++j) {
                    if (o.allowed && !o.allowed(b, i, j)) continue;
                    double s = 0;
                    for (index_t d = 0; d < D; ++d) s += q(0, 0, i, d) * k(0, 0, j, d);
                    p[static_cast<std::size_t>(j)] = s / std::sqrt(static_cast<double>(D));
                    mx = std::max(mx, p[static_cast<std::size_t>(j)]);
                }
                double sum = 0;
                for (auto& x : p) sum += (x = std::exp(x - mx));
                for (index_t d = 0; d < D; ++d) {
                    double acc = 0;
                    for (index_t j = 0; j < S; ++j) acc += p[static_cast<std::size_t>(j)] / sum * v(0, 0, j, d);
                    concat(b, i, h * D + d) = acc;
                }
                for (index_t j = 0; j < S; ++j) r.head_weights(b, h, i, j) = p[static_cast<std::size_t>(j)] / sum;
            }
        }
    r.out = tensor<double, 3>(B, L, E);
    for (index_t b = 0; b < B; ++b)
        for (index_t i = 0; i < L; ++i)
            for (index_t e = 0; e < E; ++e) {
                double s = bias(m.out_bias(), e);
                for (index_t f = 0; f < H * D; ++f) s += concat(b, i, f) * static_cast<double>(m.out_weight()(e, f));
                r.out(b, i, e) = s;
            }
    return r;
}

/// The classic bug: the projected [B, L, H*D] buffer reshaped to [B, H, L, D] without the transpose, and the
/// head outputs [B, H, L, D] reshaped back to [B, L, H*D] the same way. No mask, plain multi-head attention.
template <class T>
tensor<double, 3> reshape_bug_mha(const attend::multi_head_attention<T>& m, const tensor<T, 3>& x) {
    const auto& c = m.config();
    const index_t B = x.dimension(0), L = x.dimension(1), H = c.heads, D = m.head_dim(), E = c.model_dim;
    const auto project = [&](const tensor<T, 2>& w, const tensor<T, 1>& bv) {
        std::vector<double> y(static_cast<std::size_t>(B * L * H * D));
        for (index_t b = 0; b < B; ++b)
            for (index_t i = 0; i < L; ++i)
                for (index_t f = 0; f < H * D; ++f) {
                    double s = bv.size() ? static_cast<double>(bv(f)) : 0.0;
                    for (index_t e = 0; e < E; ++e) s += static_cast<double>(x(b, i, e)) * static_cast<double>(w(f, e));
                    y[static_cast<std::size_t>((b * L + i) * H * D + f)] = s;
                }
        return y;
    };
    const auto q = project(m.q_weight(), m.q_bias()), k = project(m.k_weight(), m.k_bias()),
               v = project(m.v_weight(), m.v_bias());
    const auto at = [&](const std::vector<double>& y, index_t b, index_t h, index_t i, index_t d) {
        return y[static_cast<std::size_t>(((b * H + h) * L + i) * D + d)];  // reshape, no transpose
    };
    std::vector<double> o(static_cast<std::size_t>(B * L * H * D));
    for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h)
            for (index_t i = 0; i < L; ++i) {
                std::vector<double> p(static_cast<std::size_t>(L));
                double mx = -std::numeric_limits<double>::infinity(), sum = 0;
                for (index_t j = 0; j < L; ++j) {
                    double s = 0;
                    for (index_t d = 0; d < D; ++d) s += at(q, b, h, i, d) * at(k, b, h, j, d);
                    p[static_cast<std::size_t>(j)] = s / std::sqrt(static_cast<double>(D));
                    mx = std::max(mx, p[static_cast<std::size_t>(j)]);
                }
                for (auto& s : p) sum += (s = std::exp(s - mx));
                for (index_t d = 0; d < D; ++d) {
                    double acc = 0;
                    for (index_t j = 0; j < L; ++j) acc += p[static_cast<std::size_t>(j)] / sum * at(v, b, h, j, d);
                    o[static_cast<std::size_t>(((b * H + h) * L + i) * D + d)] = acc;
                }
            }
    tensor<double, 3> out(B, L, E);
    for (index_t b = 0; b < B; ++b)
        for (index_t i = 0; i < L; ++i)
            for (index_t e = 0; e < E; ++e) {
                double s = m.out_bias().size() ? static_cast<double>(m.out_bias()(e)) : 0.0;
                for (index_t f = 0; f < H * D; ++f)
                    s += o[static_cast<std::size_t>((b * L + i) * H * D + f)] *
                         static_cast<double>(m.out_weight()(e, f));
                out(b, i, e) = s;
            }
    return out;
}

// ---------------------------------------------------------------------------------------------------------
// PyTorch goldens (tests/data/mha.json)

using attend_test::golden_config;
using attend_test::golden_forward;
using attend_test::golden_parameters;

class MhaGolden : public ::testing::TestWithParam<const char*> {};

TEST_P(MhaGolden, MatchesPyTorchInDouble) {
    const json doc = attend_test::load_golden("mha.json");
    const json& c = attend_test::find_case(doc, GetParam());
    const auto m = attend::multi_head_attention<double>::from_torch(golden_config(c), golden_parameters<double>(c));
    EXPECT_EQ(m.parameter_count(), attend_test::member(c, "parameter_count").get<index_t>());
    EXPECT_EQ(m.packed(), c.at("parameter_names").at(0) == "in_proj_weight");

    const json& outputs = attend_test::member(c, "outputs");
    const auto out = attend_test::to_double<3>(outputs.at("out"), "out");
    const auto averaged = attend_test::to_double<3>(outputs.at("weights_averaged"), "weights_averaged");
    const auto per_head = attend_test::to_double<4>(outputs.at("weights_per_head"), "weights_per_head");

    attend::mha_options options;
    options.attention.need_weights = true;
    const auto avg = golden_forward(m, c, options);
    options.average_weights = false;
    const auto ph = golden_forward(m, c, options);

    EXPECT_EQ(avg.weights_kind, attend::weights_kind::averaged);
    EXPECT_EQ(ph.weights_kind, attend::weights_kind::per_head);
    const double e_out = max_abs_diff(avg.out, out), e_avg = max_abs_diff(avg.averaged_weights(), averaged),
                 e_ph = max_abs_diff(ph.per_head_weights(), per_head);
    std::cout << "  [" << GetParam() << "] max abs error: out " << e_out << ", averaged weights " << e_avg
              << ", per-head weights " << e_ph << '\n';
    EXPECT_LE(e_out, 1e-10);
    EXPECT_LE(e_avg, 1e-10);
    EXPECT_LE(e_ph, 1e-10);
    EXPECT_EQ(avg.head_weights.size(), 0);
    EXPECT_EQ(ph.weights.size(), 0);
    EXPECT_TRUE(bit_equal(avg.out, ph.out));

    // Without need_weights the output is the same and no weights are returned.
    const auto plain = golden_forward(m, c, {});
    EXPECT_TRUE(bit_equal(plain.out, avg.out));
    EXPECT_EQ(plain.weights.size() + plain.head_weights.size(), 0);
    EXPECT_EQ(plain.weights_kind, attend::weights_kind::none);
}

TEST_P(MhaGolden, MatchesPyTorchInFloat) {
    const json doc = attend_test::load_golden("mha.json");
    const json& c = attend_test::find_case(doc, GetParam());
    const auto m = attend::multi_head_attention<float>::from_torch(golden_config(c), golden_parameters<float>(c));
    attend::mha_options options;
    options.attention.need_weights = true;
    const auto r = golden_forward(m, c, options);
    const auto out = attend_test::to_double<3>(attend_test::member(c, "outputs").at("out"), "out");
    const double e = max_abs_diff(r.out, out);
    std::cout << "  [" << GetParam() << "] float max abs error: out " << e << '\n';
    EXPECT_LE(e, 1e-5);
}

TEST_P(MhaGolden, ParametersRoundTripThroughToTorch) {
    const json doc = attend_test::load_golden("mha.json");
    const json& c = attend_test::find_case(doc, GetParam());
    const auto given = golden_parameters<double>(c);
    const auto m = attend::multi_head_attention<double>::from_torch(golden_config(c), given);
    const auto back = m.to_torch();
    EXPECT_TRUE(bit_equal(back.in_proj_weight, given.in_proj_weight));
    EXPECT_TRUE(bit_equal(back.q_proj_weight, given.q_proj_weight));
    EXPECT_TRUE(bit_equal(back.k_proj_weight, given.k_proj_weight));
    EXPECT_TRUE(bit_equal(back.v_proj_weight, given.v_proj_weight));
    EXPECT_TRUE(bit_equal(back.in_proj_bias, given.in_proj_bias));
    EXPECT_TRUE(bit_equal(back.out_proj_weight, given.out_proj_weight));
    EXPECT_TRUE(bit_equal(back.out_proj_bias, given.out_proj_bias));
}

INSTANTIATE_TEST_SUITE_P(Cases, MhaGolden, ::testing::ValuesIn(attend_test::golden_mha_cases));

TEST(MhaGoldenForms, PositionalFromTorchOverloadsAndLengthsMatchTheMaskForms) {
    const json doc = attend_test::load_golden("mha.json");
    {
        const json& c = attend_test::find_case(doc, "cross_attention_L3_S5");
        const auto p = golden_parameters<double>(c);
        const auto m = attend::multi_head_attention<double>::from_torch(
            golden_config(c), p.in_proj_weight, p.in_proj_bias, p.out_proj_weight, p.out_proj_bias);
        const json& in = c.at("inputs");
        const auto q = attend_test::to_double<3>(in.at("query")), k = attend_test::to_double<3>(in.at("key")),
                   v = attend_test::to_double<3>(in.at("value"));
        attend::mha_options o;
        o.key_padding = {5, 2};  // the golden key_padding_mask blocks keys 2.. of batch 1
        const auto r = m.forward(q, k, v, o);
        const double e = max_abs_diff(r.out, attend_test::to_double<3>(c.at("outputs").at("out")));
        std::cout << "  [cross_attention_L3_S5, key padding as lengths] max abs error: out " << e << '\n';
        EXPECT_LE(e, 1e-10);
        o.key_padding = attend::key_padding({5, 2});
        EXPECT_TRUE(bit_equal(m.forward(q, k, v, o).out, r.out));
    }
    {
        const json& c = attend_test::find_case(doc, "kdim5_vdim6");
        const auto p = golden_parameters<double>(c);
        const auto m = attend::multi_head_attention<double>::from_torch(golden_config(c), p.q_proj_weight,
                                                                        p.k_proj_weight, p.v_proj_weight,
                                                                        p.in_proj_bias, p.out_proj_weight,
                                                                        p.out_proj_bias);
        EXPECT_FALSE(m.packed());
        EXPECT_EQ(m.parameter_count(), 248);
        const auto r = golden_forward(m, c, {});
        EXPECT_LE(max_abs_diff(r.out, attend_test::to_double<3>(c.at("outputs").at("out"))), 1e-10);
    }
}

// ---------------------------------------------------------------------------------------------------------
// The head split: reshape vs transpose

TEST(HeadSplit, MatchesAnExplicitPerHeadLoopAndNotAReshape) {
    attend_test::rng g(11);
    for (int rep = 0; rep < attend_test::repeat(12); ++rep) {
        const index_t H = g.uniform_int(2, 4), D = g.uniform_int(1, 5), E = H * D;
        const index_t B = g.uniform_int(1, 3), L = g.uniform_int(2, 7);
        attend::mha_config c{E, H};
        attend::multi_head_attention<double> m(c, 100 + static_cast<std::uint64_t>(rep));
        const auto x = random3<double>(200 + static_cast<std::uint64_t>(rep), B, L, E);
        const auto r = m.forward(x, x, x);
        const auto oracle = explicit_mha(m, x, x, x);
        EXPECT_LE(max_abs_diff(r.out, oracle.out), 1e-12) << "H " << H << " D " << D << " B " << B << " L " << L;
        // The test is sharp: the reshape-without-transpose bug gives a visibly different answer.
        EXPECT_GT(max_abs_diff(reshape_bug_mha(m, x), oracle.out), 1e-3) << "H " << H << " D " << D << " L " << L;
    }
}

TEST(HeadSplit, PerHeadWeightsAreThoseOfEachHeadsOwnRows) {
    attend::multi_head_attention<double> m({6, 3}, 5);
    const auto x = random3<double>(6, 2, 4, 6);
    attend::mha_options o;
    o.attention.need_weights = true;
    o.average_weights = false;
    const auto r = m.forward(x, x, x, o);
    const auto oracle = explicit_mha(m, x, x, x);
    EXPECT_LE(max_abs_diff(r.head_weights, oracle.head_weights), 1e-12);
    // The heads really differ, so a weight tensor with heads permuted would fail.
    double between = 0;
    for (index_t i = 0; i < 4; ++i)
        for (index_t j = 0; j < 4; ++j)
            between = std::max(between, std::abs(r.head_weights(0, 0, i, j) - r.head_weights(0, 1, i, j)));
    EXPECT_GT(between, 1e-3);
}

TEST(CrossAttention, RandomShapesWithKeyAndValueWidthsMatchTheOracle) {
    attend_test::rng g(12);
    for (int rep = 0; rep < attend_test::repeat(10); ++rep) {
        const index_t H = g.uniform_int(1, 4), G = H % 2 == 0 ? g.uniform_int(1, 2) : 1, D = g.uniform_int(1, 4);
        attend::mha_config c;
        c.model_dim = H * D;
        c.heads = H;
        c.kv_heads = G;
        c.key_dim = g.uniform_int(1, 7);
        c.value_dim = g.uniform_int(1, 7);
        c.bias = g.bernoulli(0.5);
        const attend::multi_head_attention<double> m(c, 300 + static_cast<std::uint64_t>(rep));
        const index_t B = g.uniform_int(1, 3), L = g.uniform_int(1, 6), S = g.uniform_int(1, 9);
        const auto q = random3<double>(1000 + static_cast<std::uint64_t>(rep), B, L, c.model_dim);
        const auto k = random3<double>(2000 + static_cast<std::uint64_t>(rep), B, S, c.key_dim);
        const auto v = random3<double>(3000 + static_cast<std::uint64_t>(rep), B, S, c.value_dim);
        std::vector<index_t> lengths;
        for (index_t b = 0; b < B; ++b) lengths.push_back(g.uniform_int(1, S));
        attend::mha_options o;
        o.key_padding = lengths;
        o.attention.need_weights = true;
        o.average_weights = false;
        const auto r = m.forward(q, k, v, o);
        oracle_options oo;
        oo.allowed = [&](index_t b, index_t, index_t j) { return j < lengths[static_cast<std::size_t>(b)]; };
        const auto oracle = explicit_mha(m, q, k, v, oo);
        EXPECT_LE(max_abs_diff(r.out, oracle.out), 1e-12) << "rep " << rep;
        EXPECT_LE(max_abs_diff(r.head_weights, oracle.head_weights), 1e-12) << "rep " << rep;
        EXPECT_EQ(r.out.dimension(1), L);
        EXPECT_EQ(r.head_weights.dimension(3), S);
    }
}

TEST(CrossAttention, SelfAttentionIsCrossAttentionWithTheSameTensor) {
    attend::multi_head_attention<double> m({8, 2}, 3);
    const auto x = random3<double>(4, 2, 5, 8);
    const tensor<double, 3> k = x, v = x;
    const auto causal = attend::causal(attend::alignment::top_left);
    EXPECT_TRUE(bit_equal(m.forward(x, x, x, causal).out, m.forward(x, k, v, causal).out));
    // A TensorMap input reads the same memory, nothing copied.
    const attend::const_tensor_view<double, 3> view(x.data(), 2, 5, 8);
    EXPECT_TRUE(bit_equal(m.forward(view, view, view, causal).out, m.forward(x, x, x, causal).out));
    // Cross-attention with L != S and no causal mask: every query sees every key.
    const auto src = random3<double>(5, 2, 7, 8);
    attend::mha_options o;
    o.attention.need_weights = true;
    const auto r = m.forward(x, src, src, o);
    EXPECT_LE(max_abs_diff(r.out, explicit_mha(m, x, src, src).out), 1e-12);
    for (index_t i = 0; i < 5; ++i)
        for (index_t j = 0; j < 7; ++j) EXPECT_GT(r.weights(1, i, j), 0.0);
}

// ---------------------------------------------------------------------------------------------------------
// Grouped-query and multi-query attention

/// The plain multi-head module that repeats each kv head's rows of Wk, Wv (and biases) for its query heads.
template <class T>
attend::multi_head_attention<T> repeated_kv(const attend::multi_head_attention<T>& gqa) {
    const auto& c = gqa.config();
    const index_t H = c.heads, G = c.kv_heads, D = gqa.head_dim(), group = H / G;
    attend::mha_config full = c;
    full.kv_heads = H;
    auto p = gqa.to_torch();
    if (G == H) return attend::multi_head_attention<T>::from_torch(full, p);
    const auto repeat_rows = [&](const tensor<T, 2>& w) {
        tensor<T, 2> r(H * D, w.dimension(1));
        for (index_t h = 0; h < H; ++h)
            for (index_t d = 0; d < D; ++d)
                for (index_t e = 0; e < w.dimension(1); ++e) r(h * D + d, e) = w((h / group) * D + d, e);
        return r;
    };
    p.k_proj_weight = repeat_rows(p.k_proj_weight);
    p.v_proj_weight = repeat_rows(p.v_proj_weight);
    if (c.bias) {
        tensor<T, 1> b(3 * H * D);
        for (index_t f = 0; f < H * D; ++f) {
            b(f) = gqa.q_bias()(f);
            b(H * D + f) = gqa.k_bias()((f / D / group) * D + f % D);
            b(2 * H * D + f) = gqa.v_bias()((f / D / group) * D + f % D);
        }
        p.in_proj_bias = b;
    }
    return attend::multi_head_attention<T>::from_torch(full, p);
}

/// Non-zero biases, so the bias split under GQA is exercised too.
template <class T>
attend::multi_head_attention<T> with_random_biases(const attend::multi_head_attention<T>& m, std::uint64_t seed) {
    auto p = m.to_torch();
    attend_test::fill_uniform(p.in_proj_bias, seed);
    attend_test::fill_uniform(p.out_proj_bias, seed + 1);
    return attend::multi_head_attention<T>::from_torch(m.config(), p);
}

TEST(GroupedQuery, EqualsPlainAttentionWithRepeatedKeyValueWeights) {
    for (const index_t G : {1, 2, 3, 6}) {  // 1 = multi-query, 6 = plain multi-head
        attend::mha_config c{12, 6, G};
        const auto m = with_random_biases(attend::multi_head_attention<double>(c, 40), 41);
        EXPECT_EQ(m.k_weight().dimension(0), G * 2);
        EXPECT_EQ(m.parameter_count(), 12 * 12 * 2 + 2 * G * 2 * 12 + 12 + 2 * G * 2 + 12);
        const auto full = repeated_kv(m);
        const auto x = random3<double>(42, 2, 5, 12), src = random3<double>(43, 2, 6, 12);
        attend::mha_options o;
        o.attention.need_weights = true;
        o.average_weights = false;
        o.key_padding = {6, 4};
        const auto a = m.forward(x, src, src, o), b = full.forward(x, src, src, o);
        EXPECT_LE(max_abs_diff(a.out, b.out), 1e-12) << "kv_heads " << G;
        EXPECT_LE(max_abs_diff(a.head_weights, b.head_weights), 1e-12) << "kv_heads " << G;
        const auto causal = attend::causal(attend::alignment::top_left);
        EXPECT_LE(max_abs_diff(m.forward(x, x, x, causal).out, full.forward(x, x, x, causal).out), 1e-12);
    }
}

TEST(GroupedQuery, IsNotPackedLikePyTorchAndLoadsSeparateWeights) {
    const attend::multi_head_attention<float> m({8, 4, 2}, 1);
    EXPECT_FALSE(m.packed());
    const auto p = m.to_torch();
    EXPECT_EQ(p.in_proj_weight.size(), 0);
    EXPECT_EQ(p.k_proj_weight.dimension(0), 4);
    EXPECT_EQ(p.in_proj_bias.size(), 8 + 4 + 4);
    const auto again = attend::multi_head_attention<float>::from_torch(m.config(), p);
    EXPECT_TRUE(bit_equal(again.k_weight(), m.k_weight()));
}

// ---------------------------------------------------------------------------------------------------------
// Masks, padding and rotary

TEST(Masks, KeyPaddingAsForbiddenMaskEqualsLengthsAndAnyPaddedContent) {
    attend::multi_head_attention<double> m({8, 2}, 7);
    const auto x = random3<double>(8, 2, 4, 8);
    auto src = random3<double>(9, 2, 6, 8);
    tensor<bool, 2> kpm(2, 6);
    for (index_t b = 0; b < 2; ++b)
        for (index_t j = 0; j < 6; ++j) kpm(b, j) = j >= (b == 0 ? 6 : 3);
    attend::mha_options by_mask, by_lengths;
    by_mask.key_padding = attend::forbidden_mask::key_padding(kpm);
    by_lengths.key_padding = {6, 3};
    const auto a = m.forward(x, src, src, by_mask);
    EXPECT_TRUE(bit_equal(a.out, m.forward(x, src, src, by_lengths).out));
    // What the padded keys hold cannot matter.
    for (index_t j = 3; j < 6; ++j)
        for (index_t e = 0; e < 8; ++e) src(1, j, e) = 1e3 * static_cast<double>(e + j);
    EXPECT_TRUE(bit_equal(a.out, m.forward(x, src, src, by_mask).out));
}

TEST(Masks, KeyPaddingCombinesWithAnAdditiveMask) {
    attend::multi_head_attention<double> m({4, 2}, 7);
    const auto x = random3<double>(8, 2, 3, 4);
    tensor<double, 2> bias(3, 3);
    attend_test::fill_uniform(bias, 9);
    bias(0, 2) = -std::numeric_limits<double>::infinity();
    attend::mha_options o;
    o.key_padding = {3, 2};
    o.attention.need_weights = true;
    const auto r = m.forward(x, x, x, attend::additive_mask<double>::query_key_grid(bias), o);
    EXPECT_EQ(r.weights(0, 0, 2), 0.0);
    EXPECT_EQ(r.weights(1, 1, 2), 0.0);
    EXPECT_GT(r.weights(0, 1, 2), 0.0);
}

TEST(Masks, PaddedQueriesAreZeroAndRealOnesIgnoreThePadding) {
    attend::multi_head_attention<double> m({8, 2}, 17);
    auto x = random3<double>(18, 2, 5, 8);
    const std::vector<index_t> lengths{5, 3};
    attend::mha_options o;
    o.key_padding = lengths;
    o.attention.need_weights = true;
    const auto qp = attend::query_padding(lengths);
    const auto a = m.forward(x, x, x, qp, o);
    for (index_t i = 3; i < 5; ++i)
        for (index_t e = 0; e < 8; ++e) EXPECT_EQ(a.out(1, i, e), 0.0);
    for (index_t i = 3; i < 5; ++i)
        for (index_t j = 0; j < 5; ++j) EXPECT_EQ(a.weights(1, i, j), 0.0);
    for (index_t i = 0; i < 3; ++i)
        for (index_t j = 3; j < 5; ++j) EXPECT_EQ(a.weights(1, i, j), 0.0);
    for (index_t i = 3; i < 5; ++i)
        for (index_t e = 0; e < 8; ++e) x(1, i, e) = -50.0 + static_cast<double>(i * e);
    const auto b = m.forward(x, x, x, qp, o);
    EXPECT_TRUE(bit_equal(a.out, b.out));
}

TEST(Masks, AllKeysBlockedIsAnErrorOrZeroByPolicy) {
    attend::multi_head_attention<double> m({4, 2}, 7);
    const auto x = random3<double>(8, 1, 3, 4);
    attend::mha_options o;
    o.key_padding = {0};
    expect_error<attend::mask_error>([&] { m.forward(x, x, x, o); }, "attend.mask.empty_row");
    o.attention.empty_rows = attend::empty_rows::zero;
    o.attention.need_weights = true;
    const auto r = m.forward(x, x, x, o);
    for (index_t n = 0; n < r.weights.size(); ++n) EXPECT_EQ(r.weights.data()[n], 0.0);
    for (index_t n = 0; n < r.out.size(); ++n) EXPECT_TRUE(std::isfinite(r.out.data()[n]));
}

TEST(Rotary, RotatesEachHeadOfQAndKAtItsPosition) {
    for (const auto layout : {attend::rotary_layout::half_split, attend::rotary_layout::interleaved}) {
        attend::multi_head_attention<double> m({12, 2, 1}, 21);  // head_dim 6, multi-query
        const auto x = random3<double>(22, 2, 5, 12);
        attend::mha_options o;
        o.rotary = attend::rotary_embedding{4, 10000, layout};
        o.position_offset = 3;
        const auto causal = attend::causal(attend::alignment::top_left);
        const auto r = m.forward(x, x, x, causal, o);
        oracle_options oo;
        oo.rotary = o.rotary;
        oo.position_offset = 3;
        oo.allowed = [](index_t, index_t i, index_t j) { return j <= i; };
        EXPECT_LE(max_abs_diff(r.out, explicit_mha(m, x, x, x, oo).out), 1e-12);
        // Rotary scores depend on relative positions only: a shift of every position changes nothing.
        o.position_offset = 40;
        EXPECT_LE(max_abs_diff(m.forward(x, x, x, causal, o).out, r.out), 1e-12);
        // And it does change the result compared to no rotary.
        EXPECT_GT(max_abs_diff(m.forward(x, x, x, causal).out, r.out), 1e-6);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Dropout

TEST(Dropout, EvalIsBitIdenticalToNoDropout) {
    const auto m = with_random_biases(attend::multi_head_attention<float>({8, 2}, 51), 52);
    const auto x = attend_test::random_tensor<float>(53, 2, 6, 8);
    attend::mha_options none, dropping;
    none.attention.need_weights = dropping.attention.need_weights = true;
    dropping.attention.dropout = {0.5, 99, false};
    const auto a = m.forward(x, x, x, none), b = m.forward(x, x, x, dropping);
    EXPECT_TRUE(bit_equal(a.out, b.out));
    EXPECT_TRUE(bit_equal(a.weights, b.weights));
    // training with probability 0 drops nothing either.
    none.attention.dropout.training = true;
    EXPECT_TRUE(bit_equal(m.forward(x, x, x, none).out, a.out));
}

TEST(Dropout, TrainingUsesTheSeedDeterministically) {
    const attend::multi_head_attention<double> m({8, 2}, 61);
    const auto x = random3<double>(62, 2, 6, 8);
    attend::mha_options o;
    o.attention.dropout.probability = 0.3;
    o.attention.dropout.training = true;
    o.attention.dropout.seed = 5;
    o.attention.need_weights = true;
    o.average_weights = false;
    o.attention.weights_after_dropout = true;
    const auto a = m.forward(x, x, x, o), b = m.forward(x, x, x, o);
    EXPECT_TRUE(bit_equal(a.out, b.out));
    EXPECT_TRUE(bit_equal(a.head_weights, b.head_weights));
    o.attention.threads = 1;
    EXPECT_TRUE(bit_equal(m.forward(x, x, x, o).out, a.out));
    o.attention.dropout.seed = 6;
    EXPECT_GT(max_abs_diff(m.forward(x, x, x, o).out, a.out), 1e-6);
    attend::mha_options eval;
    eval.attention.need_weights = true;
    eval.average_weights = false;
    const auto e = m.forward(x, x, x, eval);
    EXPECT_GT(max_abs_diff(e.out, a.out), 1e-6);
    // Dropped weights are exactly 0, kept ones are the probability scaled by 1 / (1 - p).
    int dropped = 0;
    for (index_t n = 0; n < a.head_weights.size(); ++n) {
        const double w = a.head_weights.data()[n], p = e.head_weights.data()[n];
        if (w == 0) ++dropped;
        else EXPECT_NEAR(w, p / 0.7, 1e-14);
    }
    EXPECT_GT(dropped, 0);
}

TEST(Dropout, MeanOverSeedsApproachesTheEvalOutput) {
    // Attention output and out-projection are linear in the weights, and E[dropped weight] = weight, so the mean
    // over N seeds estimates the eval output with a standard error sigma / sqrt(N) per element. The bound is
    // 5 standard errors of the sample itself (plus rounding), per element: a biased rescaling (e.g. no
    // 1 / (1 - p)) misses it by far more.
    const auto m = with_random_biases(attend::multi_head_attention<double>({8, 2}, 71), 72);
    const auto x = random3<double>(73, 2, 5, 8);
    const auto reference = m.forward(x, x, x).out;
    const int n = attend_test::repeat(2000);
    std::vector<double> sum(static_cast<std::size_t>(reference.size()), 0.0), sum_sq(sum.size(), 0.0);
    attend::mha_options o;
    o.attention.dropout.probability = 0.25;
    o.attention.dropout.training = true;
    for (int s = 0; s < n; ++s) {
        o.attention.dropout.seed = static_cast<std::uint64_t>(1000 + s);
        const auto r = m.forward(x, x, x, o);
        for (index_t k = 0; k < r.out.size(); ++k) {
            sum[static_cast<std::size_t>(k)] += r.out.data()[k];
            sum_sq[static_cast<std::size_t>(k)] += r.out.data()[k] * r.out.data()[k];
        }
    }
    double worst = 0;
    for (std::size_t k = 0; k < sum.size(); ++k) {
        const double mean = sum[k] / n;
        const double var = std::max(0.0, sum_sq[k] / n - mean * mean) * n / (n - 1);
        const double bound = 5.0 * std::sqrt(var / n) + 1e-12;
        const double err = std::abs(mean - reference.data()[k]);
        worst = std::max(worst, err / bound);
        EXPECT_LE(err, bound) << "element " << k;
    }
    std::cout << "  dropout mean over " << n << " seeds: worst |mean - eval| / (5 standard errors) = " << worst << '\n';
}

// ---------------------------------------------------------------------------------------------------------
// Initialisation

template <class T>
void expect_uniform(const tensor<T, 2>& w, double bound, const char* what) {
    double sum = 0, sum_sq = 0, largest = 0;
    for (index_t k = 0; k < w.size(); ++k) {
        const double x = w.data()[k];
        sum += x;
        sum_sq += x * x;
        largest = std::max(largest, std::abs(x));
    }
    const double n = static_cast<double>(w.size());
    EXPECT_LE(largest, static_cast<double>(static_cast<T>(bound))) << what;
    EXPECT_GT(largest, 0.9 * bound) << what;  // the whole range is used
    // U(-a, a): mean 0, variance a^2 / 3; 5 standard errors of each estimate.
    EXPECT_LE(std::abs(sum / n), 5 * bound / std::sqrt(3 * n)) << what;
    EXPECT_NEAR(sum_sq / n, bound * bound / 3, 5 * bound * bound * std::sqrt(4.0 / 45.0 / n)) << what;
}

TEST(Init, PackedXavierLikePyTorch) {
    const index_t E = 32;
    const attend::multi_head_attention<double> m({E, 4}, 123);
    EXPECT_TRUE(m.packed());
    const auto p = m.to_torch();
    expect_uniform(p.in_proj_weight, std::sqrt(6.0 / (E + 3 * E)), "in_proj_weight");  // xavier on [3E, E]
    expect_uniform(m.out_weight(), 1 / std::sqrt(static_cast<double>(E)), "out_proj.weight");
    for (index_t k = 0; k < p.in_proj_bias.size(); ++k) EXPECT_EQ(p.in_proj_bias(k), 0.0);
    for (index_t k = 0; k < p.out_proj_bias.size(); ++k) EXPECT_EQ(p.out_proj_bias(k), 0.0);
    EXPECT_EQ(m.parameter_count(), 4 * E * E + 4 * E);
    // q, k and v are different slices of one draw.
    EXPECT_GT(max_abs_diff(m.q_weight(), m.k_weight()), 1e-3);
    EXPECT_GT(max_abs_diff(m.k_weight(), m.v_weight()), 1e-3);
}

TEST(Init, SeparateXavierPerWeightAndDeterministicSeeds) {
    attend::mha_config c;
    c.model_dim = 24;
    c.heads = 4;
    c.key_dim = 40;
    c.value_dim = 10;
    const attend::multi_head_attention<float> m(c, 9);
    EXPECT_FALSE(m.packed());
    expect_uniform(m.q_weight(), std::sqrt(6.0 / (24 + 24)), "q_proj_weight");
    expect_uniform(m.k_weight(), std::sqrt(6.0 / (24 + 40)), "k_proj_weight");
    expect_uniform(m.v_weight(), std::sqrt(6.0 / (24 + 10)), "v_proj_weight");
    expect_uniform(m.out_weight(), 1 / std::sqrt(24.0), "out_proj.weight");
    EXPECT_EQ(m.parameter_count(), 24 * 24 + 24 * 40 + 24 * 10 + 24 * 24 + 3 * 24 + 24);  // PyTorch's count
    const attend::multi_head_attention<float> same(c, 9), other(c, 10);
    EXPECT_TRUE(bit_equal(m.q_weight(), same.q_weight()));
    EXPECT_TRUE(bit_equal(m.out_weight(), same.out_weight()));
    EXPECT_FALSE(bit_equal(m.q_weight(), other.q_weight()));
    attend::mha_config nb{8, 2};
    nb.bias = false;
    const attend::multi_head_attention<float> no_bias(nb);
    EXPECT_EQ(no_bias.parameter_count(), 4 * 64);
    EXPECT_EQ(no_bias.q_bias().size() + no_bias.out_bias().size(), 0);
    EXPECT_EQ(no_bias.to_torch().in_proj_bias.size(), 0);
}

TEST(Init, ConfigDefaultsResolve) {
    const attend::multi_head_attention<double> m({8, 2});
    EXPECT_EQ(m.config().kv_heads, 2);
    EXPECT_EQ(m.config().key_dim, 8);
    EXPECT_EQ(m.config().value_dim, 8);
    EXPECT_EQ(m.head_dim(), 4);
}

// ---------------------------------------------------------------------------------------------------------
// Errors: type, id, and nothing computed

TEST(Errors, Constructor) {
    using attend::mha_config;
    const auto make = [](mha_config c) { return [c] { attend::multi_head_attention<double> m(c); }; };
    auto msg = expect_error<attend::shape_error>(make({10, 4}), "attend.shape.model_dim_heads");
    EXPECT_TRUE(contains(msg, "model_dim 10")) << msg;
    EXPECT_TRUE(contains(msg, "heads 4")) << msg;
    msg = expect_error<attend::shape_error>(make({12, 6, 4}), "attend.shape.gqa");
    EXPECT_TRUE(contains(msg, "kv_heads 4")) << msg;
    expect_error<attend::shape_error>(make({12, 2, 4}), "attend.shape.gqa");  // kv_heads > heads
    expect_error<attend::value_error>(make({0, 1}), "attend.value.size");
    expect_error<attend::value_error>(make({8, 0}), "attend.value.size");
    expect_error<attend::value_error>(make({8, 2, -1}), "attend.value.size");
    mha_config neg{8, 2};
    neg.key_dim = -3;
    expect_error<attend::value_error>(make(neg), "attend.value.size");
}

TEST(Errors, FromTorchNamesTheParameterAndBothShapes) {
    using P = attend::torch_mha_parameters<double>;
    const attend::mha_config c{8, 2};
    const P good = attend::multi_head_attention<double>(c, 1).to_torch();
    const auto load = [&](const attend::mha_config& config, const P& p) {
        return [config, p] { attend::multi_head_attention<double>::from_torch(config, p); };
    };
    P p = good;
    p.in_proj_weight = tensor<double, 2>(20, 8);
    auto msg = expect_error<attend::shape_error>(load(c, p), "attend.shape.torch_weight");
    EXPECT_TRUE(contains(msg, "in_proj_weight [20,8]")) << msg;
    EXPECT_TRUE(contains(msg, "[24,8]")) << msg;
    p = good;
    p.out_proj_weight = tensor<double, 2>(8, 7);
    msg = expect_error<attend::shape_error>(load(c, p), "attend.shape.torch_weight");
    EXPECT_TRUE(contains(msg, "out_proj.weight [8,7]") && contains(msg, "[8,8]")) << msg;
    p = good;
    p.in_proj_bias = tensor<double, 1>(16);
    msg = expect_error<attend::shape_error>(load(c, p), "attend.shape.torch_weight");
    EXPECT_TRUE(contains(msg, "in_proj_bias [16]") && contains(msg, "[24]")) << msg;
    p = good;
    p.out_proj_bias = tensor<double, 1>();
    msg = expect_error<attend::shape_error>(load(c, p), "attend.shape.torch_weight");
    EXPECT_TRUE(contains(msg, "out_proj.bias") && contains(msg, "missing")) << msg;
    p = good;
    p.q_proj_weight = tensor<double, 2>(8, 8);
    msg = expect_error<attend::shape_error>(load(c, p), "attend.shape.torch_weight");
    EXPECT_TRUE(contains(msg, "both")) << msg;
    // kdim != embed_dim: PyTorch has no packed weight, so a packed one is refused and the separate ones asked for.
    attend::mha_config kc{8, 2};
    kc.key_dim = 5;
    msg = expect_error<attend::shape_error>(load(kc, good), "attend.shape.torch_weight");
    EXPECT_TRUE(contains(msg, "in_proj_weight [24,8]") && contains(msg, "k_proj_weight [8,5]")) << msg;
    P sep;
    sep.q_proj_weight = tensor<double, 2>(8, 8);
    sep.k_proj_weight = tensor<double, 2>(8, 8);  // should be [8, 5]
    sep.v_proj_weight = tensor<double, 2>(8, 8);
    sep.in_proj_bias = good.in_proj_bias;
    sep.out_proj_weight = good.out_proj_weight;
    sep.out_proj_bias = good.out_proj_bias;
    msg = expect_error<attend::shape_error>(load(kc, sep), "attend.shape.torch_weight");
    EXPECT_TRUE(contains(msg, "k_proj_weight [8,8]") && contains(msg, "[8,5]")) << msg;
    // bias = false with biases given.
    attend::mha_config nb{8, 2};
    nb.bias = false;
    msg = expect_error<attend::shape_error>(load(nb, good), "attend.shape.torch_weight");
    EXPECT_TRUE(contains(msg, "in_proj_bias [24]")) << msg;
    // The constructor's checks come first.
    expect_error<attend::shape_error>(load({9, 2}, good), "attend.shape.model_dim_heads");
}

TEST(Errors, ForwardShapes) {
    attend::mha_config c{8, 2};
    c.key_dim = 5;
    c.value_dim = 6;
    const attend::multi_head_attention<double> m(c, 3);
    const auto q = random3<double>(1, 2, 3, 8), k = random3<double>(2, 2, 4, 5), v = random3<double>(3, 2, 4, 6);
    EXPECT_NO_THROW(m.forward(q, k, v));
    auto msg = expect_error<attend::shape_error>([&] { m.forward(random3<double>(1, 2, 3, 7), k, v); },
                                                 "attend.shape.model_dim");
    EXPECT_TRUE(contains(msg, "query") && contains(msg, "[2,3,7]") && contains(msg, "[2,3,8]")) << msg;
    msg = expect_error<attend::shape_error>([&] { m.forward(q, random3<double>(2, 2, 4, 8), v); },
                                            "attend.shape.model_dim");
    EXPECT_TRUE(contains(msg, "key") && contains(msg, "key_dim 5") && contains(msg, "[2,4,8]")) << msg;
    msg = expect_error<attend::shape_error>([&] { m.forward(q, k, random3<double>(3, 2, 4, 5)); },
                                            "attend.shape.model_dim");
    EXPECT_TRUE(contains(msg, "value") && contains(msg, "value_dim 6") && contains(msg, "[2,4,5]")) << msg;
    msg =
        expect_error<attend::shape_error>([&] { m.forward(q, random3<double>(2, 3, 4, 5), v); }, "attend.shape.batch");
    EXPECT_TRUE(contains(msg, "[3,4,5]")) << msg;
    msg = expect_error<attend::shape_error>([&] { m.forward(q, k, random3<double>(3, 2, 5, 6)); },
                                            "attend.shape.key_len");
    EXPECT_TRUE(contains(msg, "[2,4,5]") && contains(msg, "[2,5,6]")) << msg;
    expect_error<attend::shape_error>([&] { m.forward(q, tensor<double, 3>(2, 0, 5), tensor<double, 3>(2, 0, 6)); },
                                      "attend.shape.empty_keys");
    // Zero queries is an empty result, not an error.
    EXPECT_EQ(m.forward(tensor<double, 3>(2, 0, 8), k, v).out.size(), 0);
}

TEST(Errors, ForwardMasksOptionsAndValues) {
    const attend::multi_head_attention<double> m({8, 2}, 3);
    const auto x = random3<double>(1, 2, 3, 8);
    attend::mha_options o;
    o.key_padding = {3};
    expect_error<attend::mask_error>([&] { m.forward(x, x, x, o); }, "attend.mask.lengths_batch");
    o.key_padding = {3, 4};
    expect_error<attend::mask_error>([&] { m.forward(x, x, x, o); }, "attend.mask.length_range");
    o.key_padding = attend::forbidden_mask::key_padding(tensor<bool, 2>(3, 2).setConstant(false));
    auto msg = expect_error<attend::mask_error>([&] { m.forward(x, x, x, o); }, "attend.mask.key_padding_shape");
    EXPECT_TRUE(contains(msg, "[3,2]") && contains(msg, "[2,3]")) << msg;
    o.key_padding = {};
    expect_error<attend::mask_error>(
        [&] { m.forward(x, x, x, attend::allowed_mask::query_key_grid(tensor<bool, 2>(4, 3).setConstant(true))); },
        "attend.mask.broadcast");
    o.rotary = attend::rotary_embedding{6};  // head_dim is 4
    expect_error<attend::shape_error>([&] { m.forward(x, x, x, o); }, "attend.shape.rotary_dim");
    o.rotary = attend::rotary_embedding{4};
    o.position_offset = -1;
    expect_error<attend::position_error>([&] { m.forward(x, x, x, o); }, "attend.position.negative_offset");
    o.rotary.reset();
    expect_error<attend::position_error>([&] { m.forward(x, x, x, o); }, "attend.position.negative_offset");
    o.position_offset = 0;
    o.attention.scale = -1.0;
    expect_error<attend::value_error>([&] { m.forward(x, x, x, o); }, "attend.value.scale");
    o.attention.scale.reset();
    o.attention.dropout.probability = -0.1;
    expect_error<attend::value_error>([&] { m.forward(x, x, x, o); }, "attend.value.dropout");
    o.attention.dropout.probability = 0;
    o.attention.sinks = attend::attention_sinks{0.0, 0.0};
    msg = expect_error<attend::value_error>([&] { m.forward(x, x, x, o); }, "attend.value.layer_sinks");
    EXPECT_TRUE(contains(msg, "with_sinks(true)")) << msg;
    o.attention.sinks = {};
    auto bad = x;
    bad(1, 2, 5) = std::numeric_limits<double>::quiet_NaN();
    msg = expect_error<attend::value_error>([&] { m.forward(x, bad, x); }, "attend.value.non_finite");
    EXPECT_TRUE(contains(msg, "key") && contains(msg, "[1,2,5]")) << msg;
    attend::mha_options unchecked;
    unchecked.attention.check_finite = false;
    EXPECT_NO_THROW(m.forward(x, bad, x, unchecked));
}

// ---------------------------------------------------------------------------------------------------------
// The API as a newcomer writes it: named config, both PyTorch masks through one wrapper, weights that say their kind

TEST(NamedConfig, SettersNameEveryFieldAndMatchThePositionalSpelling) {
    const auto named = attend::mha_config{}
                           .with_model_dim(16)
                           .with_heads(4)
                           .with_kv_heads(2)
                           .with_key_dim(12)
                           .with_value_dim(10)
                           .with_bias(false);
    const attend::mha_config positional{16, 4, 2, 12, 10, false};
    EXPECT_EQ(named.model_dim, positional.model_dim);
    EXPECT_EQ(named.heads, positional.heads);
    EXPECT_EQ(named.kv_heads, positional.kv_heads);
    EXPECT_EQ(named.key_dim, positional.key_dim);
    EXPECT_EQ(named.value_dim, positional.value_dim);
    EXPECT_EQ(named.bias, positional.bias);
    // A setter returns a changed copy and leaves its source alone, so a base config can be shared.
    const auto base = attend::mha_config{}.with_model_dim(8).with_heads(2);
    const auto grouped = base.with_kv_heads(1);
    EXPECT_EQ(base.kv_heads, 0);
    EXPECT_EQ(grouped.kv_heads, 1);
    EXPECT_EQ(grouped.model_dim, 8);
    // The same module either way: same shapes, same seeded initialisation.
    const attend::multi_head_attention<double> a(named, 5), b(positional, 5);
    EXPECT_EQ(a.parameter_count(), b.parameter_count());
    EXPECT_TRUE(bit_equal(a.k_weight(), b.k_weight()));
    EXPECT_EQ(a.config().kv_heads, 2);
    static_assert(attend::mha_config{}.with_heads(3).heads == 3, "the setters are constexpr");
}

TEST(TorchMasks, AttnMaskAndKeyPaddingTakeTheSameWrapperAndMeanWhatPyTorchMeans) {
    attend_test::rng g(41);
    for (int rep = 0; rep < attend_test::repeat(8); ++rep) {
        const index_t B = g.uniform_int(1, 3), H = g.uniform_int(1, 3), L = g.uniform_int(1, 6),
                      S = g.uniform_int(2, 7);
        const attend::multi_head_attention<double> m(attend::mha_config{}.with_model_dim(2 * H).with_heads(H),
                                                     static_cast<std::uint64_t>(rep));
        const auto q = random3<double>(100 + static_cast<std::uint64_t>(rep), B, L, 2 * H);
        const auto kv = random3<double>(200 + static_cast<std::uint64_t>(rep), B, S, 2 * H);
        // PyTorch's bool masks, true = blocked; key 0 always stays allowed so no row is empty.
        tensor<bool, 2> attn_mask(L, S);
        tensor<bool, 2> key_padding_mask(B, S);
        for (index_t i = 0; i < L; ++i)
            for (index_t j = 0; j < S; ++j) attn_mask(i, j) = j > 0 && g.bernoulli(0.4);
        for (index_t b = 0; b < B; ++b)
            for (index_t j = 0; j < S; ++j) key_padding_mask(b, j) = j > 0 && g.bernoulli(0.3);
        attend::mha_options o;
        o.attention.need_weights = true;
        o.average_weights = false;
        o.key_padding = attend::forbidden_mask::key_padding(key_padding_mask);
        const auto direct = m.forward(q, kv, kv, attend::forbidden_mask::query_key_grid(attn_mask), o);
        const auto converted =
            m.forward(q, kv, kv, attend::to_allowed(attend::forbidden_mask::query_key_grid(attn_mask)), o);
        EXPECT_TRUE(bit_equal(direct.out, converted.out)) << "rep " << rep;
        const auto& w = direct.per_head_weights();
        for (index_t b = 0; b < B; ++b)
            for (index_t h = 0; h < H; ++h)
                for (index_t i = 0; i < L; ++i)
                    for (index_t j = 0; j < S; ++j)
                        if (attn_mask(i, j) || key_padding_mask(b, j))
                            EXPECT_EQ(w(b, h, i, j), 0.0)
                                << "blocked (" << b << ',' << h << ',' << i << ',' << j << ')';
                        else
                            EXPECT_GT(w(b, h, i, j), 0.0)
                                << "allowed (" << b << ',' << h << ',' << i << ',' << j << ')';
        // The same wrapper reaches forward_cached (self-attention) too.
        if (L == S) {
            auto cache = m.make_cache(B, S);
            attend::mha_options plain;
            const auto cached = m.forward_cached(kv, cache, attend::forbidden_mask::query_key_grid(attn_mask), plain);
            auto cache2 = m.make_cache(B, S);
            const auto cached2 = m.forward_cached(
                kv, cache2, attend::to_allowed(attend::forbidden_mask::query_key_grid(attn_mask)), plain);
            EXPECT_TRUE(bit_equal(cached.out, cached2.out));
        }
    }
}

TEST(WeightsAccessor, SaysWhichKindItHoldsAndThrowsForTheOther) {
    const attend::multi_head_attention<double> m(attend::mha_config{}.with_model_dim(6).with_heads(3), 2);
    const auto x = random3<double>(8, 2, 4, 6);
    attend::mha_options o;
    const auto none = m.forward(x, x, x, o);
    EXPECT_EQ(none.weights_kind, attend::weights_kind::none);
    auto msg = expect_error<attend::value_error>([&] { (void)none.averaged_weights(); }, "attend.value.weights_kind");
    EXPECT_TRUE(contains(msg, "need_weights = false")) << msg;
    expect_error<attend::value_error>([&] { (void)none.per_head_weights(); }, "attend.value.weights_kind");

    o.attention.need_weights = true;
    const auto averaged = m.forward(x, x, x, o);
    EXPECT_EQ(averaged.weights_kind, attend::weights_kind::averaged);
    EXPECT_EQ(averaged.averaged_weights().dimensions(), (std::array<index_t, 3>{2, 4, 4}));
    msg = expect_error<attend::value_error>([&] { (void)averaged.per_head_weights(); }, "attend.value.weights_kind");
    EXPECT_TRUE(contains(msg, "average_weights = false")) << msg;

    o.average_weights = false;
    const auto per_head = m.forward(x, x, x, o);
    EXPECT_EQ(per_head.weights_kind, attend::weights_kind::per_head);
    EXPECT_EQ(per_head.per_head_weights().dimensions(), (std::array<index_t, 4>{2, 3, 4, 4}));
    expect_error<attend::value_error>([&] { (void)per_head.averaged_weights(); }, "attend.value.weights_kind");
    // The two kinds agree: the averaged weights are the mean of the per-head ones.
    double worst = 0;
    for (index_t b = 0; b < 2; ++b)
        for (index_t i = 0; i < 4; ++i)
            for (index_t j = 0; j < 4; ++j) {
                double mean = 0;
                for (index_t h = 0; h < 3; ++h) mean += per_head.per_head_weights()(b, h, i, j) / 3;
                worst = std::max(worst, std::abs(mean - averaged.averaged_weights()(b, i, j)));
            }
    EXPECT_LE(worst, 1e-15);
}

}  // namespace
