// SPDX-License-Identifier: MIT
#pragma once
/// Multi-head attention as nn.MultiheadAttention computes it, weights loadable 1:1:
///   Q = query Wq^T + bq `[batch, query_len, heads * head_dim]`, K = key Wk^T + bk, V = value Wv^T + bv
///   `[batch, key_len, kv_heads * head_dim]`, head h = attention(Q_h, K_{h / group}, V_{h / group}),
///   out = concat_h(head h) Wo^T + bo `[batch, query_len, model_dim]`.
/// The trap the seed notes warn about is the head split: a projected row holds the heads side by side, so
/// `[batch, len, heads * head_dim]` must become `[batch, heads, len, head_dim]` by a transpose, not a reshape.
/// attend never copies either way: heads are strided views of the projected buffers (split_heads), and the
/// attention of every head is written straight into its slice of the `[batch, query_len, heads * head_dim]` buffer
/// the output projection reads.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "cache.hpp"
#include "detail/dropout.hpp"
#include "detail/memory.hpp"
#include "detail/random.hpp"
#include "detail/widen.hpp"
#include "error.hpp"
#include "mask.hpp"
#include "paged_attention.hpp"
#include "position.hpp"
#include "q8_cache.hpp"
#include "sdpa.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace attend {

/// Sizes of a multi_head_attention. The sizes that default to another one are 0 in the struct and mean "the
/// same as": kv_heads = 0 is heads (plain multi-head attention), key_dim = 0 and value_dim = 0 are model_dim
/// (self-attention widths). `mha_config{512, 8}` is nn.MultiheadAttention(512, 8). Beyond the first two sizes,
/// name what you set, since five numbers in a row do not say which is kv_heads:
/// `mha_config{}.with_model_dim(16).with_heads(2).with_kv_heads(1).with_key_dim(12)`; the setters return a copy,
/// so a config reads as one expression. Fields may also be assigned one by one (`c.kv_heads = 1`).
struct mha_config {
    index_t model_dim = 0;  ///< E: width of the query input and of the output (PyTorch's embed_dim)
    index_t heads = 0;      ///< query heads; head_dim = model_dim / heads, for queries, keys and values alike
    index_t kv_heads = 0;   ///< key/value heads, 0 = heads; heads % kv_heads == 0 (grouped-query; 1 = multi-query)
    index_t key_dim = 0;    ///< width of the key input (PyTorch's kdim), 0 = model_dim
    index_t value_dim = 0;  ///< width of the value input (PyTorch's vdim), 0 = model_dim
    bool bias = true;       ///< in-projection and out-projection biases, as nn.MultiheadAttention(bias=...)
    /// A learnable attention sink per query head (gpt-oss; sinks.hpp), `[heads]`, initialised to 0. Not part of
    /// nn.MultiheadAttention: from_torch leaves them 0 and to_torch omits them.
    bool sinks = false;

private:
    // Defined before the setters use it: clang does not evaluate a later-defined member template in a constant
    // expression.
    template <class Field>
    constexpr mha_config with(Field mha_config::*field, Field value) const {
        mha_config c = *this;
        c.*field = value;
        return c;
    }

public:
    /// A copy with model_dim (PyTorch's embed_dim) set.
    constexpr mha_config with_model_dim(index_t n) const { return with(&mha_config::model_dim, n); }
    /// A copy with heads (PyTorch's num_heads) set.
    constexpr mha_config with_heads(index_t n) const { return with(&mha_config::heads, n); }
    /// A copy with kv_heads set (0 = heads; 1 = multi-query attention).
    constexpr mha_config with_kv_heads(index_t n) const { return with(&mha_config::kv_heads, n); }
    /// A copy with key_dim (PyTorch's kdim) set.
    constexpr mha_config with_key_dim(index_t n) const { return with(&mha_config::key_dim, n); }
    /// A copy with value_dim (PyTorch's vdim) set.
    constexpr mha_config with_value_dim(index_t n) const { return with(&mha_config::value_dim, n); }
    /// A copy with the biases on or off.
    constexpr mha_config with_bias(bool on) const { return with(&mha_config::bias, on); }
    /// A copy with learnable attention sinks on or off.
    constexpr mha_config with_sinks(bool on) const { return with(&mha_config::sinks, on); }

    /// A copy with every 0 default replaced by what it stands for.
    mha_config resolved() const {
        mha_config c = *this;
        if (c.kv_heads == 0) c.kv_heads = c.heads;
        if (c.key_dim == 0) c.key_dim = c.model_dim;
        if (c.value_dim == 0) c.value_dim = c.model_dim;
        return c;
    }
};

/// The key padding of a multi-head attention call, in nn.MultiheadAttention's key_padding_mask convention:
/// what it names is ignored. Either lengths (keys j >= lengths[b] of sequence b are padding; also
/// key_padding(lengths)) or a forbidden_mask `[batch, key_len]`, true = ignore this key. An allowed_mask (true =
/// may attend) does not convert: the compiler says to call to_forbidden, so the meaning cannot flip silently.
class mha_key_padding {
public:
    /// What the padding holds.
    enum class kind {
        none,      ///< no key padding
        lengths,   ///< one length per sequence
        forbidden  ///< a forbidden_mask `[batch, key_len]`
    };

    /// No key padding.
    mha_key_padding() = default;
    /// Sequence b has lengths[b] real keys; the rest are padding.
    mha_key_padding(std::vector<index_t> lengths) : kind_(kind::lengths), lengths_(std::move(lengths)) {}
    /// Sequence b has lengths[b] real keys; the rest are padding.
    mha_key_padding(std::initializer_list<index_t> lengths) : kind_(kind::lengths), lengths_(lengths) {}
    /// The rule key_padding(lengths).
    mha_key_padding(key_padding_rule rule) : kind_(kind::lengths), lengths_(std::move(rule.lengths)) {}
    /// PyTorch's key_padding_mask `[batch, key_len]` (forbidden_mask::key_padding(t)): true = ignore this key.
    mha_key_padding(forbidden_mask mask) : kind_(kind::forbidden), mask_(std::move(mask)) {}

    /// Anything else does not compile, with the message saying what to write instead.
    template <class M, std::enable_if_t<!std::is_same_v<std::decay_t<M>, forbidden_mask> &&
                                            !std::is_same_v<std::decay_t<M>, key_padding_rule> &&
                                            (detail::is_mask_like_v<std::decay_t<M>> ||
                                             detail::tensor_traits<std::decay_t<M>>::supported),
                                        int> = 0>
    mha_key_padding(const M&) {
        using m = std::decay_t<M>;
        static_assert(!std::is_same_v<m, allowed_mask>,
                      "attend: key_padding follows nn.MultiheadAttention's key_padding_mask convention (true = "
                      "ignore this key); an allowed_mask (true = may attend) must be converted explicitly with "
                      "attend::to_forbidden(mask)");
        static_assert(!detail::tensor_traits<m>::supported,
                      "attend: wrap a bool key_padding_mask tensor in attend::forbidden_mask::key_padding(t) "
                      "(true = ignore this key) before passing it as key_padding");
        static_assert(!detail::is_mask_like_v<m> || std::is_same_v<m, allowed_mask>,
                      "attend: key_padding takes lengths or a forbidden_mask [batch, key_len]; pass other masks "
                      "as the mask argument of forward");
    }

    kind which() const { return kind_; }                                 ///< what the padding holds
    bool empty() const { return kind_ == kind::none; }                   ///< no key padding
    const std::vector<index_t>& lengths() const { return lengths_; }     ///< with kind::lengths
    const std::optional<forbidden_mask>& mask() const { return mask_; }  ///< with kind::forbidden

private:
    kind kind_ = kind::none;
    std::vector<index_t> lengths_;
    std::optional<forbidden_mask> mask_;
};

/// Options of multi_head_attention::forward and forward_cached: the attention call's own options, nested as
/// SDPA takes them (so every score feature works in the layer), and what only a layer has.
struct mha_options {
    /// The attention inside the layer, as scaled_dot_product_attention takes it: scale (default 1 / sqrt(head_dim),
    /// as nn.MultiheadAttention), softcap, dropout (probability, seed and training; PyTorch's dropout_p and
    /// training), score_bias (one slope or bias per query head; its alignment says where the diagonal sits,
    /// bottom_right in a decode), score_mod, empty_rows, threads, kernel, need_weights, weights_after_dropout and
    /// check_finite (here also the scan of the inputs and projections). Sinks are the module's parameters
    /// (mha_config::sinks): `attention.sinks` must stay empty (value_error attend.value.layer_sinks).
    sdpa_options attention;
    mha_key_padding key_padding;  ///< lengths or a forbidden_mask [batch, key_len] (true = ignore), combined
                                  ///< with the mask argument by &&
    bool average_weights = true;  ///< with attention.need_weights: mean over heads `[batch, query_len, key_len]` as
                                  ///< PyTorch's average_attn_weights=True; false: per head `[batch, heads, ...]`
    std::optional<rotary_embedding> rotary;  ///< rotates each head of the projected Q and K
    index_t position_offset = 0;  ///< global position of query 0 and key 0 for rotary; forward_cached adds the
                                  ///< cache length (new token i sits at position_offset + cache.length() + i)
};

/// Which attention weights an mha_result holds.
enum class weights_kind {
    none,      ///< need_weights was false
    averaged,  ///< mean over heads `[batch, query_len, key_len]` (average_weights, PyTorch's default)
    per_head   ///< `[batch, heads, query_len, key_len]` (average_weights = false)
};

/// Result of multi_head_attention::forward. Read the weights through averaged_weights() or per_head_weights():
/// asking for a kind the call did not produce is an error that says which options produce it, where the fields
/// would be silently empty.
template <class T>
struct mha_result {
    tensor<T, 3> out;           ///< `[batch, query_len, model_dim]`
    tensor<T, 3> weights;       ///< `[batch, query_len, key_len]`, mean over heads; need_weights && average_weights
    tensor<T, 4> head_weights;  ///< `[batch, heads, query_len, key_len]`; need_weights && !average_weights
    attend::weights_kind weights_kind = attend::weights_kind::none;  ///< which of the two is filled

    /// The weights averaged over heads `[batch, query_len, key_len]`. Throws value_error
    /// `attend.value.weights_kind` unless the forward ran with need_weights and average_weights.
    const tensor<T, 3>& averaged_weights() const {
        require(attend::weights_kind::averaged);
        return weights;
    }
    /// The weights of every head `[batch, heads, query_len, key_len]`. Throws value_error
    /// `attend.value.weights_kind` unless the forward ran with need_weights and average_weights = false.
    const tensor<T, 4>& per_head_weights() const {
        require(attend::weights_kind::per_head);
        return head_weights;
    }

private:
    static const char* name(attend::weights_kind k) {
        switch (k) {
            case attend::weights_kind::averaged:
                return "averaged weights (attention.need_weights = true, average_weights = true)";
            case attend::weights_kind::per_head:
                return "per-head weights (attention.need_weights = true, average_weights = false)";
            case attend::weights_kind::none: break;
        }
        return "no weights (need_weights = false, the default)";
    }
    void require(attend::weights_kind wanted) const {
        if (weights_kind != wanted)
            throw value_error("attend.value.weights_kind",
                              detail::concat("asked for ", name(wanted), ", but the forward call produced ",
                                             name(weights_kind), "; set those options in mha_options"));
    }
};

/// What multi_head_attention_backward needs from a training forward pass (forward(..., saved)): the projected
/// heads as the kernel read them (rotated when options.rotary) and the attention output before the output
/// projection. O(batch x len x model_dim) scalars; nothing of size query_len x key_len is kept.
template <class T>
struct mha_saved {
    tensor<T, 3> q;          ///< `[batch, query_len, heads * head_dim]`
    tensor<T, 3> k;          ///< `[batch, key_len, kv_heads * head_dim]`
    tensor<T, 3> v;          ///< `[batch, key_len, kv_heads * head_dim]`
    tensor<T, 3> attention;  ///< `[batch, query_len, heads * head_dim]`: head h in columns [h * head_dim, ...)
    tensor<accumulator_t<T>, 3>
        lse;  ///< `[batch, heads, query_len]` (float for 16-bit T), -inf for padded queries and empty rows
};

/// One learned tensor seen as flat storage, for optimizers: multi_head_attention::parameters() and
/// mha_gradients::parameters() list the same tensors in the same order.
template <class T>
struct parameter_span {
    const char* name;  ///< q_weight, k_weight, v_weight, out_weight, q_bias, k_bias, v_bias, out_bias
    T* data;           ///< the tensor's elements, row-major
    index_t size;      ///< how many
};

/// nn.MultiheadAttention's parameters under their PyTorch names: defined in interop/torch.hpp, which this header
/// includes at its end.
template <class T>
struct torch_mha_parameters;

namespace detail {
namespace mha_init {

/// A uniform double in [0, 1) for element `counter` of stream `stream` of seed `seed`.
inline double uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
    return counter_uniform(seed, 0xd1b54a32d192ed03ULL, stream, counter);
}

/// Fills w with U(-bound, bound) draws: element k gets counter first_counter + k of the stream.
template <class T>
void fill_uniform(tensor<T, 2>& w, double bound, std::uint64_t seed, std::uint64_t stream,
                  std::uint64_t first_counter = 0) {
    for (index_t k = 0; k < w.size(); ++k)
        w.data()[k] =
            static_cast<T>(bound * (2.0 * uniform(seed, stream, first_counter + static_cast<std::uint64_t>(k)) - 1.0));
}

/// torch.nn.init.xavier_uniform_ (gain 1) for a weight `[fan_out, fan_in]`.
inline double xavier_bound(index_t fan_out, index_t fan_in) {
    return std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
}

}  // namespace mha_init

/// Rank-3 row-major input of T, checked at compile time.
template <class X, class T>
constexpr void require_mha_input() {
    using traits = tensor_traits<std::decay_t<X>>;
    static_assert(traits::supported && !std::is_same_v<std::decay_t<X>, strided_view<T>> &&
                      !std::is_same_v<std::decay_t<X>, strided_view<const T>>,
                  "attend: multi-head attention inputs are attend::tensor<T, 3> [batch, len, dim] or an "
                  "Eigen::TensorMap of one");
    if constexpr (traits::supported) {
        static_assert(traits::row_major,
                      "attend: multi-head attention inputs must be Eigen::RowMajor (PyTorch's layout, last axis "
                      "contiguous)");
        static_assert(traits::rank == 3, "attend: multi-head attention inputs have rank 3 [batch, len, dim]");
        static_assert(std::is_same_v<typename traits::scalar, T>,
                      "attend: multi-head attention inputs must have the scalar type of the module");
    }
}

template <class X>
std::array<index_t, 3> dims3(const X& x) {
    return {x.dimension(0), x.dimension(1), x.dimension(2)};
}

/// Intersection of a user mask with a rule: && for allowed sets, + for additive expressions.
template <class A, class B>
auto combine_masks(const A& a, const B& b) {
    if constexpr (is_additive_v<A>) return a + b;
    else return a && b;
}

/// A `[batch, key_len]` forbidden mask (forbidden_mask::key_padding) as the allowed set it means for the scores.
/// Throws mask_error `attend.mask.key_padding_shape` unless it was built as key padding and is exactly
/// `[batch, key_len]`.
inline allowed_mask key_padding_allowed(const forbidden_mask& m, index_t batch, index_t key_len) {
    const auto& d = m.dims();
    if (!m.is_key_padding() || d[0] != batch || d[1] != key_len)
        throw mask_error("attend.mask.key_padding_shape",
                         concat("key_padding mask ", format_shape(d),
                                m.is_key_padding() ? "" : " (not built by forbidden_mask::key_padding)",
                                " must be [batch, key_len] = ", format_shape(std::array<index_t, 2>{batch, key_len}),
                                " (nn.MultiheadAttention's key_padding_mask, true = ignore this key, built by "
                                "forbidden_mask::key_padding(t))"));
    return to_allowed(m);
}

/// The mask argument of multi-head attention: an allowed set or additive expression, or a forbidden_mask, which
/// nn.MultiheadAttention's attn_mask is (true = blocked), so both of its masks pass as forbidden_mask builds them.
/// A forbidden_mask still never combines with && || ! or reaches scaled_dot_product_attention unconverted.
template <class Mask>
constexpr void require_mha_mask() {
    if constexpr (!std::is_same_v<Mask, forbidden_mask>) require_mask<Mask>();
}

/// The allowed set a mask argument of multi-head attention means.
template <class Mask>
decltype(auto) mha_allowed(const Mask& mask) {
    if constexpr (std::is_same_v<Mask, forbidden_mask>) return to_allowed(mask);
    else return (mask);
}

/// Calls f with the user mask (see require_mha_mask) combined with the key padding of the options.
template <class Mask, class F>
void with_key_padding(const Mask& user_mask, const mha_key_padding& padding, index_t batch, index_t key_len, F&& f) {
    const auto& mask = mha_allowed(user_mask);
    switch (padding.which()) {
        case mha_key_padding::kind::none: f(mask); return;
        case mha_key_padding::kind::lengths: f(combine_masks(mask, key_padding(padding.lengths()))); return;
        case mha_key_padding::kind::forbidden:
            f(combine_masks(mask, key_padding_allowed(*padding.mask(), batch, key_len)));
            return;
    }
}

/// An uninitialised buffer of multi-head attention whose allocation failure is resource_error
/// attend.resource.allocation naming `what`, never a std::bad_alloc from inside.
template <class T, int R>
tensor<T, R> mha_buffer(const std::array<index_t, static_cast<std::size_t>(R)>& dims, const char* what) {
    tensor<T, R> t;
    resize_guarded(t, dims, what,
                   "Use a smaller batch or shorter sequences; need_weights materializes [batch, heads, query_len, "
                   "key_len]");
    return t;
}

/// y `[rows, w.rows]` = x `[rows, w.cols]` w^T + b, one Eigen GEMM. 16-bit storage accumulates in float, as
/// PyTorch's CPU linear does: x is widened once, w in blocks of rows (never a float copy of the whole weight),
/// the bias is added in float and each output is rounded to T once.
template <class T>
void project(const T* x, index_t rows, const tensor<T, 2>& w, const tensor<T, 1>& b, T* y) {
    const index_t out = w.dimension(0), in = w.dimension(1);
    if constexpr (std::is_same_v<accumulator_t<T>, T>) {
        using matrix = row_matrix<T>;
        Eigen::Map<const matrix> xm(x, rows, in);
        Eigen::Map<const matrix> wm(w.data(), out, in);
        Eigen::Map<matrix> ym(y, rows, out);
        ym.noalias() = xm * wm.transpose();
        if (b.size() != 0) ym.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(b.data(), out);
    } else {
        using matrix = row_matrix<float>;
        constexpr index_t block = 256;  // weight rows widened at a time
        const index_t width = std::min(block, out);
        auto xf = mha_buffer<float, 2>({rows, in}, "input widened to float [rows, in_features]");
        auto wf = mha_buffer<float, 2>({width, in}, "weight rows widened to float [256, in_features]");
        auto yf = mha_buffer<float, 2>({rows, width}, "projection block in float [rows, 256]");
        auto bf = mha_buffer<float, 1>({b.size()}, "bias widened to float [out_features]");
        widen(x, rows * in, xf.data());
        widen(b.data(), b.size(), bf.data());
        Eigen::Map<const matrix> xm(xf.data(), rows, in);
        for (index_t o0 = 0; o0 < out; o0 += block) {
            const index_t n = std::min(block, out - o0);
            widen(w.data() + o0 * in, n * in, wf.data());
            Eigen::Map<matrix> ym(yf.data(), rows, n);
            ym.noalias() = xm * Eigen::Map<const matrix>(wf.data(), n, in).transpose();
            if (b.size() != 0) ym.rowwise() += Eigen::Map<const Eigen::RowVectorXf>(bf.data() + o0, n);
            for (index_t r = 0; r < rows; ++r)
                for (index_t c = 0; c < n; ++c) y[r * out + o0 + c] = static_cast<T>(ym(r, c));
        }
    }
}

inline void check_width(const char* name, const std::array<index_t, 3>& d, index_t expected, const char* dim_name,
                        const char* meaning) {
    if (d[2] != expected)
        throw shape_error("attend.shape.model_dim",
                          concat(name, " last dim ", d[2], " != ", dim_name, ' ', expected, " (", name, ' ',
                                 format_shape(d), ", expected ",
                                 format_shape(std::array<index_t, 3>{d[0], d[1], expected}), " = ", meaning, ')'));
}

/// The shapes of query `[batch, query_len, model_dim]`, key `[batch, key_len, key_dim]` and value
/// `[batch, key_len, value_dim]` against the module and each other.
inline void check_mha_inputs(const mha_config& c, const std::array<index_t, 3>& qd, const std::array<index_t, 3>& kd,
                             const std::array<index_t, 3>& vd) {
    check_width("query", qd, c.model_dim, "model_dim", "[batch, query_len, model_dim]");
    check_width("key", kd, c.key_dim, "key_dim", "[batch, key_len, key_dim]");
    check_width("value", vd, c.value_dim, "value_dim", "[batch, key_len, value_dim]");
    if (qd[0] != kd[0] || qd[0] != vd[0])
        throw shape_error("attend.shape.batch",
                          concat("batch differs: query ", qd[0], ", key ", kd[0], ", value ", vd[0], " (query ",
                                 format_shape(qd), ", key ", format_shape(kd), ", value ", format_shape(vd), ')'));
    if (kd[1] != vd[1])
        throw shape_error("attend.shape.key_len", concat("key key_len ", kd[1], " != value key_len ", vd[1], " (key ",
                                                         format_shape(kd), ", value ", format_shape(vd), ')'));
}

/// What only a layer's options can get wrong: position_offset >= 0, the rotary embedding fits head_dim at the first
/// position it rotates, and no sinks besides the module's own.
inline void check_layer_options(const mha_config& c, const mha_options& options, index_t first_position) {
    if (options.attention.sinks.size() != 0)
        throw value_error("attend.value.layer_sinks",
                          "mha_options::attention.sinks must be empty: a layer's sinks are its parameters "
                          "(mha_config::with_sinks(true), trained or loaded with the other parameters)");
    if (options.position_offset < 0)
        throw position_error("attend.position.negative_offset",
                             concat("position_offset must be >= 0, got ", options.position_offset));
    if (options.rotary) options.rotary->validate(c.model_dim / c.heads, first_position);
}

template <class T>
void check_finite_input(const T* data, const std::array<index_t, 3>& d, const char* name) {
    const index_t n = d[0] * d[1] * d[2];
    for (index_t k = 0; k < n; ++k)
        if (!std::isfinite(static_cast<accumulator_t<T>>(data[k]))) {
            const index_t b = k / (d[1] * d[2]), i = (k / d[2]) % d[1], e = k % d[2];
            throw value_error("attend.value.non_finite", concat(name, ' ', format_shape(d), " holds ", data[k], " at ",
                                                                format_shape(std::array<index_t, 3>{b, i, e}),
                                                                " (turn check_finite off to skip this scan)"));
        }
}

template <class T>
void check_finite_projections(const strided_view<const T>& q, const strided_view<const T>& k,
                              const strided_view<const T>& v) {
    check_finite(q, "projected query");
    check_finite(k, "projected key");
    check_finite(v, "projected value");
}

/// What a cache's append takes under a multi_head_attention<T>: kv_cache<S> and paged_kv_cache<S> their own type S,
/// the quantized caches (quantized_kv_cache, paged_kv_cache of q8_0 or q4_0 blocks) the module's T (they quantize
/// as they append).
template <class Cache, class T>
struct append_type {
    using type = T;
};
template <class S, class T>
struct append_type<kv_cache<S>, T> {
    using type = S;
};
template <class S, class T>
struct append_type<paged_kv_cache<S>, T> {
    using type = std::conditional_t<is_quantized_block_v<S>, T, S>;
};

/// A quantized (int8 q8_0, int4 q4_0) cache under a multi_head_attention<T>: float or 16-bit queries read it.
template <class T>
constexpr void require_quantized_cache() {
    static_assert(storage_pair_v<T, q8_0_block>,
                  "attend: a quantized (int8 q8_0 or int4 q4_0) cache is read by float or 16-bit queries: use "
                  "multi_head_attention<float>, "
                  "<Eigen::half> or <Eigen::bfloat16>");
}

/// A kv_cache<Storage> under a multi_head_attention<T>: the pairs the attention call takes (of T, or 16-bit under a
/// float module; kv_cache itself holds no q8_0 blocks).
template <class T, class Storage>
constexpr void require_cache_storage() {
    static_assert(storage_pair_v<T, Storage>,
                  "attend: multi_head_attention<T> caches keys and values in T, or a float one in Eigen::half or "
                  "Eigen::bfloat16");
}

/// The attention options of a multi-head call: the call's, with the module's sinks `[heads]` (empty: none).
template <class T>
sdpa_options sdpa_options_for(const mha_options& o, const tensor<T, 1>& sinks) {
    sdpa_options s = o.attention;
    if (sinks.size() != 0) s.sinks = sinks;
    s.check_finite = false;  // inputs and projections were scanned before, with their own names
    return s;
}

}  // namespace detail

/// Multi-head attention with nn.MultiheadAttention's weight layout (batch_first) and initialisation, plus
/// grouped-query heads, rotary embeddings and KV-cache decoding. T is float or double, or Eigen::half or
/// Eigen::bfloat16 for a module stored in 16 bits (PyTorch's module.to(torch.bfloat16)): weights, inputs, outputs and
/// caches in T, every product accumulated in float, each projection and the attention output rounded to T once.
/// Weights: q `[heads * head_dim, model_dim]`, k `[kv_heads * head_dim, key_dim]`, v `[kv_heads * head_dim,
/// value_dim]`, out `[model_dim, heads * head_dim]`; biases q `[heads * head_dim]`, k and v `[kv_heads *
/// head_dim]`, out `[model_dim]` (all empty when bias = false).
template <class T>
class multi_head_attention {
    static_assert(is_storage_type_v<T>,
                  "attend: multi_head_attention<T> is defined for float, double, Eigen::half and Eigen::bfloat16");

public:
    /// Initialised as nn.MultiheadAttention._reset_parameters does: xavier_uniform_ on the in-projection (the
    /// packed [3E, E] when key_dim == value_dim == model_dim and kv_heads == heads, else each weight), zero
    /// in-projection bias, out weight U(-1/sqrt(E), 1/sqrt(E)) (nn.Linear's kaiming_uniform_(a=sqrt(5))),
    /// zero out bias; the numbers come from a counter-based generator seeded by `seed` (platform-independent;
    /// not torch's stream: load trained weights with from_torch).
    /// Throws value_error `attend.value.size` (model_dim or heads < 1, kv_heads, key_dim or value_dim < 0),
    /// shape_error `attend.shape.model_dim_heads` (model_dim % heads != 0), `attend.shape.gqa`
    /// (heads % kv_heads != 0).
    explicit multi_head_attention(const mha_config& config, std::uint64_t seed = 0) : config_(validated(config)) {
        allocate();
        const index_t E = config_.model_dim;
        if (packed()) {
            // One xavier draw over the packed [3E, E]: fan_in E, fan_out 3E, rows q, k, v.
            const double bound = detail::mha_init::xavier_bound(3 * E, E);
            const auto block = static_cast<std::uint64_t>(E * E);
            detail::mha_init::fill_uniform(wq_, bound, seed, 0, 0);
            detail::mha_init::fill_uniform(wk_, bound, seed, 0, block);
            detail::mha_init::fill_uniform(wv_, bound, seed, 0, 2 * block);
        } else {
            detail::mha_init::fill_uniform(wq_, detail::mha_init::xavier_bound(wq_.dimension(0), wq_.dimension(1)),
                                           seed, 1);
            detail::mha_init::fill_uniform(wk_, detail::mha_init::xavier_bound(wk_.dimension(0), wk_.dimension(1)),
                                           seed, 2);
            detail::mha_init::fill_uniform(wv_, detail::mha_init::xavier_bound(wv_.dimension(0), wv_.dimension(1)),
                                           seed, 3);
        }
        detail::mha_init::fill_uniform(wo_, 1.0 / std::sqrt(static_cast<double>(wo_.dimension(1))), seed, 4);
    }

    /// Every weight and bias zero: the starting point of a loader that fills parameters() next (interop/torch.hpp,
    /// interop/safetensors.hpp), without the cost of drawing an initialisation it overwrites.
    static multi_head_attention zeros(const mha_config& config) {
        multi_head_attention m(config, no_init{});
        for (const auto& p : m.parameters()) std::fill(p.data, p.data + p.size, T(0));
        return m;
    }

    /// Loads nn.MultiheadAttention's parameters 1:1: the same as attend::mha_from_torch(config, p)
    /// (interop/torch.hpp, which documents the layout and what it throws).
    static multi_head_attention from_torch(const mha_config& config, const torch_mha_parameters<T>& p);
    /// Packed form: in_proj_weight `[3E, E]` (rows q, k, v), in_proj_bias `[3E]`, out_proj.weight `[E, E]`,
    /// out_proj.bias `[E]`; pass empty tensors `{}` for the biases of a bias = false module.
    static multi_head_attention from_torch(const mha_config& config, const tensor<T, 2>& in_proj_weight,
                                           const tensor<T, 1>& in_proj_bias, const tensor<T, 2>& out_proj_weight,
                                           const tensor<T, 1>& out_proj_bias);
    /// Separate form (kdim / vdim != embed_dim): q_proj_weight `[E, E]`, k_proj_weight `[E, kdim]`,
    /// v_proj_weight `[E, vdim]`, in_proj_bias `[3E]`, out_proj.weight, out_proj.bias.
    static multi_head_attention from_torch(const mha_config& config, const tensor<T, 2>& q_proj_weight,
                                           const tensor<T, 2>& k_proj_weight, const tensor<T, 2>& v_proj_weight,
                                           const tensor<T, 1>& in_proj_bias, const tensor<T, 2>& out_proj_weight,
                                           const tensor<T, 1>& out_proj_bias);
    /// The parameters under PyTorch's names, packed exactly when nn.MultiheadAttention would pack them: the same
    /// as attend::mha_to_torch(*this).
    torch_mha_parameters<T> to_torch() const;

    /// The configuration with every 0 default resolved.
    const mha_config& config() const { return config_; }
    /// model_dim / heads: the width of one query, key and value head.
    index_t head_dim() const { return config_.model_dim / config_.heads; }
    /// True when nn.MultiheadAttention would hold one packed in_proj_weight (_qkv_same_embed_dim, no GQA).
    bool packed() const {
        return config_.key_dim == config_.model_dim && config_.value_dim == config_.model_dim &&
               config_.kv_heads == config_.heads;
    }
    /// Number of learned scalars, PyTorch's sum(p.numel() for p in module.parameters()).
    index_t parameter_count() const {
        return wq_.size() + wk_.size() + wv_.size() + wo_.size() + bq_.size() + bk_.size() + bv_.size() + bo_.size() +
               sinks_.size();
    }

    const tensor<T, 2>& q_weight() const { return wq_; }    ///< `[heads * head_dim, model_dim]`
    const tensor<T, 2>& k_weight() const { return wk_; }    ///< `[kv_heads * head_dim, key_dim]`
    const tensor<T, 2>& v_weight() const { return wv_; }    ///< `[kv_heads * head_dim, value_dim]`
    const tensor<T, 2>& out_weight() const { return wo_; }  ///< `[model_dim, heads * head_dim]`
    const tensor<T, 1>& q_bias() const { return bq_; }      ///< `[heads * head_dim]`, empty without bias
    const tensor<T, 1>& k_bias() const { return bk_; }      ///< `[kv_heads * head_dim]`, empty without bias
    const tensor<T, 1>& v_bias() const { return bv_; }      ///< `[kv_heads * head_dim]`, empty without bias
    const tensor<T, 1>& out_bias() const { return bo_; }    ///< `[model_dim]`, empty without bias
    const tensor<T, 1>& sinks() const { return sinks_; }    ///< `[heads]` sink logits, empty without config.sinks

    /// Every learned tensor as mutable flat storage (weights, then biases when config.bias, then the sinks when
    /// config.sinks), for an optimizer step; the order is that of mha_gradients::parameters().
    std::vector<parameter_span<T>> parameters() {
        std::vector<parameter_span<T>> p{{"q_weight", wq_.data(), wq_.size()},
                                         {"k_weight", wk_.data(), wk_.size()},
                                         {"v_weight", wv_.data(), wv_.size()},
                                         {"out_weight", wo_.data(), wo_.size()}};
        if (config_.bias) {
            p.push_back({"q_bias", bq_.data(), bq_.size()});
            p.push_back({"k_bias", bk_.data(), bk_.size()});
            p.push_back({"v_bias", bv_.data(), bv_.size()});
            p.push_back({"out_bias", bo_.data(), bo_.size()});
        }
        if (config_.sinks) p.push_back({"sinks", sinks_.data(), sinks_.size()});
        return p;
    }

    /// An empty cache sized for this module: `[batch, kv_heads, capacity, head_dim]` keys and values stored as
    /// Storage: the module's type; for a float module also Eigen::half or Eigen::bfloat16 (`make_cache<Eigen::half>`:
    /// half the bytes; forward_cached rounds the new keys and values into it once); for a float, fp16 or bf16
    /// module also q8_0_block or q4_0_block (an int8 / int4 quantized_kv_cache, head_dim a multiple of 32: value_error
    /// `attend.value.quantized_dim` otherwise). One function for every storage, as paged_kv_cache<Storage> is one type.
    template <class Storage = T>
    auto make_cache(index_t batch, index_t capacity) const {
        const auto sizes = kv_cache_config{}
                               .with_batch(batch)
                               .with_kv_heads(config_.kv_heads)
                               .with_capacity(capacity)
                               .with_head_dim(head_dim());
        if constexpr (detail::is_quantized_block_v<Storage>) {
            detail::require_quantized_cache<T>();
            return quantized_kv_cache<Storage>(sizes);
        } else {
            detail::require_cache_storage<T, Storage>();
            return kv_cache<Storage>(sizes);
        }
    }

    /// Attention of query `[batch, query_len, model_dim]` over key `[batch, key_len, key_dim]` and value
    /// `[batch, key_len, value_dim]` (self-attention: pass the same tensor three times) under `mask` (an allowed
    /// set or additive expression over scores `[batch, heads, query_len, key_len]` such as
    /// causal(alignment::top_left), or nn.MultiheadAttention's bool attn_mask as forbidden_mask::query_key_grid(t) (2-D) or from_torch_mha(t),
    /// true = blocked, the same wrapper options.key_padding takes), intersected with options.key_padding. Padded queries (query_padding in the mask) get zero output and weight rows.
    /// Throws shape_error `attend.shape.model_dim` (an input's last dim differs from model_dim / key_dim /
    /// value_dim), `attend.shape.batch`, `attend.shape.key_len`, `attend.shape.empty_keys`, and what
    /// scaled_dot_product_attention and rotary_embedding throw (mask_error attend.mask.*, incl.
    /// attend.mask.key_padding_shape for a key padding mask that is not [batch, key_len]; value_error
    /// attend.value.*; position_error attend.position.negative_offset).
    template <class Q, class K, class V, class Mask>
    mha_result<T> forward(const Q& query, const K& key, const V& value, const Mask& mask,
                          const mha_options& options = {}) const {
        return forward_impl(query, key, value, mask, options, nullptr);
    }

    /// forward for training: also fills `saved` with what multi_head_attention_backward (mha_backward.hpp)
    /// needs. On a throw `saved` is unchanged.
    template <class Q, class K, class V, class Mask>
    mha_result<T> forward(const Q& query, const K& key, const V& value, const Mask& mask, const mha_options& options,
                          mha_saved<T>& saved) const {
        return forward_impl(query, key, value, mask, options, &saved);
    }

    /// forward without a mask (besides options.key_padding).
    template <class Q, class K, class V>
    mha_result<T> forward(const Q& query, const K& key, const V& value, const mha_options& options = {}) const {
        return forward(query, key, value, no_mask{}, options);
    }

    /// Decoding step: self-attention of L new tokens x `[batch, L, model_dim]` over every position in the cache
    /// plus themselves. Projects Q, K, V of the new tokens, rotates Q and K (options.rotary) at their global
    /// positions position_offset + cache.length() + i, appends K and V to the cache, and attends over the whole
    /// cache under causal(alignment::bottom_right) && mask && key_padding (key_len = cache.length() after the
    /// append). Token by token this gives the outputs of one causal forward pass over the whole sequence.
    /// Needs key_dim == value_dim == model_dim (shape_error `attend.shape.self_attention`) and a cache made for
    /// this module (shape_error `attend.shape.cache`; see make_cache). Throws position_error
    /// `attend.position.cache_full` if the new tokens do not fit, and everything forward throws. Every check
    /// runs before the cache changes: on a throw nothing was appended.
    /// A float module decodes over an fp16 or bf16 cache too (make_cache<Eigen::half>, llama.cpp's default
    /// cache type): the new keys and values are rounded once as they are stored, and with options.attention.check_finite one
    /// that rounds to inf (beyond fp16's 65504) is value_error `attend.value.non_finite` before anything changes;
    /// the queries stay float and read the cache as float attention over its values.
    template <class X, class Mask, class Storage>
    mha_result<T> forward_cached(const X& x, kv_cache<Storage>& cache, const Mask& mask,
                                 const mha_options& options = {}) const {
        detail::require_cache_storage<T, Storage>();
        return forward_cached_over(x, cache, mask, options);
    }

    /// forward_cached without a mask besides the causal rule (and options.key_padding).
    template <class X, class Storage>
    mha_result<T> forward_cached(const X& x, kv_cache<Storage>& cache, const mha_options& options = {}) const {
        return forward_cached(x, cache, no_mask{}, options);
    }

    /// forward_cached over an int8 (q8_0) or int4 (q4_0) cache (make_cache<q8_0_block>, make_cache<q4_0_block>; float and 16-bit
    /// modules): the new keys and values are quantized as they are appended, and the queries attend over what the
    /// cache holds (q8_cache.hpp's bounds). Throws what its append throws (value_error
    /// `attend.value.quantized_range` for a projected key or value beyond the cache's max_magnitude) before anything
    /// changes, and everything the form above throws.
    template <class X, class Mask, class Block>
    mha_result<T> forward_cached(const X& x, quantized_kv_cache<Block>& cache, const Mask& mask,
                                 const mha_options& options = {}) const {
        detail::require_quantized_cache<T>();
        return forward_cached_over(x, cache, mask, options);
    }

    /// forward_cached over a quantized cache without a mask besides the causal rule (and options.key_padding).
    template <class X, class Block>
    mha_result<T> forward_cached(const X& x, quantized_kv_cache<Block>& cache, const mha_options& options = {}) const {
        return forward_cached(x, cache, no_mask{}, options);
    }

    /// Decoding step of a ragged batch over a paged cache (continuous batching): batch row n of x `[batch, max new
    /// tokens, model_dim]` holds new_tokens[n] new tokens of sequence sequences[n] (rows past them are padding and
    /// get zero output). Each sequence is projected, rotated at its own positions (position_offset +
    /// cache.length(id) + i), appended and attended (causal over everything it holds; with the cache's rolling
    /// window, its last window positions) as a call of its own, so its output is bit for bit what forward_cached
    /// over a kv_cache holding only that sequence gives: which other sequences share the batch never changes it.
    /// Needs key_dim == value_dim == model_dim and a cache with this module's kv_heads and head_dim (shape_error
    /// `attend.shape.cache`). Throws shape_error `attend.shape.sequences` (list sizes, a count outside [0, max new
    /// tokens]), value_error `attend.value.sequence`, `attend.value.need_weights`, position_error
    /// `attend.position.cache_full`, and everything forward_cached throws. All or nothing: on a throw, also one from
    /// the attention after the append, the cache is exactly as it was.
    /// A float module decodes over an fp16 or bf16 paged cache too, its keys and values rounded once as they are
    /// stored (as forward_cached over a kv_cache above), and a float or 16-bit module over an int8 pool
    /// (paged_kv_cache<q8_0_block>) or int4 pool (q4_0_block), its keys and values quantized as they are stored
    /// (value_error `attend.value.quantized_range` for one beyond what a block holds, before anything changes).
    template <class X, class Storage>
    mha_result<T> forward_cached(const X& x, paged_kv_cache<Storage>& cache, const std::vector<index_t>& sequences,
                                 const std::vector<index_t>& new_tokens, const mha_options& options = {}) const {
        detail::require_mha_input<X, T>();
        if constexpr (detail::is_quantized_block_v<Storage>) detail::require_quantized_cache<T>();
        else detail::require_cache_storage<T, Storage>();
        // Every allocation of the call (lists, buffers, messages) fails as a typed error, and the cache as it was.
        return detail::allocating([&] { return forward_paged(x, cache, sequences, new_tokens, options); },
                                  [] { return std::string("forward_cached's bookkeeping"); }, "Decode fewer sequences");
    }

private:
    template <class X, class Storage>
    mha_result<T> forward_paged(const X& x, paged_kv_cache<Storage>& cache, const std::vector<index_t>& sequences,
                                const std::vector<index_t>& new_tokens, const mha_options& options) const {
        const auto xd = detail::dims3(x);
        detail::check_width("x", xd, config_.model_dim, "model_dim", "[batch, new tokens, model_dim]");
        const index_t B = xd[0], L = xd[1], E = config_.model_dim, H = config_.heads, G = config_.kv_heads,
                      D = head_dim();
        check_self_attention();
        if (cache.kv_heads() != G || cache.head_dim() != D || cache.value_dim() != D)
            throw shape_error("attend.shape.cache",
                              detail::concat("paged cache [kv_heads ", cache.kv_heads(), ", head_dim ",
                                             cache.head_dim(), ", value_dim ", cache.value_dim(),
                                             "] does not fit the module: expected [kv_heads ", G, ", head_dim ", D,
                                             ", value_dim ", D, "]"));
        if (static_cast<index_t>(sequences.size()) != B || static_cast<index_t>(new_tokens.size()) != B)
            throw shape_error("attend.shape.sequences",
                              detail::concat("x ", detail::format_shape(xd), " has ", B, " batch rows but ",
                                             sequences.size(), " sequences and ", new_tokens.size(),
                                             " new-token counts are given (one each)"));
        if (options.attention.need_weights)
            throw value_error("attend.value.need_weights",
                              "need_weights is not available over a paged cache: key_len differs per sequence");
        std::vector<index_t> first(sequences.size());
        for (std::size_t n = 0; n < sequences.size(); ++n) {
            const index_t t = new_tokens[n];
            if (t < 0 || t > L)
                throw shape_error("attend.shape.sequences",
                                  detail::concat("sequence ", sequences[n], " (batch row ", n, ") has ", t,
                                                 " new tokens, outside [0, ", L, "]"));
            first[n] = detail::checked_position_sum(options.position_offset, cache.length(sequences[n]),
                                                    "position_offset + cache length");
            detail::checked_position_sum(first[n], t, "the position after the last new token");
            detail::check_layer_options(config_, options, first[n]);
        }
        if (options.attention.check_finite) detail::check_finite_input(x.data(), xd, "x");
        // Each sequence projected alone, so its rows meet the same GEMM shapes as when it is decoded alone.
        std::vector<projected_heads> p;
        using Stored = typename detail::append_type<paged_kv_cache<Storage>, T>::type;  // what the append takes
        std::vector<tensor<Stored, 3>> rounded(2 * sequences.size());  // a 16-bit cache's keys and values
        std::vector<strided_view<const Stored>> keys, values;
        p.reserve(sequences.size());
        keys.reserve(sequences.size());
        values.reserve(sequences.size());
        for (index_t n = 0; n < B; ++n) {
            const index_t t = new_tokens[static_cast<std::size_t>(n)];
            const T* rows = x.data() + n * L * E;
            p.push_back(project_heads(rows, rows, rows, 1, t, t, options, first[static_cast<std::size_t>(n)]));
            if (options.attention.check_finite)
                detail::check_finite_projections(split_heads(static_cast<const T*>(p.back().q.data()), 1, t, H, D),
                                                 split_heads(static_cast<const T*>(p.back().k.data()), 1, t, G, D),
                                                 split_heads(static_cast<const T*>(p.back().v.data()), 1, t, G, D));
            const auto at = 2 * static_cast<std::size_t>(n);
            keys.push_back(stored_heads(p.back().k, rounded[at], 1, t, options.attention.check_finite, "key"));
            values.push_back(stored_heads(p.back().v, rounded[at + 1], 1, t, options.attention.check_finite, "value"));
        }
        detail::paged_append<Storage, Stored> append(cache, sequences, keys, values);
        mha_result<T> r;
        r.out = detail::mha_buffer<T, 3>({B, L, E}, "out [batch, new tokens, model_dim]");
        r.out.setZero();
        auto o = detail::mha_buffer<T, 3>({1, L, H * D}, "attention output [1, new tokens, heads * head_dim]");
        const sdpa_options attention = detail::sdpa_options_for(options, sinks_);
        append.commit();  // cannot fail; `append` takes it back out if anything below throws
        // Checked and run sequence by sequence: the result is local until it is returned, and a throw takes the
        // append back out.
        for (index_t n = 0; n < B; ++n) {
            const index_t id = sequences[static_cast<std::size_t>(n)], t = new_tokens[static_cast<std::size_t>(n)];
            const auto qv = split_heads(static_cast<const T*>(p[static_cast<std::size_t>(n)].q.data()), 1, t, H, D);
            const auto kv = cache.key_blocks(id), vv = cache.value_blocks(id);
            const attention_shape s = shape_of(t, kv.dims[2]);
            const auto call = detail::check_call(qv, kv, vv, s, detail::cached_rule(cache.window_left()), attention);
            if (t == 0) continue;
            detail::attention_outputs<T> out;
            out.out = split_heads(o.data(), 1, t, H, D);
            detail::run_checked(qv, kv, vv, s, call, out);
            detail::project(o.data(), t, wo_, bo_, r.out.data() + n * L * E);
        }
        append.done();
        return r;
    }

    struct no_init {};

    void check_self_attention() const {
        if (config_.key_dim != config_.model_dim || config_.value_dim != config_.model_dim)
            throw shape_error("attend.shape.self_attention",
                              detail::concat("forward_cached is self-attention and needs key_dim == value_dim == "
                                             "model_dim, got model_dim ",
                                             config_.model_dim, ", key_dim ", config_.key_dim, ", value_dim ",
                                             config_.value_dim));
    }

    /// The shape of one sequence's call over a cache: t new queries over its key_len positions.
    attention_shape shape_of(index_t t, index_t key_len) const {
        return detail::sequence_shape(config_.heads, config_.kv_heads, t, key_len, head_dim(), head_dim());
    }

    multi_head_attention(const mha_config& config, no_init) : config_(validated(config)) { allocate(); }

    static mha_config validated(const mha_config& raw) {
        const mha_config c = raw.resolved();
        const auto spelled = [&] {
            return detail::concat(" (mha_config{model_dim ", raw.model_dim, ", heads ", raw.heads, ", kv_heads ",
                                  raw.kv_heads, ", key_dim ", raw.key_dim, ", value_dim ", raw.value_dim, "})");
        };
        if (raw.model_dim < 1 || raw.heads < 1 || raw.kv_heads < 0 || raw.key_dim < 0 || raw.value_dim < 0)
            throw value_error("attend.value.size",
                              detail::concat("model_dim and heads must be >= 1 and kv_heads, key_dim, value_dim >= 0 "
                                             "(0 = default)",
                                             spelled()));
        if (c.model_dim % c.heads != 0)
            throw shape_error("attend.shape.model_dim_heads",
                              detail::concat("model_dim ", c.model_dim, " is not a multiple of heads ", c.heads,
                                             " (head_dim = model_dim / heads)", spelled()));
        if (c.heads % c.kv_heads != 0)
            throw shape_error("attend.shape.gqa",
                              detail::concat("heads ", c.heads, " is not a multiple of kv_heads ", c.kv_heads,
                                             " (grouped-query attention needs heads % kv_heads == 0)", spelled()));
        if (detail::product_overflows(c.heads, c.model_dim / c.heads, std::max({c.model_dim, c.key_dim, c.value_dim})))
            throw shape_error("attend.shape.overflow", detail::concat("weights overflow Eigen::Index", spelled()));
        return c;
    }

    void allocate() {
        const index_t E = config_.model_dim, D = head_dim();
        const index_t q_rows = config_.heads * D, kv_rows = config_.kv_heads * D;
        wq_ = tensor<T, 2>(q_rows, E);
        wk_ = tensor<T, 2>(kv_rows, config_.key_dim);
        wv_ = tensor<T, 2>(kv_rows, config_.value_dim);
        wo_ = tensor<T, 2>(E, q_rows);
        if (config_.bias) {
            bq_ = tensor<T, 1>(q_rows);
            bk_ = tensor<T, 1>(kv_rows);
            bv_ = tensor<T, 1>(kv_rows);
            bo_ = tensor<T, 1>(E);
            bq_.setZero();
            bk_.setZero();
            bv_.setZero();
            bo_.setZero();
        }
        if (config_.sinks) {
            sinks_ = tensor<T, 1>(config_.heads);
            sinks_.setZero();
        }
    }

    /// Projections of query `[batch, query_len, model_dim]`, key and value `[batch, key_len, *]`: q
    /// `[batch, query_len, heads * head_dim]`, k and v `[batch, key_len, kv_heads * head_dim]`, the heads side by
    /// side (read through split_heads views); q and k rotated (options.rotary) from position first_position.
    struct projected_heads {
        tensor<T, 3> q, k, v;
    };
    projected_heads project_heads(const T* query, const T* key, const T* value, index_t B, index_t L, index_t S,
                                  const mha_options& options, index_t first_position) const {
        const index_t H = config_.heads, G = config_.kv_heads, D = head_dim();
        projected_heads p{
            detail::mha_buffer<T, 3>({B, L, H * D}, "projected query [batch, query_len, heads * head_dim]"),
            detail::mha_buffer<T, 3>({B, S, G * D}, "projected key [batch, key_len, kv_heads * head_dim]"),
            detail::mha_buffer<T, 3>({B, S, G * D}, "projected value [batch, key_len, kv_heads * head_dim]")};
        detail::project(query, B * L, wq_, bq_, p.q.data());
        detail::project(key, B * S, wk_, bk_, p.k.data());
        detail::project(value, B * S, wv_, bv_, p.v.data());
        if (options.rotary) {
            options.rotary->apply(split_heads(p.q.data(), B, L, H, D), first_position);
            options.rotary->apply(split_heads(p.k.data(), B, S, G, D), first_position);
        }
        return p;
    }

    template <class Q, class K, class V, class Mask>
    mha_result<T> forward_impl(const Q& query, const K& key, const V& value, const Mask& mask,
                               const mha_options& options, mha_saved<T>* saved) const {
        detail::require_mha_mask<Mask>();
        detail::require_mha_input<Q, T>();
        detail::require_mha_input<K, T>();
        detail::require_mha_input<V, T>();
        const auto qd = detail::dims3(query), kd = detail::dims3(key), vd = detail::dims3(value);
        detail::check_mha_inputs(config_, qd, kd, vd);
        detail::check_layer_options(config_, options, options.position_offset);
        if (options.attention.check_finite) {
            detail::check_finite_input(query.data(), qd, "query");
            detail::check_finite_input(key.data(), kd, "key");
            detail::check_finite_input(value.data(), vd, "value");
        }
        const index_t B = qd[0], L = qd[1], S = kd[1];
        const index_t H = config_.heads, G = config_.kv_heads, D = head_dim();
        projected_heads p =
            project_heads(query.data(), key.data(), value.data(), B, L, S, options, options.position_offset);
        const auto qv = split_heads(static_cast<const T*>(p.q.data()), B, L, H, D);
        const auto kv = split_heads(static_cast<const T*>(p.k.data()), B, S, G, D);
        const auto vv = split_heads(static_cast<const T*>(p.v.data()), B, S, G, D);
        if (options.attention.check_finite) detail::check_finite_projections(qv, kv, vv);
        const attention_shape s = detail::check_views(qv, kv, vv);
        mha_result<T> r;
        auto o = detail::mha_buffer<T, 3>({B, L, H * D}, "attention output [batch, query_len, heads * head_dim]");
        auto lse =
            detail::mha_buffer<accumulator_t<T>, 3>({saved ? B : 0, H, L}, "saved lse [batch, heads, query_len]");
        // Named: the checked call keeps pointers into its options (the score_bias) until the kernels ran.
        const sdpa_options attention = detail::sdpa_options_for(options, sinks_);
        detail::with_key_padding(mask, options.key_padding, B, S, [&](const auto& full_mask) {
            const auto call = detail::check_call(qv, kv, vv, s, full_mask, attention);
            attend_and_project(qv, kv, vv, s, call, options, o, saved ? lse.data() : nullptr, r);
        });
        if (saved) {
            saved->q = std::move(p.q);
            saved->k = std::move(p.k);
            saved->v = std::move(p.v);
            saved->attention = std::move(o);
            saved->lse = std::move(lse);
        }
        return r;
    }

    /// The new keys or values (`projected` `[batch, len, kv_heads * head_dim]`) as a cache of Stored is given them,
    /// `[batch, kv_heads, len, head_dim]`: the projection itself, or (a 16-bit cache under a float module) rounded
    /// once into `rounded`, where with check_finite a value that rounds to +-inf (beyond fp16's 65504) throws
    /// value_error attend.value.non_finite.
    template <class Stored>
    strided_view<const Stored> stored_heads(const tensor<T, 3>& projected, tensor<Stored, 3>& rounded, index_t B,
                                            index_t L, bool check_finite, const char* what) const {
        const index_t G = config_.kv_heads, D = head_dim();
        if constexpr (std::is_same_v<Stored, T>) {
            return split_heads(static_cast<const T*>(projected.data()), B, L, G, D);
        } else {
            rounded = detail::mha_buffer<Stored, 3>({B, L, G * D}, "new keys or values rounded to the cache's type");
            detail::narrow(projected.data(), projected.size(), rounded.data());
            const auto heads = split_heads(static_cast<const Stored*>(rounded.data()), B, L, G, D);
            if (check_finite)  // finite in float, but it may be beyond fp16's range: inf in the cache
                detail::check_finite(heads, detail::concat("projected ", what, " rounded to the cache's type").c_str());
            return heads;
        }
    }

    /// forward_cached over a kv_cache (of T, or 16-bit under a float module) or a quantized_kv_cache: both check an append
    /// without making it, append and truncate alike, and their keys() / values() are views the kernels read.
    template <class X, class Mask, class Cache>
    mha_result<T> forward_cached_over(const X& x, Cache& cache, const Mask& mask, const mha_options& options) const {
        detail::require_mha_mask<Mask>();
        detail::require_mha_input<X, T>();
        const auto xd = detail::dims3(x);
        detail::check_width("x", xd, config_.model_dim, "model_dim", "[batch, new tokens, model_dim]");
        check_self_attention();
        const index_t B = xd[0], L = xd[1], H = config_.heads, G = config_.kv_heads, D = head_dim();
        if (cache.batch() != B || cache.kv_heads() != G || cache.head_dim() != D || cache.value_dim() != D)
            throw shape_error("attend.shape.cache",
                              detail::concat("cache [batch ", cache.batch(), ", kv_heads ", cache.kv_heads(),
                                             ", head_dim ", cache.head_dim(), ", value_dim ", cache.value_dim(),
                                             "] does not fit x ", detail::format_shape(xd),
                                             " and the module (kv_heads ", G, ", head_dim ", D, "): expected [batch ",
                                             B, ", kv_heads ", G, ", head_dim ", D, ", value_dim ", D,
                                             "] (see make_cache)"));
        cache.check_fits(L);
        const index_t past = cache.length(), S = past + L;
        const index_t first_position =
            detail::checked_position_sum(options.position_offset, past, "position_offset + cache length");
        detail::checked_position_sum(first_position, L, "the position after the last new token");
        detail::check_layer_options(config_, options, first_position);
        if (options.attention.check_finite) detail::check_finite_input(x.data(), xd, "x");
        const projected_heads p = project_heads(x.data(), x.data(), x.data(), B, L, L, options, first_position);
        const auto qv = split_heads(p.q.data(), B, L, H, D);
        const auto k_new = split_heads(p.k.data(), B, L, G, D);
        const auto v_new = split_heads(p.v.data(), B, L, G, D);
        if (options.attention.check_finite) detail::check_finite_projections(qv, k_new, v_new);
        using Stored = typename detail::append_type<Cache, T>::type;
        tensor<Stored, 3> k_rounded, v_rounded;
        const auto k_store = stored_heads(p.k, k_rounded, B, L, options.attention.check_finite, "key");
        const auto v_store = stored_heads(p.v, v_rounded, B, L, options.attention.check_finite, "value");
        cache.check_append(k_store, v_store);
        // Views of the cache as it will be after the append: the storage exists, only the length grows.
        auto kv = cache.keys(), vv = cache.values();
        kv.dims[2] = S;
        vv.dims[2] = S;
        const attention_shape s = detail::check_views(qv, kv, vv);
        mha_result<T> r;
        const auto causal_mask = detail::combine_masks(detail::mha_allowed(mask), causal(alignment::bottom_right));
        const sdpa_options attention = detail::sdpa_options_for(options, sinks_);  // outlives the call
        detail::with_key_padding(causal_mask, options.key_padding, B, S, [&](const auto& full_mask) {
            const auto call = detail::check_call(qv, kv, vv, s, full_mask, attention);
            auto o = detail::mha_buffer<T, 3>({B, L, H * D}, "attention output [batch, new tokens, heads * head_dim]");
            // The append is the call's only mutation: it runs after every buffer is allocated and cannot throw
            // (check_append above checks what it checks), so a failure anywhere leaves the cache as it was.
            // A throw after it (the kernel's scratch) takes the new positions back out.
            try {
                attend_and_project(qv, kv, vv, s, call, options, o, nullptr, r,
                                   [&] { cache.append(k_store, v_store); });
            } catch (...) {
                cache.truncate(past);
                throw;
            }
        });
        return r;
    }

    /// Runs a checked call: heads written straight into their slices of o `[batch, query_len, heads*head_dim]`,
    /// then the output projection, padded query rows zeroed, weights averaged or kept per head. Every buffer is
    /// allocated first; then before_run() (a caller's mutation that must not happen if an allocation fails), then
    /// the kernel.
    template <class KV, class Call, class BeforeRun = void (*)()>
    void attend_and_project(
        const strided_view<const T>& q, const KV& k, const KV& v, const attention_shape& s, const Call& call,
        const mha_options& options, tensor<T, 3>& o, accumulator_t<T>* lse, mha_result<T>& r,
        BeforeRun before_run = [] {}) const {
        const index_t B = s.batch, L = s.query_len, S = s.key_len, H = s.heads, D = head_dim();
        auto w = detail::mha_buffer<T, 4>({options.attention.need_weights ? B : 0, H, L, S},
                                          "per-head weights [batch, heads, query_len, key_len]");
        auto out = detail::mha_buffer<T, 3>({B, L, config_.model_dim}, "out [batch, query_len, model_dim]");
        auto averaged =
            detail::mha_buffer<T, 3>({options.attention.need_weights && options.average_weights ? B : 0, L, S},
                                     "averaged weights [batch, query_len, key_len]");
        before_run();
        detail::attention_outputs<T> outputs;
        outputs.out = split_heads(o.data(), B, L, H, D);
        outputs.weights = options.attention.need_weights ? w.data() : nullptr;
        outputs.lse = lse;
        if (B * L > 0) detail::run_checked(q, k, v, s, call, outputs);  // nothing to attend for zero queries
        r.out = std::move(out);
        detail::project(o.data(), B * L, wo_, bo_, r.out.data());
        for (index_t b = 0; b < B; ++b)
            for (index_t i = 0; i < L; ++i)
                if (call.mask.query_padded(b, i)) {
                    T* row = r.out.data() + (b * L + i) * config_.model_dim;
                    std::fill(row, row + config_.model_dim, T(0));
                }
        if (!options.attention.need_weights) return;
        if (!options.average_weights) {
            r.head_weights = std::move(w);
            r.weights_kind = weights_kind::per_head;
            return;
        }
        r.weights_kind = weights_kind::averaged;
        r.weights = std::move(averaged);
        // torch's mean over heads, summed in the accumulation type and rounded once
        using Acc = accumulator_t<T>;
        for (index_t b = 0; b < B; ++b)
            for (index_t i = 0; i < L; ++i)
                for (index_t j = 0; j < S; ++j) {
                    Acc sum = 0;
                    for (index_t h = 0; h < H; ++h) sum += static_cast<Acc>(w.data()[((b * H + h) * L + i) * S + j]);
                    r.weights.data()[(b * L + i) * S + j] = static_cast<T>(sum / static_cast<Acc>(H));
                }
    }

    mha_config config_;
    tensor<T, 2> wq_, wk_, wv_, wo_;
    tensor<T, 1> bq_, bk_, bv_, bo_;
    tensor<T, 1> sinks_;  ///< `[heads]`, empty without config.sinks
};

}  // namespace attend

// The PyTorch parameter layout (from_torch, to_torch) lives in its own header; included here, after the class it
// completes, so code that includes mha.hpp alone keeps compiling.
#include "interop/torch.hpp"
