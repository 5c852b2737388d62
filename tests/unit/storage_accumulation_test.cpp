// SPDX-License-Identifier: MIT
// The tiled kernels keep the storage type apart from the accumulation type (detail/score_pipeline.hpp): inputs
// and outputs in Storage, every score, probability, running sum and product in Acc. Proven with float storage
// accumulated in double, against the reference kernels in double on the same float-rounded inputs:
// - forward: out and lse are the double results rounded to float once (within 1 float spacing, plus 1e-12 of
//   the largest magnitude for double's own rounding), which float accumulation does not achieve on the same case
//   (checked too, so the test tells the two apart);
// - backward: the gradients agree to the precision the float-stored lse and out allow (float accumulation does
//   not), and are bit-identical
//   for 1 and 2 threads (with the key chunks whose dq partials the staged path adds up).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <attend/attend.hpp>

#include "support/compare.hpp"
#include "support/random.hpp"

namespace {

using attend::index_t;
using attend_test::bit_equal;
using attend_test::max_rel_diff;
namespace detail = attend::detail;

/// One case: q `[batch, heads, query_len, head_dim]`, k and v `[batch, kv_heads, key_len, dim]`, float storage,
/// with the same values in double for the reference.
struct storage_case {
    index_t batch = 1, heads = 4, kv_heads = 2, query_len = 200, key_len = 1500, dim = 64;
    attend::tensor<float, 4> q, k, v;
    attend::tensor<double, 4> qd, kd, vd;
    attend::score_bias bias;
    attend::attention_shape shape;

    storage_case(index_t L, index_t S, std::uint64_t seed) : query_len(L), key_len(S) {
        q.resize(batch, heads, L, dim);
        k.resize(batch, kv_heads, S, dim);
        v.resize(batch, kv_heads, S, dim);
        attend_test::fill_uniform(q, seed, -2.0, 2.0);
        attend_test::fill_uniform(k, seed + 1, -2.0, 2.0);
        attend_test::fill_uniform(v, seed + 2);
        qd = q.cast<double>();
        kd = k.cast<double>();
        vd = v.cast<double>();
        bias = attend::score_bias::alibi(attend::alibi_slopes(heads), attend::alignment::bottom_right);
        shape = detail::check_views(detail::as_view(q), detail::as_view(k), detail::as_view(v));
    }

    template <class Acc>
    detail::kernel_params<Acc> params(double dropout = 0) const {
        detail::kernel_params<Acc> p;
        p.scale = static_cast<Acc>(1.0 / std::sqrt(static_cast<double>(dim)));
        p.bias = &bias;
        if (dropout > 0) {
            p.dropout.probability = dropout;
            p.dropout.keep_scale = 1.0 / (1.0 - dropout);
            p.dropout.seed = 7;
        }
        return p;
    }
};

/// |got - want| in units of what one rounding to float allows: the float spacing at want's magnitude, plus
/// 1e-12 of the tensor's largest magnitude `scale` for the double arithmetic itself (the tiled and the reference
/// kernel add in different orders; in double that moves a result by about 1e-16 x key_len x scale).
double rounding_units(float got, double want, double scale) {
    const auto magnitude = static_cast<float>(std::abs(want));
    const double spacing = static_cast<double>(std::nextafter(magnitude, std::numeric_limits<float>::infinity())) -
                           static_cast<double>(magnitude);
    return std::abs(static_cast<double>(got) - want) / (spacing + 1e-12 * scale);
}

template <class T, int Rank>
double max_magnitude(const attend::tensor<T, Rank>& t) {
    double m = 0;
    for (index_t n = 0; n < t.size(); ++n) m = std::max(m, std::abs(static_cast<double>(t.data()[n])));
    return m;
}

struct forward_result {
    attend::tensor<float, 4> out;
    attend::tensor<float, 3> lse;
};

struct reference_result {
    attend::tensor<double, 4> out;
    attend::tensor<double, 3> lse;
};

/// The reference forward in double on the case's float-rounded values (dropout as the backward replays it).
reference_result reference_forward(const storage_case& c, const detail::mask_tiles& mask, double dropout = 0) {
    reference_result r{attend::tensor<double, 4>(c.batch, c.heads, c.query_len, c.dim),
                       attend::tensor<double, 3>(c.batch, c.heads, c.query_len)};
    detail::attention_outputs<double> o;
    o.out = detail::as_mutable_view(r.out);
    o.lse = r.lse.data();
    detail::reference_attention(detail::as_view(c.qd), detail::as_view(c.kd), detail::as_view(c.vd), c.shape, mask,
                                c.params<double>(dropout), o);
    return r;
}

template <class Acc>
forward_result tiled_forward_float(const storage_case& c, const detail::mask_tiles& mask,
                                   const detail::tile_config& tiles, int threads) {
    forward_result r;
    r.out.resize(c.batch, c.heads, c.query_len, c.dim);
    r.lse.resize(c.batch, c.heads, c.query_len);
    detail::attention_outputs<float> o;
    o.out = detail::as_mutable_view(r.out);
    o.lse = r.lse.data();
    const auto p = c.params<Acc>();
    detail::tiled_forward<float, Acc>(detail::as_view(c.q), detail::as_view(c.k), detail::as_view(c.v), c.shape, mask,
                                      p, o, threads, tiles);
    return r;
}

/// Worst rounding_units of the tiled float-storage kernel accumulating in Acc against the double reference, over
/// out and lse.
template <class Acc>
double forward_rounding_units(const storage_case& c, const detail::tile_config& tiles) {
    const auto bound = attend::causal(attend::alignment::bottom_right).bind(c.shape);
    const detail::erased_mask<decltype(bound)> mask(bound);
    const auto [ref, ref_lse] = reference_forward(c, mask);
    const auto got = tiled_forward_float<Acc>(c, mask, tiles, 2);
    double worst = 0;
    const double out_scale = max_magnitude(ref), lse_scale = max_magnitude(ref_lse);
    for (index_t n = 0; n < ref.size(); ++n)
        worst = std::max(worst, rounding_units(got.out.data()[n], ref.data()[n], out_scale));
    for (index_t n = 0; n < ref_lse.size(); ++n)
        worst = std::max(worst, rounding_units(got.lse.data()[n], ref_lse.data()[n], lse_scale));
    return worst;
}

TEST(StorageAccumulation, FloatStorageAccumulatedInDoubleRoundsTheDoubleResultOnce) {
    const storage_case c(200, 1500, 11);
    const auto tiles = detail::default_tile_config<float>(c.shape);
    EXPECT_LE(forward_rounding_units<double>(c, tiles), 1.0);
    // The same case accumulated in float is off by more: the bound above is one the float kernel cannot meet.
    EXPECT_GT(forward_rounding_units<float>(c, tiles), 1.0);
}

TEST(StorageAccumulation, DecodeAndGemvPathsOfFloatStorageAccumulateInDouble) {
    const storage_case c(3, 5000, 12);  // 3 queries x 2 heads per kv head: GEMV rows; 5000 keys: split-key decode
    detail::tile_config tiles = detail::default_tile_config<float>(c.shape);
    ASSERT_LE(c.query_len, tiles.decode_queries);
    ASSERT_GT(c.key_len, tiles.decode_chunk);
    EXPECT_LE(forward_rounding_units<double>(c, tiles), 1.0);
    // Small tiles: mixed causal tiles cut into strips and slabs, the staged keys and values converted per slab.
    const storage_case d(100, 333, 13);
    tiles = detail::tile_config{};
    tiles.query_rows = 48;
    tiles.key_tile = 64;
    tiles.slab_rows = 8;
    tiles.trim_step = 16;
    EXPECT_LE(forward_rounding_units<double>(d, tiles), 1.0);
}

struct gradients {
    attend::tensor<float, 4> d_query, d_key, d_value;
    attend::tensor<float, 2> bias_grad;
};

template <class Acc>
gradients tiled_backward_float(const storage_case& c, const detail::mask_tiles& mask, const forward_result& fwd,
                               const attend::tensor<float, 4>& d_out, double dropout, int threads) {
    gradients g;
    g.d_query.resize(c.q.dimensions());
    g.d_key.resize(c.k.dimensions());
    g.d_value.resize(c.v.dimensions());
    g.bias_grad.resize(c.heads, c.query_len + c.key_len - 1);
    detail::backward_inputs<float> in;
    in.q = detail::as_view(c.q);
    in.k = detail::as_view(c.k);
    in.v = detail::as_view(c.v);
    in.out = detail::as_view(fwd.out);
    in.d_out = detail::as_view(d_out);
    in.lse = fwd.lse.data();
    in.lse_dims = {c.batch, c.heads, c.query_len};
    detail::gradient_outputs<float> o;
    o.d_query = detail::as_mutable_view(g.d_query);
    o.d_key = detail::as_mutable_view(g.d_key);
    o.d_value = detail::as_mutable_view(g.d_value);
    o.d_score_bias = g.bias_grad.data();
    const auto p = c.params<Acc>(dropout);
    detail::tiled_backward<float, Acc>(in, c.shape, mask, p, o, detail::default_backward_tiling<float>(c.shape),
                                       threads);
    return g;
}

TEST(StorageAccumulation, BackwardOfFloatStorageAccumulatesInDoubleDeterministically) {
    const storage_case c(160, 700, 21);
    const auto bound = attend::causal(attend::alignment::bottom_right).bind(c.shape);
    const detail::erased_mask<decltype(bound)> mask(bound);
    for (const double dropout : {0.0, 0.2}) {
        SCOPED_TRACE(dropout);
        // The forward in double, stored in float like a caller's.
        const auto reference = reference_forward(c, mask, dropout);
        forward_result fwd{reference.out.cast<float>(), reference.lse.cast<float>()};
        attend::tensor<float, 4> d_out(c.batch, c.heads, c.query_len, c.dim);
        attend_test::fill_uniform(d_out, 22);
        const attend::tensor<double, 4> d_out_d = d_out.cast<double>();

        // The reference backward in double on the float-rounded values.
        attend::tensor<double, 4> dq(c.q.dimensions()), dk(c.k.dimensions()), dv(c.v.dimensions());
        attend::tensor<double, 2> bias_grad(c.heads, c.query_len + c.key_len - 1);
        const attend::tensor<double, 4> out_r = fwd.out.cast<double>();
        const attend::tensor<double, 3> lse_r = fwd.lse.cast<double>();
        detail::backward_inputs<double> in;
        in.q = detail::as_view(c.qd);
        in.k = detail::as_view(c.kd);
        in.v = detail::as_view(c.vd);
        in.out = detail::as_view(out_r);
        in.d_out = detail::as_view(d_out_d);
        in.lse = lse_r.data();
        in.lse_dims = {c.batch, c.heads, c.query_len};
        detail::gradient_outputs<double> o;
        o.d_query = detail::as_mutable_view(dq);
        o.d_key = detail::as_mutable_view(dk);
        o.d_value = detail::as_mutable_view(dv);
        o.d_score_bias = bias_grad.data();
        detail::reference_backward(in, c.shape, static_cast<const detail::mask_tiles&>(mask), c.params<double>(dropout),
                                   o);

        const auto one = tiled_backward_float<double>(c, mask, fwd, d_out, dropout, 1);
        const auto two = tiled_backward_float<double>(c, mask, fwd, d_out, dropout, 2);
        EXPECT_TRUE(bit_equal(one.d_query, two.d_query) && bit_equal(one.d_key, two.d_key) &&
                    bit_equal(one.d_value, two.d_value) && bit_equal(one.bias_grad, two.bias_grad));
        // The float-stored lse and out move the gradients by about 2^-23 of their scale; accumulating in double
        // adds nothing visible, accumulating in float several times more (checked, so the bound tells them apart).
        const double limit = std::ldexp(1.0, -22);
        // Relative to the largest reference gradient, at least 1.
        const auto worst = [&](const gradients& g) {
            return std::max({max_rel_diff(g.d_query, dq, 1.0), max_rel_diff(g.d_key, dk, 1.0),
                             max_rel_diff(g.d_value, dv, 1.0), max_rel_diff(g.bias_grad, bias_grad, 1.0)});
        };
        EXPECT_LE(worst(one), limit);
        EXPECT_GT(worst(tiled_backward_float<float>(c, mask, fwd, d_out, dropout, 1)), limit);
    }
}

}  // namespace
