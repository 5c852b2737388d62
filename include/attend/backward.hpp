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
/// 16-bit storage (Eigen::half, Eigen::bfloat16 q, k, v, out, d_out, with the forward's float lse): the inputs are
/// widened to float copies, the float kernels compute everything in float, and the gradients are rounded to the
/// storage type once (or, with float outputs passed to the _into form, not at all). The copies cost as much
/// memory again as the inputs, in float.

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
    tensor<T, Rank> dq;  ///< `[batch, heads, query_len, head_dim]`
    tensor<T, Rank> dk;  ///< `[batch, kv_heads, key_len, head_dim]`, summed over the query heads of each group
    tensor<T, Rank> dv;  ///< `[batch, kv_heads, key_len, value_dim]`, summed over the query heads of each group
    /// `[heads, query_len + key_len - 1]` when options.score_bias is not none, else empty: entry (h, n) is
    /// d loss / d (the bias head h adds where key - query = n - (query_len - 1)), summed over the batch and over
    /// every (query, key) pair on that diagonal. Input of relative_bias_gradient; for ALiBi it is informational.
    tensor<T, 2> score_bias_gradient;
    /// `[heads]` when options.sinks is not empty, else empty: d loss / d sink logit of each query head (sinks.hpp),
    /// summed over the batch and the queries.
    tensor<T, 1> sink_gradient;
};

namespace detail {

template <class T>
inline constexpr bool is_16bit_v = std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;

/// A 16-bit input of the backward widened to a float tensor of its shape, exactly (widen.hpp).
template <class X>
tensor<float, rank_of<X>()> widened_input(const X& x, const char* what) {
    require_row_major_tensor<X>();
    tensor<float, rank_of<X>()> copy;
    resize_guarded(copy, x.dimensions(), what, "the 16-bit backward widens its inputs to float copies first");
    widen(x.data(), x.size(), copy.data());
    return copy;
}

/// y = x, element by element, rounded once to y's type (same shape and size).
template <class X, class Y>
void round_into(const X& x, Y&& y) {
    using U = scalar_of<std::decay_t<Y>>;
    std::transform(x.data(), x.data() + x.size(), y.data(), [](const auto v) { return static_cast<U>(v); });
}

/// A float tensor rounded once to U, in a new tensor.
template <class U, int Rank>
tensor<U, Rank> rounded(const tensor<float, Rank>& x) {
    tensor<U, Rank> y;
    resize_guarded(y, x.dimensions(), "a 16-bit gradient", "the gradients are as large as q, k and v");
    round_into(x, y);
    return y;
}

/// A backward call that passed every check.
template <class T, class Bound>
struct checked_backward {
    attention_shape shape;
    checked_call<T, Bound> call;
};

template <class T>
std::string spell_lse(const backward_inputs<T>& in) {
    if (in.lse_rank == 2) return format_shape(std::array<index, 2>{in.lse_dims[0], in.lse_dims[2]});
    return format_shape(in.lse_dims);
}

template <class View>
void check_view_dims(const View& x, const std::array<index, 4>& expected, int rank, const char* id, const char* what,
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
template <class T, class Mask>
auto check_backward(const backward_inputs<T>& in, const gradient_outputs<T>* out, const Mask& mask,
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
    const std::array<index, 4> out_dims{s.batch, s.heads, s.query_len, s.value_dim};
    check_view_dims(in.out, out_dims, rank, "attend.shape.backward_out", "out", context);
    const std::array<index, 3> lse_expected{s.batch, s.heads, s.query_len};
    if (in.lse_dims != lse_expected || in.lse_rank != rank - 1) {
        backward_inputs<T> want;
        want.lse_dims = lse_expected;
        want.lse_rank = rank - 1;
        throw shape_error("attend.shape.backward_lse",
                          concat("lse ", spell_lse(in), " != expected ", spell_lse(want), context));
    }
    check_view_dims(in.d_out, out_dims, rank, "attend.shape.backward_d_out", "d_out", context);
    if (out) {
        check_view_dims(out->dq, in.q.dims, rank, "attend.shape.backward_dq", "dq", context);
        check_view_dims(out->dk, in.k.dims, rank, "attend.shape.backward_dk", "dk", context);
        check_view_dims(out->dv, in.v.dims, rank, "attend.shape.backward_dv", "dv", context);
    }
    checked_backward<T, decltype(mask.bind(s))> checked{s, check_call(in.q, in.k, in.v, s, mask, o)};
    if (o.check_finite) {
        check_finite(in.out, "out", resolve_threads(o.threads));
        check_finite(in.d_out, "d_out", resolve_threads(o.threads));
        const index rows = s.batch * s.heads * s.query_len;
        for (index n = 0; n < rows; ++n) {
            const T x = in.lse[n];
            if (std::isnan(x) || x == std::numeric_limits<T>::infinity())
                throw value_error("attend.value.lse",
                                  concat("lse ", spell_lse(in), " holds ", x, " at flat index ", n,
                                         "; it must be finite, or -inf for a padded query or an empty row"));
        }
    }
    return checked;
}

/// Runs the kernel of a checked backward call: kernel::reference is the oracle, anything else the tiled path.
template <class T, class Bound>
void run_backward(const backward_inputs<T>& in, const checked_backward<T, Bound>& checked,
                  const gradient_outputs<T>& out, const backward_tiling& tiling) {
    if (checked.call.kernel == kernel::reference) {
        reference_backward(in, checked.shape, checked.call.mask, checked.call.params, out);
        return;
    }
    with_mask_tiles(checked.call.mask, [&](const mask_tiles& mask) {
        tiled_backward<T, accumulator_t<T>>(in, checked.shape, mask, checked.call.params, out, tiling,
                                            checked.call.threads);
    });
}

template <class T, class Bound>
void run_backward(const backward_inputs<T>& in, const checked_backward<T, Bound>& checked,
                  const gradient_outputs<T>& out) {
    run_backward(in, checked, out, default_backward_tiling<T>(checked.shape));
}

/// The backward on strided views, for multi-head attention (heads read from and written to projected
/// `[batch, len, heads * dim]` buffers through split_heads): checks everything, then writes dq, dk, dv and,
/// when not null and the call has a score_bias, score_bias_gradient. Throws as
/// scaled_dot_product_attention_backward, before any write.
template <class T, class Mask>
void sdpa_backward_views(const backward_inputs<T>& in, const Mask& mask, const sdpa_options& options,
                         const gradient_outputs<T>& out) {
    require_mask<Mask>();
    const auto checked = check_backward(in, &out, mask, options);
    run_backward(in, checked, out);
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
        static_assert(std::is_same_v<typename traits::scalar, T>,
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

/// The allocating backward of float and double inputs.
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
    detail::resize_guarded(g.dq, detail::rank_dims<rank>(s, s.head_dim), "dq", hint);
    if constexpr (rank == 4) {
        detail::resize_guarded(g.dk, std::array<index, 4>{s.batch, s.kv_heads, s.key_len, s.head_dim}, "dk", hint);
        detail::resize_guarded(g.dv, std::array<index, 4>{s.batch, s.kv_heads, s.key_len, s.value_dim}, "dv", hint);
    } else {
        detail::resize_guarded(g.dk, std::array<index, 3>{s.batch, s.key_len, s.head_dim}, "dk", hint);
        detail::resize_guarded(g.dv, std::array<index, 3>{s.batch, s.key_len, s.value_dim}, "dv", hint);
    }
    detail::gradient_outputs<T> o;
    o.dq = detail::as_mutable_view(g.dq);
    o.dk = detail::as_mutable_view(g.dk);
    o.dv = detail::as_mutable_view(g.dv);
    if (!options.score_bias.empty()) {
        detail::resize_guarded(g.score_bias_gradient, std::array<index, 2>{s.heads, s.query_len + s.key_len - 1},
                               "score_bias_gradient", hint);
        o.score_bias_gradient = g.score_bias_gradient.data();
    }
    if (!options.sinks.empty()) {
        detail::resize_guarded(g.sink_gradient, std::array<index, 1>{s.heads}, "sink_gradient", hint);
        o.sink_gradient = g.sink_gradient.data();
    }
    detail::run_backward(in, checked, o);
    return g;
}

}  // namespace detail

/// Gradients of scaled_dot_product_attention(q, k, v, mask, options) for d_out = d loss / d out, given that
/// call's out `[batch, heads, query_len, value_dim]` and lse `[batch, heads, query_len]` (need_lse, on by
/// default; or pass the forward's result whole, below). Pass the forward's options: scale, empty_rows, score_bias and dropout (replayed from its seed, so
/// the same weights are dropped) must be the same; threads and kernel may differ (kernel::reference is the
/// oracle, anything else the tiled path, O(threads x tile) memory). Returns dq, dk, dv (dk and dv summed over
/// the query heads of each group) and, with a score_bias, score_bias_gradient.
/// Throws before computing anything: everything scaled_dot_product_attention throws, shape_error
/// attend.shape.backward_out / backward_lse / backward_d_out for out, lse, d_out of the wrong shape, value_error
/// attend.value.non_finite for NaN / Inf in out or d_out and attend.value.lse for NaN / +inf in lse (both
/// when check_finite).
template <class Q, class K, class V, class Out, class Lse, class DOut, class Mask>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse,
                                           const DOut& d_out, const Mask& mask, const sdpa_options& options = {}) {
    detail::require_mask<Mask>();
    using T = detail::scalar_of<Q>;
    constexpr int rank = detail::rank_of<Q>();
    if constexpr (detail::is_16bit_v<T>) {  // float copies through the float backward, rounded once (file comment)
        static_assert(std::is_same_v<T, detail::scalar_of<K>> && std::is_same_v<T, detail::scalar_of<V>> &&
                          std::is_same_v<T, detail::scalar_of<Out>> && std::is_same_v<T, detail::scalar_of<DOut>>,
                      "attend: query, key, value, out and d_out must have the same scalar type");
        const auto g =
            scaled_dot_product_attention_backward(detail::widened_input(q, "query"), detail::widened_input(k, "key"),
                                                  detail::widened_input(v, "value"), detail::widened_input(out, "out"),
                                                  lse, detail::widened_input(d_out, "d_out"), mask, options);
        return attention_gradients<T, rank>{detail::rounded<T>(g.dq), detail::rounded<T>(g.dk),
                                            detail::rounded<T>(g.dv), detail::rounded<T>(g.score_bias_gradient),
                                            detail::rounded<T>(g.sink_gradient)};
    } else {
        return detail::backward_allocating<rank>(q, k, v, out, lse, d_out, mask, options);
    }
}

/// Gradients of attention without a mask.
template <class Q, class K, class V, class Out, class Lse, class DOut>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse,
                                           const DOut& d_out, const sdpa_options& options = {}) {
    return scaled_dot_product_attention_backward(q, k, v, out, lse, d_out, no_mask{}, options);
}

/// Gradients from the forward's result as scaled_dot_product_attention returned it: its out and lse (need_lse
/// is on by default). Throws shape_error attend.shape.backward_lse, saying so, when the forward ran with
/// need_lse = false, and everything the form with out and lse throws.
template <class Q, class K, class V, class T, int Rank, class DOut, class Mask>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const attention_result<T, Rank>& forward,
                                           const DOut& d_out, const Mask& mask, const sdpa_options& options = {}) {
    if (forward.lse.size() == 0 && forward.out.size() != 0)
        throw shape_error("attend.shape.backward_lse",
                          detail::concat("the forward result holds out ",
                                         detail::format_shape(forward.out.dimensions()),
                                         " but no lse: run the forward with need_lse = true (the default)"));
    return scaled_dot_product_attention_backward(q, k, v, forward.out, forward.lse, d_out, mask, options);
}

/// Gradients of attention without a mask from the forward's result.
template <class Q, class K, class V, class T, int Rank, class DOut>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const attention_result<T, Rank>& forward,
                                           const DOut& d_out, const sdpa_options& options = {}) {
    return scaled_dot_product_attention_backward(q, k, v, forward, d_out, no_mask{}, options);
}

/// Writes the gradients into caller-owned tensors of the inputs' rank (attend::tensor or TensorMap):
/// dq like q, dk like k, dv like v (for 16-bit inputs: all in their type, rounded once, or all float, unrounded), and unless nullptr score_bias_gradient `[heads, query_len + key_len - 1]`
/// (written only when options.score_bias is not none). On any error nothing is written: the throws of
/// scaled_dot_product_attention_backward and shape_error attend.shape.backward_dq / backward_dk / backward_dv /
/// backward_score_bias for outputs of the wrong shape, and attend.shape.aliasing, naming both tensors, when an
/// output overlaps q, k, v, out, d_out, lse or another output in memory (measured conservatively, from each
/// tensor's lowest to its highest element address; adjacent buffers are fine).
template <class Q, class K, class V, class Out, class Lse, class DOut, class Mask, class DQ, class DK, class DV,
          class BiasGrad = std::nullptr_t, class SinkGrad = std::nullptr_t>
void scaled_dot_product_attention_backward_into(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse,
                                                const DOut& d_out, const Mask& mask, DQ&& dq, DK&& dk, DV&& dv,
                                                const sdpa_options& options = {},
                                                BiasGrad&& score_bias_gradient = nullptr,
                                                SinkGrad&& sink_gradient = nullptr) {
    detail::require_mask<Mask>();
    using T = detail::scalar_of<Q>;
    constexpr int rank = detail::rank_of<Q>();
    if constexpr (detail::is_16bit_v<T>) {
        // Float copies through the float backward (file comment); gradients rounded once into 16-bit outputs, or
        // written straight into float ones.
        using G = detail::scalar_of<std::decay_t<DQ>>;
        static_assert(std::is_same_v<T, detail::scalar_of<K>> && std::is_same_v<T, detail::scalar_of<V>> &&
                          std::is_same_v<T, detail::scalar_of<Out>> && std::is_same_v<T, detail::scalar_of<DOut>>,
                      "attend: query, key, value, out and d_out must have the same scalar type");
        static_assert((std::is_same_v<G, T> ||
                       std::is_same_v<G, float>)&&std::is_same_v<G, detail::scalar_of<std::decay_t<DK>>> &&
                          std::is_same_v<G, detail::scalar_of<std::decay_t<DV>>>,
                      "attend: with 16-bit inputs, dq, dk and dv are all of the inputs' type or all float");
        detail::check_no_aliasing(
            {detail::named("query", detail::checked_input(q)), detail::named("key", detail::checked_input(k)),
             detail::named("value", detail::checked_input(v)), detail::named("out", detail::checked_input(out)),
             detail::named("d_out", detail::checked_input(d_out)),
             detail::named("lse", lse.data(), std::array<index, 1>{lse.size()})},
            {detail::named("dq", detail::as_mutable_view(dq)), detail::named("dk", detail::as_mutable_view(dk)),
             detail::named("dv", detail::as_mutable_view(dv))});
        const auto wq = detail::widened_input(q, "query"), wk = detail::widened_input(k, "key");
        const auto wv = detail::widened_input(v, "value"), wout = detail::widened_input(out, "out");
        const auto wd_out = detail::widened_input(d_out, "d_out");
        if constexpr (std::is_same_v<G, float>) {
            scaled_dot_product_attention_backward_into(wq, wk, wv, wout, lse, wd_out, mask, dq, dk, dv, options,
                                                       score_bias_gradient, sink_gradient);
        } else {
            const char* hint = "16-bit gradients are computed in float copies first; pass float dq, dk, dv";
            tensor<float, rank> fq, fk, fv;
            detail::resize_guarded(fq, dq.dimensions(), "float dq", hint);
            detail::resize_guarded(fk, dk.dimensions(), "float dk", hint);
            detail::resize_guarded(fv, dv.dimensions(), "float dv", hint);
            tensor<float, 2> f_bias;
            tensor<float, 1> f_sink;
            if constexpr (!std::is_same_v<std::decay_t<BiasGrad>, std::nullptr_t>)
                detail::resize_guarded(f_bias, score_bias_gradient.dimensions(), "float score_bias_gradient", hint);
            if constexpr (!std::is_same_v<std::decay_t<SinkGrad>, std::nullptr_t>)
                detail::resize_guarded(f_sink, sink_gradient.dimensions(), "float sink_gradient", hint);
            const auto bias_out = [&]() -> auto& {
                if constexpr (std::is_same_v<std::decay_t<BiasGrad>, std::nullptr_t>) return score_bias_gradient;
                else return f_bias;
            };
            const auto sink_out = [&]() -> auto& {
                if constexpr (std::is_same_v<std::decay_t<SinkGrad>, std::nullptr_t>) return sink_gradient;
                else return f_sink;
            };
            scaled_dot_product_attention_backward_into(wq, wk, wv, wout, lse, wd_out, mask, fq, fk, fv, options,
                                                       bias_out(), sink_out());
            detail::round_into(fq, dq);
            detail::round_into(fk, dk);
            detail::round_into(fv, dv);
            if constexpr (!std::is_same_v<std::decay_t<BiasGrad>, std::nullptr_t>)
                if (!options.score_bias.empty()) detail::round_into(f_bias, score_bias_gradient);
            if constexpr (!std::is_same_v<std::decay_t<SinkGrad>, std::nullptr_t>)
                if (!options.sinks.empty()) detail::round_into(f_sink, sink_gradient);
        }
    } else {
        static_assert(std::is_same_v<T, detail::scalar_of<DQ>> && std::is_same_v<T, detail::scalar_of<DK>> &&
                          std::is_same_v<T, detail::scalar_of<DV>>,
                      "attend: dq, dk and dv must have the query's scalar type");
        static_assert(detail::rank_of<DQ>() == rank && detail::rank_of<DK>() == rank && detail::rank_of<DV>() == rank,
                      "attend: dq, dk and dv must have the query's rank");
        const auto in = detail::backward_inputs_of<rank>(q, k, v, out, lse, d_out);
        detail::gradient_outputs<T> o;
        o.dq = detail::as_mutable_view(dq);
        o.dk = detail::as_mutable_view(dk);
        o.dv = detail::as_mutable_view(dv);
        if constexpr (!std::is_same_v<std::decay_t<BiasGrad>, std::nullptr_t>) {
            static_assert(std::is_same_v<T, detail::scalar_of<BiasGrad>> && detail::rank_of<BiasGrad>() == 2,
                          "attend: score_bias_gradient is a rank-2 tensor [heads, query_len + key_len - 1] of the "
                          "query's scalar type");
            const std::array<index, 2> expected{in.q.dims[1], in.q.dims[2] + in.k.dims[2] - 1};
            const std::array<index, 2> got{score_bias_gradient.dimension(0), score_bias_gradient.dimension(1)};
            if (!options.score_bias.empty() && got != expected)
                throw shape_error("attend.shape.backward_score_bias",
                                  detail::concat("score_bias_gradient ", detail::format_shape(got), " != expected ",
                                                 detail::format_shape(expected), " [heads, query_len + key_len - 1]"));
            o.score_bias_gradient = options.score_bias.empty() ? nullptr : score_bias_gradient.data();
        }
        if constexpr (!std::is_same_v<std::decay_t<SinkGrad>, std::nullptr_t>) {
            static_assert(std::is_same_v<T, detail::scalar_of<SinkGrad>> && detail::rank_of<SinkGrad>() == 1,
                          "attend: sink_gradient is a rank-1 tensor [heads] of the query's scalar type");
            if (!options.sinks.empty() && sink_gradient.dimension(0) != in.q.dims[1])
                throw shape_error("attend.shape.backward_sinks",
                                  detail::concat("sink_gradient [", sink_gradient.dimension(0), "] != expected [",
                                                 in.q.dims[1], "] [heads]"));
            o.sink_gradient = options.sinks.empty() ? nullptr : sink_gradient.data();
        }
        detail::check_no_aliasing(
            {detail::named("query", in.q), detail::named("key", in.k), detail::named("value", in.v),
             detail::named("out", in.out), detail::named("d_out", in.d_out), detail::named("lse", in.lse, in.lse_dims)},
            {detail::named("dq", o.dq), detail::named("dk", o.dk), detail::named("dv", o.dv),
             detail::named("score_bias_gradient", o.score_bias_gradient,
                           std::array<index, 2>{in.q.dims[1], in.q.dims[2] + in.k.dims[2] - 1}),
             detail::named("sink_gradient", o.sink_gradient, std::array<index, 1>{in.q.dims[1]})});
        const auto checked = detail::check_backward(in, &o, mask, options);
        detail::run_backward(in, checked, o);
    }
}

/// The gradient of a T5 relative-position bias table `[num_buckets, heads]` (d loss / d table(bucket, h)) from
/// the score_bias_gradient of a backward call whose options.score_bias was built from `table`
/// (score_bias::relative(table, alignment)): each key - query offset adds its gradient to its bucket.
/// `bias` is that call's options.score_bias; the table must reproduce it at every offset of the call.
/// Throws shape_error attend.shape.relative_bias_gradient when grads has no score_bias_gradient or its heads
/// differ from the table's, value_error attend.value.relative_bias_table when the table does not give bias's
/// values (another table, another alignment, or a table changed since).
template <class U, class T, int Rank>
tensor<U, 2> relative_bias_gradient(const relative_position_bias<U>& table, const attention_gradients<T, Rank>& grads,
                                    const score_bias& bias) {
    const index L = grads.dq.dimension(Rank - 2), S = grads.dk.dimension(Rank - 2);
    const index heads = Rank == 4 ? grads.dq.dimension(1) : 1;
    const index diagonals = L + S - 1;
    const auto& g = grads.score_bias_gradient;
    if (g.dimension(0) != heads || g.dimension(1) != diagonals || table.heads() != heads || bias.empty())
        throw shape_error("attend.shape.relative_bias_gradient",
                          detail::concat("score_bias_gradient ", detail::format_shape(g.dimensions()), " must be [",
                                         heads, ',', diagonals,
                                         "] (heads, query_len + key_len - 1; empty means the "
                                         "backward ran without a score_bias) and the table ",
                                         detail::format_shape(table.table().dimensions()), " must have heads ", heads));
    const index shift = bias.bias_alignment() == alignment::bottom_right ? S - L : 0;
    tensor<U, 2> d_table(table.num_buckets(), heads);
    d_table.setZero();
    for (index h = 0; h < heads; ++h)
        for (index n = 0; n < diagonals; ++n) {
            const index offset = n - (L - 1);  // key - query
            const index i = std::max<index>(0, -offset), j = i + offset;
            const index bucket = table.bucket(i + shift, j);
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
