// SPDX-License-Identifier: MIT
// Tests of attend/mha_backward.hpp: gradients of multi-head attention for its inputs and every parameter, proven
//   - against nn.MultiheadAttention's autograd (tests/data/mha.json: parameter and input gradients),
//   - by finite differences in double for masks, key padding, GQA / MQA, rotary, dropout replay, kdim / vdim,
//     no bias, padded queries and empty rows under the zero policy, with both kernels,
// and for thread-count independence and every error id, with `saved` untouched by a failing forward.
#include <attend/mha_backward.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/finite_differences.hpp"
#include "support/golden.hpp"
#include "support/mha_golden.hpp"
#include "support/random.hpp"

namespace {

using attend::alignment;
using attend::index_t;
using attend::tensor;
using attend_test::expect_error;
using attend_test::json;

using attend_test::all_finite;
using attend_test::bit_equal;
using attend_test::max_abs;
using attend_test::max_abs_diff;

// ---- PyTorch goldens -------------------------------------------------------------------------------------------

class MhaBackwardGolden : public ::testing::TestWithParam<const char*> {};

/// Every parameter's .grad and the inputs' gradients of nn.MultiheadAttention (autograd, float64) for
/// loss = sum(out * d_out), reproduced by both kernels to 1e-12.
TEST_P(MhaBackwardGolden, GradientsMatchPyTorchAutograd) {
    const json doc = attend_test::load_golden("mha.json");
    const json& c = attend_test::find_case(doc, GetParam());
    const auto m = attend::multi_head_attention<double>::from_torch(attend_test::golden_config(c),
                                                                    attend_test::golden_parameters<double>(c));
    const auto x = attend_test::golden_mha_inputs<double>(c);
    const json& backward = attend_test::member(c, "backward");
    const json& expected = attend_test::member(backward, "grads");
    const auto d_out = attend_test::to_tensor<double, 3>(backward.at("d_out"), "d_out");
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::mha_options options;
        options.attention.kernel = kernel;
        const auto g = attend_test::with_golden_masks(c, options, [&](const auto& mask, const attend::mha_options& o) {
            attend::mha_saved<double> saved;
            m.forward(x.query, x.key, x.value, mask, o, saved);
            return attend::multi_head_attention_backward(m, x.query, x.key, x.value, mask, saved, d_out, o);
        });
        const auto torch = attend::to_torch(g, m);
        double worst = 0;
        const auto compare = [&](const auto& got, const std::string& name) {
            using got_t = std::decay_t<decltype(got)>;
            constexpr int rank = got_t::NumDimensions;
            const auto want = attend_test::to_tensor<double, rank>(expected.at(name), name);
            const double err = max_abs_diff(got, want);
            worst = std::max(worst, err);
            EXPECT_LE(err, 1e-12) << GetParam() << ' ' << name;
        };
        for (const auto& name_json : attend_test::member(c, "parameter_names")) {
            const auto name = name_json.get<std::string>();
            if (name == "in_proj_weight") compare(torch.in_proj_weight, name);
            else if (name == "q_proj_weight") compare(torch.q_proj_weight, name);
            else if (name == "k_proj_weight") compare(torch.k_proj_weight, name);
            else if (name == "v_proj_weight") compare(torch.v_proj_weight, name);
            else if (name == "in_proj_bias") compare(torch.in_proj_bias, name);
            else if (name == "out_proj.weight") compare(torch.out_proj_weight, name);
            else if (name == "out_proj.bias") compare(torch.out_proj_bias, name);
            else ADD_FAILURE() << "unknown parameter " << name;
        }
        if (c.at("self_attention").get<bool>()) {
            // The module was called as m(x, x, x): autograd sums the three uses of x.
            tensor<double, 3> self_input = g.d_query + g.d_key + g.d_value;
            compare(self_input, "self_input");
        } else {
            compare(g.d_query, "query");
            compare(g.d_key, "key");
            compare(g.d_value, "value");
        }
        std::cout << "[golden] " << GetParam() << (kernel == attend::kernel::reference ? " reference" : " tiled")
                  << ": max abs error " << worst << '\n';
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, MhaBackwardGolden, ::testing::ValuesIn(attend_test::golden_mha_cases));

// ---- finite differences ----------------------------------------------------------------------------------------

/// One multi-head configuration: module sizes, input lengths and the forward's options.
struct fd_case {
    std::string name;
    attend::mha_config config;
    index_t batch = 2, query_len = 3, key_len = 4;
    bool self_attention = false;  ///< call forward(x, x, x) and check d x = d_query + d_key + d_value
    attend::mha_options options;
};

template <class Mask>
void check_mha_by_finite_differences(const fd_case& t, const Mask& mask, std::uint64_t seed) {
    SCOPED_TRACE(t.name);
    attend::multi_head_attention<double> m(t.config, seed);
    const auto c = m.config();
    // Non-zero biases and sinks, so their gradients and their effect on the outputs are both exercised.
    std::uint64_t stream = seed * 7919;
    for (auto& p : m.parameters())
        if (std::string(p.name).find("bias") != std::string::npos || std::string(p.name) == "sinks") {
            attend_test::rng r(++stream);
            for (index_t n = 0; n < p.size; ++n) p.data[n] = r.uniform(-0.3, 0.3);
        }
    auto query = attend_test::random_tensor<double>(seed + 1, t.batch, t.query_len, c.model_dim);
    auto key = attend_test::random_tensor<double>(seed + 2, t.batch, t.key_len, c.key_dim);
    auto value = attend_test::random_tensor<double>(seed + 3, t.batch, t.key_len, c.value_dim);
    const auto w = attend_test::random_tensor<double>(seed + 4, t.batch, t.query_len, c.model_dim);
    attend::mha_options forward_options = t.options;
    forward_options.attention.kernel = attend::kernel::reference;
    const auto loss = [&] {
        const auto r = t.self_attention ? m.forward(query, query, query, mask, forward_options)
                                        : m.forward(query, key, value, mask, forward_options);
        double sum = 0;
        for (index_t n = 0; n < r.out.size(); ++n) sum += r.out.data()[n] * w.data()[n];
        return sum;
    };
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
        attend::mha_options o = t.options;
        o.attention.kernel = kernel;
        attend::mha_saved<double> saved;
        const auto& k_in = t.self_attention ? query : key;
        const auto& v_in = t.self_attention ? query : value;
        m.forward(query, k_in, v_in, mask, o, saved);
        const auto g = attend::multi_head_attention_backward(m, query, k_in, v_in, mask, saved, w, o);
        const std::string kernel_name = kernel == attend::kernel::reference ? " (reference)" : " (tiled)";
        auto params = m.parameters();
        const auto grads = g.parameters();
        ASSERT_EQ(params.size(), grads.size());
        for (std::size_t p = 0; p < params.size(); ++p) {
            ASSERT_EQ(params[p].size, grads[p].size) << params[p].name;
            const auto fd = attend_test::fd_gradient(params[p].data, params[p].size, loss);
            attend_test::expect_close_to_fd(grads[p].data, fd.data(), grads[p].size, params[p].name + kernel_name);
        }
        if (t.self_attention) {
            const tensor<double, 3> dx = g.d_query + g.d_key + g.d_value;
            attend_test::expect_close_to_fd(dx, attend_test::fd_gradient(query, loss), "d x" + kernel_name);
        } else {
            attend_test::expect_close_to_fd(g.d_query, attend_test::fd_gradient(query, loss), "d_query" + kernel_name);
            attend_test::expect_close_to_fd(g.d_key, attend_test::fd_gradient(key, loss), "d_key" + kernel_name);
            attend_test::expect_close_to_fd(g.d_value, attend_test::fd_gradient(value, loss), "d_value" + kernel_name);
        }
    }
}

fd_case base_case(std::string name, index_t model_dim, index_t heads, index_t kv_heads = 0) {
    fd_case t;
    t.name = std::move(name);
    t.config.model_dim = model_dim;
    t.config.heads = heads;
    t.config.kv_heads = kv_heads;
    return t;
}

TEST(MhaBackwardFiniteDifferences, PlainCrossAttention) {
    check_mha_by_finite_differences(base_case("plain", 8, 2), attend::no_mask{}, 11);
}

TEST(MhaBackwardFiniteDifferences, SelfAttentionSumsTheThreeInputGradients) {
    auto t = base_case("self causal", 8, 2);
    t.self_attention = true;
    t.key_len = t.query_len = 4;
    check_mha_by_finite_differences(t, attend::causal(alignment::top_left), 12);
}

TEST(MhaBackwardFiniteDifferences, CausalBottomRightWithKeyPaddingLengths) {
    auto t = base_case("bottom-right causal + key padding", 8, 2);
    t.options.key_padding = {4, 3};
    check_mha_by_finite_differences(t, attend::causal(alignment::bottom_right), 13);
}

TEST(MhaBackwardFiniteDifferences, KeyPaddingAsForbiddenMaskAndAdditiveMask) {
    auto t = base_case("forbidden key padding + additive", 8, 2);
    tensor<bool, 2> ignore(2, 4);
    ignore.setConstant(false);
    ignore(1, 0) = true;
    ignore(0, 3) = true;
    t.options.key_padding = attend::forbidden_mask::key_padding(ignore);
    const auto bias = attend_test::random_tensor<double>(14, 3, 4);
    check_mha_by_finite_differences(t, attend::additive_mask<double>::query_key_grid(bias), 15);
}

TEST(MhaBackwardFiniteDifferences, GroupedAndMultiQueryHeadsSumKeyValueGradientsOverTheGroup) {
    check_mha_by_finite_differences(base_case("GQA 4 / 2", 8, 4, 2), attend::causal(alignment::bottom_right), 16);
    check_mha_by_finite_differences(base_case("MQA 4 / 1", 8, 4, 1), attend::no_mask{}, 17);
}

TEST(MhaBackwardFiniteDifferences, RotaryGradientIsTheInverseRotation) {
    for (const auto layout : {attend::rotary_layout::half_split, attend::rotary_layout::interleaved}) {
        auto t =
            base_case(layout == attend::rotary_layout::half_split ? "rotary half_split" : "rotary interleaved", 8, 2);
        t.options.rotary = attend::rotary_embedding{4, 10000, layout};
        t.options.position_offset = 5;
        check_mha_by_finite_differences(t, attend::causal(alignment::bottom_right), 18);
    }
    auto gqa = base_case("rotary GQA", 8, 4, 2);
    gqa.options.rotary = attend::rotary_embedding{2};
    check_mha_by_finite_differences(gqa, attend::no_mask{}, 19);
}

TEST(MhaBackwardFiniteDifferences, SoftcapGradientGoesThroughTheTanhSlope) {
    auto t = base_case("softcap 0.3, GQA, causal", 8, 4, 2);
    t.options.attention.softcap = 0.3;  // below the scores' spread, so the cap bends them
    check_mha_by_finite_differences(t, attend::causal(alignment::bottom_right), 21);
}

TEST(MhaBackwardFiniteDifferences, AScoreBiasInTheLayerIsDifferentiatedLikeTheScoresItShifts) {
    auto t = base_case("ALiBi score_bias, GQA, causal", 8, 4, 2);
    t.options.attention.score_bias = attend::score_bias::alibi(attend::alibi_slopes(4), alignment::bottom_right);
    check_mha_by_finite_differences(t, attend::causal(alignment::bottom_right), 23);
}

TEST(MhaScoreBias, TheLayerAddsItsScoreBiasAsTheSameBiasWrittenAsAScoreModWould) {
    // ALiBi bottom-right over 3 queries and 5 keys: key j of query i gets -slope[h] |(i + 2) - j|.
    const attend::multi_head_attention<double> m(attend::mha_config{8, 4}, 31);
    const auto query = attend_test::random_tensor<double>(32, 2, 3, 8);
    const auto memory = attend_test::random_tensor<double>(33, 2, 5, 8);
    const std::vector<double> slopes = attend::alibi_slopes(4);
    attend::mha_options as_bias, as_function;
    as_bias.attention.score_bias = attend::score_bias::alibi(slopes, alignment::bottom_right);
    as_function.attention.score_mod = attend::score_mod([slopes](auto s, auto, auto h, auto i, auto j) {
        const auto distance = std::abs(static_cast<double>(i + 2) - static_cast<double>(j));
        return s - static_cast<decltype(s)>(slopes[static_cast<std::size_t>(h)] * distance);
    });
    const auto with_bias = m.forward(query, memory, memory, as_bias),
               with_function = m.forward(query, memory, memory, as_function);
    EXPECT_TRUE(attend_test::near(with_bias.out, with_function.out, 1e-12));
    const auto without = m.forward(query, memory, memory);
    EXPECT_FALSE(attend_test::near(with_bias.out, without.out, 1e-3)) << "the bias changed nothing";
}

TEST(MhaBackwardFiniteDifferences, LearnableSinksGetTheirGradientWithGqaSoftcapAndDropout) {
    auto t = base_case("sinks, GQA, softcap, dropout", 8, 4, 2);
    t.config.sinks = true;
    t.options.attention.dropout.probability = 0.2;
    t.options.attention.dropout.training = true;
    t.options.attention.dropout.seed = 5;
    t.options.attention.softcap = 2.0;
    t.options.key_padding = {4, 2};
    check_mha_by_finite_differences(t, attend::causal(alignment::bottom_right), 22);
}

TEST(MhaBackwardFiniteDifferences, DropoutIsReplayedFromItsSeed) {
    auto t = base_case("dropout", 8, 2);
    t.options.attention.dropout.probability = 0.3;
    t.options.attention.dropout.training = true;
    t.options.attention.dropout.seed = 77;
    t.key_len = 6;
    check_mha_by_finite_differences(t, attend::causal(alignment::bottom_right), 20);
}

TEST(MhaBackwardFiniteDifferences, SeparateKeyValueWidthsWithoutBias) {
    auto t = base_case("kdim 5, vdim 3, no bias", 6, 2);
    t.config.key_dim = 5;
    t.config.value_dim = 3;
    t.config.bias = false;
    check_mha_by_finite_differences(t, attend::no_mask{}, 21);
}

TEST(MhaBackwardFiniteDifferences, PaddedQueriesAndEmptyRowsGetZeroGradients) {
    auto t = base_case("query padding + empty row", 8, 2);
    t.options.attention.empty_rows = attend::empty_rows::zero;
    t.query_len = 4;
    // Query 0 of every batch sees no key (sliding window behind a bottom-right diagonal), batch 1 pads query 3.
    tensor<bool, 2> allowed(4, 4);
    for (index_t i = 0; i < 4; ++i)
        for (index_t j = 0; j < 4; ++j) allowed(i, j) = i > 0 && j <= i;
    const auto mask = attend::allowed_mask::query_key_grid(allowed) && attend::query_padding({4, 3});
    check_mha_by_finite_differences(t, mask, 22);
}

// ---- properties ------------------------------------------------------------------------------------------------

/// The gradients do not depend on the number of threads, bit for bit, in float (GQA, causal, dropout).
TEST(MhaBackward, GradientsAreBitIdenticalForAnyThreadCount) {
    attend::mha_config config;
    config.model_dim = 64;
    config.heads = 8;
    config.kv_heads = 2;
    const attend::multi_head_attention<float> m(config, 3);
    const auto x = attend_test::random_tensor<float>(31, 2, 300, 64);
    const auto d_out = attend_test::random_tensor<float>(32, 2, 300, 64);
    attend::mha_options o;
    o.attention.dropout = {0.1, 9, true};
    o.rotary = attend::rotary_embedding{8};
    std::vector<attend::mha_gradients<float>> runs;
    for (const int threads : {1, 2, 7}) {
        o.attention.threads = threads;
        attend::mha_saved<float> saved;
        m.forward(x, x, x, attend::causal(alignment::top_left), o, saved);
        runs.push_back(
            attend::multi_head_attention_backward(m, x, x, x, attend::causal(alignment::top_left), saved, d_out, o));
    }
    for (std::size_t r = 1; r < runs.size(); ++r) {
        EXPECT_TRUE(bit_equal(runs[0].d_query, runs[r].d_query));
        EXPECT_TRUE(bit_equal(runs[0].d_key, runs[r].d_key));
        EXPECT_TRUE(bit_equal(runs[0].d_value, runs[r].d_value));
        const auto a = runs[0].parameters(), b = runs[r].parameters();
        for (std::size_t p = 0; p < a.size(); ++p)
            EXPECT_TRUE(std::equal(a[p].data, a[p].data + a[p].size, b[p].data)) << a[p].name;
    }
    EXPECT_TRUE(all_finite(runs[0].d_query) && max_abs(runs[0].d_q_weight) > 0);
}

/// Float gradients agree with double gradients of the same module and inputs (tiled kernel, bottom-right causal
/// cross-attention with a longer key sequence than the tiles).
TEST(MhaBackward, FloatAgreesWithDouble) {
    attend::mha_config config;
    config.model_dim = 32;
    config.heads = 4;
    const attend::multi_head_attention<double> md(config, 5);
    const auto p = md.to_torch();
    attend::torch_mha_parameters<float> pf;
    pf.in_proj_weight = p.in_proj_weight.cast<float>();
    pf.in_proj_bias = p.in_proj_bias.cast<float>();
    pf.out_proj_weight = p.out_proj_weight.cast<float>();
    pf.out_proj_bias = p.out_proj_bias.cast<float>();
    const auto mf = attend::multi_head_attention<float>::from_torch(config, pf);
    const auto q = attend_test::random_tensor<double>(41, 2, 70, 32),
               kv = attend_test::random_tensor<double>(42, 2, 600, 32);
    const auto d_out = attend_test::random_tensor<double>(43, 2, 70, 32);
    const tensor<float, 3> qf = q.cast<float>(), kvf = kv.cast<float>(), df = d_out.cast<float>();
    const auto mask = attend::causal(alignment::bottom_right);
    attend::mha_saved<double> sd;
    attend::mha_saved<float> sf;
    md.forward(q, kv, kv, mask, {}, sd);
    mf.forward(qf, kvf, kvf, mask, {}, sf);
    const auto gd = attend::multi_head_attention_backward(md, q, kv, kv, mask, sd, d_out);
    const auto gf = attend::multi_head_attention_backward(mf, qf, kvf, kvf, mask, sf, df);
    const auto close = [](const auto& f, const auto& d, const char* name) {
        const tensor<double, std::decay_t<decltype(d)>::NumDimensions> fd = f.template cast<double>();
        EXPECT_LE(max_abs_diff(fd, d), 1e-4 * std::max(1.0, max_abs(d))) << name;
    };
    close(gf.d_query, gd.d_query, "d_query");
    close(gf.d_key, gd.d_key, "d_key");
    close(gf.d_value, gd.d_value, "d_value");
    close(gf.d_q_weight, gd.d_q_weight, "d_q_weight");
    close(gf.d_k_weight, gd.d_k_weight, "d_k_weight");
    close(gf.d_out_weight, gd.d_out_weight, "d_out_weight");
    close(gf.d_v_bias, gd.d_v_bias, "d_v_bias");
}

// ---- errors: typed, with an id, before anything is computed ----------------------------------------------------

struct error_fixture {
    attend::multi_head_attention<double> m{attend::mha_config{8, 2}, 1};
    tensor<double, 3> x = attend_test::random_tensor<double>(51, 2, 3, 8);
    tensor<double, 3> d_out = attend_test::random_tensor<double>(52, 2, 3, 8);
    attend::mha_saved<double> saved;
    error_fixture() { m.forward(x, x, x, attend::no_mask{}, {}, saved); }
};

TEST(MhaBackwardErrors, DOutOfAnotherShapeIsRejected) {
    error_fixture f;
    const auto wrong = attend_test::random_tensor<double>(53, 2, 4, 8);
    const auto message = expect_error<attend::shape_error>(
        [&] { attend::multi_head_attention_backward(f.m, f.x, f.x, f.x, f.saved, wrong); }, "attend.shape.mha_d_out");
    EXPECT_NE(message.find("[2,4,8]"), std::string::npos) << message;
}

TEST(MhaBackwardErrors, SavedStateOfOtherInputsIsRejectedNamingTheField) {
    error_fixture f;
    const auto longer = attend_test::random_tensor<double>(54, 2, 5, 8);
    const auto d_longer = attend_test::random_tensor<double>(55, 2, 5, 8);
    const auto message = expect_error<attend::shape_error>(
        [&] { attend::multi_head_attention_backward(f.m, longer, longer, longer, f.saved, d_longer); },
        "attend.shape.mha_saved");
    EXPECT_NE(message.find("saved.q"), std::string::npos) << message;
    attend::mha_saved<double> no_lse = f.saved;
    no_lse.lse = tensor<double, 3>();
    const auto lse_message = expect_error<attend::shape_error>(
        [&] { attend::multi_head_attention_backward(f.m, f.x, f.x, f.x, no_lse, f.d_out); }, "attend.shape.mha_saved");
    EXPECT_NE(lse_message.find("saved.lse"), std::string::npos) << lse_message;
    // A saved state from a plain forward (never filled) is rejected too.
    expect_error<attend::shape_error>(
        [&] { attend::multi_head_attention_backward(f.m, f.x, f.x, f.x, attend::mha_saved<double>{}, f.d_out); },
        "attend.shape.mha_saved");
}

TEST(MhaBackwardErrors, NonFiniteDOutIsRejectedWhenChecked) {
    error_fixture f;
    f.d_out(1, 2, 3) = std::nan("");
    expect_error<attend::value_error>(
        [&] { attend::multi_head_attention_backward(f.m, f.x, f.x, f.x, f.saved, f.d_out); },
        "attend.value.non_finite");
    attend::mha_options unchecked;
    unchecked.attention.check_finite = false;
    EXPECT_NO_THROW(attend::multi_head_attention_backward(f.m, f.x, f.x, f.x, f.saved, f.d_out, unchecked));
}

TEST(MhaBackwardErrors, ForwardChecksApplyToTheBackwardCall) {
    error_fixture f;
    const auto narrow = attend_test::random_tensor<double>(56, 2, 3, 6);
    expect_error<attend::shape_error>(
        [&] { attend::multi_head_attention_backward(f.m, f.x, narrow, f.x, f.saved, f.d_out); },
        "attend.shape.model_dim");
    // A mask that empties a row under the default policy: the same error as forward, before any work.
    tensor<bool, 2> none(3, 3);
    none.setConstant(false);
    expect_error<attend::mask_error>(
        [&] {
            attend::multi_head_attention_backward(f.m, f.x, f.x, f.x, attend::allowed_mask::query_key_grid(none),
                                                  f.saved, f.d_out);
        },
        "attend.mask.empty_row");
    attend::mha_options o;
    o.position_offset = -1;
    expect_error<attend::position_error>(
        [&] { attend::multi_head_attention_backward(f.m, f.x, f.x, f.x, f.saved, f.d_out, o); },
        "attend.position.negative_offset");
}

TEST(MhaBackwardErrors, FailingTrainingForwardLeavesSavedUnchanged) {
    error_fixture f;
    const auto before = f.saved;
    tensor<bool, 2> none(3, 3);
    none.setConstant(false);
    expect_error<attend::mask_error>(
        [&] { f.m.forward(f.x, f.x, f.x, attend::allowed_mask::query_key_grid(none), {}, f.saved); },
        "attend.mask.empty_row");
    EXPECT_TRUE(bit_equal(before.q, f.saved.q) && bit_equal(before.k, f.saved.k) && bit_equal(before.v, f.saved.v) &&
                bit_equal(before.attention, f.saved.attention) && bit_equal(before.lse, f.saved.lse));
}

}  // namespace
