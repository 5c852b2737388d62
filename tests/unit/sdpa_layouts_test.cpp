// SPDX-License-Identifier: MIT
// How the operands of scaled_dot_product_attention (sdpa.hpp) are laid out: grouped-query attention against
// explicitly repeated keys and values, the _into form into tensors and TensorMaps, split_heads views of projected
// buffers, and zero-size calls. The configurations, the oracle, the masks and the tolerances are in
// support/sdpa_properties.hpp.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/errors.hpp"
#include "support/random.hpp"
#include "support/sdpa_properties.hpp"

namespace {

using namespace attend_test::sdpa_properties;
using attend::index_t;
using attend_test::identical;
using attend_test::near;
using attend_test::rng;

// ---------------------------------------------------------------------------------------------------------------
// Grouped-query attention
// ---------------------------------------------------------------------------------------------------------------

// GQA against repeated K/V is compared within tol_same, not for identity: the same kernel runs on different
// addresses, and Eigen's vectorized reductions may peel a different number of leading elements depending on
// alignment, which changes the rounding order (in practice the reference kernel is identical here).
TYPED_TEST(SdpaProperty, GroupedQueryAttentionEqualsExplicitlyRepeatedKeysAndValues) {
    using T = TypeParam;
    int grouped = 0, multi_query = 0;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(7000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        // Force real grouping: rank 4, heads a proper multiple of kv_heads (kv_heads == 1 a third of the time).
        c.rank3 = false;
        c.kv_heads = g.bernoulli(1.0 / 3) ? 1 : g.uniform_int(1, 3);
        c.heads = c.kv_heads * g.uniform_int(2, 4);
        grouped += 1;
        multi_query += c.kv_heads == 1 ? 1 : 0;
        const auto x = random_inputs<T>(c);
        config cr = c;
        cr.kv_heads = c.heads;
        inputs<T> xr{x.q, tensor<T, 4>(c.batch, c.heads, c.key_len, c.head_dim),
                     tensor<T, 4>(c.batch, c.heads, c.key_len, c.value_dim)};
        for (index_t b = 0; b < c.batch; ++b)
            for (index_t h = 0; h < c.heads; ++h)
                for (index_t j = 0; j < c.key_len; ++j) {
                    for (index_t d = 0; d < c.head_dim; ++d)
                        xr.k(b, h, j, d) = x.k(b, h / (c.heads / c.kv_heads), j, d);
                    for (index_t d = 0; d < c.value_dim; ++d)
                        xr.v(b, h, j, d) = x.v(b, h / (c.heads / c.kv_heads), j, d);
                }
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn&) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            const auto r = run(c, x, mask, zero_rows());
            const auto e = run(cr, xr, mask, zero_rows());
            ASSERT_TRUE(near(r.out, e.out, tol_same<T>()));
            ASSERT_TRUE(near(r.weights, e.weights, tol_same<T>()));
            ASSERT_TRUE(near(r.lse, e.lse, tol_same<T>() * 10));
        });
    }
    EXPECT_GT(multi_query, 0);
    EXPECT_GT(grouped, multi_query);
}

// ---------------------------------------------------------------------------------------------------------------
// The _into form, strided views, empty results
// ---------------------------------------------------------------------------------------------------------------

template <class T>
using aligned_vector = std::vector<T, Eigen::aligned_allocator<T>>;

// Identical, not near: the same kernel on the same inputs into outputs of the same (Eigen) alignment. The
// TensorMap buffers use Eigen's aligned allocator so that alignment cannot change a reduction order.
TYPED_TEST(SdpaProperty, IntoFormWritesTheSameValuesAsTheAllocatingFormRank3Rank4AndTensorMap) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        const config c = random_config(18000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        const auto x = random_inputs<T>(c);
        with_random_mask<T>(g, c, [&](const auto& mask, const std::string& name, const bias_fn&) {
            SCOPED_TRACE(describe(c) + ", mask " + name);
            attend::sdpa_options o = zero_rows();
            o.need_weights = true;
            o.need_lse = true;
            o.kernel = c.kernel;
            if (g.bernoulli(0.3)) o.dropout = {0.25, c.seed, true};
            const index_t B = c.batch, H = c.heads, L = c.query_len, S = c.key_len, Dv = c.value_dim;
            if (c.rank3) {
                const auto q = drop_heads(x.q), k = drop_heads(x.k), v = drop_heads(x.v);
                const auto r = attend::scaled_dot_product_attention(q, k, v, mask, o);
                tensor<T, 3> out(B, L, Dv), weights(B, L, S);
                tensor<T, 2> lse(B, L);
                attend::scaled_dot_product_attention_into(q, k, v, mask, o, out, weights, lse);
                ASSERT_TRUE(identical(out, r.out));
                ASSERT_TRUE(identical(weights, r.weights));
                ASSERT_TRUE(identical(lse, r.lse));
                aligned_vector<T> ob(at(B * L * Dv), T(7)), wb(at(B * L * S), T(7)), lb(at(B * L), T(7));
                attend::tensor_view<T, 3> om(ob.data(), B, L, Dv), wm(wb.data(), B, L, S);
                attend::tensor_view<T, 2> lm(lb.data(), B, L);
                attend::scaled_dot_product_attention_into(q, k, v, mask, o, om, wm, lm);
                ASSERT_TRUE(identical(tensor<T, 3>(om), r.out));
                ASSERT_TRUE(identical(tensor<T, 3>(wm), r.weights));
                ASSERT_TRUE(identical(tensor<T, 2>(lm), r.lse));
                // Out only (no weights, no lse).
                tensor<T, 3> out_only(B, L, Dv);
                attend::scaled_dot_product_attention_into(q, k, v, mask, o, out_only);
                ASSERT_TRUE(identical(out_only, r.out));
            } else {
                const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
                tensor<T, 4> out(B, H, L, Dv), weights(B, H, L, S);
                tensor<T, 3> lse(B, H, L);
                attend::scaled_dot_product_attention_into(x.q, x.k, x.v, mask, o, out, weights, lse);
                ASSERT_TRUE(identical(out, r.out));
                ASSERT_TRUE(identical(weights, r.weights));
                ASSERT_TRUE(identical(lse, r.lse));
                aligned_vector<T> ob(at(B * H * L * Dv), T(7)), wb(at(B * H * L * S), T(7)), lb(at(B * H * L), T(7));
                attend::tensor_view<T, 4> om(ob.data(), B, H, L, Dv), wm(wb.data(), B, H, L, S);
                attend::tensor_view<T, 3> lm(lb.data(), B, H, L);
                attend::scaled_dot_product_attention_into(x.q, x.k, x.v, mask, o, om, wm, lm);
                ASSERT_TRUE(identical(tensor<T, 4>(om), r.out));
                ASSERT_TRUE(identical(tensor<T, 4>(wm), r.weights));
                ASSERT_TRUE(identical(tensor<T, 3>(lm), r.lse));
                // TensorMap inputs too (const views of the same data).
                const attend::const_tensor_view<T, 4> qm(x.q.data(), B, H, L, c.head_dim),
                    km(x.k.data(), B, c.kv_heads, S, c.head_dim), vm(x.v.data(), B, c.kv_heads, S, Dv);
                tensor<T, 4> out2(B, H, L, Dv);
                attend::scaled_dot_product_attention_into(qm, km, vm, mask, o, out2);
                ASSERT_TRUE(identical(out2, r.out));
            }
        });
    }
}

TYPED_TEST(SdpaProperty, IntoFormWithoutAMaskWritesWhatTheUnmaskedCallReturns) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(40); ++n) {
        const config c = random_config(18500 + static_cast<std::uint64_t>(n));
        const auto x = random_inputs<T>(c);
        attend::sdpa_options o;
        o.need_weights = true;
        o.need_lse = true;
        o.kernel = c.kernel;
        const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, o);
        tensor<T, 4> out(c.batch, c.heads, c.query_len, c.value_dim), weights(c.batch, c.heads, c.query_len, c.key_len);
        tensor<T, 3> lse(c.batch, c.heads, c.query_len);
        attend::scaled_dot_product_attention_into(x.q, x.k, x.v, o, out, weights, lse);
        ASSERT_TRUE(identical(out, r.out)) << describe(c);
        ASSERT_TRUE(identical(weights, r.weights)) << describe(c);
        ASSERT_TRUE(identical(lse, r.lse)) << describe(c);
        tensor<T, 4> out_only(c.batch, c.heads, c.query_len, c.value_dim);
        attend::scaled_dot_product_attention_into(x.q, x.k, x.v, out_only);
        ASSERT_TRUE(identical(out_only, attend::scaled_dot_product_attention(x.q, x.k, x.v).out)) << describe(c);
    }
}

// split_heads reads a projected [B, L, H*D] buffer as [B, H, L, D] through strides. Compared with the explicitly
// transposed contiguous tensors within tol_same (strided and contiguous operands may take different product
// paths). A plain reshape of the same buffer into [B, H, L, D] (no transpose) mixes heads and tokens: the test
// shows it gives a different answer, so a missing transpose could not pass unnoticed. (heads >= 2, query_len >= 2
// and key_len >= 2: with a single key every query's output is that key's value whatever the queries are.)
TYPED_TEST(SdpaProperty, SplitHeadsViewsEqualTransposedTensorsAndPlainReshapeDoesNot) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(200); ++n) {
        config c = random_config(19000 + static_cast<std::uint64_t>(n));
        rng g(c.seed);
        c.rank3 = false;
        c.kv_heads = g.uniform_int(1, 3);
        c.heads = c.kv_heads * g.uniform_int(1, 3);
        if (c.heads == 1) c.heads = c.kv_heads = 2;
        c.query_len = std::max<index_t>(c.query_len, 2);
        c.key_len = std::max<index_t>(c.key_len, 2);
        SCOPED_TRACE(describe(c));
        const index_t B = c.batch, H = c.heads, G = c.kv_heads, L = c.query_len, S = c.key_len, D = c.head_dim,
                      Dv = c.value_dim;
        // Projected buffers [B, len, heads * dim], as multi-head attention produces them.
        const auto xq = attend_test::random_tensor<T>(c.seed * 5 + 1, B, L, H * D);
        const auto xk = attend_test::random_tensor<T>(c.seed * 5 + 2, B, S, G * D);
        const auto xv = attend_test::random_tensor<T>(c.seed * 5 + 3, B, S, G * Dv);
        const auto transpose = [](const tensor<T, 3>& buf, index_t heads, index_t dim) {
            tensor<T, 4> t(buf.dimension(0), heads, buf.dimension(1), dim);
            for (index_t b = 0; b < t.dimension(0); ++b)
                for (index_t h = 0; h < heads; ++h)
                    for (index_t i = 0; i < t.dimension(2); ++i)
                        for (index_t d = 0; d < dim; ++d) t(b, h, i, d) = buf(b, i, h * dim + d);
            return t;
        };
        const auto qt = transpose(xq, H, D), kt = transpose(xk, G, D), vt = transpose(xv, G, Dv);
        const auto mask = attend::causal(attend::alignment::bottom_right) ||
                          attend::sliding_window(1, 1, attend::alignment::top_left);
        attend::sdpa_options o = zero_rows();
        o.kernel = c.kernel;
        o.need_weights = true;
        const auto expected = attend::scaled_dot_product_attention(qt, kt, vt, mask, o);
        const auto strided = attend::scaled_dot_product_attention(attend::split_heads(xq.data(), B, L, H, D),
                                                                  attend::split_heads(xk.data(), B, S, G, D),
                                                                  attend::split_heads(xv.data(), B, S, G, Dv), mask, o);
        ASSERT_TRUE(near(strided.out, expected.out, tol_same<T>()));
        ASSERT_TRUE(near(strided.weights, expected.weights, tol_same<T>()));
        // The trap: reshape without transpose.
        const attend::const_tensor_view<T, 4> qr(xq.data(), B, H, L, D), kr(xk.data(), B, G, S, D),
            vr(xv.data(), B, G, S, Dv);
        const auto reshaped = attend::scaled_dot_product_attention(qr, kr, vr, mask, o);
        EXPECT_FALSE(near(reshaped.out, expected.out, 1e-3)) << "a reshape without transpose gave the same answer";
    }
}

/// The [batch, len, heads * dim] buffer of a projection, read back as [batch, heads, len, dim].
template <class T>
tensor<T, 4> heads_of(const std::vector<T>& buf, index_t B, index_t len, index_t heads, index_t dim) {
    tensor<T, 4> t(B, heads, len, dim);
    for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < heads; ++h)
            for (index_t i = 0; i < len; ++i)
                for (index_t d = 0; d < dim; ++d) t(b, h, i, d) = buf[at(((b * len + i) * heads + h) * dim + d)];
    return t;
}

// The _into forms write through split_heads views into [B, L, H * Dv] (and [B, S, G * D]) buffers: the bits of the
// tensor outputs, in the layout an output projection reads, with no transpose copy.
TYPED_TEST(SdpaProperty, IntoFormsWriteSplitHeadsOutputsWithTheBitsOfTensorOutputs) {
    using T = TypeParam;
    for (int n = 0; n < attend_test::repeat(60); ++n) {
        config c = random_config(19400 + static_cast<std::uint64_t>(n));
        c.rank3 = false;
        SCOPED_TRACE(describe(c));
        const index_t B = c.batch, H = c.heads, G = c.kv_heads, L = c.query_len, S = c.key_len, D = c.head_dim,
                      Dv = c.value_dim;
        const auto x = random_inputs<T>(c);
        const auto mask = attend::causal(attend::alignment::bottom_right);
        attend::sdpa_options o = zero_rows();
        o.kernel = c.kernel;
        const auto r = attend::scaled_dot_product_attention(x.q, x.k, x.v, mask, o);
        std::vector<T> out_buf(at(B * L * H * Dv), T(7));
        attend::scaled_dot_product_attention_into(x.q, x.k, x.v, mask, o,
                                                  attend::split_heads(out_buf.data(), B, L, H, Dv));
        ASSERT_TRUE(identical(heads_of(out_buf, B, L, H, Dv), r.out));
        const auto d_out = attend_test::random_tensor<T>(c.seed * 3 + 1, B, H, L, Dv);
        const auto g = attend::scaled_dot_product_attention_backward(x.q, x.k, x.v, mask, r, d_out, o);
        std::vector<T> dq(at(B * L * H * D), T(7)), dk(at(B * S * G * D), T(7)), dv(at(B * S * G * Dv), T(7));
        attend::scaled_dot_product_attention_backward_into(x.q, x.k, x.v, mask, r.out, r.lse, d_out, o,
                                                           attend::split_heads(dq.data(), B, L, H, D),
                                                           attend::split_heads(dk.data(), B, S, G, D),
                                                           attend::split_heads(dv.data(), B, S, G, Dv));
        ASSERT_TRUE(identical(heads_of(dq, B, L, H, D), g.d_query));
        ASSERT_TRUE(identical(heads_of(dk, B, S, G, D), g.d_key));
        ASSERT_TRUE(identical(heads_of(dv, B, S, G, Dv), g.d_value));
    }
}

TEST(SdpaLayoutErrors, AStridedOutputWhoseElementsShareMemoryIsRejectedBeforeAnyWrite) {
    const tensor<float, 4> q = attend_test::random_tensor<float>(1, 1, 2, 3, 4);
    std::vector<float> buf(64, 42.0f);
    // Every head at the same address (stride 0), then rows that overlap (stride 2 < the row's 4 elements).
    for (const std::array<index_t, 4>& strides :
         {std::array<index_t, 4>{24, 0, 4, 1}, std::array<index_t, 4>{24, 12, 2, 1}}) {
        attend::strided_view<float> out;
        out.data = buf.data();
        out.dims = {1, 2, 3, 4};
        out.strides = strides;
        attend_test::expect_error<attend::shape_error>(
            [&] { attend::scaled_dot_product_attention_into(q, q, q, attend::sdpa_options{}, out); },
            "attend.shape.output_strides");
        std::vector<float> grads(64, 42.0f);
        attend::strided_view<float> d_query = out;
        d_query.data = grads.data();
        tensor<float, 4> out_t(1, 2, 3, 4), d_key(1, 2, 3, 4), d_value(1, 2, 3, 4);
        out_t.setZero();
        tensor<float, 3> lse(1, 2, 3);
        lse.setZero();
        attend_test::expect_error<attend::shape_error>(
            [&] {
                attend::scaled_dot_product_attention_backward_into(q, q, q, attend::no_mask{}, out_t, lse, out_t,
                                                                   d_query, d_key, d_value);
            },
            "attend.shape.output_strides");
        EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [](float x) { return x == 42.0f; }));
        EXPECT_TRUE(std::all_of(grads.begin(), grads.end(), [](float x) { return x == 42.0f; }));
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Zero-size calls
// ---------------------------------------------------------------------------------------------------------------

/// Every zero-size call of one kernel: results of the right (empty) shape, no throw, under the default policy.
template <class T>
void check_zero_size_calls(attend::kernel kernel) {
    for (const auto& dims : std::vector<std::array<index_t, 2>>{{0, 5}, {3, 0}, {0, 0}}) {
        const index_t B = dims[0], L = dims[1], H = 4, G = 2, S = 7, D = 3, Dv = 5;
        SCOPED_TRACE(std::string("kernel ") + name_of(kernel) + ", batch " + std::to_string(B) + ", query_len " +
                     std::to_string(L));
        attend::sdpa_options o;  // default policy: empty_rows::error, and still no throw
        o.kernel = kernel;
        o.need_weights = true;
        o.need_lse = true;
        tensor<T, 4> q(B, H, L, D), k(B, G, S, D), v(B, G, S, Dv);
        attend_test::fill_uniform(k, 1);
        attend_test::fill_uniform(v, 2);
        std::vector<index_t> lengths(at(B), S);
        const auto check4 = [&](const auto& r) {
            EXPECT_EQ(r.out.dimensions(), (std::array<index_t, 4>{B, H, L, Dv}));
            EXPECT_EQ(r.weights.dimensions(), (std::array<index_t, 4>{B, H, L, S}));
            EXPECT_EQ(r.lse.dimensions(), (std::array<index_t, 3>{B, H, L}));
            EXPECT_EQ(r.out.size(), 0);
        };
        EXPECT_NO_THROW(check4(attend::scaled_dot_product_attention(q, k, v, o)));
        EXPECT_NO_THROW(
            check4(attend::scaled_dot_product_attention(q, k, v, attend::causal(attend::alignment::bottom_right), o)));
        EXPECT_NO_THROW(check4(attend::scaled_dot_product_attention(q, k, v, attend::key_padding(lengths), o)));
        tensor<bool, 2> everything(L, S);
        everything.setConstant(true);
        EXPECT_NO_THROW(
            check4(attend::scaled_dot_product_attention(q, k, v, attend::allowed_mask::query_key_grid(everything), o)));
        tensor<T, 4> out(B, H, L, Dv), weights(B, H, L, S);
        tensor<T, 3> lse(B, H, L);
        EXPECT_NO_THROW(attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, o, out, weights, lse));
        attend::sdpa_options out_only = o;  // without weights (the tiled kernel's decode path is chosen then)
        out_only.need_weights = false;
        EXPECT_NO_THROW((void)attend::scaled_dot_product_attention(q, k, v, out_only));
        // Rank 3.
        tensor<T, 3> q3(B, L, D), k3(B, S, D), v3(B, S, Dv);
        attend_test::fill_uniform(k3, 3);
        attend_test::fill_uniform(v3, 4);
        EXPECT_NO_THROW({
            const auto r =
                attend::scaled_dot_product_attention(q3, k3, v3, attend::causal(attend::alignment::top_left), o);
            EXPECT_EQ(r.out.dimensions(), (std::array<index_t, 3>{B, L, Dv}));
            EXPECT_EQ(r.lse.dimensions(), (std::array<index_t, 2>{B, L}));
        });
    }
}

// Each kernel runs in a child process first (a gtest death-test fork), so that a crash (e.g. a division by zero on
// an empty shape) fails this test instead of killing the whole binary; then in process for the detailed messages.
TYPED_TEST(SdpaProperty, ZeroBatchOrZeroQueryLenGivesAnEmptyResultWithoutError) {
    using T = TypeParam;
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    for (const auto kernel : {attend::kernel::reference, attend::kernel::tiled, attend::kernel::automatic}) {
        SCOPED_TRACE(name_of(kernel));
        EXPECT_EXIT(
            {
                check_zero_size_calls<T>(kernel);
                std::exit(::testing::Test::HasFailure() ? 1 : 0);
            },
            ::testing::ExitedWithCode(0), "")
            << "zero-size calls crashed or failed in a child process";
        if (!::testing::Test::HasFailure()) check_zero_size_calls<T>(kernel);
    }
}

}  // namespace
