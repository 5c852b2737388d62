// SPDX-License-Identifier: MIT
#pragma once
/// Backward of scaled dot-product attention: the gradients dq, dk, dv of a loss given d_out = d loss / d out,
/// for out = softmax(scale * q k^T + score_bias + mask) v with the forward's options (scale, empty rows, dropout
/// replayed from its seed, score_bias). Shapes as in sdpa.hpp: q `[batch, heads, query_len, head_dim]`,
/// k `[batch, kv_heads, key_len, head_dim]`, v `[batch, kv_heads, key_len, value_dim]`,
/// out and d_out `[batch, heads, query_len, value_dim]`, lse `[batch, heads, query_len]` (rank 3: one head).
///
/// With P = softmax of the masked scores, P' = P with dropout applied (kept weights times 1 / (1 - p), dropped 0):
///   dv = P'^T d_out,  dP' = d_out v^T,  dP = dP' at kept positions times 1 / (1 - p), 0 at dropped ones,
///   D = rowsum(d_out * out) = rowsum(P * dP),  dS = P * (dP - D),  dq = scale dS k,  dk = scale dS^T q.
/// Under grouped-query attention dk and dv are summed over the query heads of each group. Padded queries and
/// empty rows (lse = -inf) have zero gradients, never NaN. An ALiBi bias is fixed (no gradient); the gradient of
/// any score_bias per key - query offset is returned, and relative_bias_gradient turns it into the gradient of
/// a T5 relative-position table. With sinks (sinks.hpp) P's rows sum to 1 - p_sink, lse includes the sink, the
/// formulas above hold as written, and d sink = -sum over rows of p_sink D (the sink is a score with no value).
///
/// 16-bit storage (Eigen::half, Eigen::bfloat16 q, k, v, out, d_out, with the forward's float lse): the tiled kernel
/// reads the 16-bit inputs in place, widening each tile into its float scratch, computes everything in float, and
/// rounds the gradients to the storage type once (or, with float outputs passed to the _into form, not at all).
/// The gradients are then those of the float backward on the same values, bit for bit; no float copy of an input
/// is made (kernel::reference, the oracle, works on float copies).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "detail/dropout.hpp"
#include "detail/kernel_interface.hpp"
#include "detail/mask_nodes.hpp"
#include "detail/memory.hpp"
#include "detail/parallel_for.hpp"
#include "detail/reference_backward.hpp"
#include "detail/tiled_backward.hpp"
#include "error.hpp"
#include "mask.hpp"
#include "position.hpp"
#include "score_bias.hpp"
#include "sdpa.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace attend {

/// Gradients of scaled dot-product attention; Rank is the rank of the inputs (3 or 4).
template <class T, int Rank>
struct attention_gradients {
    tensor<T, Rank> d_query;  ///< `[batch, heads, query_len, head_dim]`
    tensor<T, Rank> d_key;    ///< `[batch, kv_heads, key_len, head_dim]`, summed over the query heads of each group
    tensor<T, Rank> d_value;  ///< `[batch, kv_heads, key_len, value_dim]`, summed over the query heads of each group
    /// `[heads, query_len + key_len - 1]` when options.score_bias is not none, else empty: entry (h, n) is
    /// d loss / d (the bias head h adds where key - query = n - (query_len - 1)), summed over the batch and over
    /// every (query, key) pair on that diagonal. Input of relative_bias_gradient; for ALiBi it is informational.
    tensor<T, 2> d_score_bias;
    /// `[heads]` when options.sinks is not empty, else empty: d loss / d sink logit of each query head (sinks.hpp),
    /// summed over the batch and the queries.
    tensor<T, 1> d_sinks;
};

namespace detail {

/// A contiguous view of x's dims over `data` (x.size() elements).
template <class F, class T>
strided_view<F> contiguous_like(const strided_view<T>& x, F* data) {
    strided_view<F> y;
    y.data = data;
    y.dims = x.dims;
    y.strides = {x.dims[1] * x.dims[2] * x.dims[3], x.dims[2] * x.dims[3], x.dims[3], 1};
    y.rank = x.rank;
    return y;
}

/// Every row of view x, each rounded once to the type of view y (same dims; widening is exact).
template <class X, class Y>
void convert_rows(const strided_view<X>& x, const strided_view<Y>& y) {
    for (index_t b = 0; b < x.dims[0]; ++b)
        for (index_t h = 0; h < x.dims[1]; ++h)
            for (index_t i = 0; i < x.dims[2]; ++i)
                std::transform(x.row(b, h, i), x.row(b, h, i) + x.dims[3], y.row(b, h, i),
                               [](const auto v) { return static_cast<std::remove_const_t<Y>>(v); });
}

/// A backward call that passed every check.
template <class T, class Bound>
struct checked_backward {
    attention_shape shape;
    checked_call<T, Bound> call;
};

template <class T>
std::string spell_lse(const backward_inputs<T>& in) {
    if (in.lse_rank == 2) return format_shape(std::array<index_t, 2>{in.lse_dims[0], in.lse_dims[2]});
    return format_shape(in.lse_dims);
}

template <class View>
void check_view_dims(const View& x, const std::array<index_t, 4>& expected, int rank, const char* id, const char* what,
                     const std::string& context) {
    if (x.dims != expected || x.rank != rank) {
        strided_view<const scalar_of<View>> want;
        want.dims = expected;
        want.rank = rank;
        throw shape_error(id, concat(what, ' ', spell_view(x), " != expected ", spell_view(want), context));
    }
}

/// Every check of a backward call before anything is written: the forward's checks (shapes of q, k, v; options;
/// the mask against the shape; finite q, k, v; empty rows under empty_rows::error), the shapes of out, lse and
/// d_out (attend.shape.backward_out, backward_lse, backward_d_out), the gradient outputs when `out` is not null
/// (attend.shape.backward_dq, backward_dk, backward_dv), finite out and d_out and an lse without NaN or +inf
/// when check_finite is on (attend.value.non_finite, attend.value.lse).
template <class T, class G, class Mask>
auto check_backward(const backward_inputs<T>& in, const gradient_outputs<G>* out, const Mask& mask,
                    const sdpa_options& o) {
    const attention_shape s = check_views(in.q, in.k, in.v);
    if (!o.score_mod.empty() && !o.score_mod.has_derivative())
        throw value_error(
            "attend.value.score_mod_derivative",
            "the call's score_mod has no derivative, which the backward needs: build it with "
            "attend::score_mod(f, derivative), derivative(score, batch, head, query, key) = d f / d score");
    const int rank = s.rank;
    const std::string context =
        concat(" (query ", spell_view(in.q), ", key ", spell_view(in.k), ", value ", spell_view(in.v), ')');
    const std::array<index_t, 4> out_dims{s.batch, s.heads, s.query_len, s.value_dim};
    check_view_dims(in.out, out_dims, rank, "attend.shape.backward_out", "out", context);
    const std::array<index_t, 3> lse_expected{s.batch, s.heads, s.query_len};
    if (in.lse_dims != lse_expected || in.lse_rank != rank - 1) {
        backward_inputs<T> want;
        want.lse_dims = lse_expected;
        want.lse_rank = rank - 1;
        throw shape_error("attend.shape.backward_lse",
                          concat("lse ", spell_lse(in), " != expected ", spell_lse(want), context));
    }
    check_view_dims(in.d_out, out_dims, rank, "attend.shape.backward_d_out", "d_out", context);
    if (out) {
        check_view_dims(out->d_query, in.q.dims, rank, "attend.shape.backward_dq", "d_query", context);
        check_view_dims(out->d_key, in.k.dims, rank, "attend.shape.backward_dk", "d_key", context);
        check_view_dims(out->d_value, in.v.dims, rank, "attend.shape.backward_dv", "d_value", context);
    }
    checked_backward<T, decltype(mask.bind(s))> checked{s, check_call(in.q, in.k, in.v, s, mask, o)};
    if (o.check_finite) {
        check_finite(in.out, "out", resolve_threads(o.threads));
        check_finite(in.d_out, "d_out", resolve_threads(o.threads));
        const index_t rows = s.batch * s.heads * s.query_len;
        for (index_t n = 0; n < rows; ++n) {
            const accumulator_t<T> x = in.lse[n];
            if (std::isnan(x) || x == std::numeric_limits<accumulator_t<T>>::infinity())
                throw value_error("attend.value.lse",
                                  concat("lse ", spell_lse(in), " holds ", x, " at flat index ", n,
                                         "; it must be finite, or -inf for a padded query or an empty row"));
        }
    }
    return checked;
}

/// kernel::reference on 16-bit inputs: the float oracle on exact float copies of the inputs, its gradients rounded
/// once into 16-bit outputs (float outputs get them as they are). Everything is allocated before the first write.
template <class T, class G, class Bound>
void reference_backward_16bit(const backward_inputs<T>& in, const checked_backward<T, Bound>& checked,
                              const gradient_outputs<G>& out) {
    const attention_shape& s = checked.shape;
    const auto& p = checked.call.params;
    constexpr bool round = !std::is_same_v<G, float>;
    const bool bias = round && out.d_score_bias && p.bias && !p.bias->empty();
    const bool sinks = round && out.d_sinks && p.has_sinks();
    const std::array<const strided_view<const T>*, 5> inputs{&in.q, &in.k, &in.v, &in.out, &in.d_out};
    std::array<index_t, 10> sizes{};  // q, k, v, out, d_out; then, when rounding, dq, dk, dv, bias and sink gradients
    for (std::size_t n = 0; n < inputs.size(); ++n) sizes[n] = inputs[n]->size();
    if (round) {
        sizes[5] = out.d_query.size();
        sizes[6] = out.d_key.size();
        sizes[7] = out.d_value.size();
        sizes[8] = bias ? s.heads * (s.query_len + s.key_len - 1) : 0;
        sizes[9] = sinks ? s.heads : 0;
    }
    std::array<aligned_vector<float>, 10> buffers;
    allocating(
        [&] {
            for (std::size_t n = 0; n < buffers.size(); ++n) buffers[n].resize(static_cast<std::size_t>(sizes[n]));
        },
        [&] {
            index_t total = 0;
            for (const index_t n : sizes) total += n;
            return allocation_text("kernel::reference's float copies of the 16-bit inputs and gradients (elements)",
                                   std::array<index_t, 1>{total}, sizeof(float));
        },
        "the tiled kernel (the default) reads 16-bit inputs in place");
    backward_inputs<float> f;
    std::array<strided_view<const float>*, 5> copies{&f.q, &f.k, &f.v, &f.out, &f.d_out};
    for (std::size_t n = 0; n < inputs.size(); ++n) {
        convert_rows(*inputs[n], contiguous_like(*inputs[n], buffers[n].data()));
        *copies[n] = contiguous_like(*inputs[n], static_cast<const float*>(buffers[n].data()));
    }
    f.lse = in.lse;
    f.lse_dims = in.lse_dims;
    f.lse_rank = in.lse_rank;
    if constexpr (round) {
        gradient_outputs<float> g;
        g.d_query = contiguous_like(out.d_query, buffers[5].data());
        g.d_key = contiguous_like(out.d_key, buffers[6].data());
        g.d_value = contiguous_like(out.d_value, buffers[7].data());
        g.d_score_bias = bias ? buffers[8].data() : nullptr;
        g.d_sinks = sinks ? buffers[9].data() : nullptr;
        reference_backward(f, s, checked.call.mask, p, g);
        convert_rows(g.d_query, out.d_query);
        convert_rows(g.d_key, out.d_key);
        convert_rows(g.d_value, out.d_value);
        const auto to_g = [](float v) { return static_cast<G>(v); };
        if (bias) std::transform(buffers[8].begin(), buffers[8].end(), out.d_score_bias, to_g);
        if (sinks) std::transform(buffers[9].begin(), buffers[9].end(), out.d_sinks, to_g);
    } else {
        reference_backward(f, s, checked.call.mask, p, out);
    }
}

/// Runs the kernel of a checked backward call: kernel::reference is the oracle, anything else the tiled path.
/// Gradients of type G: the storage type T, or float for 16-bit T.
template <class T, class G, class Bound>
void run_backward(const backward_inputs<T>& in, const checked_backward<T, Bound>& checked,
                  const gradient_outputs<G>& out, const backward_tiling& tiling) {
    if (checked.call.kernel == kernel::reference) {
        if constexpr (is_16bit_v<T>) reference_backward_16bit(in, checked, out);
        else reference_backward(in, checked.shape, checked.call.mask, checked.call.params, out);
        return;
    }
    with_mask_tiles(checked.call.mask, [&](const mask_tiles& mask) {
        tiled_backward<T, accumulator_t<T>>(in, checked.shape, mask, checked.call.params, out, tiling,
                                            checked.call.threads);
    });
}

/// The tiles hold the accumulation type, so 16-bit inputs take float's tiling (and float's bits).
template <class T, class G, class Bound>
void run_backward(const backward_inputs<T>& in, const checked_backward<T, Bound>& checked,
                  const gradient_outputs<G>& out) {
    run_backward(in, checked, out, default_backward_tiling<accumulator_t<T>>(checked.shape));
}

/// The backward on strided views, for multi-head attention (heads read from and written to projected
/// `[batch, len, heads * dim]` buffers through split_heads): checks everything, then writes dq, dk, dv and,
/// when not null and the call has a score_bias, d_score_bias. Throws as
/// scaled_dot_product_attention_backward, before any write.
template <class T, class Mask>
void sdpa_backward_views(const backward_inputs<T>& in, const Mask& mask, const sdpa_options& options,
                         const gradient_outputs<T>& out) {
    if constexpr (require_mask<Mask>()) {
        const auto checked = check_backward(in, &out, mask, options);
        run_backward(in, checked, out);
    }
}

template <class Lse, class T, int Rank>
constexpr void require_lse() {
    using traits = tensor_traits<std::decay_t<Lse>>;
    static_assert(traits::supported,
                  "attend: lse must be an attend::tensor (row-major Eigen::Tensor) or a TensorMap "
                  "of one, as scaled_dot_product_attention returns it");
    if constexpr (traits::supported) {
        static_assert(traits::row_major, "attend: lse must be Eigen::RowMajor (PyTorch's layout)");
        static_assert(traits::rank == Rank - 1,
                      "attend: lse has one axis less than the query: [batch, heads, query_len] for rank-4 inputs, "
                      "[batch, query_len] for rank 3");
        static_assert(std::is_same_v<typename traits::scalar, accumulator_t<T>>,
                      "attend: lse must have the query's accumulation type (float for float, half and bfloat16 "
                      "inputs; double for double), as scaled_dot_product_attention returns it");
    }
}

template <int Rank, class Q, class K, class V, class Out, class Lse, class DOut>
auto backward_inputs_of(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse, const DOut& d_out) {
    using T = scalar_of<Q>;
    static_assert(std::is_same_v<T, scalar_of<K>> && std::is_same_v<T, scalar_of<V>> &&
                      std::is_same_v<T, scalar_of<Out>> && std::is_same_v<T, scalar_of<DOut>>,
                  "attend: query, key, value, out and d_out must have the same scalar type");
    static_assert(rank_of<K>() == Rank && rank_of<V>() == Rank && rank_of<Out>() == Rank && rank_of<DOut>() == Rank,
                  "attend: query, key, value, out and d_out must have the same rank");
    require_lse<Lse, T, Rank>();
    backward_inputs<T> in;
    in.q = checked_input(q);
    in.k = checked_input(k);
    in.v = checked_input(v);
    in.out = checked_input(out);
    in.d_out = checked_input(d_out);
    in.lse = lse.data();
    in.lse_rank = Rank - 1;
    if constexpr (Rank == 4) in.lse_dims = {lse.dimension(0), lse.dimension(1), lse.dimension(2)};
    else in.lse_dims = {lse.dimension(0), 1, lse.dimension(1)};
    return in;
}

/// The allocating backward: gradients in the inputs' type.
template <int rank, class Q, class K, class V, class Out, class Lse, class DOut, class Mask>
auto backward_allocating(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse, const DOut& d_out,
                         const Mask& mask, const sdpa_options& options) {
    using T = detail::scalar_of<Q>;
    const auto in = detail::backward_inputs_of<rank>(q, k, v, out, lse, d_out);
    const auto checked =
        detail::check_backward(in, static_cast<const detail::gradient_outputs<T>*>(nullptr), mask, options);
    const attention_shape& s = checked.shape;
    attention_gradients<T, rank> g;
    const char* hint = "The gradients are as large as q, k and v; split the call over the batch";
    detail::resize_guarded(g.d_query, detail::rank_dims<rank>(s, s.head_dim), "d_query", hint);
    if constexpr (rank == 4) {
        detail::resize_guarded(g.d_key, std::array<index_t, 4>{s.batch, s.kv_heads, s.key_len, s.head_dim}, "d_key",
                               hint);
        detail::resize_guarded(g.d_value, std::array<index_t, 4>{s.batch, s.kv_heads, s.key_len, s.value_dim},
                               "d_value", hint);
    } else {
        detail::resize_guarded(g.d_key, std::array<index_t, 3>{s.batch, s.key_len, s.head_dim}, "d_key", hint);
        detail::resize_guarded(g.d_value, std::array<index_t, 3>{s.batch, s.key_len, s.value_dim}, "d_value", hint);
    }
    detail::gradient_outputs<T> o;
    o.d_query = detail::as_mutable_view(g.d_query);
    o.d_key = detail::as_mutable_view(g.d_key);
    o.d_value = detail::as_mutable_view(g.d_value);
    if (!options.score_bias.empty()) {
        detail::resize_guarded(g.d_score_bias, std::array<index_t, 2>{s.heads, s.query_len + s.key_len - 1},
                               "d_score_bias", hint);
        o.d_score_bias = g.d_score_bias.data();
    }
    if (!options.sinks.empty()) {
        detail::resize_guarded(g.d_sinks, std::array<index_t, 1>{s.heads}, "d_sinks", hint);
        o.d_sinks = g.d_sinks.data();
    }
    detail::run_backward(in, checked, o);
    return g;
}

}  // namespace detail

/// Gradients of scaled_dot_product_attention(q, k, v, mask, options) for d_out = d loss / d out, given that
/// call's out `[batch, heads, query_len, value_dim]` and lse `[batch, heads, query_len]` (need_lse, on by
/// default; or pass the forward's result whole, below). Pass the forward's options: scale, empty_rows,
/// score_bias and dropout (replayed from its seed, so the same weights are dropped) must be the same; threads and
/// kernel may differ (kernel::reference is the oracle, anything else the tiled path, O(threads x tile) memory).
/// Returns dq, dk, dv (dk and dv summed over the query heads of each group; of the inputs' type, 16-bit ones
/// included) and, with a score_bias, d_score_bias.
/// Throws before computing anything: everything scaled_dot_product_attention throws, shape_error
/// attend.shape.backward_out / backward_lse / backward_d_out for out, lse, d_out of the wrong shape, value_error
/// attend.value.non_finite for NaN / Inf in out or d_out and attend.value.lse for NaN / +inf in lse (both
/// when check_finite).
template <class Q, class K, class V, class Mask, class Out, class Lse, class DOut>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const Mask& mask, const Out& out,
                                           const Lse& lse, const DOut& d_out, const sdpa_options& options = {}) {
    if constexpr (detail::require_mask<Mask>()) {
        return detail::backward_allocating<detail::rank_of<Q>()>(q, k, v, out, lse, d_out, mask, options);
    }
}

/// Gradients of attention without a mask.
template <class Q, class K, class V, class Out, class Lse, class DOut>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse,
                                           const DOut& d_out, const sdpa_options& options = {}) {
    return scaled_dot_product_attention_backward(q, k, v, no_mask{}, out, lse, d_out, options);
}

/// Gradients from the forward's result as scaled_dot_product_attention returned it: its out and lse (need_lse
/// is on by default). Throws shape_error attend.shape.backward_lse, saying so, when the forward ran with
/// need_lse = false, and everything the form with out and lse throws.
template <class Q, class K, class V, class Mask, class T, int Rank, class DOut>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const Mask& mask,
                                           const attention_result<T, Rank>& forward, const DOut& d_out,
                                           const sdpa_options& options = {}) {
    if (forward.lse.size() == 0 && forward.out.size() != 0)
        throw shape_error("attend.shape.backward_lse",
                          detail::concat("the forward result holds out ",
                                         detail::format_shape(forward.out.dimensions()),
                                         " but no lse: run the forward with need_lse = true (the default)"));
    return scaled_dot_product_attention_backward(q, k, v, mask, forward.out, forward.lse, d_out, options);
}

/// Gradients of attention without a mask from the forward's result.
template <class Q, class K, class V, class T, int Rank, class DOut>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const attention_result<T, Rank>& forward,
                                           const DOut& d_out, const sdpa_options& options = {}) {
    return scaled_dot_product_attention_backward(q, k, v, no_mask{}, forward, d_out, options);
}

/// Writes the gradients into caller-owned tensors of the inputs' rank (attend::tensor or TensorMap), given after
/// the inputs, the mask and the options (the order of every attend call): d_query like q, d_key like k, d_value
/// like v (for 16-bit inputs: all in their type, rounded once, or all float, unrounded),
/// and unless nullptr d_score_bias `[heads, query_len + key_len - 1]` (written only when
/// options.score_bias is not none) and d_sinks `[heads]` (only with sinks), both of d_query's type. On any error
/// nothing is written: the throws of scaled_dot_product_attention_backward and shape_error
/// attend.shape.backward_dq / backward_dk / backward_dv / backward_score_bias / backward_sinks for outputs of the
/// wrong shape, and attend.shape.aliasing, naming both tensors, when an output overlaps q, k, v, out, d_out, lse
/// or another output in memory (measured conservatively, from each tensor's lowest to its highest element
/// address; adjacent buffers are fine).
template <class Q, class K, class V, class Mask, class Out, class Lse, class DOut, class DQ, class DK, class DV,
          class BiasGrad = std::nullptr_t, class SinkGrad = std::nullptr_t>
void scaled_dot_product_attention_backward_into(const Q& q, const K& k, const V& v, const Mask& mask, const Out& out,
                                                const Lse& lse, const DOut& d_out, const sdpa_options& options,
                                                DQ&& d_query, DK&& d_key, DV&& d_value,
                                                BiasGrad&& d_score_bias = nullptr, SinkGrad&& d_sinks = nullptr) {
    if constexpr (detail::require_mask<Mask>()) {
        using T = detail::scalar_of<Q>;
        using G = detail::scalar_of<DQ>;  // T, or float for 16-bit inputs
        constexpr int rank = detail::rank_of<Q>();
        static_assert(
            (std::is_same_v<G, T> || (detail::is_16bit_v<T> && std::is_same_v<G, float>)) &&
                std::is_same_v<G, detail::scalar_of<DK>> && std::is_same_v<G, detail::scalar_of<DV>>,
            "attend: d_query, d_key and d_value must have the query's scalar type (with 16-bit inputs: all of it, or "
            "all float)");
        static_assert(detail::rank_of<DQ>() == rank && detail::rank_of<DK>() == rank && detail::rank_of<DV>() == rank,
                      "attend: d_query, d_key and d_value must have the query's rank");
        const auto in = detail::backward_inputs_of<rank>(q, k, v, out, lse, d_out);
        detail::gradient_outputs<G> o;
        o.d_query = detail::as_mutable_view(d_query);
        o.d_key = detail::as_mutable_view(d_key);
        o.d_value = detail::as_mutable_view(d_value);
        if constexpr (detail::is_strided_view_v<DQ>) detail::check_output_strides(o.d_query, "d_query");
        if constexpr (detail::is_strided_view_v<DK>) detail::check_output_strides(o.d_key, "d_key");
        if constexpr (detail::is_strided_view_v<DV>) detail::check_output_strides(o.d_value, "d_value");
        if constexpr (!std::is_same_v<std::decay_t<BiasGrad>, std::nullptr_t>) {
            static_assert(std::is_same_v<G, detail::scalar_of<BiasGrad>> && detail::rank_of<BiasGrad>() == 2,
                          "attend: d_score_bias is a rank-2 tensor [heads, query_len + key_len - 1] of d_query's "
                          "scalar type");
            const std::array<index_t, 2> expected{in.q.dims[1], in.q.dims[2] + in.k.dims[2] - 1};
            const std::array<index_t, 2> got{d_score_bias.dimension(0), d_score_bias.dimension(1)};
            if (!options.score_bias.empty() && got != expected)
                throw shape_error("attend.shape.backward_score_bias",
                                  detail::concat("d_score_bias ", detail::format_shape(got), " != expected ",
                                                 detail::format_shape(expected), " [heads, query_len + key_len - 1]"));
            o.d_score_bias = options.score_bias.empty() ? nullptr : d_score_bias.data();
        }
        if constexpr (!std::is_same_v<std::decay_t<SinkGrad>, std::nullptr_t>) {
            static_assert(std::is_same_v<G, detail::scalar_of<SinkGrad>> && detail::rank_of<SinkGrad>() == 1,
                          "attend: d_sinks is a rank-1 tensor [heads] of d_query's scalar type");
            if (!options.sinks.empty() && d_sinks.dimension(0) != in.q.dims[1])
                throw shape_error("attend.shape.backward_sinks",
                                  detail::concat("d_sinks [", d_sinks.dimension(0), "] != expected [", in.q.dims[1],
                                                 "] [heads]"));
            o.d_sinks = options.sinks.empty() ? nullptr : d_sinks.data();
        }
        detail::check_no_aliasing(
            {detail::named("query", in.q), detail::named("key", in.k), detail::named("value", in.v),
             detail::named("out", in.out), detail::named("d_out", in.d_out), detail::named("lse", in.lse, in.lse_dims)},
            {detail::named("d_query", o.d_query), detail::named("d_key", o.d_key), detail::named("d_value", o.d_value),
             detail::named("d_score_bias", o.d_score_bias,
                           std::array<index_t, 2>{in.q.dims[1], in.q.dims[2] + in.k.dims[2] - 1}),
             detail::named("d_sinks", o.d_sinks, std::array<index_t, 1>{in.q.dims[1]})});
        const auto checked = detail::check_backward(in, &o, mask, options);
        detail::run_backward(in, checked, o);
    }
}

/// The _into backward with default options: the three input gradients only.
template <class Q, class K, class V, class Mask, class Out, class Lse, class DOut, class DQ, class DK, class DV,
          std::enable_if_t<!std::is_same_v<std::decay_t<DQ>, sdpa_options>, int> = 0>
void scaled_dot_product_attention_backward_into(const Q& q, const K& k, const V& v, const Mask& mask, const Out& out,
                                                const Lse& lse, const DOut& d_out, DQ&& d_query, DK&& d_key,
                                                DV&& d_value) {
    scaled_dot_product_attention_backward_into(q, k, v, mask, out, lse, d_out, sdpa_options{},
                                               std::forward<DQ>(d_query), std::forward<DK>(d_key),
                                               std::forward<DV>(d_value));
}

/// The gradient of a T5 relative-position bias table `[num_buckets, heads]` (d loss / d table(bucket, h)) from
/// the d_score_bias of a backward call whose options.score_bias was built from `table`
/// (score_bias::relative(table, alignment)): each key - query offset adds its gradient to its bucket.
/// `bias` is that call's options.score_bias; the table must reproduce it at every offset of the call.
/// Throws shape_error attend.shape.relative_bias_gradient when grads has no d_score_bias or its heads
/// differ from the table's, value_error attend.value.relative_bias_table when the table does not give bias's
/// values (another table, another alignment, or a table changed since).
template <class U, class T, int Rank>
tensor<U, 2> relative_bias_gradient(const relative_position_bias<U>& table, const attention_gradients<T, Rank>& grads,
                                    const score_bias& bias) {
    const index_t L = grads.d_query.dimension(Rank - 2), S = grads.d_key.dimension(Rank - 2);
    const index_t heads = Rank == 4 ? grads.d_query.dimension(1) : 1;
    const index_t diagonals = L + S - 1;
    const auto& g = grads.d_score_bias;
    if (g.dimension(0) != heads || g.dimension(1) != diagonals || table.heads() != heads || bias.empty())
        throw shape_error("attend.shape.relative_bias_gradient",
                          detail::concat("d_score_bias ", detail::format_shape(g.dimensions()), " must be [", heads,
                                         ',', diagonals,
                                         "] (heads, query_len + key_len - 1; empty means the "
                                         "backward ran without a score_bias) and the table ",
                                         detail::format_shape(table.table().dimensions()), " must have heads ", heads));
    const index_t shift = bias.bias_alignment() == alignment::bottom_right ? S - L : 0;
    tensor<U, 2> d_table(table.num_buckets(), heads);
    d_table.setZero();
    for (index_t h = 0; h < heads; ++h)
        for (index_t n = 0; n < diagonals; ++n) {
            const index_t offset = n - (L - 1);  // key - query
            const index_t i = std::max<index_t>(0, -offset), j = i + offset;
            const index_t bucket = table.bucket(i + shift, j);
            if (bias.value<double>(h, i, j, L, S) != static_cast<double>(table.table()(bucket, h)))
                throw value_error("attend.value.relative_bias_table",
                                  detail::concat("the table does not give the call's score_bias at head ", h,
                                                 ", key - query ", offset, ": ", table.table()(bucket, h),
                                                 " != ", bias.value<double>(h, i, j, L, S),
                                                 " (pass the table and alignment the bias was built from)"));
            d_table(bucket, h) += static_cast<U>(g(h, n));
        }
    return d_table;
}

}  // namespace attend
