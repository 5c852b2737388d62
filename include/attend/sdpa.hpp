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
#include "detail/score_output.hpp"
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

/// The stage of the score pipeline result.scores holds (sdpa_options::need_scores): ONNX Attention's
/// qk_matmul_output_mode 0, 1 and 2. Its mode 3, the probabilities, is need_weights.
enum class score_stage {
    scaled,      ///< Q·Kᵀ × scale (ONNX mode 0)
    softcapped,  ///< after the softcap; the same as scaled without one (ONNX mode 1)
    masked       ///< after score_mod, score_bias and the mask, what the softmax reads: -inf where forbidden (mode 2)
};

/// The type a call computes in (ONNX Attention's softmax_precision).
enum class accumulation {
    standard,  ///< accumulator_t of the query's type: float for float, half and bfloat16, double for double
    /// double for any storage type: q, k and v are widened into double copies (memory of the inputs' size, in
    /// double), the call runs as a double call, and out, weights and scores are rounded into the storage type
    /// (through float for 16-bit types), lse into its accumulator_t. Only scaled_dot_product_attention and its
    /// _into form take it (elsewhere value_error attend.value.sdpa_only).
    float64
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
    /// Fill result.scores `[batch, heads, query_len, key_len]` with the scores at this stage (unset: none). Only
    /// scaled_dot_product_attention and its _into form return them (elsewhere value_error
    /// attend.value.sdpa_only). The scores are the kernel's within rounding: a pass of their own computes them.
    std::optional<score_stage> need_scores;
    attend::accumulation accumulation = attend::accumulation::standard;  ///< the type the call computes in
    bool check_finite = true;  ///< reject NaN / Inf in q, k, v (value_error attend.value.non_finite) and
                               ///< scores beyond half of T's range (attend.value.score_overflow,
                               ///< detail/input_scan.hpp); off: the caller promises both. A decode
                               ///< scans K and V in the kernel's own pass, so they are read once
};

/// The result of scaled_dot_product_attention; T is the query's storage type, Rank the rank of the inputs (3 or 4).
template <class T, int Rank>
struct attention_result {
    tensor<T, Rank> out;      ///< `[batch, heads, query_len, value_dim]`
    tensor<T, Rank> weights;  ///< `[batch, heads, query_len, key_len]` when need_weights, else empty
    tensor<T, Rank> scores;   ///< `[batch, heads, query_len, key_len]` when need_scores, else empty
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
/// either way; then a mask's attend.mask.empty_row comes before a non-finite key or value. `sdpa_outputs`: the
/// caller is scaled_dot_product_attention, which serves need_scores and accumulation::float64 itself; every other
/// caller refuses them here (value_error attend.value.sdpa_only).
template <class T, class Rows, class Mask>
auto check_call(const strided_view<const T>& q, const Rows& k, const Rows& v, const attention_shape& s,
                const Mask& mask, const sdpa_options& o, bool defer_kv_scan = false, bool sdpa_outputs = false) {
    if (!sdpa_outputs && (o.need_scores || o.accumulation != accumulation::standard))
        throw value_error("attend.value.sdpa_only",
                          concat(o.need_scores ? "need_scores" : "accumulation::float64",
                                 " is served by scaled_dot_product_attention and its _into form only; unset it here, "
                                 "or call scaled_dot_product_attention on the same q, k and v"));
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
        for (index_t h = 0; h < x.dims[1]; ++h)
            widen_head(x, b, h, copy.data() + (b * x.dims[1] + h) * x.dims[2] * x.dims[3]);
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

/// Where a scaled_dot_product_attention call's results go: the kernel's outputs, and when not null the scores
/// `[batch, heads, query_len, key_len]` in T.
template <class T>
struct sdpa_outputs {
    attention_outputs<T> kernel;
    T* scores = nullptr;
};

template <class T, class Rows, class Mask, class MakeOutputs>
void run_sdpa(const strided_view<const T>& q, const Rows& k, const Rows& v, const attention_shape& s, const Mask& mask,
              const sdpa_options& options, const MakeOutputs& make_outputs);

/// Rounds double results into the storage type: float directly, 16-bit types through float (whose rounding to
/// them is the one attend has).
template <class To>
void round_from_double(const double* from, index_t n, To* to) {
    for (index_t j = 0; j < n; ++j) {
        if constexpr (std::is_same_v<To, float>) {
            to[j] = static_cast<float>(from[j]);
        } else {
            const float f = static_cast<float>(from[j]);
            narrow(&f, 1, to + j);
        }
    }
}

/// scaled_dot_product_attention under accumulation::float64 for a storage type T other than double: q, k and v
/// widened into double copies, the call run as a double call into double results, which are then rounded into
/// the caller's outputs. Every check runs in the double call, before any output exists.
template <class T, class Rows, class Mask, class MakeOutputs>
void run_sdpa_in_double(const strided_view<const T>& q, const Rows& k, const Rows& v, const attention_shape& s,
                        const Mask& mask, const sdpa_options& options, const MakeOutputs& make_outputs) {
    const char* hint = "accumulation::float64 copies q, k and v into double; use accumulation::standard";
    const auto wide_q = gathered<double>(q, "the float64 copy of the queries");
    const auto wide_k = gathered<double>(k, "the float64 copy of the keys");
    const auto wide_v = gathered<double>(v, "the float64 copy of the values");
    const index_t rows = s.batch * s.heads * s.query_len;
    sdpa_outputs<T> o;
    tensor<double, 4> out;
    tensor<double, 1> weights, scores, lse;
    run_sdpa(as_view(wide_q), as_view(wide_k), as_view(wide_v), s, mask, options, [&] {
        o = make_outputs();
        resize_guarded(out, std::array<index_t, 4>{s.batch, s.heads, s.query_len, s.value_dim}, "the float64 out",
                       hint);
        const std::array<index_t, 1> scores_dims{rows * s.key_len};
        if (o.kernel.weights) resize_guarded(weights, scores_dims, "the float64 weights", hint);
        if (o.scores) resize_guarded(scores, scores_dims, "the float64 scores", hint);
        if (o.kernel.lse) resize_guarded(lse, std::array<index_t, 1>{rows}, "the float64 lse", hint);
        sdpa_outputs<double> wide;
        wide.kernel.out = as_mutable_view(out);
        wide.kernel.weights = o.kernel.weights ? weights.data() : nullptr;
        wide.kernel.lse = o.kernel.lse ? lse.data() : nullptr;
        wide.scores = o.scores ? scores.data() : nullptr;
        return wide;
    });
    const auto wide_out = as_view(out);
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h)
            for (index_t i = 0; i < s.query_len; ++i)
                round_from_double(wide_out.row(b, h, i), s.value_dim, o.kernel.out.row(b, h, i));
    if (o.kernel.weights) round_from_double(weights.data(), weights.size(), o.kernel.weights);
    if (o.scores) round_from_double(scores.data(), scores.size(), o.scores);
    if (o.kernel.lse) round_from_double(lse.data(), lse.size(), o.kernel.lse);
}

/// A scaled_dot_product_attention call from its checked inputs on: the checks of options and mask, then
/// make_outputs() (the sdpa_outputs<T> to write, allocated only now), the kernel, and the scores pass when asked
/// (its scratch allocated before the kernel writes anything). Under accumulation::float64 all of it as a double
/// call (run_sdpa_in_double).
template <class T, class Rows, class Mask, class MakeOutputs>
void run_sdpa(const strided_view<const T>& q, const Rows& k, const Rows& v, const attention_shape& s, const Mask& mask,
              const sdpa_options& options, const MakeOutputs& make_outputs) {
    if constexpr (!std::is_same_v<T, double>)
        if (options.accumulation == accumulation::float64)
            return run_sdpa_in_double(q, k, v, s, mask, options, make_outputs);
    const auto call = check_call(q, k, v, s, mask, options, true, true);
    const sdpa_outputs<T> o = make_outputs();
    std::optional<score_writer<T>> scores;
    if (o.scores) scores.emplace(s, call.threads);
    run_checked(q, k, v, s, call, o.kernel);
    if (o.scores)
        with_mask_tiles(call.mask, [&](const mask_tiles& m) {
            const score_stage stage = *options.need_scores;
            scores->write(q, k, m, call.params, {stage != score_stage::scaled, stage == score_stage::masked}, o.scores);
        });
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
/// causal(alignment::top_left)). Returns out, and weights / scores / lse when asked by options.
/// Throws shape_error (attend.shape.*), mask_error (attend.mask.*, incl. attend.mask.empty_row),
/// value_error (attend.value.{scale, softcap, dropout, threads, non_finite, sinks}), shape_error attend.shape.sinks.
template <class Q, class K, class V, class Mask>
auto scaled_dot_product_attention(const Q& q, const K& k, const V& v, const Mask& mask,
                                  const sdpa_options& options = {}) {
    if constexpr (detail::require_mask<Mask>()) {
        using T = detail::scalar_of<Q>;
        constexpr int rank = detail::rank_of<Q>();
        const auto in = detail::checked_inputs(q, k, v);
        const attention_shape& s = in.shape;  // a variable, not a structured binding: the lambda below captures it
        attention_result<T, rank> r;
        detail::run_sdpa(in.q, in.k, in.v, s, mask, options, [&] {
            const char* hint =
                "need_weights and need_scores materialize [batch, heads, query_len, key_len]; leave "
                "them off or split the call";
            detail::resize_guarded(r.out, detail::rank_dims<rank>(s, s.value_dim), "out", hint);
            if (options.need_weights)
                detail::resize_guarded(r.weights, detail::rank_dims<rank>(s, s.key_len), "weights", hint);
            if (options.need_scores)
                detail::resize_guarded(r.scores, detail::rank_dims<rank>(s, s.key_len), "scores", hint);
            if (options.need_lse) detail::resize_guarded(r.lse, detail::lse_dims<rank>(s), "lse", hint);
            detail::sdpa_outputs<T> o;
            o.kernel.out = detail::as_mutable_view(r.out);
            o.kernel.weights = options.need_weights ? r.weights.data() : nullptr;
            o.kernel.lse = options.need_lse ? r.lse.data() : nullptr;
            o.scores = options.need_scores ? r.scores.data() : nullptr;
            return o;
        });
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
/// out `[batch, heads, query_len, value_dim]`, and unless nullptr weights `[batch, heads, query_len, key_len]`,
/// lse `[batch, heads, query_len]` and scores `[batch, heads, query_len, key_len]` (at options.need_scores, which
/// is set exactly when scores are given: value_error attend.value.need_scores otherwise). On any error nothing is
/// written (shape_error attend.shape.output, attend.shape.weights_output, attend.shape.lse_output,
/// attend.shape.scores_output besides those of scaled_dot_product_attention).
/// Outputs must not overlap q, k, v or each other in memory (measured conservatively, from each tensor's lowest
/// to its highest element address): the kernels read inputs while they write outputs, tile by tile, so an
/// overlap is shape_error attend.shape.aliasing naming both tensors. Adjacent buffers are fine.
/// The arguments come in the order of every attend call: inputs, the mask, the options, then the outputs.
template <class Q, class K, class V, class Mask, class Out, class Weights = std::nullptr_t, class Lse = std::nullptr_t,
          class Scores = std::nullptr_t>
void scaled_dot_product_attention_into(const Q& q, const K& k, const V& v, const Mask& mask,
                                       const sdpa_options& options, Out&& out, Weights&& weights = nullptr,
                                       Lse&& lse = nullptr, Scores&& scores = nullptr) {
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
        T* score_data = nullptr;
        constexpr bool has_scores = !std::is_same_v<std::decay_t<Scores>, std::nullptr_t>;
        if constexpr (has_scores) {
            static_assert(std::is_same_v<T, detail::scalar_of<Scores>> && detail::rank_of<Scores>() == rank &&
                              detail::tensor_traits<std::decay_t<Scores>>::row_major,
                          "attend: scores must be row-major with the scalar type and rank of the query ([batch, "
                          "heads, query_len, key_len], or [batch, query_len, key_len] for rank-3 inputs)");
            detail::check_output_dims(scores, detail::rank_dims<rank>(s, s.key_len), "attend.shape.scores_output",
                                      "scores");
            score_data = scores.data();
        }
        if (has_scores != options.need_scores.has_value())
            throw value_error("attend.value.need_scores",
                              has_scores ? "a scores output was given but options.need_scores is unset: set the stage "
                                           "the scores are taken at (score_stage::scaled, softcapped or masked)"
                                         : "options.need_scores is set but no scores output was given: pass a "
                                           "[batch, heads, query_len, key_len] tensor after lse");
        detail::check_no_aliasing({detail::named("query", qv), detail::named("key", kv), detail::named("value", vv)},
                                  {detail::named("out", o.out),
                                   detail::named("weights", o.weights, detail::rank_dims<rank>(s, s.key_len)),
                                   detail::named("lse", o.lse, detail::lse_dims<rank>(s)),
                                   detail::named("scores", score_data, detail::rank_dims<rank>(s, s.key_len))});
        detail::run_sdpa(qv, kv, vv, s, mask, options, [&] { return detail::sdpa_outputs<T>{o, score_data}; });
    }
}

/// The _into form with default options: out only.
template <class Q, class K, class V, class Mask, class Out,
          std::enable_if_t<!std::is_same_v<std::decay_t<Mask>, sdpa_options>, int> = 0>
void scaled_dot_product_attention_into(const Q& q, const K& k, const V& v, const Mask& mask, Out&& out) {
    scaled_dot_product_attention_into(q, k, v, mask, sdpa_options{}, std::forward<Out>(out));
}

/// The _into form without a mask: every query attends every key. Outputs and errors as the masked form.
template <class Q, class K, class V, class Out, class Weights = std::nullptr_t, class Lse = std::nullptr_t,
          class Scores = std::nullptr_t>
void scaled_dot_product_attention_into(const Q& q, const K& k, const V& v, const sdpa_options& options, Out&& out,
                                       Weights&& weights = nullptr, Lse&& lse = nullptr, Scores&& scores = nullptr) {
    scaled_dot_product_attention_into(q, k, v, no_mask{}, options, std::forward<Out>(out),
                                      std::forward<Weights>(weights), std::forward<Lse>(lse),
                                      std::forward<Scores>(scores));
}

/// The _into form without a mask and with default options: out only.
template <class Q, class K, class V, class Out>
void scaled_dot_product_attention_into(const Q& q, const K& k, const V& v, Out&& out) {
    scaled_dot_product_attention_into(q, k, v, no_mask{}, sdpa_options{}, std::forward<Out>(out));
}

}  // namespace attend
