// SPDX-License-Identifier: MIT
#pragma once
/// Scaled dot-product attention: out = softmax(scale * q k^T + mask + score_bias) v, softmax along the key axis.
/// q `[batch, heads, query_len, head_dim]`, k `[batch, kv_heads, key_len, head_dim]`,
/// v `[batch, kv_heads, key_len, value_dim]`, out `[batch, heads, query_len, value_dim]` (rank 3: one head).
/// The data path reads in one direction: inputs -> checks -> mask tiles -> kernel -> outputs. Every check runs
/// before the first output element is written.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include "detail/empty_rows.hpp"
#include "detail/input_scan.hpp"
#include "detail/memory.hpp"
#include "detail/parallel_for.hpp"
#include "detail/reference_kernel.hpp"
#include "detail/tiled_kernel.hpp"
#include "detail/widen.hpp"
#include "error.hpp"
#include "mask.hpp"
#include "score_bias.hpp"
#include "score_function.hpp"
#include "shape.hpp"
#include "sinks.hpp"
#include "tensor.hpp"

namespace attend {

/// What a query with no allowed key gets. Never NaN.
enum class empty_rows {
    error,  ///< throw mask_error attend.mask.empty_row naming the first (batch, head, query), before any write
    zero    ///< zero output and weights, lse = -inf (PyTorch >= 2.5 SDPA and FlexAttention)
};

/// Which implementation computes the result; both give the same answer within rounding.
enum class kernel {
    automatic,  ///< the fastest available: tiled
    reference,  ///< materializes the scores of one (batch, head); the oracle of the tests
    tiled       ///< FlashAttention-2's online softmax on micro-kernels, O(threads x tile) memory; multi-threaded
};

/// Dropout on the attention probabilities. Applied only when `training` is true: attend never drops in eval.
struct dropout_options {
    double probability = 0;  ///< in [0, 1)
    std::uint64_t seed = 0;  ///< with (batch, head, query, key) it fully determines which weights are dropped
    bool training = false;   ///< dropout only when true: attend never drops in eval
    /// Where this call's queries and keys sit in a longer sequence (>= 0): the decisions are those of query
    /// i + query_offset and key j + key_offset, so attention computed block by block (ring attention over shards)
    /// drops exactly what one call over the whole sequence drops. 0 for an ordinary call.
    index_t query_offset = 0;
    index_t key_offset = 0;  ///< see query_offset
};

/// Options of scaled_dot_product_attention.
struct sdpa_options {
    std::optional<double> scale;  ///< default 1 / sqrt(head_dim); must be finite and > 0
    /// Logit soft-capping (Gemma 2, Grok; ONNX Attention's and FlashAttention's softcap): the scaled scores s
    /// become softcap * tanh(s / softcap), then score_bias and the mask are added. Capping first keeps a mask's
    /// -inf and a bias's slope out of the tanh, as ONNX defines it. Must be finite and > 0; unset: no capping.
    std::optional<double> softcap;
    attend::empty_rows empty_rows = attend::empty_rows::error;  ///< a query with no allowed key: throw or zero
    dropout_options dropout;                                    ///< on the probabilities, in training only
    attend::score_bias score_bias;                              ///< ALiBi or relative-position bias, applied per tile
    /// Attention sinks (sinks.hpp): one logit per query head `[heads]` that joins each row's softmax denominator
    /// with no value, so weights sum to less than 1 and lse includes it. A row whose keys are all forbidden still
    /// follows empty_rows: an error by default, and under empty_rows::zero a zero row whose lse is the sink (its
    /// whole mass), so merge_partials stays exact. Empty: none.
    attention_sinks sinks;
    /// A user's score modifier (score_function.hpp, FlexAttention's score_mod): f(score, batch, head, query, key)
    /// after the scale and softcap, before score_bias and the mask. The backward needs it built with its
    /// derivative. Empty: none.
    score_function score_mod;
    /// Tiled kernel threads; 0 = std::thread::hardware_concurrency() (logical CPUs, read once). Same result bit
    /// for bit for any count; the threads past the caller's are kept between calls.
    int threads = 0;
    ///< (docs/guarantees.md)
    attend::kernel kernel = attend::kernel::automatic;  ///< which implementation runs
    bool need_weights = false;                          ///< fill result.weights `[batch, heads, query_len, key_len]`
    bool need_lse = true;                ///< fill result.lse `[batch, heads, query_len]`, what the backward and
                                         ///< merge_partials need; on by default (one scalar per query row) so a
                                         ///< training forward cannot forget it
    bool weights_after_dropout = false;  ///< weights as used (dropped and rescaled) instead of probabilities
    bool check_finite = true;            ///< reject NaN / Inf in q, k, v (value_error attend.value.non_finite) and
                                         ///< scores beyond half of T's range (attend.value.score_overflow,
                                         ///< detail/input_scan.hpp); off: the caller promises both. A decode
                                         ///< scans K and V in the kernel's own pass, so they are read once
};

/// The result of scaled_dot_product_attention; T is the query's storage type, Rank the rank of the inputs (3 or 4).
template <class T, int Rank>
struct attention_result {
    tensor<T, Rank> out;      ///< `[batch, heads, query_len, value_dim]`
    tensor<T, Rank> weights;  ///< `[batch, heads, query_len, key_len]` when need_weights, else empty
    /// `[batch, heads, query_len]`, natural-log sum-exp of masked scaled scores, in the accumulation type (float
    /// for 16-bit storage, as PyTorch's flash kernels return it)
    tensor<accumulator_t<T>, Rank - 1> lse;
};

namespace detail {

template <class X>
constexpr int rank_of() {
    return tensor_traits<std::decay_t<X>>::rank;
}

/// The options of a call with storage type T as kernel parameters in its accumulation type, checked.
template <class T>
kernel_params<accumulator_t<T>> checked_params(const attention_shape& s, const sdpa_options& o) {
    using Acc = accumulator_t<T>;  // every value below is applied to scores, which are computed in Acc
    kernel_params<Acc> p;
    const double scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim));
    if (!std::isfinite(scale) || scale <= 0)
        throw value_error("attend.value.scale", concat("scale ", scale, " must be finite and > 0"));
    // Also in the scores' type: 1e300 is inf as a float and 1e-50 is 0, and either turns every score into inf, NaN
    // or 0 although the check in double passed.
    if (scale > static_cast<double>(std::numeric_limits<Acc>::max()) || static_cast<Acc>(scale) <= Acc(0))
        throw value_error("attend.value.scale", concat("scale ", scale, " must be finite and > 0, also as ",
                                                       scalar_name<Acc>(), ", the type the scores are computed in"));
    p.scale = static_cast<Acc>(scale);
    if (o.softcap) {
        const double c = *o.softcap;
        if (!std::isfinite(c) || c <= 0 || c > static_cast<double>(std::numeric_limits<Acc>::max()) ||
            static_cast<Acc>(c) <= Acc(0))
            throw value_error("attend.value.softcap",
                              concat("softcap ", c, " must be finite and > 0, also as ", scalar_name<Acc>(),
                                     ", the type the scores are computed in"));
        p.softcap = static_cast<Acc>(c);
    }
    const double pd = o.dropout.probability;
    if (!(pd >= 0 && pd < 1))
        throw value_error("attend.value.dropout", concat("dropout probability ", pd, " must be in [0, 1)"));
    if (o.dropout.query_offset < 0 || o.dropout.key_offset < 0)
        throw value_error("attend.value.dropout", concat("dropout query_offset ", o.dropout.query_offset,
                                                         " and key_offset ", o.dropout.key_offset, " must be >= 0"));
    if (o.dropout.training && pd > 0) {
        p.dropout.query_offset = o.dropout.query_offset;
        p.dropout.key_offset = o.dropout.key_offset;
        p.dropout.seed = o.dropout.seed;
        p.dropout.probability = pd;
        p.dropout.keep_scale = 1.0 / (1.0 - pd);
    }
    if (o.threads < 0) throw value_error("attend.value.threads", concat("threads ", o.threads, " must be >= 0"));
    if (!o.score_bias.empty()) {
        o.score_bias.template validate<Acc>(s.heads, s.query_len, s.key_len);
        p.bias = &o.score_bias;
    }
    p.weights_after_dropout = o.weights_after_dropout;
    o.score_mod.validate(s);
    p.score_mod = o.score_mod.tiles();
    o.sinks.template validate<Acc>(s.heads);
    for (index_t h = 0; h < o.sinks.size(); ++h) p.sinks.push_back(static_cast<Acc>(o.sinks[h]));
    return p;
}

/// A call that passed every check: its kernel parameters (in the accumulation type of the query's storage type T)
/// and its mask bound to the shape.
template <class T, class Bound>
struct checked_call {
    kernel_params<accumulator_t<T>> params;
    Bound mask;
    attend::kernel kernel = attend::kernel::automatic;
    int threads = 1;                ///< resolved: >= 1
    bool kv_scan_deferred = false;  ///< check_finite's scan of k and v is left to run_checked (deferred_kv_scan)
    std::vector<row_magnitudes> query_magnitudes{};  ///< with check_finite: q's, per (batch, head), from its scan
};

/// Every check of an attention call, in data-path order: options, mask against the shape, finite inputs, empty
/// rows. Nothing is allocated or written before it returns. With `defer_kv_scan` (a caller that runs the call
/// with run_checked right away and hands out nothing written before it) check_finite's scan of k and v is left to
/// run_checked, which has the kernel do it in its own pass where it can and throws before any output is written
/// either way; then a mask's attend.mask.empty_row comes before a non-finite key or value.
template <class T, class Rows, class Mask>
auto check_call(const strided_view<const T>& q, const Rows& k, const Rows& v, const attention_shape& s,
                const Mask& mask, const sdpa_options& o, bool defer_kv_scan = false) {
    checked_call<T, decltype(mask.bind(s))> call{checked_params<T>(s, o), mask.bind(s), o.kernel,
                                                 resolve_threads(o.threads)};
    if (o.check_finite) {
        // check_finite of q, and q's side of the score-range rule, kept for the scan of k and v (now or deferred).
        call.query_magnitudes = head_magnitudes(q, "query", call.threads);
        if (defer_kv_scan) call.kv_scan_deferred = true;
        else scan_keys_and_values(q, call.query_magnitudes, k, v, s, call.params.scale, call.threads);
    }
    if (o.empty_rows == empty_rows::error)
        if (const auto row = first_empty_row<mask_tiles>(erased_mask<decltype(call.mask)>(call.mask), s))
            throw mask_error("attend.mask.empty_row",
                             concat("query ", (*row)[2], " of batch ", (*row)[0], ", head ", (*row)[1],
                                    " has no allowed key, so softmax is undefined; fix the mask, mark padded "
                                    "queries with query_padding, or pass empty_rows::zero"));
    return call;
}

/// Rows of a strided or paged view gathered into a dense `[batch, heads, len, dim]` tensor of type Acc, widened
/// from 16-bit storage where it is that.
template <class Acc, class Rows>
tensor<Acc, 4> gathered(const Rows& x, const char* what) {
    auto copy = allocating([&] { return tensor<Acc, 4>(x.dims[0], x.dims[1], x.dims[2], x.dims[3]); },
                           [&] { return allocation_text(what, x.dims, sizeof(Acc)); },
                           "kernel::tiled reads the inputs in place");
    for (index_t b = 0; b < x.dims[0]; ++b)
        for (index_t h = 0; h < x.dims[1]; ++h) {
            Acc* dst = copy.data() + (b * x.dims[1] + h) * x.dims[2] * x.dims[3];
            if constexpr (quantized_rows_v<Rows>) {
                widen_rows(x, b, h, 0, x.dims[2], dst);
            } else {
                for (index_t i = 0; i < x.dims[2]; ++i)
                    std::transform(x.row(b, h, i), x.row(b, h, i) + x.dims[3], dst + i * x.dims[3],
                                   [](auto value) { return static_cast<Acc>(value); });
            }
        }
    return copy;
}

/// Runs the kernel of a checked call: queries and outputs in T, keys and values as `Rows` (strided views of T or
/// of a 16-bit type, or a paged cache's blocks). The tiled kernel reads them all in place. The reference kernel,
/// the oracle, computes in one type: what is not already a strided view of that type (paged blocks, 16-bit rows)
/// it gets gathered into copies, and for 16-bit storage its results are rounded into the outputs once.
template <class T, class Rows, class Bound>
void run_checked(const strided_view<const T>& q, const Rows& k, const Rows& v, const attention_shape& s,
                 const checked_call<T, Bound>& call, const attention_outputs<T>& out) {
    using Acc = accumulator_t<T>;
    if (call.kv_scan_deferred) {
        const kv_scan_of<T, Rows> kv_scan(q, k, v, s, call.params.scale, call.query_magnitudes);
        if (call.kernel != kernel::reference) {
            auto params = call.params;
            if (!kv_scan.settled()) params.kv_scan = &kv_scan;
            return tiled_attention(q, k, v, s, call.mask, params, out, call.threads);
        }
        kv_scan.scan_now(call.threads);
    }
    if (call.kernel != kernel::reference) return tiled_attention(q, k, v, s, call.mask, call.params, out, call.threads);
    if constexpr (std::is_same_v<T, Acc> && std::is_same_v<Rows, strided_view<const T>>) {
        reference_attention(q, k, v, s, call.mask, call.params, out);
    } else {
        const auto keys = gathered<Acc>(k, "the reference kernel's copy of the keys");
        const auto values = gathered<Acc>(v, "the reference kernel's copy of the values");
        if constexpr (std::is_same_v<T, Acc>) {
            reference_attention(q, as_view(keys), as_view(values), s, call.mask, call.params, out);
        } else {
            const auto queries = gathered<Acc>(q, "the reference kernel's copy of the queries");
            tensor<Acc, 4> wide_out;
            resize_guarded(wide_out, std::array<index_t, 4>{s.batch, s.heads, s.query_len, s.value_dim},
                           "the reference kernel's output", "kernel::tiled writes the outputs in place");
            tensor<Acc, 1> wide_weights;
            if (out.weights)
                resize_guarded(wide_weights, std::array<index_t, 1>{s.batch * s.heads * s.query_len * s.key_len},
                               "the reference kernel's weights", "leave need_weights off");
            attention_outputs<Acc> o;
            o.out = as_mutable_view(wide_out);
            o.weights = out.weights ? wide_weights.data() : nullptr;
            o.lse = out.lse;
            reference_attention(as_view(queries), as_view(keys), as_view(values), s, call.mask, call.params, o);
            for (index_t b = 0; b < s.batch; ++b)
                for (index_t h = 0; h < s.heads; ++h)
                    for (index_t i = 0; i < s.query_len; ++i)
                        narrow(o.out.row(b, h, i), s.value_dim, out.out.row(b, h, i));
            if (out.weights) narrow(wide_weights.data(), wide_weights.size(), out.weights);
        }
    }
}

template <class X>
strided_view<const scalar_of<X>> checked_input(const X& x) {
    require_row_major_tensor<X>();
    return as_view(x);
}

/// q, k and v as views read in place (k and v of q's type, or 16-bit, or q8_0 blocks) and the shape they make.
template <class Q, class K, class V>
auto checked_inputs(const Q& q, const K& k, const V& v) {
    struct inputs {
        decltype(checked_input(std::declval<const Q&>())) q;
        decltype(checked_input(std::declval<const K&>())) k, v;
        attention_shape shape;
    };
    inputs in{checked_input(q), checked_input(k), checked_input(v), {}};
    static_assert(std::is_same_v<scalar_of<K>, scalar_of<V>> && storage_pair_v<scalar_of<Q>, scalar_of<K>>,
                  ATTEND_STORAGE_PAIR_MESSAGE);
    in.shape = check_views(in.q, in.k, in.v);
    return in;
}

/// Shape of a caller-owned output, checked against what the call produces.
template <class Out, std::size_t N>
void check_output_dims(const Out& out, const std::array<index_t, N>& expected, const char* id, const char* what) {
    std::array<index_t, N> got{};
    for (std::size_t a = 0; a < N; ++a) {
        if constexpr (is_strided_view_v<Out>) got[a] = out.dims[a];
        else got[a] = out.dimensions()[a];  // dimensions(): Tensor and TensorMap index it alike
    }
    if (got != expected)
        throw shape_error(id, concat(what, ' ', format_shape(got), " != expected ", format_shape(expected)));
}

template <int Rank>
std::array<index_t, Rank> rank_dims(const attention_shape& s, index_t last) {
    if constexpr (Rank == 4) return {s.batch, s.heads, s.query_len, last};
    else return {s.batch, s.query_len, last};
}

template <int Rank>
std::array<index_t, Rank - 1> lse_dims(const attention_shape& s) {
    if constexpr (Rank == 4) return {s.batch, s.heads, s.query_len};
    else return {s.batch, s.query_len};
}

}  // namespace detail

/// Attention of q over k/v under `mask` (an allowed set, an additive expression, or a rule such as
/// causal(alignment::top_left)). Returns out, and weights / lse when asked by options.
/// Throws shape_error (attend.shape.*), mask_error (attend.mask.*, incl. attend.mask.empty_row),
/// value_error (attend.value.{scale, softcap, dropout, threads, non_finite, sinks}), shape_error attend.shape.sinks.
template <class Q, class K, class V, class Mask>
auto scaled_dot_product_attention(const Q& q, const K& k, const V& v, const Mask& mask,
                                  const sdpa_options& options = {}) {
    if constexpr (detail::require_mask<Mask>()) {
        using T = detail::scalar_of<Q>;
        constexpr int rank = detail::rank_of<Q>();
        const auto [qv, kv, vv, s] = detail::checked_inputs(q, k, v);
        const auto call = detail::check_call(qv, kv, vv, s, mask, options, true);
        attention_result<T, rank> r;
        const char* hint =
            "need_weights materializes [batch, heads, query_len, key_len]; leave it off or split the call";
        detail::resize_guarded(r.out, detail::rank_dims<rank>(s, s.value_dim), "out", hint);
        if (options.need_weights)
            detail::resize_guarded(r.weights, detail::rank_dims<rank>(s, s.key_len), "weights", hint);
        if (options.need_lse) detail::resize_guarded(r.lse, detail::lse_dims<rank>(s), "lse", hint);
        detail::attention_outputs<T> o;
        o.out = detail::as_mutable_view(r.out);
        o.weights = options.need_weights ? r.weights.data() : nullptr;
        o.lse = options.need_lse ? r.lse.data() : nullptr;
        detail::run_checked(qv, kv, vv, s, call, o);
        return r;
    }
}

/// Attention without a mask: every query attends every key.
template <class Q, class K, class V>
auto scaled_dot_product_attention(const Q& q, const K& k, const V& v, const sdpa_options& options = {}) {
    return scaled_dot_product_attention(q, k, v, no_mask{}, options);
}

/// Writes attention into caller-owned tensors (attend::tensor or TensorMap of the inputs' rank; out may also be a
/// strided_view, such as split_heads over a `[batch, query_len, heads * value_dim]` buffer, whose elements must
/// have distinct addresses: shape_error attend.shape.output_strides):
/// out `[batch, heads, query_len, value_dim]`, and unless nullptr weights `[batch, heads, query_len, key_len]`
/// and lse `[batch, heads, query_len]`. On any error nothing is written (shape_error attend.shape.output,
/// attend.shape.weights_output, attend.shape.lse_output besides those of scaled_dot_product_attention).
/// Outputs must not overlap q, k, v or each other in memory (measured conservatively, from each tensor's lowest
/// to its highest element address): the kernels read inputs while they write outputs, tile by tile, so an
/// overlap is shape_error attend.shape.aliasing naming both tensors. Adjacent buffers are fine.
/// The arguments come in the order of every attend call: inputs, the mask, the options, then the outputs.
template <class Q, class K, class V, class Mask, class Out, class Weights = std::nullptr_t, class Lse = std::nullptr_t>
void scaled_dot_product_attention_into(const Q& q, const K& k, const V& v, const Mask& mask,
                                       const sdpa_options& options, Out&& out, Weights&& weights = nullptr,
                                       Lse&& lse = nullptr) {
    if constexpr (detail::require_mask<Mask>()) {
        using T = detail::scalar_of<Q>;
        constexpr int rank = detail::rank_of<Q>();
        static_assert(std::is_same_v<T, detail::scalar_of<Out>> && detail::rank_of<Out>() == rank,
                      "attend: out must have the scalar type and rank of the query");
        const auto [qv, kv, vv, s] = detail::checked_inputs(q, k, v);
        detail::check_output_dims(out, detail::rank_dims<rank>(s, s.value_dim), "attend.shape.output", "out");
        detail::attention_outputs<T> o;
        o.out = detail::as_mutable_view(out);
        if constexpr (detail::is_strided_view_v<Out>) detail::check_output_strides(o.out, "out");
        if constexpr (!std::is_same_v<std::decay_t<Weights>, std::nullptr_t>) {
            static_assert(std::is_same_v<T, detail::scalar_of<Weights>> && detail::rank_of<Weights>() == rank &&
                              detail::tensor_traits<std::decay_t<Weights>>::row_major,
                          "attend: weights must be row-major with the scalar type and rank of the query ([batch, "
                          "heads, query_len, "
                          "key_len], or [batch, query_len, key_len] for rank-3 inputs)");
            detail::check_output_dims(weights, detail::rank_dims<rank>(s, s.key_len), "attend.shape.weights_output",
                                      "weights");
            o.weights = weights.data();
        }
        if constexpr (!std::is_same_v<std::decay_t<Lse>, std::nullptr_t>) {
            static_assert(
                std::is_same_v<accumulator_t<T>, detail::scalar_of<Lse>> && detail::rank_of<Lse>() == rank - 1 &&
                    detail::tensor_traits<std::decay_t<Lse>>::row_major,
                "attend: lse must be row-major in the accumulation type of the query (float for float, half and "
                "bfloat16, double for double) and one rank less ([batch, heads, query_len], or [batch, query_len] for "
                "rank-3 inputs)");
            detail::check_output_dims(lse, detail::lse_dims<rank>(s), "attend.shape.lse_output", "lse");
            o.lse = lse.data();
        }
        detail::check_no_aliasing({detail::named("query", qv), detail::named("key", kv), detail::named("value", vv)},
                                  {detail::named("out", o.out),
                                   detail::named("weights", o.weights, detail::rank_dims<rank>(s, s.key_len)),
                                   detail::named("lse", o.lse, detail::lse_dims<rank>(s))});
        const auto call = detail::check_call(qv, kv, vv, s, mask, options, true);
        detail::run_checked(qv, kv, vv, s, call, o);
    }
}

/// The _into form with default options: out only.
template <class Q, class K, class V, class Mask, class Out,
          std::enable_if_t<!std::is_same_v<std::decay_t<Mask>, sdpa_options>, int> = 0>
void scaled_dot_product_attention_into(const Q& q, const K& k, const V& v, const Mask& mask, Out&& out) {
    scaled_dot_product_attention_into(q, k, v, mask, sdpa_options{}, std::forward<Out>(out));
}

/// The _into form without a mask: every query attends every key. Outputs and errors as the masked form.
template <class Q, class K, class V, class Out, class Weights = std::nullptr_t, class Lse = std::nullptr_t>
void scaled_dot_product_attention_into(const Q& q, const K& k, const V& v, const sdpa_options& options, Out&& out,
                                       Weights&& weights = nullptr, Lse&& lse = nullptr) {
    scaled_dot_product_attention_into(q, k, v, no_mask{}, options, std::forward<Out>(out),
                                      std::forward<Weights>(weights), std::forward<Lse>(lse));
}

/// The _into form without a mask and with default options: out only.
template <class Q, class K, class V, class Out>
void scaled_dot_product_attention_into(const Q& q, const K& k, const V& v, Out&& out) {
    scaled_dot_product_attention_into(q, k, v, no_mask{}, sdpa_options{}, std::forward<Out>(out));
}

}  // namespace attend
