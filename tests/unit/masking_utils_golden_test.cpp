// SPDX-License-Identifier: MIT
// The named rules of transformers' masking_utils patterns (chunked, bidirectional_groups, sliding_window_from_config,
// causal with offsets), against tests/data/masking_utils.json, which tests/data/generate_masking_utils.py writes with
// transformers' own mask functions and float64 attention: materialize equals each mask exactly, and attention under
// the rule equals the reference output. Then the same rules through the tiled kernel against the reference, forward
// and backward, and in decodes: forward_cached over a kv_cache and paged_attention over a paged cache.

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/golden.hpp"
#include "support/kernel_agreement.hpp"
#include "support/paged_model.hpp"
#include "support/random.hpp"

namespace {

using attend::alignment;
using attend::index_t;
using attend_test::json;

const json& masking_utils_doc() {
    static const json doc = attend_test::load_golden("masking_utils.json");
    return doc;
}

std::vector<index_t> index_list(const json& c, const char* key) {
    std::vector<index_t> values;
    for (const json& x : attend_test::member(c, key)) values.push_back(x.get<index_t>());
    return values;
}

/// Calls f(rule) with attend's rule for the case's transformers pattern, on the case's per-row diagonals.
template <class F>
void with_pattern_rule(const json& c, F&& f) {
    const std::string pattern = attend_test::member(c, "pattern").get<std::string>();
    const auto d = attend::diagonal_offsets(index_list(c, "diagonal_offsets"));
    const auto chunked = [&] {
        return attend::chunked(attend_test::member(c, "chunk_size").get<index_t>(), d)
            .with_left_padding(index_list(c, "left_padding"));
    };
    const auto groups = [&] { return attend::bidirectional_groups(attend_test::tensor_at<int, 2>(c, "group_ids"), d); };
    if (pattern == "causal") f(attend::causal(d));
    else if (pattern == "sliding_window")
        f(attend::sliding_window_from_config(attend_test::member(c, "sliding_window").get<index_t>(), d));
    else if (pattern == "chunked") f(attend::causal(d) && chunked());
    else if (pattern == "bidirectional_groups") f(attend::causal(d) || groups());
    else if (pattern == "chunked_groups") f((attend::causal(d) && chunked()) || groups());
    else ADD_FAILURE() << "unknown pattern " << pattern;
}

/// f(mask): the pattern's rule, intersected with HF's attention_mask over the keys when the case had one.
template <class F>
void with_case_mask(const json& c, F&& f) {
    with_pattern_rule(c, [&](const auto& rule) {
        if (c.contains("key_padding"))
            f(rule && attend::allowed_mask::key_padding(attend_test::tensor_at<bool, 2>(c, "key_padding")));
        else f(rule);
    });
}

TEST(MaskingUtilsGolden, EveryPatternMaterializesExactlyToTransformersMask) {
    const auto& cases = attend_test::member(masking_utils_doc(), "cases");
    ASSERT_GE(cases.size(), 30u);
    for (const json& c : cases) {
        SCOPED_TRACE(c.at("name").get<std::string>());
        const auto allowed = attend_test::tensor_at<bool, 3>(c, "allowed");
        const index_t heads = attend_test::shape_of(attend_test::member(c, "q"))[1];
        const attend::score_shape s{allowed.dimension(0), heads, allowed.dimension(1), allowed.dimension(2)};
        with_case_mask(c, [&](const auto& mask) {
            const auto dense = attend::materialize(mask, s);
            index_t wrong = 0;
            for (index_t b = 0; b < s.batch; ++b)
                for (index_t h = 0; h < s.heads; ++h)
                    for (index_t i = 0; i < s.query_len; ++i)
                        for (index_t j = 0; j < s.key_len; ++j) wrong += dense(b, h, i, j) != allowed(b, i, j);
            EXPECT_EQ(wrong, 0) << attend::to_string(mask, s);
        });
    }
}

TEST(MaskingUtilsGolden, AttentionUnderEachRuleEqualsTheFloat64ReferenceOnBothKernels) {
    for (const json& c : attend_test::member(masking_utils_doc(), "cases")) {
        SCOPED_TRACE(c.at("name").get<std::string>());
        const auto q = attend_test::tensor_at<double, 4>(c, "q");
        const auto k = attend_test::tensor_at<double, 4>(c, "k");
        const auto v = attend_test::tensor_at<double, 4>(c, "v");
        const auto want = attend_test::tensor_at<double, 4>(c, "out");
        const auto want_lse = attend_test::tensor_at<double, 3>(c, "lse");
        const auto empty = attend_test::tensor_at<bool, 3>(c, "empty_rows");
        with_case_mask(c, [&](const auto& mask) {
            for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled}) {
                attend::sdpa_options o;
                o.kernel = kernel;
                o.empty_rows = attend::empty_rows::zero;  // left padding leaves HF's padded queries no key
                o.need_lse = true;
                const auto r = attend::scaled_dot_product_attention(q, k, v, mask, o);
                EXPECT_LE(attend_test::max_abs_diff(r.out, want), 1e-10);
                for (index_t n = 0; n < want_lse.size(); ++n) {
                    if (empty.data()[n]) EXPECT_EQ(r.lse.data()[n], -std::numeric_limits<double>::infinity());
                    else EXPECT_NEAR(r.lse.data()[n], want_lse.data()[n], 1e-10);
                }
            }
        });
    }
}

TEST(MaskingUtilsGolden, DecodeCasesAreTheBottomRightAlignment) {
    // The decode cases' offsets are key_len - query_len: alignment::bottom_right names the same rules.
    index_t checked = 0;
    for (const json& c : attend_test::member(masking_utils_doc(), "cases")) {
        const std::string name = c.at("name").get<std::string>();
        if (name.find("_decode") == std::string::npos) continue;
        SCOPED_TRACE(name);
        const auto allowed = attend_test::tensor_at<bool, 3>(c, "allowed");
        const attend::score_shape s{allowed.dimension(0), 1, allowed.dimension(1), allowed.dimension(2)};
        const auto offsets = index_list(c, "diagonal_offsets");
        for (const index_t o : offsets) ASSERT_EQ(o, s.key_len - s.query_len);
        const auto d = alignment::bottom_right;
        const std::string pattern = c.at("pattern").get<std::string>();
        if (pattern == "chunked") {
            const auto rule =
                attend::causal(d) &&
                attend::chunked(c.at("chunk_size").get<index_t>(), d).with_left_padding(index_list(c, "left_padding"));
            const auto golden = attend::causal(attend::diagonal_offsets(offsets)) &&
                                attend::chunked(c.at("chunk_size").get<index_t>(), attend::diagonal_offsets(offsets))
                                    .with_left_padding(index_list(c, "left_padding"));
            EXPECT_EQ(attend::to_string(rule, s), attend::to_string(golden, s));
            ++checked;
        }
        if (pattern == "bidirectional_groups") {
            const auto ids = attend_test::tensor_at<int, 2>(c, "group_ids");
            EXPECT_EQ(attend::to_string(attend::causal(d) || attend::bidirectional_groups(ids, d), s),
                      attend::to_string(attend::causal(attend::diagonal_offsets(offsets)) ||
                                            attend::bidirectional_groups(ids, attend::diagonal_offsets(offsets)),
                                        s));
            ++checked;
        }
    }
    EXPECT_EQ(checked, 4);
}

/// Group ids [batch, len]: runs of text (-1) and groups, a group sometimes coming back later in the row.
attend::tensor<int, 2> random_group_ids(std::uint64_t seed, index_t batch, index_t len, index_t max_run) {
    attend_test::rng g(seed);
    attend::tensor<int, 2> ids(batch, len);
    for (index_t b = 0; b < batch; ++b) {
        int next = 0;
        for (index_t j = 0; j < len;) {
            const index_t run = g.uniform_int(1, max_run);
            const int id = g.bernoulli(0.5) ? -1 : g.bernoulli(0.2) && next > 0 ? 0 : next++;
            for (index_t n = 0; n < run && j < len; ++n, ++j) ids(b, j) = id;
        }
    }
    return ids;
}

/// Tiled against reference, forward and every gradient, at sizes past several tiles, with grouped heads, left
/// padding, per-row decode diagonals and dropout: what the classifier skips must change nothing.
TEST(MaskingUtilsKernels, ChunkedAndGroupRulesAgreeAcrossKernelsForwardAndBackward) {
    attend::sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;
    o.need_weights = true;
    o.dropout = {0.1, 5, true};
    for (const index_t query_len : {index_t(150), index_t(37)}) {
        const index_t batch = 2, heads = 4, kv_heads = 2, key_len = 150, dim = 8;
        SCOPED_TRACE(query_len);
        const auto q = attend_test::random_tensor<double>(1, batch, heads, query_len, dim);
        const auto k = attend_test::random_tensor<double>(2, batch, kv_heads, key_len, dim);
        const auto v = attend_test::random_tensor<double>(3, batch, kv_heads, key_len, dim);
        const auto d_out = attend_test::random_tensor<double>(4, batch, heads, query_len, dim);
        const auto d = attend::diagonal_offsets({key_len - query_len, key_len - query_len - 9});
        const auto chunked = attend::causal(d) && attend::chunked(37, d).with_left_padding({0, 13});
        attend_test::expect_kernels_agree(attend_test::run_every_kernel(q, k, v, d_out, chunked, o));
        const auto groups = attend::bidirectional_groups(random_group_ids(5, batch, key_len, 40), d);
        attend_test::expect_kernels_agree(
            attend_test::run_every_kernel(q, k, v, d_out, attend::causal(d) || groups, o));
        attend_test::expect_kernels_agree(attend_test::run_every_kernel(q, k, v, d_out, chunked || groups, o));
        attend_test::expect_kernels_agree(attend_test::run_every_kernel(q, k, v, d_out, groups, o));
    }
}

/// x[:, begin : begin + n, :].
template <class T>
attend::tensor<T, 3> tokens(const attend::tensor<T, 3>& x, index_t begin, index_t n) {
    attend::tensor<T, 3> part(x.dimension(0), n, x.dimension(2));
    for (index_t b = 0; b < x.dimension(0); ++b)
        for (index_t i = 0; i < n; ++i)
            for (index_t e = 0; e < x.dimension(2); ++e) part(b, i, e) = x(b, begin + i, e);
    return part;
}

/// ids[:, :n].
attend::tensor<int, 2> first_ids(const attend::tensor<int, 2>& ids, index_t n) {
    attend::tensor<int, 2> part(ids.dimension(0), n);
    for (index_t b = 0; b < ids.dimension(0); ++b)
        for (index_t j = 0; j < n; ++j) part(b, j) = ids(b, j);
    return part;
}

double max_token_diff(const attend::tensor<double, 3>& step, const attend::tensor<double, 3>& full, index_t pos) {
    double worst = 0;
    for (index_t b = 0; b < step.dimension(0); ++b)
        for (index_t i = 0; i < step.dimension(1); ++i)
            for (index_t e = 0; e < step.dimension(2); ++e)
                worst = std::max(worst, std::abs(step(b, i, e) - full(b, pos + i, e)));
    return worst;
}

TEST(MaskingUtilsDecode, CachedDecodeUnderChunkedEqualsTheFullChunkedCausalPass) {
    // Llama 4's local layers: the layer adds causality; the chunks are counted on the bottom-right diagonal.
    const attend::mha_config config{16, 4, 2};
    const attend::multi_head_attention<double> m(config, 7);
    const index_t batch = 2, total = 23, chunk = 5;
    const auto x = attend_test::random_tensor<double>(8, batch, total, config.model_dim);
    attend::mha_options o;
    o.rotary = attend::rotary_embedding{m.head_dim()};
    const auto full =
        m.forward(x, x, x, attend::causal(alignment::top_left) && attend::chunked(chunk, alignment::top_left), o);
    auto cache = m.make_cache(batch, total);
    index_t pos = 0;
    for (const index_t n : {7, 1, 1, 3, 1, 6, 4}) {
        const auto step =
            m.forward_cached(tokens(x, pos, n), cache, attend::chunked(chunk, alignment::bottom_right), o);
        EXPECT_LE(max_token_diff(step.out, full.out, pos), 1e-12) << "at " << pos;
        pos += n;
    }
    ASSERT_EQ(pos, total);
}

TEST(MaskingUtilsDecode, CachedTextDecodeAfterAMultimodalPromptEqualsTheFullPass) {
    // A prompt with image groups, then text tokens one by one (id -1). The cached layer attends under causal && mask,
    // so its prefill is causal (bidirectional image prefill goes through forward or scaled_dot_product_attention);
    // the cache holds the same keys and values either way, and each text token then sees what the full
    // multimodal pass gives it.
    const attend::mha_config config{16, 4, 4};
    const attend::multi_head_attention<double> m(config, 9);
    const index_t batch = 2, prompt = 14, total = 20;
    const auto x = attend_test::random_tensor<double>(10, batch, total, config.model_dim);
    auto ids = random_group_ids(11, batch, total, 5);
    for (index_t b = 0; b < batch; ++b)
        for (index_t j = prompt; j < total; ++j) ids(b, j) = -1;
    const auto full = m.forward(
        x, x, x, attend::causal(alignment::top_left) || attend::bidirectional_groups(ids, alignment::top_left));
    const auto causal_only = m.forward(x, x, x, attend::causal(alignment::top_left));
    auto cache = m.make_cache(batch, total);
    const auto prefill =
        m.forward_cached(tokens(x, 0, prompt), cache,
                         attend::causal(alignment::bottom_right) ||
                             attend::bidirectional_groups(first_ids(ids, prompt), alignment::bottom_right));
    EXPECT_LE(max_token_diff(prefill.out, causal_only.out, 0), 1e-12);
    EXPECT_GT(max_token_diff(prefill.out, full.out, 0), 1e-3);  // the groups did change the full pass's prompt
    for (index_t pos = prompt; pos < total; ++pos) {
        const auto step =
            m.forward_cached(tokens(x, pos, 1), cache,
                             attend::causal(alignment::bottom_right) ||
                                 attend::bidirectional_groups(first_ids(ids, pos + 1), alignment::bottom_right));
        EXPECT_LE(max_token_diff(step.out, full.out, pos), 1e-12) << "at " << pos;
    }
}

TEST(MaskingUtilsDecode, PagedAttentionUnderEachRuleEqualsEachSequenceAttendedAlone) {
    const index_t heads = 4, kv_heads = 2, dim = 8;
    attend::paged_kv_cache<double> cache(attend_test::paged_config(kv_heads, dim, 8, 40, 2));
    const std::vector<index_t> lengths{61, 29}, counts{3, 1};
    std::vector<index_t> ids;
    std::vector<attend::tensor<double, 4>> keys, values;
    for (std::size_t n = 0; n < lengths.size(); ++n) {
        ids.push_back(cache.add_sequence());
        keys.push_back(attend_test::random_tensor<double>(20 + n, 1, kv_heads, lengths[n], dim));
        values.push_back(attend_test::random_tensor<double>(30 + n, 1, kv_heads, lengths[n], dim));
        cache.append(ids.back(), keys.back(), values.back());
    }
    const auto q = attend_test::random_tensor<double>(40, 2, heads, 3, dim);
    const auto chunked = attend::chunked(16, alignment::bottom_right);
    std::vector<attend::bidirectional_groups_rule> groups;
    for (std::size_t n = 0; n < lengths.size(); ++n) {
        auto g = random_group_ids(50 + n, 1, lengths[n], 6);
        g(0, lengths[n] - 2) = g(0, lengths[n] - 1) = 0;  // the newest queries belong to a group that started earlier
        g(0, 4) = 0;
        groups.push_back(attend::bidirectional_groups(g, alignment::bottom_right));
    }
    attend::sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;  // a text query sees no key under the groups alone
    const auto paged_chunked = attend::paged_attention(q, cache, ids, counts, chunked, o);
    const auto paged_groups = attend::paged_attention(q, cache, ids, counts, groups, o);
    for (std::size_t n = 0; n < lengths.size(); ++n) {
        SCOPED_TRACE(n);
        attend::tensor<double, 4> one_q(1, heads, counts[n], dim);
        for (index_t h = 0; h < heads; ++h)
            for (index_t i = 0; i < counts[n]; ++i)
                for (index_t d = 0; d < dim; ++d) one_q(0, h, i, d) = q(static_cast<index_t>(n), h, i, d);
        const auto alone_chunked = attend::scaled_dot_product_attention(
            one_q, keys[n], values[n], attend::causal(alignment::bottom_right) && chunked, o);
        const auto alone_groups = attend::scaled_dot_product_attention(
            one_q, keys[n], values[n], attend::causal(alignment::bottom_right) && groups[n], o);
        for (index_t h = 0; h < heads; ++h)
            for (index_t i = 0; i < counts[n]; ++i)
                for (index_t d = 0; d < dim; ++d) {
                    EXPECT_EQ(paged_chunked.out(static_cast<index_t>(n), h, i, d), alone_chunked.out(0, h, i, d));
                    EXPECT_EQ(paged_groups.out(static_cast<index_t>(n), h, i, d), alone_groups.out(0, h, i, d));
                }
    }
    attend_test::expect_error<attend::shape_error>(
        [&] { (void)attend::paged_attention(q, cache, ids, counts, std::vector<attend::bidirectional_groups_rule>{}); },
        "attend.shape.sequences");
    // One rule for every sequence binds as each sequence's own call: ids of another length do not fit.
    attend_test::expect_error<attend::mask_error>(
        [&] { (void)attend::paged_attention(q, cache, ids, counts, groups[0], o); }, "attend.mask.group_ids_shape");
}

TEST(MaskingUtilsErrors, BadRulesAreRejectedBeforeAnythingIsWritten) {
    const auto q = attend_test::random_tensor<double>(1, 2, 2, 3, 4);
    const auto k = attend_test::random_tensor<double>(2, 2, 2, 5, 4);
    attend::tensor<double, 4> out(2, 2, 3, 4);
    out.setConstant(42.0);
    attend::tensor<int, 2> ids(2, 4);  // one key short
    ids.setZero();
    attend_test::expect_error<attend::mask_error>(
        [&] {
            attend::scaled_dot_product_attention_into(q, k, k,
                                                      attend::causal(alignment::bottom_right) ||
                                                          attend::bidirectional_groups(ids, alignment::bottom_right),
                                                      out);
        },
        "attend.mask.group_ids_shape");
    attend_test::expect_error<attend::mask_error>(
        [&] {
            attend::scaled_dot_product_attention_into(
                q, k, k, attend::chunked(2, alignment::bottom_right).with_left_padding({1}), out);
        },
        "attend.mask.lengths_batch");
    EXPECT_TRUE(std::all_of(out.data(), out.data() + out.size(), [](double x) { return x == 42.0; }));
    attend_test::expect_error<attend::mask_error>([] { (void)attend::chunked(0, alignment::bottom_right); },
                                                  "attend.mask.chunk_size");
}

}  // namespace
