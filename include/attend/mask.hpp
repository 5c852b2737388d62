// SPDX-License-Identifier: MIT
#pragma once
/// Masks with explicit meaning. Every mask says which keys a query may attend in the score matrix
/// `[batch, heads, query_len, key_len]`:
///   allowed_mask      Boolean, true = may attend (PyTorch SDPA, JAX, FlexAttention)
///   forbidden_mask    Boolean, true = blocked (nn.MultiheadAttention's attn_mask and key_padding_mask)
///   additive_mask<T>  added to the scaled scores; -inf forbids, finite values bias
///   causal, key_padding, query_padding, sliding_window, prefix_lm, block_diagonal, packed_segments, chunked,
///   bidirectional_groups: rules, never materialized.
/// Allowed sets combine with && || !, additive terms with +. The two Boolean conventions never convert
/// implicitly: to_allowed / to_forbidden say which way.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "alignment.hpp"
#include "detail/checked_arithmetic.hpp"
#include "detail/mask_nodes.hpp"
#include "detail/memory.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace attend {

/// The score shape `[batch, heads, query_len, key_len]` to draw or materialize a mask for.
struct score_shape {
    index_t batch = 1;      ///< sequences
    index_t heads = 1;      ///< query heads
    index_t query_len = 0;  ///< rows of the grid
    index_t key_len = 0;    ///< columns of the grid
};

namespace detail {

/// Tags: what kind of mask term a type is.
struct boolean_term {};    ///< an allowed set
struct additive_term {};   ///< values added to the scores
struct forbidden_term {};  ///< a forbidden set: data only, must be converted with to_allowed

template <class E>
inline constexpr bool is_boolean_v = std::is_base_of_v<boolean_term, E>;
template <class E>
inline constexpr bool is_additive_v = std::is_base_of_v<additive_term, E>;
template <class E>
inline constexpr bool is_forbidden_v = std::is_base_of_v<forbidden_term, E>;
template <class E>
inline constexpr bool is_mask_v = is_boolean_v<E> || is_additive_v<E>;
template <class E>
inline constexpr bool is_mask_like_v = is_mask_v<E> || is_forbidden_v<E>;

template <class E>
constexpr bool has_query_padding() {
    if constexpr (is_mask_v<E>) return E::has_query_padding;
    return false;
}

/// How a dense mask's axes meet the scores `[batch, heads, query_len, key_len]`.
enum class dense_layout {
    right_aligned,  ///< numpy / PyTorch broadcasting from the right (rank 1, 3, 4; rank 2 only when built by name)
    batch_key       ///< rank 2 `[batch, key_len]`: PyTorch's key_padding_mask, HF's attention_mask
};

/// The shape of a dense mask as the user gave it (rank 1 to 4), how its axes meet the scores, and whether its key
/// axis may be shorter than key_len (ONNX pads such a mask with -inf: the missing keys are forbidden).
struct dense_dims {
    std::vector<index_t> dims;
    dense_layout layout = dense_layout::right_aligned;
    bool short_keys_forbidden = false;  ///< ONNX: a key axis shorter than key_len forbids the keys past it

    /// Strides onto `[batch, heads, query_len, key_len]`, aligned from the right against the score shape of the
    /// call (rank 3 inputs have scores `[batch, query_len, key_len]`) or by the batch_key layout, 0 on broadcast
    /// axes.
    std::array<index_t, 4> broadcast_strides(const attention_shape& s, const char* what) const {
        const std::array<index_t, 4> score{s.batch, s.heads, s.query_len, s.key_len};
        const std::vector<int> right = s.rank == 4 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0, 2, 3};
        const auto score_spelled = s.rank == 4 ? format_shape(score)
                                               : format_shape(std::array<index_t, 3>{s.batch, s.query_len, s.key_len});
        const int mask_rank = static_cast<int>(dims.size());
        if (mask_rank > static_cast<int>(right.size()))
            throw mask_error("attend.mask.rank", concat(what, " of rank ", mask_rank, ' ', format_shape(dims),
                                                        " has more axes than the scores ", score_spelled));
        const std::vector<int> axes = layout == dense_layout::batch_key
                                          ? std::vector<int>{0, 3}
                                          : std::vector<int>(right.end() - mask_rank, right.end());
        std::array<index_t, 4> strides{0, 0, 0, 0};
        index_t stride = 1;
        for (int a = mask_rank - 1; a >= 0; --a) {
            const auto axis = static_cast<std::size_t>(axes[static_cast<std::size_t>(a)]);
            const index_t n = dims[static_cast<std::size_t>(a)];
            const bool shorter_keys_ok = short_keys_forbidden && axis == 3 && n < score[axis];
            if (n != 1 && n != score[axis] && !shorter_keys_ok)
                throw mask_error("attend.mask.broadcast",
                                 concat(what, ' ', format_shape(dims), " does not broadcast to the scores ",
                                        score_spelled, " [batch, heads, query_len, key_len]: axis ", a, " is ", n,
                                        ", expected 1 or ", score[axis], hint(mask_rank)));
            strides[axis] = n == 1 && !(shorter_keys_ok && n < score[axis]) ? 0 : stride;
            stride *= n;
        }
        return strides;
    }
    /// Keys at or past this are forbidden (ONNX's short masks); key_len otherwise.
    index_t key_end(const attention_shape& s) const {
        if (!short_keys_forbidden || dims.empty()) return s.key_len;
        return std::min(dims.back(), s.key_len);
    }

private:
    std::string hint(int mask_rank) const {
        if (layout == dense_layout::batch_key) return " (a key padding mask is [batch, key_len])";
        if (mask_rank == 2)
            return " (a rank-2 grid is [query_len, key_len]; PyTorch's key_padding_mask [batch, key_len] is "
                   "forbidden_mask::key_padding(t), HF's attention_mask allowed_mask::key_padding(t))";
        return "";
    }
};

/// float, double, long double, Eigen::half and Eigen::bfloat16: the types an additive mask may hold.
template <class T>
inline constexpr bool is_floating_like_v =
    std::is_floating_point_v<T> || std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;

/// A number of another floating-point type as V: finite values beyond V's range saturate at V's lowest() / max()
/// (what the kernels do with finite biases, so -1e300 from a double mask stays a finite fill in a float one, and
/// -1e9 in an fp16 one, and never empties a row); infinities and NaN keep their meaning.
template <class V, class X>
V saturating_cast(X x) {
    if constexpr (is_floating_like_v<X> && is_floating_like_v<V>) {
        const auto wide = [](auto y) -> long double {  // exact: 16-bit values through float
            if constexpr (std::is_floating_point_v<decltype(y)>) return y;
            else return static_cast<float>(y);
        };
        if ((Eigen::numext::isfinite)(x)) {  // in x's own type: valgrind's x87 emulation takes -inf widened to
                                             // long double for a finite number
            if (wide(x) > wide(std::numeric_limits<V>::max())) return std::numeric_limits<V>::max();
            if (wide(x) < wide(std::numeric_limits<V>::lowest())) return std::numeric_limits<V>::lowest();
        }
    }
    return static_cast<V>(x);
}

/// How a dense mask was built: which ranks its constructor takes and how its axes meet the scores.
enum class dense_form {
    broadcast,       ///< rank 1, 3 or 4, broadcast from the right (rank 2 is ambiguous: refused)
    query_key_grid,  ///< rank 2 `[query_len, key_len]`
    key_padding,     ///< rank 2 `[batch, key_len]`
    onnx             ///< rank 1 to 4 from the right (rank 2 is `[query_len, key_len]`), short key axis forbidden
};

/// Reads a Boolean or numeric rank 1-4 row-major tensor (or TensorMap) into a flat vector plus its dims; numbers
/// convert with saturating_cast. `Form` is checked against the tensor's rank at compile time.
template <class V, dense_form Form, class X>
std::pair<std::vector<V>, dense_dims> read_dense(const X& x) {
    using traits = tensor_traits<std::decay_t<X>>;
    static_assert(traits::supported,
                  "attend: masks are built from attend::tensor (row-major Eigen::Tensor) or "
                  "an Eigen::TensorMap of one");
    if constexpr (traits::supported) {
        static_assert(traits::row_major, "attend: mask tensors must be Eigen::RowMajor (PyTorch's layout)");
        static_assert(Form != dense_form::broadcast || traits::rank != 2,
                      "attend: a rank-2 mask is ambiguous: build a [query_len, key_len] grid with "
                      "query_key_grid(t), PyTorch's key_padding_mask [batch, key_len] with "
                      "forbidden_mask::key_padding(t), HF's attention_mask with allowed_mask::key_padding(t)");
        static_assert(Form == dense_form::broadcast || Form == dense_form::onnx || traits::rank == 2,
                      "attend: query_key_grid and key_padding take rank-2 tensors");
        static_assert(traits::rank >= 1 && traits::rank <= 4,
                      "attend: dense masks have rank 1 [key_len] to 4 [batch, heads, query_len, key_len]");
        dense_dims d;
        for (int a = 0; a < traits::rank; ++a) d.dims.push_back(x.dimensions()[static_cast<std::size_t>(a)]);
        d.layout = Form == dense_form::key_padding ? dense_layout::batch_key : dense_layout::right_aligned;
        d.short_keys_forbidden = Form == dense_form::onnx;
        std::vector<V> values(static_cast<std::size_t>(x.size()));
        for (index_t n = 0; n < x.size(); ++n) values[static_cast<std::size_t>(n)] = saturating_cast<V>(x.data()[n]);
        return {std::move(values), std::move(d)};
    } else {
        return {};
    }
}

/// The scalar of a tensor, or void for a type that is not one (whose own static_assert then speaks).
template <class X, bool = tensor_traits<std::decay_t<X>>::supported>
struct scalar_or_void {
    using type = void;
};
template <class X>
struct scalar_or_void<X, true> {
    using type = scalar_of<X>;
};

/// Reads a bool tensor for a Boolean mask; the static_assert comes first, so it is the one message.
template <dense_form Form, class BoolTensor>
std::pair<std::vector<std::uint8_t>, dense_dims> read_boolean(const BoolTensor& t) {
    using scalar = typename scalar_or_void<BoolTensor>::type;
    static_assert(std::is_same_v<scalar, bool> || std::is_void_v<scalar>,
                  "attend: allowed_mask and forbidden_mask are built from bool tensors; for float masks use "
                  "additive_mask<T>");
    if constexpr (std::is_same_v<scalar, bool> || std::is_void_v<scalar>) return read_dense<std::uint8_t, Form>(t);
    else return {};
}

}  // namespace detail

class forbidden_mask;

/// Dense Boolean mask, true = this query may attend this key. Any shape that broadcasts to
/// `[batch, heads, query_len, key_len]` (rank 2, 3 or 4, size-1 axes broadcast, aligned from the right).
class allowed_mask : public detail::boolean_term {
public:
    static constexpr bool has_query_padding = false;

    /// From a bool tensor in PyTorch scaled_dot_product_attention's convention: true = may attend. Rank 1
    /// `[key_len]`, 3 or 4, broadcast from the right; a rank-2 tensor is ambiguous and does not compile (use
    /// query_key_grid or key_padding).
    template <class BoolTensor>
    static allowed_mask from_torch_sdpa(const BoolTensor& t) {
        return true_means_allowed(t);
    }
    /// From a bool tensor in JAX's and FlexAttention's convention: true = may attend (ranks as from_torch_sdpa).
    template <class BoolTensor>
    static allowed_mask from_jax(const BoolTensor& t) {
        return true_means_allowed(t);
    }
    /// From a bool tensor whose true means "may attend" (ranks as from_torch_sdpa).
    template <class BoolTensor>
    static allowed_mask true_means_allowed(const BoolTensor& t) {
        return make(detail::read_boolean<detail::dense_form::broadcast>(t));
    }
    /// From a rank-2 bool grid `[query_len, key_len]`, true = may attend, broadcast over batch and heads.
    template <class BoolTensor>
    static allowed_mask query_key_grid(const BoolTensor& t) {
        return make(detail::read_boolean<detail::dense_form::query_key_grid>(t));
    }
    /// From a rank-2 bool `[batch, key_len]`, true = a real key (HF's attention_mask as bool): the keys each
    /// sequence may attend, for every head and query.
    template <class BoolTensor>
    static allowed_mask key_padding(const BoolTensor& t) {
        return make(detail::read_boolean<detail::dense_form::key_padding>(t));
    }
    /// From an ONNX Attention bool attn_mask: true = takes part in attention; rank 1 to 4 broadcast from the right
    /// (rank 2 is `[query_len, key_len]`); a key axis shorter than key_len forbids the keys past it, as ONNX pads.
    template <class BoolTensor>
    static allowed_mask from_onnx(const BoolTensor& t) {
        return make(detail::read_boolean<detail::dense_form::onnx>(t));
    }

    /// The mask's dims as given (rank 1 to 4).
    const std::vector<index_t>& dims() const { return dims_.dims; }
    /// True when built as `[batch, key_len]` key padding (key_padding), false for a grid or a broadcast mask.
    bool is_key_padding() const { return dims_.layout == detail::dense_layout::batch_key; }
    /// The value at a position of a rank-4 mask (what materialize returns): true = may attend.
    bool operator()(index_t b, index_t h, index_t i, index_t j) const {
        ATTEND_ASSERT(dims_.dims.size() == 4);
        const auto& d = dims_.dims;
        return ((*values_)[static_cast<std::size_t>(((b * d[1] + h) * d[2] + i) * d[3] + j)] != 0) != inverted_;
    }

    /// Checks the mask against one call's shape (mask_error attend.mask.rank / attend.mask.broadcast).
    detail::bound_dense_boolean bind(const attention_shape& s) const {
        detail::bound_dense_boolean bound;
        bound.data = values_->data();
        bound.strides = dims_.broadcast_strides(s, "allowed mask");
        bound.key_end = dims_.key_end(s);
        bound.inverted = inverted_;
        return bound;
    }

private:
    friend class forbidden_mask;
    static allowed_mask make(std::pair<std::vector<std::uint8_t>, detail::dense_dims> read) {
        return allowed_mask(std::make_shared<const std::vector<std::uint8_t>>(std::move(read.first)),
                            std::move(read.second), false);
    }
    friend forbidden_mask to_forbidden(const allowed_mask&);
    friend allowed_mask to_allowed(const forbidden_mask&);
    allowed_mask(std::shared_ptr<const std::vector<std::uint8_t>> values, detail::dense_dims dims, bool inverted)
        : values_(std::move(values)), dims_(std::move(dims)), inverted_(inverted) {}

    std::shared_ptr<const std::vector<std::uint8_t>> values_;
    detail::dense_dims dims_;
    bool inverted_ = false;  ///< values_ hold "blocked" flags (the mask came from a forbidden_mask)
};

/// Dense Boolean mask, true = blocked: nn.MultiheadAttention's convention. It is data, not an allowed set:
/// combining it with masks or passing it to attention does not compile; convert it with to_allowed.
class forbidden_mask : public detail::forbidden_term {
public:
    /// From a bool attn_mask of nn.MultiheadAttention (rank 3 or 4; a rank-2 `[query_len, key_len]` one is
    /// query_key_grid, its key_padding_mask key_padding): true = not allowed to attend.
    template <class BoolTensor>
    static forbidden_mask from_torch_mha(const BoolTensor& t) {
        return true_means_blocked(t);
    }
    /// From a bool tensor whose true means "blocked" (rank 1, 3 or 4, broadcast from the right).
    template <class BoolTensor>
    static forbidden_mask true_means_blocked(const BoolTensor& t) {
        return make(detail::read_boolean<detail::dense_form::broadcast>(t));
    }
    /// From a rank-2 bool grid `[query_len, key_len]`, true = blocked (nn.MultiheadAttention's 2-D attn_mask).
    template <class BoolTensor>
    static forbidden_mask query_key_grid(const BoolTensor& t) {
        return make(detail::read_boolean<detail::dense_form::query_key_grid>(t));
    }
    /// From PyTorch's key_padding_mask, a rank-2 bool `[batch, key_len]`: true = padding, never attended.
    template <class BoolTensor>
    static forbidden_mask key_padding(const BoolTensor& t) {
        return make(detail::read_boolean<detail::dense_form::key_padding>(t));
    }

    /// The mask's dims as given.
    const std::vector<index_t>& dims() const { return dims_.dims; }
    /// True when built as `[batch, key_len]` key padding (key_padding).
    bool is_key_padding() const { return dims_.layout == detail::dense_layout::batch_key; }

private:
    static forbidden_mask make(std::pair<std::vector<std::uint8_t>, detail::dense_dims> read) {
        return forbidden_mask(std::make_shared<const std::vector<std::uint8_t>>(std::move(read.first)),
                              std::move(read.second), false);
    }
    friend forbidden_mask to_forbidden(const allowed_mask&);
    friend allowed_mask to_allowed(const forbidden_mask&);
    forbidden_mask(std::shared_ptr<const std::vector<std::uint8_t>> values, detail::dense_dims dims, bool inverted)
        : values_(std::move(values)), dims_(std::move(dims)), inverted_(inverted) {}

    std::shared_ptr<const std::vector<std::uint8_t>> values_;
    detail::dense_dims dims_;
    bool inverted_ = false;  ///< values_ hold "allowed" flags (the mask came from an allowed_mask)
};

/// The allowed set of a forbidden mask: allowed where it is false. O(1), shares the data.
inline allowed_mask to_allowed(const forbidden_mask& m) { return allowed_mask(m.values_, m.dims_, !m.inverted_); }
/// The forbidden set of an allowed mask: blocked where it is false. O(1), shares the data.
inline forbidden_mask to_forbidden(const allowed_mask& m) { return forbidden_mask(m.values_, m.dims_, !m.inverted_); }

/// Dense additive mask: added to the scaled scores before softmax; -inf forbids, finite values bias.
/// Same broadcasting as allowed_mask. NaN or +inf entries are a value_error (attend.value.additive_mask).
template <class T>
class additive_mask : public detail::additive_term {
public:
    static_assert(detail::is_floating_like_v<T>,
                  "attend: additive_mask<T> needs a floating-point T (float, double, Eigen::half, Eigen::bfloat16)");
    static constexpr bool has_query_padding = false;

    /// From values to add to the scores (PyTorch's float attn_mask in both SDPA and nn.MultiheadAttention): rank 1
    /// `[key_len]`, 3 or 4 broadcast from the right; rank 2 is ambiguous and does not compile (use query_key_grid
    /// or key_padding).
    template <class Tensor>
    static additive_mask from_values(const Tensor& t) {
        return make(detail::read_dense<T, detail::dense_form::broadcast>(t));
    }
    /// Same as from_values: PyTorch's float masks are additive in every API.
    template <class Tensor>
    static additive_mask from_torch(const Tensor& t) {
        return from_values(t);
    }
    /// From a rank-2 grid `[query_len, key_len]` of values to add, broadcast over batch and heads.
    template <class Tensor>
    static additive_mask query_key_grid(const Tensor& t) {
        return make(detail::read_dense<T, detail::dense_form::query_key_grid>(t));
    }
    /// From a rank-2 `[batch, key_len]` of values added to every query's score of that key (a float
    /// key_padding_mask: -inf on padding).
    template <class Tensor>
    static additive_mask key_padding(const Tensor& t) {
        return make(detail::read_dense<T, detail::dense_form::key_padding>(t));
    }
    /// From an ONNX Attention float attn_mask: rank 1 to 4 broadcast from the right (rank 2 is
    /// `[query_len, key_len]`); a key axis shorter than key_len adds -inf past it, as ONNX pads.
    template <class Tensor>
    static additive_mask from_onnx(const Tensor& t) {
        return make(detail::read_dense<T, detail::dense_form::onnx>(t));
    }

    /// The mask's dims as given (rank 1 to 4).
    const std::vector<index_t>& dims() const { return dims_.dims; }

    detail::bound_dense_additive<T> bind(const attention_shape& s) const {
        detail::bound_dense_additive<T> bound;
        bound.data = values_->data();
        bound.strides = dims_.broadcast_strides(s, "additive mask");
        bound.key_end = dims_.key_end(s);
        return bound;
    }

private:
    /// NaN or +inf entries are a value_error (attend.value.additive_mask).
    static additive_mask make(std::pair<std::vector<T>, detail::dense_dims> read) {
        auto& [values, dims] = read;
        for (std::size_t n = 0; n < values.size(); ++n)
            if ((Eigen::numext::isnan)(values[n]) || values[n] == std::numeric_limits<T>::infinity())
                throw value_error("attend.value.additive_mask", concat_position(values[n], n, dims.dims));
        return additive_mask(std::make_shared<const std::vector<T>>(std::move(values)), std::move(dims));
    }
    additive_mask(std::shared_ptr<const std::vector<T>> values, detail::dense_dims dims)
        : values_(std::move(values)), dims_(std::move(dims)) {}
    static std::string concat_position(T value, std::size_t flat, const std::vector<index_t>& dims) {
        return detail::concat("additive mask ", detail::format_shape(dims), " holds ", value, " at flat index ", flat,
                              "; entries must be finite or -inf (-inf forbids)");
    }

    std::shared_ptr<const std::vector<T>> values_;
    detail::dense_dims dims_;
};

/// No mask: every query may attend every key.
struct no_mask : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    detail::bound_everything bind(const attention_shape&) const { return {}; }
};

namespace detail {
inline std::shared_ptr<const std::vector<index_t>> checked_lengths(const std::vector<index_t>& lengths, index_t batch,
                                                                   index_t limit, const char* what,
                                                                   const char* limit_name) {
    if (static_cast<index_t>(lengths.size()) != batch)
        throw mask_error("attend.mask.lengths_batch", concat(what, " has ", lengths.size(), " lengths for batch ",
                                                             batch, " (one length per sequence)"));
    for (std::size_t b = 0; b < lengths.size(); ++b)
        if (lengths[b] < 0 || lengths[b] > limit)
            throw mask_error("attend.mask.length_range", concat(what, " length ", lengths[b], " of batch ", b,
                                                                " is outside [0, ", limit_name, " = ", limit, ']'));
    return std::make_shared<const std::vector<index_t>>(lengths);
}

inline bound_diagonal bind_diagonal(const diagonal& d, const attention_shape& s, const char* rule) {
    return d.bind(s.batch, s.query_len, s.key_len, rule);
}
}  // namespace detail

/// Causal rule: query i sees keys j <= i + offset, the offset of its diagonal `d`: 0 for alignment::top_left
/// (PyTorch's is_causal), key_len - query_len for alignment::bottom_right (KV-cache decoding), or explicit
/// (diagonal_offset, diagonal_offsets, aligned_to_key_lengths). The diagonal is required because the choices
/// differ exactly when query_len != key_len, where silent bugs live.
struct causal_rule : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    attend::diagonal diagonal;  ///< where the diagonal runs

    detail::bound_band bind(const attention_shape& s) const {
        return detail::bound_band::around(detail::bind_diagonal(diagonal, s, "causal"), unbounded, 0, s.query_len,
                                          s.key_len);
    }
};
/// The causal rule with diagonal `d` (there is no default: top_left and bottom_right differ when
/// query_len != key_len).
inline causal_rule causal(diagonal d) { return causal_rule{{}, std::move(d)}; }

/// Sliding window: query i sees keys j with i + offset - left <= j <= i + offset + right, offset that of the
/// diagonal (as for causal). `unbounded` leaves a side open; negative sizes are a mask_error (attend.mask.window).
/// The sizes count keys besides the diagonal's own: Hugging Face's `sliding_window: W` (W keys including the
/// query's own) is sliding_window(W - 1, 0, d).
struct sliding_window_rule : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    index_t left = 0;           ///< keys before the diagonal a query also sees
    index_t right = 0;          ///< keys after the diagonal a query also sees
    attend::diagonal diagonal;  ///< where the diagonal runs, as for causal

    detail::bound_band bind(const attention_shape& s) const {
        return detail::bound_band::around(detail::bind_diagonal(diagonal, s, "sliding_window"), left, right,
                                          s.query_len, s.key_len);
    }
};
namespace detail {
inline void check_window(index_t left, index_t right, const char* rule) {
    if (left < 0 || right < 0)
        throw mask_error("attend.mask.window",
                         concat(rule, "(left ", left, ", right ", right,
                                ") needs sizes >= 0 (attend::unbounded for a side without a bound, ONNX's -1)"));
}
}  // namespace detail
/// The sliding window of `left` keys before and `right` keys after the diagonal `d`; either side may be
/// `unbounded`. Throws mask_error attend.mask.window for a negative size.
inline sliding_window_rule sliding_window(index_t left, index_t right, diagonal d) {
    detail::check_window(left, right, "sliding_window");
    return sliding_window_rule{{}, left, right, std::move(d)};
}
/// The window of a Hugging Face config's `sliding_window: W` (transformers' sliding_window_overlay: W keys, the
/// query's own included, so key j > i' - W) on diagonal `d`: sliding_window(W - 1, 0, d), without the off-by-one.
/// Throws mask_error attend.mask.window_from_config for W <= 0.
inline sliding_window_rule sliding_window_from_config(index_t window_keys, diagonal d) {
    return sliding_window(detail::window_left_from_config(window_keys), 0, std::move(d));
}

/// Chunked attention (Llama 4's local layers, transformers' chunked_overlay): the keys are cut into chunks of
/// chunk_size, and query i sees the keys of the chunk that holds its diagonal key i + offset (offset that of `d`, as
/// for causal; bottom_right in a decode). Same-chunk only, in both directions: Hugging Face's chunked mask
/// (chunked_causal_mask_function) is `causal(d) && chunked(C, d)`, so the causal part is written, not implied, and
/// `chunked` alone is the overlay (a bidirectional encoder's chunks). Chunks start at key 0 unless
/// with_left_padding says where each batch row's sequence starts.
struct chunked_rule : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    index_t chunk_size = 1;             ///< keys per chunk (> 0)
    attend::diagonal diagonal;          ///< where each query's own key is
    std::vector<index_t> left_padding;  ///< [batch] key where each row's chunks start; empty: key 0 for every row

    /// Row b's chunks start at key left_padding[b] (and every chunk_size keys before and after it): transformers'
    /// left_padding, the pad keys before a left-padded sequence, so its chunks count from its first real token.
    /// Any value is taken (only its value mod chunk_size matters): keys that start at position kv_offset of the
    /// sequence take left_padding - kv_offset. When bound, a count other than the batch is mask_error
    /// attend.mask.lengths_batch.
    chunked_rule with_left_padding(std::vector<index_t> pad_keys) const {
        auto r = *this;
        r.left_padding = std::move(pad_keys);
        return r;
    }

    detail::bound_chunked bind(const attention_shape& s) const {
        const detail::bound_diagonal d = detail::bind_diagonal(diagonal, s, "chunked");
        if (!left_padding.empty() && static_cast<index_t>(left_padding.size()) != s.batch)
            throw mask_error("attend.mask.lengths_batch",
                             detail::concat("chunked has ", left_padding.size(), " left padding counts for batch ",
                                            s.batch, " (one per batch row)"));
        const auto start_of = [&](index_t b) {
            return left_padding.empty() ? index_t(0) : left_padding[static_cast<std::size_t>(b)];
        };
        detail::bound_chunked rule;
        rule.chunk_size = chunk_size;
        rule.key_len = s.key_len;
        rule.row = detail::bound_chunked::row_of(d.offset, start_of(0), chunk_size);
        if (d.per_batch || !left_padding.empty()) {
            std::vector<std::array<index_t, 2>> rows(static_cast<std::size_t>(s.batch));
            for (index_t b = 0; b < s.batch; ++b)
                rows[static_cast<std::size_t>(b)] =
                    detail::bound_chunked::row_of(d.offset_of(b), start_of(b), chunk_size);
            rule.per_batch = std::make_shared<const std::vector<std::array<index_t, 2>>>(std::move(rows));
        }
        return rule;
    }
};
/// Same-chunk attention with chunks of `chunk_size` keys (a config's attention_chunk_size) and each query's own key
/// on diagonal `d`; combine with causal(d) for Hugging Face's chunked causal mask. Throws mask_error
/// attend.mask.chunk_size for chunk_size <= 0.
inline chunked_rule chunked(index_t chunk_size, diagonal d) {
    if (chunk_size <= 0)
        throw mask_error("attend.mask.chunk_size",
                         detail::concat("chunked chunk_size ", chunk_size, " needs at least 1 key per chunk"));
    return chunked_rule{{}, chunk_size, std::move(d), {}};
}

/// Prefix LM: every query sees the first prefix_len keys, and the rest causally (j <= i + offset as in causal).
struct prefix_lm_rule : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    index_t prefix_len = 0;     ///< keys every query sees
    attend::diagonal diagonal;  ///< the causal part's diagonal

    detail::bound_prefix_lm bind(const attention_shape& s) const {
        if (prefix_len > s.key_len)
            throw mask_error("attend.mask.prefix_len",
                             detail::concat("prefix_lm prefix_len ", prefix_len, " exceeds key_len ", s.key_len));
        detail::bound_prefix_lm rule;
        rule.prefix_len = prefix_len;
        rule.diagonal = detail::bind_diagonal(diagonal, s, "prefix_lm");
        rule.query_len = s.query_len;
        rule.key_len = s.key_len;
        return rule;
    }
};
/// The prefix LM rule with its causal part on diagonal `d`; throws mask_error attend.mask.prefix_len for a
/// negative prefix_len (and, when bound, for one beyond key_len).
inline prefix_lm_rule prefix_lm(index_t prefix_len, diagonal d) {
    if (prefix_len < 0)
        throw mask_error("attend.mask.prefix_len", detail::concat("prefix_lm prefix_len ", prefix_len, " is negative"));
    return prefix_lm_rule{{}, prefix_len, std::move(d)};
}

/// Bidirectional groups (transformers' blockwise_overlay; the image tokens of Gemma 3, PaliGemma or a Qwen-VL model):
/// `ids [batch, key_len]` give each key position a group id, -1 for none (text). Query i of batch row b is the token
/// at its diagonal key i + offset(b) (offset that of `d`; bottom_right in a decode, where the queries are the last
/// positions) and takes that position's group; a query of group g >= 0 sees every key of group g, before or after
/// it. A query of no group (-1, or a diagonal key outside the keys) sees nothing by this rule: `causal(d) ||
/// bidirectional_groups(ids, d)` is the multimodal pattern (text causal, each image bidirectional inside).
struct bidirectional_groups_rule : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    std::vector<index_t> ids;   ///< [batch, positions] row-major: the group of each key position, -1 for none
    index_t batch = 0;          ///< rows of ids
    index_t positions = 0;      ///< columns of ids: one per key
    attend::diagonal diagonal;  ///< where each query's own position is

    detail::bound_bidirectional_groups bind(const attention_shape& s) const {
        if (batch != s.batch || positions != s.key_len)
            throw mask_error("attend.mask.group_ids_shape",
                             detail::concat("bidirectional_groups ids ",
                                            detail::format_shape(std::array<index_t, 2>{batch, positions}),
                                            " must be [batch, key_len] = ",
                                            detail::format_shape(std::array<index_t, 2>{s.batch, s.key_len}),
                                            " (one group id per key position; queries take their diagonal key's)"));
        detail::bound_bidirectional_groups rule;
        rule.diagonal = detail::bind_diagonal(diagonal, s, "bidirectional_groups");
        rule.key_len = s.key_len;
        rule.ids = std::make_shared<const std::vector<index_t>>(ids);
        std::vector<index_t> run_end(ids.size());
        for (index_t b = 0; b < batch; ++b)
            for (index_t j = positions - 1; j >= 0; --j) {
                const auto at = static_cast<std::size_t>(b * positions + j);
                run_end[at] = j + 1 < positions && ids[at + 1] == ids[at] ? run_end[at + 1] : j + 1;
            }
        rule.run_end = std::make_shared<const std::vector<index_t>>(std::move(run_end));
        return rule;
    }
};
/// Bidirectional groups from a rank-2 integer tensor `ids [batch, key_len]` (transformers' block_sequence_ids, or
/// image group ids with -1 on text tokens) and the diagonal `d` that places each query on its own position. Throws
/// mask_error attend.mask.group_id for an id below -1, and attend.mask.group_ids_shape when bound to scores whose
/// batch or key_len differ from ids'.
template <class IntTensor>
bidirectional_groups_rule bidirectional_groups(const IntTensor& ids, diagonal d) {
    using traits = detail::tensor_traits<std::decay_t<IntTensor>>;
    static_assert(traits::supported, "attend: bidirectional_groups takes ids as a rank-2 attend::tensor of integers");
    if constexpr (traits::supported) {
        static_assert(traits::row_major && traits::rank == 2 && std::is_integral_v<typename traits::scalar> &&
                          !std::is_same_v<typename traits::scalar, bool>,
                      "attend: bidirectional_groups takes ids [batch, key_len] as a row-major rank-2 tensor of "
                      "integers (-1 for no group)");
    }
    const index_t batch = ids.dimension(0), positions = ids.dimension(1);
    std::vector<index_t> values(static_cast<std::size_t>(ids.size()));
    for (index_t n = 0; n < ids.size(); ++n) {
        const auto id = static_cast<index_t>(ids.data()[n]);
        if (id < -1)
            throw mask_error("attend.mask.group_id",
                             detail::concat("bidirectional_groups id ", id, " at [", n / positions, ',', n % positions,
                                            "] is below -1 (-1 = no group, groups are >= 0)"));
        values[static_cast<std::size_t>(n)] = id;
    }
    return bidirectional_groups_rule{{}, std::move(values), batch, positions, std::move(d)};
}

/// Key padding: in sequence b only keys j < lengths[b] exist. One length per batch entry, 0 <= length <= key_len.
struct key_padding_rule : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    std::vector<index_t> lengths;  ///< real keys of each sequence, one per batch entry

    detail::bound_key_padding bind(const attention_shape& s) const {
        detail::bound_key_padding rule;
        rule.lengths = detail::checked_lengths(lengths, s.batch, s.key_len, "key_padding", "key_len");
        return rule;
    }
};
/// Key padding by lengths: keys j >= lengths[b] of sequence b are padding.
inline key_padding_rule key_padding(std::vector<index_t> lengths) { return key_padding_rule{{}, std::move(lengths)}; }

/// Query padding: in sequence b queries i >= lengths[b] are padding. Their output and weight rows are zero and
/// lse is -inf whatever the empty-row policy, because masking keys never removes a padded query.
struct query_padding_rule : detail::boolean_term {
    static constexpr bool has_query_padding = true;
    std::vector<index_t> lengths;  ///< real queries of each sequence, one per batch entry

    detail::bound_query_padding bind(const attention_shape& s) const {
        detail::bound_query_padding rule;
        rule.lengths = detail::checked_lengths(lengths, s.batch, s.query_len, "query_padding", "query_len");
        rule.key_len = s.key_len;
        return rule;
    }
};
/// Query padding by lengths: queries i >= lengths[b] of sequence b are padding (zero output rows).
inline query_padding_rule query_padding(std::vector<index_t> lengths) {
    return query_padding_rule{{}, std::move(lengths)};
}

/// The lengths of packed sequences `[segments]`, in order (PyTorch nested-tensor sizes, per-sequence lengths).
/// Packed forms take lengths or offsets by name, so one cannot be read as the other.
struct segment_lengths {
    /// Names `lengths` as lengths.
    explicit segment_lengths(std::vector<index_t> lengths) : values(std::move(lengths)) {}
    std::vector<index_t> values;  ///< one length per segment
};

/// The offsets of packed sequences `[segments + 1]`: 0, then each segment's end (FlashAttention's cu_seqlens).
struct segment_offsets {
    /// Names `offsets` as offsets.
    explicit segment_offsets(std::vector<index_t> offsets) : values(std::move(offsets)) {}
    std::vector<index_t> values;  ///< ascending from 0, one more than the segments
};

namespace detail {

/// Lengths from offsets; mask_error `id` naming `rule` for offsets that are empty, do not start at 0 or descend.
inline std::vector<index_t> lengths_of(const std::vector<index_t>& offsets, const char* id, const char* rule) {
    if (offsets.empty() || offsets.front() != 0)
        throw mask_error(id, concat(rule, ": offsets must start at 0 (cu_seqlens)"));
    std::vector<index_t> lengths;
    for (std::size_t n = 1; n < offsets.size(); ++n) {
        if (offsets[n] < offsets[n - 1])
            throw mask_error(id, concat(rule, ": offsets must ascend, but offset ", n, " (", offsets[n], ") < offset ",
                                        n - 1, " (", offsets[n - 1], ')'));
        lengths.push_back(offsets[n] - offsets[n - 1]);
    }
    return lengths;
}

/// Offsets from lengths; mask_error `id` naming `rule` for a negative length or a sum past Eigen::Index.
inline std::vector<index_t> offsets_of(const std::vector<index_t>& lengths, const char* id, const char* rule) {
    std::vector<index_t> offsets{0};
    for (std::size_t n = 0; n < lengths.size(); ++n) {
        if (lengths[n] < 0) throw mask_error(id, concat(rule, ": length ", n, " (", lengths[n], ") is negative"));
        if (sum_overflows(offsets.back(), lengths[n]))
            throw mask_error(id, concat(rule, ": lengths overflow Eigen::Index at length ", n));
        offsets.push_back(offsets.back() + lengths[n]);
    }
    return offsets;
}

}  // namespace detail

/// Block diagonal for packed variable-length batches: the sequence axis holds sequences of the given lengths back
/// to back, and a query sees only keys of its own sequence. Needs query_len == key_len == sum of lengths.
struct block_diagonal_rule : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    std::vector<index_t> sequence_lengths;  ///< lengths of the packed sequences, in order

    detail::bound_block_diagonal bind(const attention_shape& s) const {
        std::vector<index_t> starts{0};
        for (index_t n : sequence_lengths) {
            if (n < 0)
                throw mask_error("attend.mask.block_lengths",
                                 detail::concat("block_diagonal sequence length ", n, " is negative"));
            if (detail::sum_overflows(starts.back(), n) || starts.back() + n > s.query_len)
                throw mask_error("attend.mask.block_lengths",
                                 detail::concat("block_diagonal sequence lengths sum past query_len ", s.query_len,
                                                " at sequence ", starts.size() - 1,
                                                " (packed sequences need the "
                                                "lengths to sum to query_len == key_len)"));
            starts.push_back(starts.back() + n);
        }
        if (starts.back() != s.query_len || starts.back() != s.key_len)
            throw mask_error("attend.mask.block_lengths",
                             detail::concat("block_diagonal sequence lengths sum to ", starts.back(),
                                            " but query_len is ", s.query_len, " and key_len is ", s.key_len,
                                            " (packed sequences need all three equal)"));
        detail::bound_block_diagonal rule;
        rule.starts = std::make_shared<const std::vector<index_t>>(std::move(starts));
        return rule;
    }
};
/// The block-diagonal rule of packed sequences of the given lengths.
inline block_diagonal_rule block_diagonal(segment_lengths lengths) {
    return block_diagonal_rule{{}, std::move(lengths.values)};
}
/// The block-diagonal rule of packed sequences at the given offsets (cu_seqlens). Throws mask_error
/// attend.mask.block_lengths for offsets that do not start at 0 or descend.
inline block_diagonal_rule block_diagonal(const segment_offsets& offsets) {
    return block_diagonal_rule{{}, detail::lengths_of(offsets.values, "attend.mask.block_lengths", "block_diagonal")};
}

/// Packed variable-length sequences with their own query and key segments (FlashAttention's varlen
/// cu_seqlens_q / cu_seqlens_k, xFormers' BlockDiagonalMask and its padded-keys form): the query axis holds
/// segment slots back to back at query_offsets, the key axis at key_offsets (n + 1 ascending offsets from 0 for n
/// segments, the last <= query_len / key_len), and the queries of slot n see only the keys of slot n. Optional
/// real lengths per segment leave padding at the end of a slot: padded queries (and every query past the last
/// slot) get zero rows, padded keys are never seen. `.causal(a)` and `.window(left, right, a)` restrict each
/// segment to a band around its own diagonal, aligned top-left (segment query i' sees key j' <= i') or
/// bottom-right (j' <= i' + real keys - real queries, as when a segment decodes over its cache). Tiles that
/// cross no segment's band are skipped. Bad offsets or lengths: mask_error attend.mask.segments when bound.
struct packed_segments_rule : detail::boolean_term {
    static constexpr bool has_query_padding = true;
    std::vector<index_t> query_offsets;  ///< cu_seqlens_q: [segments + 1]
    std::vector<index_t> key_offsets;    ///< cu_seqlens_k: [segments + 1]
    std::vector<index_t> query_lengths;  ///< [segments] real queries at the start of each slot; empty: the slots
    std::vector<index_t> key_lengths;    ///< [segments] real keys at the start of each slot; empty: the slots
    /// Keys before each segment's diagonal a query sees (unbounded unless causal or windowed).
    index_t left = std::numeric_limits<index_t>::max();
    index_t right = std::numeric_limits<index_t>::max();  ///< keys after it (unbounded unless causal or windowed)
    alignment align = alignment::top_left;                ///< the corner of each segment its diagonal starts from

    /// Causal within each segment, aligned at corner `a` of the segment.
    packed_segments_rule causal(alignment a) const {
        auto r = *this;
        r.left = std::numeric_limits<index_t>::max();
        r.right = 0;
        r.align = a;
        return r;
    }
    /// A sliding window within each segment: segment query i' sees keys j' with d - left <= j' <= d + right, d the
    /// diagonal of alignment `a` (as sliding_window, per segment; either side may be `unbounded`). Negative sizes:
    /// mask_error attend.mask.window.
    packed_segments_rule window(index_t left_keys, index_t right_keys, alignment a) const {
        detail::check_window(left_keys, right_keys, "packed_segments window");
        auto r = *this;
        r.left = left_keys;
        r.right = right_keys;
        r.align = a;
        return r;
    }
    /// Real lengths per segment; the rest of each slot is padding.
    packed_segments_rule with_lengths(std::vector<index_t> real_queries, std::vector<index_t> real_keys) const {
        auto r = *this;
        r.query_lengths = std::move(real_queries);
        r.key_lengths = std::move(real_keys);
        return r;
    }

    detail::bound_packed_segments bind(const attention_shape& s) const {
        const auto fail = [](const std::string& why) {
            throw mask_error("attend.mask.segments", "packed_segments: " + why);
        };
        const std::size_t n = query_offsets.empty() ? 0 : query_offsets.size() - 1;
        if (query_offsets.size() < 2 || key_offsets.size() != query_offsets.size())
            fail(detail::concat("needs n + 1 >= 2 query offsets and as many key offsets (cu_seqlens style), got ",
                                query_offsets.size(), " and ", key_offsets.size()));
        const auto check_offsets = [&](const std::vector<index_t>& o, index_t len, const char* axis) {
            if (o[0] != 0) fail(detail::concat(axis, " offsets must start at 0, got ", o[0]));
            for (std::size_t k = 1; k < o.size(); ++k)
                if (o[k] < o[k - 1])
                    fail(detail::concat(axis, " offsets must not decrease: ", o[k - 1], " then ", o[k], " at ", k));
            if (o.back() > len) fail(detail::concat(axis, " offsets end at ", o.back(), " past ", axis, "_len ", len));
        };
        check_offsets(query_offsets, s.query_len, "query");
        check_offsets(key_offsets, s.key_len, "key");
        const auto real = [&](const std::vector<index_t>& lengths, const std::vector<index_t>& o, const char* axis) {
            if (lengths.empty()) return std::vector<index_t>(o.begin() + 1, o.end());
            if (lengths.size() != n) fail(detail::concat(lengths.size(), " ", axis, " lengths for ", n, " segments"));
            std::vector<index_t> end(n);
            for (std::size_t k = 0; k < n; ++k) {
                if (lengths[k] < 0 || lengths[k] > o[k + 1] - o[k])
                    fail(detail::concat(axis, " length ", lengths[k], " of segment ", k, " is outside [0, ",
                                        o[k + 1] - o[k], "], its slot"));
                end[k] = o[k] + lengths[k];
            }
            return end;
        };
        auto layout = std::make_shared<detail::packed_layout>();
        layout->query_slots = query_offsets;
        layout->query_end = real(query_lengths, query_offsets, "query");
        layout->key_begin.assign(key_offsets.begin(), key_offsets.end() - 1);
        layout->key_end = real(key_lengths, key_offsets, "key");
        layout->diagonal.resize(n);
        for (std::size_t k = 0; k < n; ++k) {
            const index_t shift = align == alignment::bottom_right ? (layout->key_end[k] - key_offsets[k]) -
                                                                         (layout->query_end[k] - query_offsets[k])
                                                                   : 0;
            layout->diagonal[k] = key_offsets[k] + shift;
        }
        const index_t cap = s.query_len + s.key_len;  // wider bands see no more, and the arithmetic stays in range
        layout->left = std::min(left, cap);
        layout->right = std::min(right, cap);
        detail::bound_packed_segments rule;
        rule.layout = std::move(layout);
        return rule;
    }
};
/// Packed segments from cu_seqlens-style offsets (n + 1 each, from 0): query slot n is
/// [query_offsets[n], query_offsets[n + 1]) and sees key slot n; see packed_segments_rule.
inline packed_segments_rule packed_segments(segment_offsets query_offsets, segment_offsets key_offsets) {
    packed_segments_rule r;
    r.query_offsets = std::move(query_offsets.values);
    r.key_offsets = std::move(key_offsets.values);
    return r;
}
/// Packed segments from their lengths: query segment n holds query_lengths[n] queries, key segment n
/// key_lengths[n] keys, back to back from 0. Throws mask_error attend.mask.segments for a negative length or a sum
/// past Eigen::Index.
inline packed_segments_rule packed_segments(const segment_lengths& query_lengths, const segment_lengths& key_lengths) {
    packed_segments_rule r;
    r.query_offsets = detail::offsets_of(query_lengths.values, "attend.mask.segments", "packed_segments");
    r.key_offsets = detail::offsets_of(key_lengths.values, "attend.mask.segments", "packed_segments");
    return r;
}

/// a && b: allowed where both allow.
template <class A, class B>
struct mask_and : detail::boolean_term {
    static constexpr bool has_query_padding = A::has_query_padding || B::has_query_padding;
    A a;  ///< left operand
    B b;  ///< right operand
    auto bind(const attention_shape& s) const {
        using bound = detail::bound_intersection<decltype(a.bind(s)), decltype(b.bind(s))>;
        return bound{a.bind(s), b.bind(s)};
    }
};

/// a || b: allowed where either allows.
template <class A, class B>
struct mask_or : detail::boolean_term {
    static constexpr bool has_query_padding = A::has_query_padding && B::has_query_padding;
    A a;  ///< left operand
    B b;  ///< right operand
    auto bind(const attention_shape& s) const {
        using bound = detail::bound_union<decltype(a.bind(s)), decltype(b.bind(s))>;
        return bound{a.bind(s), b.bind(s)};
    }
};

/// !a: allowed where a forbids.
template <class A>
struct mask_not : detail::boolean_term {
    static constexpr bool has_query_padding = false;
    A a;  ///< operand
    auto bind(const attention_shape& s) const {
        using bound = detail::bound_complement<decltype(a.bind(s))>;
        return bound{a.bind(s)};
    }
};

/// a + b: additive terms add; a Boolean term contributes 0 where allowed and -inf where not.
template <class A, class B>
struct mask_sum : detail::additive_term {
    static constexpr bool has_query_padding = A::has_query_padding || B::has_query_padding;
    A a;  ///< left operand
    B b;  ///< right operand
    auto bind(const attention_shape& s) const {
        using bound = detail::bound_intersection<decltype(a.bind(s)), decltype(b.bind(s))>;
        return bound{a.bind(s), b.bind(s)};
    }
};

namespace detail {

/// Compile-time checks of an operand of && || !, with the message saying which conversion to call.
template <class E>
constexpr void require_allowed_operand() {
    static_assert(!is_forbidden_v<E>,
                  "attend: a forbidden_mask (true = blocked) is not an allowed set; convert it explicitly with "
                  "attend::to_allowed(mask) before combining it with && || !");
    static_assert(!is_additive_v<E>, "attend: additive masks combine with +, not with && || !");
    static_assert(is_mask_like_v<E>, "attend: && || ! combine attend masks only (allowed_mask, causal(...), ...)");
}

template <class E>
constexpr void require_sum_operand() {
    static_assert(!is_forbidden_v<E>,
                  "attend: a forbidden_mask (true = blocked) cannot enter an additive expression; convert it "
                  "explicitly with attend::to_allowed(mask)");
    static_assert(is_mask_v<E>, "attend: + combines attend masks only (additive_mask, allowed sets)");
}

template <class A, class B>
inline constexpr bool any_mask_like_v = is_mask_like_v<A> || is_mask_like_v<B>;

}  // namespace detail

/// Intersection of two allowed sets.
template <class A, class B, std::enable_if_t<detail::any_mask_like_v<A, B>, int> = 0>
auto operator&&(const A& a, const B& b) {
    detail::require_allowed_operand<A>();
    detail::require_allowed_operand<B>();
    return mask_and<A, B>{{}, a, b};
}

/// Union of two allowed sets.
template <class A, class B, std::enable_if_t<detail::any_mask_like_v<A, B>, int> = 0>
auto operator||(const A& a, const B& b) {
    detail::require_allowed_operand<A>();
    detail::require_allowed_operand<B>();
    return mask_or<A, B>{{}, a, b};
}

/// Complement of an allowed set.
template <class A, std::enable_if_t<detail::is_mask_like_v<A>, int> = 0>
auto operator!(const A& a) {
    detail::require_allowed_operand<A>();
    static_assert(!A::has_query_padding,
                  "attend: query_padding marks padded queries; its complement has no meaning, apply it with && "
                  "outside the negation");
    return mask_not<A>{{}, a};
}

/// Sum of additive terms; at least one side is additive (for two allowed sets use &&).
template <class A, class B, std::enable_if_t<detail::any_mask_like_v<A, B>, int> = 0>
auto operator+(const A& a, const B& b) {
    detail::require_sum_operand<A>();
    detail::require_sum_operand<B>();
    static_assert(detail::is_additive_v<A> || detail::is_additive_v<B>,
                  "attend: + needs an additive term; intersect two allowed sets with &&");
    return mask_sum<A, B>{{}, a, b};
}

namespace detail {

/// A type attention takes as its mask: an allowed set or an additive expression.
template <class Mask>
inline constexpr bool is_attention_mask_v = !is_forbidden_v<Mask> && is_mask_v<Mask>;

/// The compile-time gate of every function that takes a mask, with the message naming the conversion. Returns
/// whether Mask passed, so a caller guards its body with `if constexpr (require_mask<Mask>())` and the message is
/// the only error the compiler prints.
template <class Mask>
constexpr bool require_mask() {
    static_assert(!is_forbidden_v<Mask>,
                  "attend: attention takes allowed sets; a forbidden_mask (true = blocked) must be converted "
                  "explicitly with attend::to_allowed(mask)");
    static_assert(is_forbidden_v<Mask> || is_mask_v<Mask>,
                  "attend: the mask argument must be an attend mask: wrap Boolean tensors with "
                  "allowed_mask::from_torch_sdpa / forbidden_mask::from_torch_mha (a rank-2 [query_len, key_len] "
                  "grid with query_key_grid), float tensors with additive_mask<T>::from_values, or use a rule such "
                  "as causal(alignment::top_left)");
    return is_attention_mask_v<Mask>;
}

/// The score shape as an attention shape with one-element heads. Throws shape_error attend.shape.negative or
/// attend.shape.overflow for a size below 0 or sizes whose product overflows Eigen::Index.
inline attention_shape scores_only(const score_shape& s) {
    require_valid_sizes(std::array<index_t, 4>{s.batch, s.heads, s.query_len, s.key_len}, "score shape");
    attention_shape a;
    a.batch = s.batch;
    a.heads = s.heads;
    a.kv_heads = s.heads;
    a.query_len = s.query_len;
    a.key_len = s.key_len;
    a.head_dim = 1;
    a.value_dim = 1;
    a.rank = 4;
    return a;
}

}  // namespace detail

/// The allowed set of a mask expression as a dense allowed_mask `[batch, heads, query_len, key_len]`, for
/// inspection and tests. Additive expressions give their support (entries other than -inf). Throws shape_error
/// attend.shape.negative / attend.shape.overflow for a bad shape, resource_error attend.resource.allocation when
/// the dense mask cannot be allocated, and the mask's own binding errors.
template <class Mask>
allowed_mask materialize(const Mask& mask, const score_shape& shape) {
    if constexpr (detail::require_mask<Mask>()) {
        const auto bound = mask.bind(detail::scores_only(shape));
        tensor<bool, 4> dense;
        const std::array<index_t, 4> dims{shape.batch, shape.heads, shape.query_len, shape.key_len};
        detail::resize_guarded(dense, dims, "materialized mask", "Materialize a smaller score shape");
        for (index_t b = 0; b < shape.batch; ++b)
            for (index_t h = 0; h < shape.heads; ++h)
                for (index_t i = 0; i < shape.query_len; ++i)
                    for (index_t j = 0; j < shape.key_len; ++j) dense(b, h, i, j) = bound.allowed(b, h, i, j);
        return allowed_mask::true_means_allowed(dense);
    }
}

/// Tile classification of a mask expression for one shape, as the kernels see it. Throws shape_error
/// attend.shape.tile if the tile is not inside the shape, and what materialize throws for the shape.
template <class Mask>
tile_class classify(const Mask& mask, const score_shape& shape, const tile& t) {
    if constexpr (detail::require_mask<Mask>()) {
        const auto bound = mask.bind(detail::scores_only(shape));
        const bool inside = t.batch >= 0 && t.batch < shape.batch && t.head >= 0 && t.head < shape.heads &&
                            t.query_begin >= 0 && t.query_begin <= t.query_end && t.query_end <= shape.query_len &&
                            t.key_begin >= 0 && t.key_begin <= t.key_end && t.key_end <= shape.key_len;
        if (!inside)
            throw shape_error("attend.shape.tile",
                              detail::concat("tile {batch ", t.batch, ", head ", t.head, ", queries [", t.query_begin,
                                             ", ", t.query_end, "), keys [", t.key_begin, ", ", t.key_end,
                                             ")} is not inside the score shape [", shape.batch, ',', shape.heads, ',',
                                             shape.query_len, ',', shape.key_len, ']'));
        return bound.classify(t);
    }
}

/// Draws the allowed grid, one line per query (`q0: k0`, `q1: k0 k1`, ...); padded queries read `(padded)`,
/// queries with no allowed key `(none)`. With several batches or heads each grid gets a `batch b, head h:` line.
template <class Mask>
std::string to_string(const Mask& mask, const score_shape& shape) {
    if constexpr (detail::require_mask<Mask>()) {
        const auto bound = mask.bind(detail::scores_only(shape));
        std::ostringstream s;
        for (index_t b = 0; b < shape.batch; ++b)
            for (index_t h = 0; h < shape.heads; ++h) {
                if (shape.batch * shape.heads > 1) s << "batch " << b << ", head " << h << ":\n";
                for (index_t i = 0; i < shape.query_len; ++i) {
                    s << 'q' << i << ':';
                    if (bound.query_padded(b, i)) {
                        s << " (padded)\n";
                        continue;
                    }
                    bool any = false;
                    for (index_t j = 0; j < shape.key_len; ++j)
                        if (bound.allowed(b, h, i, j)) {
                            s << " k" << j;
                            any = true;
                        }
                    s << (any ? "\n" : " (none)\n");
                }
            }
        return s.str();
    }
}

}  // namespace attend
