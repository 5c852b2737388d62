// SPDX-License-Identifier: MIT
// Tests of attend/backward.hpp: gradients of scaled dot-product attention.
//   - finite differences in double on small random shapes for every feature (masks, GQA / MQA, rank 3, ALiBi,
//     T5 table, dropout, empty rows, query padding), for both kernels;
//   - PyTorch autograd goldens (tests/data/sdpa_backward.json);
//   - tiled backward against the reference backward over hundreds of random configurations;
//   - bit-identical results for any thread count;
//   - every error id, with nothing written.
#include <attend/backward.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <typeinfo>
#include <vector>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/finite_differences.hpp"
#include "support/golden.hpp"
#include "support/random.hpp"

namespace {

using attend_test::all_finite;
using attend_test::bit_equal;
using attend_test::expect_error;
using attend_test::max_abs;
using attend_test::max_abs_diff;

using attend::alignment;
using attend::index_t;
using attend::kernel;
using attend::sdpa_options;
using attend::tensor;

/// The forward pass whose gradients are checked: out and lse from the reference kernel.
template <class T, int Rank, class Mask>
attend::attention_result<T, Rank> forward(const tensor<T, Rank>& q, const tensor<T, Rank>& k, const tensor<T, Rank>& v,
                                          const Mask& mask, sdpa_options o) {
    o.kernel = kernel::reference;
    o.need_lse = true;
    return attend::scaled_dot_product_attention(q, k, v, mask, o);
}

template <int Rank>
double dot(const tensor<double, Rank>& a, const tensor<double, Rank>& b) {
    double s = 0;
    for (index_t n = 0; n < a.size(); ++n) s += a.data()[n] * b.data()[n];
    return s;
}

// ---- finite differences ---------------------------------------------------------------------------------------

using attend_test::expect_close_to_fd;
using attend_test::fd_gradient;

/// Gradients of loss = sum(out * w) by both kernels against finite differences of the reference forward pass.
template <int Rank, class Mask>
void check_by_finite_differences(const std::string& what, tensor<double, Rank> q, tensor<double, Rank> k,
                                 tensor<double, Rank> v, const Mask& mask, sdpa_options o, std::uint64_t seed = 99) {
    SCOPED_TRACE(what);
    const auto f = forward(q, k, v, mask, o);
    tensor<double, Rank> w(f.out.dimensions());
    attend_test::fill_uniform(w, seed);
    const std::function<double()> loss = [&] { return dot(forward(q, k, v, mask, o).out, w); };
    const auto fd_q = fd_gradient(q, loss), fd_k = fd_gradient(k, loss), fd_v = fd_gradient(v, loss);
    for (const kernel kern : {kernel::reference, kernel::automatic}) {
        SCOPED_TRACE(kern == kernel::reference ? "reference kernel" : "tiled kernel");
        o.kernel = kern;
        const auto g = attend::scaled_dot_product_attention_backward(q, k, v, mask, f.out, f.lse, w, o);
        EXPECT_TRUE(all_finite(g.d_query) && all_finite(g.d_key) && all_finite(g.d_value));
        expect_close_to_fd(g.d_query, fd_q, "dq");
        expect_close_to_fd(g.d_key, fd_k, "dk");
        expect_close_to_fd(g.d_value, fd_v, "dv");
    }
}

struct dims {
    index_t batch = 2, heads = 2, kv_heads = 2, query_len = 5, key_len = 7, head_dim = 3, value_dim = 2;
};

struct qkv {
    tensor<double, 4> q, k, v;
};

qkv random_qkv(const dims& d, std::uint64_t seed) {
    return {attend_test::random_tensor<double>(seed, d.batch, d.heads, d.query_len, d.head_dim),
            attend_test::random_tensor<double>(seed + 1, d.batch, d.kv_heads, d.key_len, d.head_dim),
            attend_test::random_tensor<double>(seed + 2, d.batch, d.kv_heads, d.key_len, d.value_dim)};
}

template <class Mask>
void check_fd(const std::string& what, const dims& d, const Mask& mask, const sdpa_options& o = {},
              std::uint64_t seed = 1) {
    auto x = random_qkv(d, seed);
    check_by_finite_differences<4>(what, x.q, x.k, x.v, mask, o, seed + 7);
}

/// A dense Boolean grid `[batch, 1, query_len, key_len]` allowing about 60 % of keys, and always key i % key_len
/// for query i so no row is empty.
tensor<bool, 4> random_allowed(const dims& d, std::uint64_t seed) {
    attend_test::rng g(seed);
    tensor<bool, 4> m(d.batch, 1, d.query_len, d.key_len);
    for (index_t b = 0; b < d.batch; ++b)
        for (index_t i = 0; i < d.query_len; ++i)
            for (index_t j = 0; j < d.key_len; ++j) m(b, 0, i, j) = j == i % d.key_len || g.bernoulli(0.6);
    return m;
}

TEST(BackwardFiniteDifferences, NoMask) { check_fd("no mask", dims{}, attend::no_mask{}); }

TEST(BackwardFiniteDifferences, NoMaskOverloadAndCustomScale) {
    sdpa_options o;
    o.scale = 0.8;
    auto x = random_qkv(dims{}, 3);
    check_by_finite_differences<4>("scale 0.8", x.q, x.k, x.v, attend::no_mask{}, o);
    const auto f = forward(x.q, x.k, x.v, attend::no_mask{}, o);
    const auto a = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, f.out, f.lse, f.out, o);
    const auto b =
        attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, attend::no_mask{}, f.out, f.lse, f.out, o);
    EXPECT_TRUE(bit_equal(a.d_query, b.d_query) && bit_equal(a.d_key, b.d_key) && bit_equal(a.d_value, b.d_value));
}

TEST(BackwardFiniteDifferences, DenseAllowedMask) {
    const dims d;
    check_fd("allowed mask", d, attend::allowed_mask::from_torch_sdpa(random_allowed(d, 5)));
}

TEST(BackwardFiniteDifferences, ForbiddenMaskConverted) {
    const dims d;
    tensor<bool, 4> blocked = random_allowed(d, 6);
    for (index_t n = 0; n < blocked.size(); ++n) blocked.data()[n] = !blocked.data()[n];
    for (index_t b = 0; b < d.batch; ++b)
        for (index_t i = 0; i < d.query_len; ++i) blocked(b, 0, i, 0) = false;  // key 0 open: no empty row
    check_fd("forbidden mask", d, attend::to_allowed(attend::forbidden_mask::from_torch_mha(blocked)));
}

TEST(BackwardFiniteDifferences, AdditiveMask) {
    const dims d;
    attend_test::rng g(8);
    tensor<double, 2> m(d.query_len, d.key_len);
    for (index_t i = 0; i < d.query_len; ++i)
        for (index_t j = 0; j < d.key_len; ++j)
            m(i, j) = j != i && g.bernoulli(0.25) ? -std::numeric_limits<double>::infinity() : g.uniform(-2, 2);
    check_fd("additive mask", d, attend::additive_mask<double>::query_key_grid(m));
}

TEST(BackwardFiniteDifferences, CausalBothAlignments) {
    dims d;
    check_fd("causal top_left L < S", d, attend::causal(alignment::top_left));
    check_fd("causal bottom_right L < S", d, attend::causal(alignment::bottom_right));
    d.query_len = 7;
    d.key_len = 4;
    check_fd("causal top_left L > S", d, attend::causal(alignment::top_left));
}

TEST(BackwardFiniteDifferences, KeyPadding) { check_fd("key padding", dims{}, attend::key_padding({7, 3})); }

TEST(BackwardFiniteDifferences, SlidingWindow) {
    check_fd("sliding window", dims{}, attend::sliding_window(1, 2, attend::alignment::top_left));
    check_fd("sliding window bottom_right", dims{}, attend::sliding_window(2, 0, alignment::bottom_right));
}

TEST(BackwardFiniteDifferences, MaskCombination) {
    check_fd("causal && key padding", dims{}, attend::causal(alignment::bottom_right) && attend::key_padding({7, 5}));
    const dims d;
    tensor<double, 2> bias(d.query_len, d.key_len);
    attend_test::fill_uniform(bias, 4, -1.5, 1.5);
    check_fd("additive + sliding window", d,
             attend::additive_mask<double>::query_key_grid(bias) +
                 attend::sliding_window(2, 2, alignment::bottom_right));
}

TEST(BackwardFiniteDifferences, GroupedAndMultiQuery) {
    dims gqa;
    gqa.heads = 4;
    gqa.kv_heads = 2;
    check_fd("GQA H=4 Hkv=2", gqa, attend::causal(alignment::bottom_right));
    dims mqa;
    mqa.heads = 3;
    mqa.kv_heads = 1;
    check_fd("MQA H=3 Hkv=1", mqa, attend::sliding_window(2, 1, attend::alignment::top_left));
}

TEST(BackwardFiniteDifferences, Rank3) {
    auto q = attend_test::random_tensor<double>(11, 2, 4, 3), k = attend_test::random_tensor<double>(12, 2, 6, 3),
         v = attend_test::random_tensor<double>(13, 2, 6, 5);
    check_by_finite_differences<3>("rank 3 causal", q, k, v, attend::causal(alignment::bottom_right), {});
    check_by_finite_differences<3>("rank 3 no mask", q, k, v, attend::no_mask{}, {});
}

TEST(BackwardFiniteDifferences, Alibi) {
    dims d;
    d.heads = 4;
    d.kv_heads = 2;
    sdpa_options o;
    o.score_bias = attend::score_bias::alibi(attend::alibi_slopes(4), alignment::bottom_right);
    check_fd("ALiBi bottom_right + causal", d, attend::causal(alignment::bottom_right), o);
    o.score_bias = attend::score_bias::alibi({0.5, -0.25, 1.0, 0.125}, attend::alignment::top_left);
    check_fd("ALiBi top_left", d, attend::no_mask{}, o);
}

TEST(BackwardFiniteDifferences, Dropout) {
    sdpa_options o;
    o.dropout = {0.3, 1234, true};
    check_fd("dropout 0.3", dims{}, attend::no_mask{}, o);
    dims gqa;
    gqa.heads = 4;
    gqa.kv_heads = 2;
    o.dropout = {0.5, 77, true};
    check_fd("dropout 0.5 GQA causal", gqa, attend::causal(alignment::top_left), o);
}

TEST(BackwardFiniteDifferences, EmptyRowsZeroHaveZeroGradient) {
    const dims d;
    tensor<bool, 4> m = random_allowed(d, 21);
    for (index_t j = 0; j < d.key_len; ++j) m(1, 0, 2, j) = false;  // batch 1, query 2: no allowed key
    const auto mask = attend::allowed_mask::from_torch_sdpa(m);
    sdpa_options o;
    o.empty_rows = attend::empty_rows::zero;
    check_fd("empty row", d, mask, o);
    auto x = random_qkv(d, 1);
    const auto f = forward(x.q, x.k, x.v, mask, o);
    tensor<double, 4> w = attend_test::random_tensor<double>(3, d.batch, d.heads, d.query_len, d.value_dim);
    for (const kernel kern : {kernel::reference, kernel::automatic}) {
        o.kernel = kern;
        const auto g = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, f.out, f.lse, w, o);
        EXPECT_TRUE(all_finite(g.d_query) && all_finite(g.d_key) && all_finite(g.d_value));
        for (index_t h = 0; h < d.heads; ++h)
            for (index_t c = 0; c < d.head_dim; ++c) EXPECT_EQ(g.d_query(1, h, 2, c), 0.0);
    }
}

TEST(BackwardFiniteDifferences, QueryPadding) {
    const dims d;
    const auto mask = attend::query_padding({5, 3}) && attend::causal(alignment::bottom_right);
    check_fd("query padding", d, mask);
    auto x = random_qkv(d, 1);
    const auto f = forward(x.q, x.k, x.v, mask, {});
    const auto w = attend_test::random_tensor<double>(3, d.batch, d.heads, d.query_len, d.value_dim);
    const auto g = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, f.out, f.lse, w);
    for (index_t h = 0; h < d.heads; ++h)
        for (index_t i = 3; i < d.query_len; ++i)
            for (index_t c = 0; c < d.head_dim; ++c) EXPECT_EQ(g.d_query(1, h, i, c), 0.0);
}

TEST(BackwardFiniteDifferences, RelativeBiasInputsAndTable) {
    for (const alignment align : {alignment::top_left, alignment::bottom_right}) {
        SCOPED_TRACE(align == alignment::top_left ? "top_left" : "bottom_right");
        dims d;
        d.heads = 4;
        d.kv_heads = 2;
        attend::relative_position_bias<double> table(d.heads, true, 8, 10, 5);
        sdpa_options o;
        o.score_bias = attend::score_bias::relative(table, align);
        auto mask = attend::sliding_window(3, 2, align);
        check_fd("relative bias", d, mask, o);
        // d loss / d table by finite differences on the table itself.
        auto x = random_qkv(d, 31);
        const auto f = forward(x.q, x.k, x.v, mask, o);
        const auto w = attend_test::random_tensor<double>(32, d.batch, d.heads, d.query_len, d.value_dim);
        const std::function<double()> loss = [&] {
            sdpa_options perturbed = o;
            perturbed.score_bias = attend::score_bias::relative(table, align);
            return dot(forward(x.q, x.k, x.v, mask, perturbed).out, w);
        };
        tensor<double, 2> entries = table.table();
        const auto fd = fd_gradient(table.table(), loss);
        for (const kernel kern : {kernel::reference, kernel::automatic}) {
            o.kernel = kern;
            const auto g = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, f.out, f.lse, w, o);
            ASSERT_EQ(g.d_score_bias.dimension(0), d.heads);
            ASSERT_EQ(g.d_score_bias.dimension(1), d.query_len + d.key_len - 1);
            expect_close_to_fd(attend::relative_bias_gradient(table, g, o.score_bias), fd, "d table");
        }
        EXPECT_TRUE(bit_equal(entries, table.table()));
    }
}

TEST(BackwardFiniteDifferences, RelativeBiasFloatTable) {
    dims d;
    attend::relative_position_bias<float> table(d.heads, false, 4, 6, 9);
    sdpa_options o;
    o.score_bias = attend::score_bias::relative(table, attend::alignment::top_left);
    auto x = random_qkv(d, 41);
    const auto f = forward(x.q, x.k, x.v, attend::no_mask{}, o);
    const auto g = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, f.out, f.lse, f.out, o);
    const tensor<float, 2> dt = attend::relative_bias_gradient(table, g, o.score_bias);
    // Every key - query offset lands in exactly one bucket, so the table gradient sums to the offset gradient.
    double total = 0, by_offset = 0;
    for (index_t n = 0; n < dt.size(); ++n) total += static_cast<double>(dt.data()[n]);
    for (index_t n = 0; n < g.d_score_bias.size(); ++n) by_offset += g.d_score_bias.data()[n];
    EXPECT_NEAR(total, by_offset, 1e-5);
}

// ---- PyTorch goldens ------------------------------------------------------------------------------------------

TEST(BackwardGolden, MatchesPyTorchAutograd) {
    const auto doc = attend_test::load_golden("sdpa_backward.json");
    int cases = 0;
    for (const auto& c : doc.at("cases")) {
        const std::string name = c.at("name").get<std::string>();
        ASSERT_EQ(c.at("mask").at("kind").get<std::string>(), "causal_bottom_right") << name;
        const auto q = attend_test::tensor_at<double, 4>(c, "q"), k = attend_test::tensor_at<double, 4>(c, "k"),
                   v = attend_test::tensor_at<double, 4>(c, "v"), out = attend_test::tensor_at<double, 4>(c, "out"),
                   d_out = attend_test::tensor_at<double, 4>(c, "d_out");
        const auto lse = attend_test::tensor_at<double, 3>(c, "lse");
        const auto dq = attend_test::tensor_at<double, 4>(c, "dq"), dk = attend_test::tensor_at<double, 4>(c, "dk"),
                   dv = attend_test::tensor_at<double, 4>(c, "dv");
        sdpa_options o;
        o.scale = attend_test::to_optional_number(c.at("scale"));
        for (const kernel kern : {kernel::reference, kernel::automatic}) {
            o.kernel = kern;
            const auto g = attend::scaled_dot_product_attention_backward(
                q, k, v, attend::causal(alignment::bottom_right), out, lse, d_out, o);
            const double eq = max_abs_diff(g.d_query, dq), ek = max_abs_diff(g.d_key, dk),
                         ev = max_abs_diff(g.d_value, dv);
            std::cout << "[golden] " << name << (kern == kernel::reference ? " reference" : " tiled")
                      << ": max abs error dq " << eq << ", dk " << ek << ", dv " << ev << '\n';
            EXPECT_LE(eq, 1e-10) << name;
            EXPECT_LE(ek, 1e-10) << name;
            EXPECT_LE(ev, 1e-10) << name;
        }
        ++cases;
    }
    EXPECT_EQ(cases, 2);
}

// ---- tiled against reference ------------------------------------------------------------------------------------

/// One random configuration of the differential test.
struct config {
    dims d;
    int mask_kind = 0;
    std::uint64_t mask_seed = 0, data_seed = 0;
    sdpa_options options;
    attend::detail::backward_tiling tiling;
    bool default_tiling = false;

    std::string describe() const {
        std::ostringstream s;
        s << "B " << d.batch << " H " << d.heads << " Hkv " << d.kv_heads << " L " << d.query_len << " S " << d.key_len
          << " D " << d.head_dim << " Dv " << d.value_dim << " mask " << mask_kind << " (seed " << mask_seed
          << ") bias " << !options.score_bias.empty() << " dropout " << options.dropout.training << " p "
          << options.dropout.probability << " threads " << options.threads << " tiles "
          << (default_tiling ? std::string("default")
                             : std::to_string(tiling.block_q) + "x" + std::to_string(tiling.block_k));
        return s.str();
    }
};

constexpr int mask_kinds = 16;

/// Calls f with the mask expression of kind `kind` built for the configuration (random parameters from seed).
template <class F>
void with_mask(const config& c, F&& f) {
    attend_test::rng g(c.mask_seed);
    const dims& d = c.d;
    const auto align = [&] { return g.bernoulli(0.5) ? alignment::top_left : alignment::bottom_right; };
    const auto lengths = [&](index_t limit) {
        std::vector<index_t> n;
        for (index_t b = 0; b < d.batch; ++b) n.push_back(g.uniform_int(0, limit));
        return n;
    };
    const auto dense_allowed = [&] {
        const bool per_batch = g.bernoulli(0.5);
        const double p = g.uniform(0.2, 0.95);
        tensor<bool, 4> m(per_batch ? d.batch : 1, 1, d.query_len, d.key_len);
        for (index_t n = 0; n < m.size(); ++n) m.data()[n] = g.bernoulli(p);
        return attend::allowed_mask::from_torch_sdpa(m);
    };
    const auto additive = [&] {
        tensor<double, 4> m(d.batch, g.bernoulli(0.5) ? d.heads : 1, d.query_len, d.key_len);
        for (index_t n = 0; n < m.size(); ++n)
            m.data()[n] = g.bernoulli(0.2) ? -std::numeric_limits<double>::infinity() : g.uniform(-3, 3);
        return attend::additive_mask<double>::from_values(m);
    };
    // An alignment, or one diagonal offset per batch row.
    const auto diagonal = [&]() -> attend::diagonal {
        if (g.bernoulli(0.5)) return align();
        std::vector<index_t> offsets;
        for (index_t b = 0; b < d.batch; ++b) offsets.push_back(g.uniform_int(-d.query_len, d.key_len));
        return attend::diagonal_offsets(offsets);
    };
    const auto window = [&] {
        const index_t left = g.bernoulli(0.2) ? attend::unbounded : g.uniform_int(0, d.key_len);
        const index_t right = g.uniform_int(0, d.key_len);
        return attend::sliding_window(left, right, diagonal());
    };
    switch (c.mask_kind) {
        case 0: return f(attend::no_mask{});
        case 1: return f(attend::causal(alignment::top_left));
        case 2: return f(attend::causal(alignment::bottom_right));
        case 3: return f(window());
        case 4: return f(attend::key_padding(lengths(d.key_len)));
        case 5: return f(attend::query_padding(lengths(d.query_len)) && attend::causal(alignment::bottom_right));
        case 6: return f(dense_allowed());
        case 7: return f(additive());
        case 8: return f(additive() + attend::causal(alignment::top_left));
        case 9: return f(attend::causal(alignment::top_left) && attend::key_padding(lengths(d.key_len)));
        case 10: return f(attend::prefix_lm(g.uniform_int(0, d.key_len), align()));
        case 11: {  // needs query_len == key_len; the generator makes them equal for this kind
            std::vector<index_t> blocks;
            for (index_t left = d.query_len; left > 0;) {
                const index_t n = std::min(left, g.uniform_int(1, 40));
                blocks.push_back(n);
                left -= n;
            }
            return f(attend::block_diagonal(attend::segment_lengths(blocks)));
        }
        case 12: return f(window() || dense_allowed());
        case 13: return f(!dense_allowed());
        case 14: return f(window() && attend::query_padding(lengths(d.query_len)));
        default: {  // ONNX's is_causal with nonpad_kv_seqlen: causal over each row's real keys
            const auto real_keys = lengths(d.key_len);
            return f(attend::causal(attend::aligned_to_key_lengths(real_keys)) && attend::key_padding(real_keys));
        }
    }
}

config random_config(attend_test::rng& g) {
    config c;
    c.d.batch = g.uniform_int(1, 2);
    c.d.kv_heads = g.uniform_int(1, 3);
    c.d.heads = c.d.kv_heads * g.uniform_int(1, 3);
    c.d.query_len = g.uniform_int(1, 140);
    c.d.key_len = g.bernoulli(0.2) ? c.d.query_len : g.uniform_int(1, 140);
    c.d.head_dim = g.uniform_int(1, 24);
    c.d.value_dim = g.bernoulli(0.3) ? c.d.head_dim : g.uniform_int(1, 24);
    c.mask_kind = static_cast<int>(g.uniform_int(0, mask_kinds - 1));
    if (c.mask_kind == 11) c.d.key_len = c.d.query_len;
    c.mask_seed = g.next();
    c.data_seed = g.next();
    sdpa_options& o = c.options;
    o.empty_rows = attend::empty_rows::zero;  // random masks may leave rows empty
    if (g.bernoulli(0.3)) o.scale = g.uniform(0.05, 2.0);
    const alignment bias_align = g.bernoulli(0.5) ? alignment::top_left : alignment::bottom_right;
    switch (g.uniform_int(0, 3)) {
        case 1: o.score_bias = attend::score_bias::alibi(attend::alibi_slopes(c.d.heads), bias_align); break;
        case 2: {
            const bool bidirectional = g.bernoulli(0.5);
            const index_t buckets = 2 * g.uniform_int(2, 8);
            attend::relative_position_bias<double> table(c.d.heads, bidirectional, buckets,
                                                         buckets + g.uniform_int(1, 40), g.next());
            o.score_bias = attend::score_bias::relative(table, bias_align);
            break;
        }
        default: break;
    }
    if (g.bernoulli(0.3)) o.dropout = {g.uniform(0.05, 0.6), g.next(), true};
    o.threads = static_cast<int>(g.uniform_int(1, 3));
    c.default_tiling = g.bernoulli(0.2);
    c.tiling.block_q = g.uniform_int(1, 40);
    c.tiling.block_k = g.uniform_int(1, 40);
    return c;
}

/// The tiled backward with an explicit tiling (the public entry always takes the default one).
template <class T, class Mask>
attend::attention_gradients<T, 4> tiled_backward(const tensor<T, 4>& q, const tensor<T, 4>& k, const tensor<T, 4>& v,
                                                 const tensor<T, 4>& out, const tensor<T, 3>& lse,
                                                 const tensor<T, 4>& d_out, const Mask& mask, sdpa_options o,
                                                 const attend::detail::backward_tiling& tiling) {
    o.kernel = kernel::automatic;
    attend::attention_gradients<T, 4> g;
    g.d_query.resize(q.dimensions());
    g.d_key.resize(k.dimensions());
    g.d_value.resize(v.dimensions());
    attend::detail::gradient_outputs<T> outputs;
    outputs.d_query = attend::detail::as_mutable_view(g.d_query);
    outputs.d_key = attend::detail::as_mutable_view(g.d_key);
    outputs.d_value = attend::detail::as_mutable_view(g.d_value);
    if (!o.score_bias.empty()) {
        g.d_score_bias.resize(q.dimension(1), q.dimension(2) + k.dimension(2) - 1);
        outputs.d_score_bias = g.d_score_bias.data();
    }
    const auto in = attend::detail::backward_inputs_of<4>(q, k, v, out, lse, d_out);
    const auto checked = attend::detail::check_backward(in, &outputs, mask, o);
    attend::detail::run_backward(in, checked, outputs, tiling);
    return g;
}

/// Largest difference between the kernels relative to `scale`; exact agreement is required when scale is 0.
template <class T, int Rank>
double relative_error(const tensor<T, Rank>& tiled, const tensor<T, Rank>& reference, double scale) {
    const double diff = max_abs_diff(tiled, reference);
    if (scale == 0) return diff == 0 ? 0 : std::numeric_limits<double>::infinity();
    return diff / scale;
}

template <class T, int Rank>
double relative_error(const tensor<T, Rank>& tiled, const tensor<T, Rank>& reference) {
    return relative_error(tiled, reference, static_cast<double>(max_abs(reference)));
}

struct differential_stats {
    double worst = 0;
    int runs = 0;
};

/// Tolerances. Errors are measured relative to the largest magnitude among the reference's dq, dk, dv (and
/// score_bias gradient): all of them are sums of products of the same P, dP = d_out v^T, q, k, v, so their
/// rounding scales with those terms, and a tensor that is small by cancellation carries the rounding of its terms,
/// not of its own size (when every row attends exactly one key, dS = P (dP - D) and with it dq and dk are 0 in
/// exact arithmetic, and each kernel returns its own rounding noise). The two kernels compute the same sums in
/// different orders and roundings: GEMM blocking vs one product per (batch, head), scale folded into K vs applied
/// to the scores, P = exp(s - lse) from the forward's lse vs a max-subtracted softmax, dK / dV summed per tile vs
/// per head. With inputs in [-1, 1) every entry is a sum of at most group x max(L, S) <= 420 terms, so the
/// difference is bounded by about 420 eps of the largest magnitude: 2.5e-5 in float (eps 6e-8), 5e-14 in double
/// (eps 1.1e-16), typical errors being near the square root of the count times eps (measured worst: 1e-6 and
/// 3e-15). float <= 1e-4 and double <= 1e-11 leave margins of 4x and 200x over the bound, while a real defect (a
/// wrong tile boundary, mask, dropout decision or head) is an error of order 1.
template <class T>
void run_differential(const config& c, differential_stats& stats) {
    const double tolerance = sizeof(T) == 4 ? 1e-4 : 1e-11;
    with_mask(c, [&](const auto& mask) {
        const dims& d = c.d;
        auto x = random_qkv(d, c.data_seed);
        tensor<T, 4> q = x.q.template cast<T>(), k = x.k.template cast<T>(), v = x.v.template cast<T>();
        tensor<T, 4> d_out =
            attend_test::random_tensor<double>(c.data_seed + 3, d.batch, d.heads, d.query_len, d.value_dim)
                .template cast<T>();
        const auto f = forward(q, k, v, mask, c.options);
        sdpa_options reference_options = c.options;
        reference_options.kernel = kernel::reference;
        const auto r =
            attend::scaled_dot_product_attention_backward(q, k, v, mask, f.out, f.lse, d_out, reference_options);
        const auto t = c.default_tiling ? attend::scaled_dot_product_attention_backward(q, k, v, mask, f.out, f.lse,
                                                                                        d_out, c.options)
                                        : tiled_backward(q, k, v, f.out, f.lse, d_out, mask, c.options, c.tiling);
        double magnitude = std::max({max_abs(r.d_query), max_abs(r.d_key), max_abs(r.d_value)});
        if (!c.options.score_bias.empty()) magnitude = std::max<double>(magnitude, max_abs(r.d_score_bias));
        const double eq = relative_error(t.d_query, r.d_query, magnitude),
                     ek = relative_error(t.d_key, r.d_key, magnitude),
                     ev = relative_error(t.d_value, r.d_value, magnitude);
        const double eb = c.options.score_bias.empty() ? 0 : relative_error(t.d_score_bias, r.d_score_bias, magnitude);
        const double worst = std::max({eq, ek, ev, eb});
        stats.worst = std::max(stats.worst, worst);
        ++stats.runs;
        EXPECT_TRUE(all_finite(t.d_query) && all_finite(t.d_key) && all_finite(t.d_value)) << c.describe();
        EXPECT_LE(worst, tolerance) << (sizeof(T) == 4 ? "float " : "double ") << c.describe() << ": dq " << eq
                                    << " dk " << ek << " dv " << ev << " bias " << eb;
    });
}

TEST(BackwardDifferential, TiledMatchesReference) {
    attend_test::rng g(20240602);
    differential_stats single, twice;
    const int configs = attend_test::repeat(240);
    for (int n = 0; n < configs; ++n) {
        const config c = random_config(g);
        run_differential<double>(c, twice);
        run_differential<float>(c, single);
    }
    std::cout << "[differential] " << twice.runs << " double configurations, worst relative error " << twice.worst
              << "; " << single.runs << " float configurations, worst " << single.worst << '\n';
}

// ---- thread-count independence ---------------------------------------------------------------------------------

TEST(BackwardThreads, BitIdenticalForAnyThreadCount) {
    struct shape_case {
        dims d;
        bool small_tiles;
    };
    // Few (batch, kv head) pairs split the keys into chunks whose dQ partials are reduced after the units (first
    // two cases: 3 and 5 chunks); 2 x 8 pairs do not split.
    const shape_case cases[] = {
        {{1, 3, 1, 70, 300, 16, 8}, false}, {{1, 4, 2, 61, 97, 5, 7}, true}, {{2, 16, 8, 20, 40, 4, 4}, true}};
    for (const auto& sc : cases) {
        const dims& d = sc.d;
        auto x = random_qkv(d, 5);
        const auto w = attend_test::random_tensor<double>(9, d.batch, d.heads, d.query_len, d.value_dim);
        sdpa_options o;
        o.empty_rows = attend::empty_rows::zero;
        o.dropout = {0.2, 42, true};
        attend::relative_position_bias<double> table(d.heads, true, 16, 50, 3);
        o.score_bias = attend::score_bias::relative(table, alignment::bottom_right);
        const auto mask = attend::causal(alignment::bottom_right) &&
                          attend::key_padding(std::vector<index_t>(static_cast<std::size_t>(d.batch), d.key_len - 3));
        const auto f = forward(x.q, x.k, x.v, mask, o);
        std::vector<attend::attention_gradients<double, 4>> results;
        for (const int threads : {1, 2, 7}) {
            o.threads = threads;
            results.push_back(sc.small_tiles ? tiled_backward(x.q, x.k, x.v, f.out, f.lse, w, mask, o, {13, 11})
                                             : attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, f.out,
                                                                                             f.lse, w, o));
        }
        for (std::size_t n = 1; n < results.size(); ++n) {
            EXPECT_TRUE(bit_equal(results[0].d_query, results[n].d_query)) << "dq, run " << n;
            EXPECT_TRUE(bit_equal(results[0].d_key, results[n].d_key)) << "dk, run " << n;
            EXPECT_TRUE(bit_equal(results[0].d_value, results[n].d_value)) << "dv, run " << n;
            EXPECT_TRUE(bit_equal(results[0].d_score_bias, results[n].d_score_bias)) << "bias";
        }
        o.kernel = kernel::reference;
        const auto r = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, f.out, f.lse, w, o);
        EXPECT_LE(relative_error(results[0].d_query, r.d_query), 1e-11);
        EXPECT_LE(relative_error(results[0].d_key, r.d_key), 1e-11);
        EXPECT_LE(relative_error(results[0].d_value, r.d_value), 1e-11);
    }
}

// ---- strided views and outputs -------------------------------------------------------------------------------

TEST(BackwardViews, StridedHeadsAsMultiHeadAttentionPassesThem) {
    // Projected buffers [batch, len, heads * dim], read and written through split_heads, as mha.hpp does.
    const index_t B = 2, H = 4, Hkv = 2, L = 37, S = 45, D = 6, Dv = 5;
    const auto pq = attend_test::random_tensor<double>(1, B, L, H * D),
               pk = attend_test::random_tensor<double>(2, B, S, Hkv * D),
               pv = attend_test::random_tensor<double>(3, B, S, Hkv * Dv),
               pd = attend_test::random_tensor<double>(4, B, L, H * Dv);
    // The same data as contiguous [batch, heads, len, dim] tensors.
    const auto heads_first = [](const tensor<double, 3>& x, index_t heads) {
        const index_t b = x.dimension(0), len = x.dimension(1), dim = x.dimension(2) / heads;
        tensor<double, 4> t(b, heads, len, dim);
        for (index_t n = 0; n < b; ++n)
            for (index_t h = 0; h < heads; ++h)
                for (index_t i = 0; i < len; ++i)
                    for (index_t c = 0; c < dim; ++c) t(n, h, i, c) = x(n, i, h * dim + c);
        return t;
    };
    const auto q = heads_first(pq, H), k = heads_first(pk, Hkv), v = heads_first(pv, Hkv), d_out = heads_first(pd, H);
    const auto mask = attend::causal(alignment::bottom_right);
    const auto f = forward(q, k, v, mask, {});
    tensor<double, 3> pout(B, L, H * Dv);  // out in the projected layout too
    for (index_t n = 0; n < B; ++n)
        for (index_t h = 0; h < H; ++h)
            for (index_t i = 0; i < L; ++i)
                for (index_t c = 0; c < Dv; ++c) pout(n, i, h * Dv + c) = f.out(n, h, i, c);
    tensor<double, 3> gq(B, L, H * D), gk(B, S, Hkv * D), gv(B, S, Hkv * Dv);
    for (const kernel kern : {kernel::reference, kernel::automatic}) {
        sdpa_options o;
        o.kernel = kern;
        o.threads = 2;
        attend::detail::backward_inputs<double> in;
        in.q = attend::split_heads(pq.data(), B, L, H, D);
        in.k = attend::split_heads(pk.data(), B, S, Hkv, D);
        in.v = attend::split_heads(pv.data(), B, S, Hkv, Dv);
        in.out = attend::split_heads(static_cast<const double*>(pout.data()), B, L, H, Dv);
        in.d_out = attend::split_heads(pd.data(), B, L, H, Dv);
        in.lse = f.lse.data();
        in.lse_dims = {B, H, L};
        attend::detail::gradient_outputs<double> out;
        out.d_query = attend::split_heads(gq.data(), B, L, H, D);
        out.d_key = attend::split_heads(gk.data(), B, S, Hkv, D);
        out.d_value = attend::split_heads(gv.data(), B, S, Hkv, Dv);
        gq.setConstant(std::numeric_limits<double>::quiet_NaN());
        gk.setConstant(std::numeric_limits<double>::quiet_NaN());
        gv.setConstant(std::numeric_limits<double>::quiet_NaN());
        attend::detail::sdpa_backward_views(in, mask, o, out);
        const auto g = attend::scaled_dot_product_attention_backward(q, k, v, mask, f.out, f.lse, d_out, o);
        EXPECT_LE(max_abs_diff(heads_first(gq, H), g.d_query), 1e-13);
        EXPECT_LE(max_abs_diff(heads_first(gk, Hkv), g.d_key), 1e-13);
        EXPECT_LE(max_abs_diff(heads_first(gv, Hkv), g.d_value), 1e-13);
    }
}

TEST(BackwardViews, IntoFormWritesTheSameAsTheAllocatingForm) {
    const dims d;
    auto x = random_qkv(d, 17);
    sdpa_options o;
    o.score_bias = attend::score_bias::alibi({0.5, 0.25}, alignment::bottom_right);
    const auto mask = attend::causal(alignment::bottom_right);
    const auto f = forward(x.q, x.k, x.v, mask, o);
    const auto g = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, f.out, f.lse, f.out, o);
    tensor<double, 4> dq(x.q.dimensions()), dk(x.k.dimensions()), dv(x.v.dimensions());
    tensor<double, 2> db(d.heads, d.query_len + d.key_len - 1);
    attend::scaled_dot_product_attention_backward_into(x.q, x.k, x.v, mask, f.out, f.lse, f.out, o, dq, dk, dv, db);
    EXPECT_TRUE(bit_equal(dq, g.d_query) && bit_equal(dk, g.d_key) && bit_equal(dv, g.d_value));
    EXPECT_TRUE(bit_equal(db, g.d_score_bias));
    // TensorMap outputs work too.
    attend::tensor_view<double, 4> dq_map(dq.data(), dq.dimensions());
    attend::scaled_dot_product_attention_backward_into(x.q, x.k, x.v, mask, f.out, f.lse, f.out, o, dq_map, dk, dv);
    EXPECT_TRUE(bit_equal(dq, g.d_query));
}

TEST(BackwardViews, ForwardResultWholeNeedsNoOptionToRemember) {
    const dims d;
    auto x = random_qkv(d, 23);
    const auto mask = attend::causal(alignment::top_left);
    // Default options: lse is there without asking.
    const auto f = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask);
    ASSERT_EQ(f.lse.dimensions(), (std::array<index_t, 3>{d.batch, d.heads, d.query_len}));
    const auto d_out = attend_test::random_tensor<double>(29, d.batch, d.heads, d.query_len, d.value_dim);
    const auto from_parts = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, f.out, f.lse, d_out);
    const auto from_result = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, f, d_out);
    EXPECT_TRUE(bit_equal(from_result.d_query, from_parts.d_query) && bit_equal(from_result.d_key, from_parts.d_key) &&
                bit_equal(from_result.d_value, from_parts.d_value));
    const auto plain = attend::scaled_dot_product_attention(x.q, x.k, x.v);
    const auto g_plain = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, plain, d_out);
    const auto g_parts = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, plain.out, plain.lse, d_out);
    EXPECT_TRUE(bit_equal(g_plain.d_query, g_parts.d_query));
    // Turning lse off and then handing the result to the backward says what to do instead of a bare shape.
    sdpa_options off;
    off.need_lse = false;
    const auto without = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, off);
    EXPECT_EQ(without.lse.size(), 0);
    const auto msg = expect_error<attend::shape_error>(
        [&] { (void)attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, without, d_out); },
        "attend.shape.backward_lse");
    EXPECT_NE(msg.find("need_lse = true"), std::string::npos) << msg;
}

TEST(BackwardViews, EmptyQueriesGiveZeroKeyGradients) {
    for (const kernel kern : {kernel::reference, kernel::automatic}) {
        const auto q = attend_test::random_tensor<double>(1, 2, 3, 0, 4);
        const auto k = attend_test::random_tensor<double>(2, 2, 3, 5, 4),
                   v = attend_test::random_tensor<double>(3, 2, 3, 5, 2);
        sdpa_options o;
        o.kernel = kern;
        const auto f = forward(q, k, v, attend::no_mask{}, o);
        const auto g = attend::scaled_dot_product_attention_backward(q, k, v, f.out, f.lse, f.out, o);
        EXPECT_EQ(g.d_query.size(), 0);
        EXPECT_EQ(max_abs(g.d_key), 0.0);
        EXPECT_EQ(max_abs(g.d_value), 0.0);
        const auto empty_batch = attend_test::random_tensor<double>(1, 0, 3, 2, 4);
        const auto kb = attend_test::random_tensor<double>(1, 0, 3, 5, 4);
        const auto fb = forward(empty_batch, kb, kb, attend::no_mask{}, o);
        EXPECT_EQ(attend::scaled_dot_product_attention_backward(empty_batch, kb, kb, fb.out, fb.lse, fb.out, o)
                      .d_query.size(),
                  0);
    }
}

TEST(BackwardViews, FloatLongSequenceMatchesReference) {
    // Default tiles of the public entry, several tiles each way, float, GQA, causal.
    dims d{1, 4, 2, 300, 333, 32, 16};
    auto x = random_qkv(d, 71);
    const tensor<float, 4> q = x.q.cast<float>(), k = x.k.cast<float>(), v = x.v.cast<float>();
    const auto mask = attend::causal(alignment::bottom_right);
    const auto f = forward(q, k, v, mask, {});
    sdpa_options o;
    const auto t = attend::scaled_dot_product_attention_backward(q, k, v, mask, f.out, f.lse, f.out, o);
    o.kernel = kernel::reference;
    const auto r = attend::scaled_dot_product_attention_backward(q, k, v, mask, f.out, f.lse, f.out, o);
    EXPECT_LE(relative_error(t.d_query, r.d_query), 1e-4);
    EXPECT_LE(relative_error(t.d_key, r.d_key), 1e-4);
    EXPECT_LE(relative_error(t.d_value, r.d_value), 1e-4);
}

// ---- errors ----------------------------------------------------------------------------------------------------

/// Calls the _into form on outputs filled with a sentinel and checks the error and that nothing was written.
struct error_fixture {
    dims d;
    tensor<double, 4> q, k, v, out, d_out, d_query, d_key, d_value;
    tensor<double, 3> lse;
    tensor<double, 2> bias_grad;

    error_fixture() {
        auto x = random_qkv(d, 3);
        q = x.q;
        k = x.k;
        v = x.v;
        const auto f = forward(q, k, v, attend::no_mask{}, {});
        out = f.out;
        lse = f.lse;
        d_out = f.out;
        d_query = tensor<double, 4>(q.dimensions());
        d_key = tensor<double, 4>(k.dimensions());
        d_value = tensor<double, 4>(v.dimensions());
        bias_grad = tensor<double, 2>(d.heads, d.query_len + d.key_len - 1);
        reset();
    }
    void reset() {
        d_query.setConstant(42);
        d_key.setConstant(42);
        d_value.setConstant(42);
        bias_grad.setConstant(42);
    }
    bool untouched() const {
        for (const auto* t : {&d_query, &d_key, &d_value})
            for (index_t n = 0; n < t->size(); ++n)
                if (t->data()[n] != 42) return false;
        for (index_t n = 0; n < bias_grad.size(); ++n)
            if (bias_grad.data()[n] != 42) return false;
        return true;
    }
    template <class E, class F>
    void expect(const std::string& id, F&& call) {
        SCOPED_TRACE(id);
        reset();
        expect_error<E>(call, id);
        EXPECT_TRUE(untouched()) << id << ": an output was written before the throw";
    }
};

TEST(BackwardErrors, ShapesOfOutLseAndDOut) {
    error_fixture x;
    using attend::scaled_dot_product_attention_backward_into;
    const dims& d = x.d;
    const attend::no_mask none;
    tensor<double, 4> bad_out(d.batch, d.heads, d.query_len, d.value_dim + 1);
    bad_out.setZero();
    tensor<double, 3> bad_lse(d.batch, d.heads, d.query_len + 1);
    bad_lse.setZero();
    tensor<double, 4> bad_d_out(d.batch, d.heads + 1, d.query_len, d.value_dim);
    bad_d_out.setZero();
    x.expect<attend::shape_error>("attend.shape.backward_out", [&] {
        scaled_dot_product_attention_backward_into(x.q, x.k, x.v, none, bad_out, x.lse, x.d_out, x.d_query, x.d_key,
                                                   x.d_value);
    });
    x.expect<attend::shape_error>("attend.shape.backward_lse", [&] {
        scaled_dot_product_attention_backward_into(x.q, x.k, x.v, none, x.out, bad_lse, x.d_out, x.d_query, x.d_key,
                                                   x.d_value);
    });
    x.expect<attend::shape_error>("attend.shape.backward_d_out", [&] {
        scaled_dot_product_attention_backward_into(x.q, x.k, x.v, none, x.out, x.lse, bad_d_out, x.d_query, x.d_key,
                                                   x.d_value);
    });
    expect_error<attend::shape_error>(
        [&] { attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, bad_out, x.lse, x.d_out); },
        "attend.shape.backward_out");
    try {
        attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, x.out, bad_lse, x.d_out);
    } catch (const attend::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find("lse [2,2,6] != expected [2,2,5]"), std::string::npos) << e.what();
    }
}

TEST(BackwardErrors, ShapesOfGradientOutputs) {
    error_fixture x;
    using attend::scaled_dot_product_attention_backward_into;
    const dims& d = x.d;
    const attend::no_mask none;
    tensor<double, 4> bad_dq(d.batch, d.heads, d.query_len, d.head_dim + 1),
        bad_dk(d.batch, d.kv_heads, d.key_len + 1, d.head_dim), bad_dv(d.batch, d.kv_heads, d.key_len, d.value_dim + 2);
    x.expect<attend::shape_error>("attend.shape.backward_dq", [&] {
        scaled_dot_product_attention_backward_into(x.q, x.k, x.v, none, x.out, x.lse, x.d_out, bad_dq, x.d_key,
                                                   x.d_value);
    });
    x.expect<attend::shape_error>("attend.shape.backward_dk", [&] {
        scaled_dot_product_attention_backward_into(x.q, x.k, x.v, none, x.out, x.lse, x.d_out, x.d_query, bad_dk,
                                                   x.d_value);
    });
    x.expect<attend::shape_error>("attend.shape.backward_dv", [&] {
        scaled_dot_product_attention_backward_into(x.q, x.k, x.v, none, x.out, x.lse, x.d_out, x.d_query, x.d_key,
                                                   bad_dv);
    });
    sdpa_options o;
    o.score_bias = attend::score_bias::alibi({1, 2}, attend::alignment::top_left);
    tensor<double, 2> bad_bias(d.heads, d.query_len + d.key_len);
    x.expect<attend::shape_error>("attend.shape.backward_score_bias", [&] {
        scaled_dot_product_attention_backward_into(x.q, x.k, x.v, none, x.out, x.lse, x.d_out, o, x.d_query, x.d_key,
                                                   x.d_value, bad_bias);
    });
}

TEST(BackwardErrors, ForwardChecks) {
    error_fixture x;
    using attend::scaled_dot_product_attention_backward_into;
    const dims& d = x.d;
    const attend::no_mask none;
    const auto call = [&](const auto& mask, const sdpa_options& o) {
        return [&x, mask, o] {
            scaled_dot_product_attention_backward_into(x.q, x.k, x.v, mask, x.out, x.lse, x.d_out, o, x.d_query,
                                                       x.d_key, x.d_value, x.bias_grad);
        };
    };
    tensor<double, 4> k_wide(d.batch, d.kv_heads, d.key_len, d.head_dim + 1);
    k_wide.setZero();
    x.expect<attend::shape_error>("attend.shape.key_dim", [&] {
        scaled_dot_product_attention_backward_into(x.q, k_wide, x.v, none, x.out, x.lse, x.d_out, x.d_query, x.d_key,
                                                   x.d_value);
    });
    tensor<double, 4> k3(d.batch, 3, d.key_len, d.head_dim), v3(d.batch, 3, d.key_len, d.value_dim);
    k3.setZero();
    v3.setZero();
    x.expect<attend::shape_error>("attend.shape.gqa", [&] {
        scaled_dot_product_attention_backward_into(x.q, k3, v3, none, x.out, x.lse, x.d_out, x.d_query, x.d_key,
                                                   x.d_value);
    });
    sdpa_options o;
    o.scale = -1.0;
    x.expect<attend::value_error>("attend.value.scale", call(none, o));
    o = {};
    o.dropout = {1.0, 0, true};
    x.expect<attend::value_error>("attend.value.dropout", call(none, o));
    o = {};
    o.threads = -2;
    x.expect<attend::value_error>("attend.value.threads", call(none, o));
    o = {};
    o.score_bias = attend::score_bias::alibi({1, 2, 3}, attend::alignment::top_left);
    x.expect<attend::shape_error>("attend.shape.score_bias_heads", call(none, o));
    tensor<bool, 2> wrong(d.query_len + 1, d.key_len);
    wrong.setConstant(true);
    x.expect<attend::mask_error>("attend.mask.broadcast", call(attend::allowed_mask::query_key_grid(wrong), {}));
    x.expect<attend::mask_error>("attend.mask.lengths_batch", call(attend::key_padding({1}), {}));
    x.expect<attend::mask_error>("attend.mask.empty_row", call(attend::key_padding({3, 0}), {}));
}

TEST(BackwardErrors, NonFiniteInputs) {
    error_fixture x;
    using attend::scaled_dot_product_attention_backward_into;
    const attend::no_mask none;
    const auto run = [&] {
        scaled_dot_product_attention_backward_into(x.q, x.k, x.v, none, x.out, x.lse, x.d_out, x.d_query, x.d_key,
                                                   x.d_value);
    };
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    for (auto* t : {&x.q, &x.k, &x.v, &x.out, &x.d_out}) {
        const double saved = t->data()[3];
        t->data()[3] = t == &x.d_out ? inf : nan;
        x.expect<attend::value_error>("attend.value.non_finite", run);
        t->data()[3] = saved;
    }
    for (const double bad : {nan, inf}) {
        const double saved = x.lse.data()[4];
        x.lse.data()[4] = bad;
        x.expect<attend::value_error>("attend.value.lse", run);
        x.lse.data()[4] = saved;
    }
    // lse = -inf is the forward's marker of a zero row: accepted, and that row gets zero gradients.
    x.lse(0, 1, 2) = -inf;
    x.reset();
    run();
    for (index_t c = 0; c < x.d.head_dim; ++c) EXPECT_EQ(x.d_query(0, 1, 2, c), 0.0);
    EXPECT_TRUE(all_finite(x.d_key) && all_finite(x.d_value));
}

TEST(BackwardErrors, RelativeBiasGradient) {
    const dims d;
    auto x = random_qkv(d, 5);
    attend::relative_position_bias<double> table(d.heads, true, 8, 20, 1), other(d.heads, true, 8, 20, 2),
        wrong_heads(3, true, 8, 20, 1);
    sdpa_options o;
    o.score_bias = attend::score_bias::relative(table, attend::alignment::top_left);
    const auto f = forward(x.q, x.k, x.v, attend::no_mask{}, o);
    const auto g = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, f.out, f.lse, f.out, o);
    EXPECT_NO_THROW(attend::relative_bias_gradient(table, g, o.score_bias));
    expect_error<attend::value_error>([&] { attend::relative_bias_gradient(other, g, o.score_bias); },
                                      "attend.value.relative_bias_table");
    // A bias built from another table, with the call's table passed along: caught the same way.
    expect_error<attend::value_error>(
        [&] {
            attend::relative_bias_gradient(table, g, attend::score_bias::relative(other, attend::alignment::top_left));
        },
        "attend.value.relative_bias_table");
    expect_error<attend::shape_error>([&] { attend::relative_bias_gradient(wrong_heads, g, o.score_bias); },
                                      "attend.shape.relative_bias_gradient");
    const auto plain = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, f.out, f.lse, f.out);
    EXPECT_EQ(plain.d_score_bias.size(), 0);
    expect_error<attend::shape_error>([&] { attend::relative_bias_gradient(table, plain, o.score_bias); },
                                      "attend.shape.relative_bias_gradient");
}

}  // namespace
