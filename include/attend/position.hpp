// SPDX-License-Identifier: MIT
#pragma once
/// Position information for attention: absolute tables (sinusoidal, learned), rotary embeddings applied to
/// q and k, T5's bucketed relative-position bias and ALiBi slopes. Everything that can fail validates before it
/// writes, so a throw leaves the caller's tensors as they were.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "detail/checked_arithmetic.hpp"
#include "detail/memory.hpp"
#include "detail/random.hpp"
#include "error.hpp"
#include "tensor.hpp"

namespace attend {

namespace detail {
namespace position_init {

template <class T>
void fill_standard_normal(tensor<T, 2>& table, std::uint64_t seed) {
    const index_t n = table.size();
    T* data = table.data();
    for (index_t k = 0; k < n; ++k) data[k] = static_cast<T>(counter_normal(seed, static_cast<std::uint64_t>(k)));
}

}  // namespace position_init

template <class T>
constexpr void require_position_scalar() {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "attend: position embeddings are defined for float and double");
}

}  // namespace detail

/// The Transformer paper's sinusoidal table `[length, dim]`: PE[p, 2i] = sin(p / 10000^(2i/dim)),
/// PE[p, 2i+1] = cos(p / 10000^(2i/dim)) (sin and cos interleaved). Angles are computed in double and rounded
/// once to T. An odd dim is allowed; its last column is a sin. length may be 0 (empty table).
/// Throws value_error `attend.value.position_dim` if dim < 1 and `attend.value.position_length` if length < 0,
/// shape_error `attend.shape.overflow` if length x dim overflows Eigen::Index and resource_error
/// `attend.resource.allocation` if the table cannot be allocated.
template <class T = double>
tensor<T, 2> sinusoidal_positions(index_t length, index_t dim) {
    detail::require_position_scalar<T>();
    if (dim < 1)
        throw value_error("attend.value.position_dim", detail::concat("sinusoidal positions need dim >= 1, got dim ",
                                                                      dim, " (length ", length, ')'));
    if (length < 0)
        throw value_error("attend.value.position_length",
                          detail::concat("sinusoidal positions need length >= 0, got length ", length, " (dim ", dim,
                                         ')'));
    detail::require_valid_sizes(std::array<index_t, 2>{length, dim}, "sinusoidal table [length, dim]");
    tensor<T, 2> table;
    detail::resize_guarded(table, std::array<index_t, 2>{length, dim}, "sinusoidal table [length, dim]",
                           "Ask for a shorter table");
    if (length == 0) return table;
    std::vector<double> inv_freq(static_cast<std::size_t>((dim + 1) / 2));
    for (index_t i = 0; 2 * i < dim; ++i)
        inv_freq[static_cast<std::size_t>(i)] =
            1.0 / std::pow(10000.0, static_cast<double>(2 * i) / static_cast<double>(dim));
    for (index_t p = 0; p < length; ++p) {
        for (index_t i = 0; 2 * i < dim; ++i) {
            const double angle = static_cast<double>(p) * inv_freq[static_cast<std::size_t>(i)];
            table(p, 2 * i) = static_cast<T>(std::sin(angle));
            if (2 * i + 1 < dim) table(p, 2 * i + 1) = static_cast<T>(std::cos(angle));
        }
    }
    return table;
}

/// A learned absolute-position table `[max_len, dim]`, initialised N(0, 1) like torch.nn.Embedding from a
/// deterministic counter-based generator seeded by `seed` (splitmix64 + Box-Muller, identical on every
/// platform; it does not reproduce torch's stream: load trained weights through `table()`).
/// A position outside [0, max_len) is a position_error, never a silent wrap.
template <class T>
class learned_positions {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "attend: learned_positions<T> is defined for float and double");

public:
    /// Table `[max_len, dim]` filled with N(0, 1) draws from `seed`.
    /// Throws value_error `attend.value.position_max_len` if max_len < 1, `attend.value.position_dim` if dim < 1.
    learned_positions(index_t max_len, index_t dim, std::uint64_t seed = 0) {
        if (max_len < 1)
            throw value_error("attend.value.position_max_len",
                              detail::concat("learned positions need max_len >= 1, got max_len ", max_len, " (dim ",
                                             dim, ')'));
        if (dim < 1)
            throw value_error("attend.value.position_dim", detail::concat("learned positions need dim >= 1, got dim ",
                                                                          dim, " (max_len ", max_len, ')'));
        detail::require_valid_sizes(std::array<index_t, 2>{max_len, dim}, "learned position table [max_len, dim]");
        detail::resize_guarded(table_, std::array<index_t, 2>{max_len, dim}, "learned position table [max_len, dim]",
                               "Choose a smaller max_len");
        detail::position_init::fill_standard_normal(table_, seed);
    }

    /// Number of positions the table holds (rows).
    index_t max_len() const { return table_.dimension(0); }
    /// Embedding width (columns).
    index_t dim() const { return table_.dimension(1); }

    /// The table `[max_len, dim]`, row p is position p. Writable so trained weights can be loaded; keep its shape.
    tensor<T, 2>& table() { return table_; }
    /// The table `[max_len, dim]`, row p is position p.
    const tensor<T, 2>& table() const { return table_; }

    /// Rows offset .. offset + length - 1 of the table, as `[length, dim]`.
    /// Throws position_error `attend.position.past_table` if offset < 0 or offset + length > max_len,
    /// value_error `attend.value.position_length` if length < 0.
    tensor<T, 2> lookup(index_t offset, index_t length) const {
        check_range(offset, length);
        tensor<T, 2> out(length, dim());
        const index_t d = dim();
        const T* src = table_.data() + offset * d;
        T* dst = out.data();
        for (index_t k = 0; k < length * d; ++k) dst[k] = src[k];
        return out;
    }

    /// Adds the rows for positions offset .. offset + len - 1 to x `[batch, len, dim]` in place (every batch
    /// entry gets the same rows). Throws shape_error `attend.shape.position_dim` if x's dim != dim(),
    /// position_error `attend.position.past_table` if offset < 0 or offset + len > max_len; x is untouched then.
    void add_to(tensor<T, 3>& x, index_t offset) const {
        if (x.dimension(2) != dim())
            throw shape_error("attend.shape.position_dim",
                              detail::concat("x [batch, len, dim] has dim ", x.dimension(2),
                                             " but the position table has dim ", dim(), " (x ",
                                             detail::format_shape(x.dimensions()), ", table ",
                                             detail::format_shape(table_.dimensions()), ')'));
        const index_t len = x.dimension(1);
        check_range(offset, len);
        const index_t d = dim();
        const T* rows = table_.data() + offset * d;
        for (index_t b = 0; b < x.dimension(0); ++b) {
            T* xb = x.data() + b * len * d;
            for (index_t k = 0; k < len * d; ++k) xb[k] += rows[k];
        }
    }

private:
    // The conditions stay inline and the throws out of line, so the compiler sees that the copy after a
    // check only runs for positions inside the table.
    void check_range(index_t offset, index_t length) const {
        if (length < 0) throw_negative_length(offset, length);
        // offset > max_len - length, not offset + length > max_len: the sum may overflow, the difference cannot.
        if (offset < 0 || offset > max_len() - length) throw_past_table(offset, length);
    }

    [[noreturn]] static void throw_negative_length(index_t offset, index_t length) {
        throw value_error("attend.value.position_length",
                          detail::concat("a position range needs length >= 0, got length ", length, " (offset ", offset,
                                         ')'));
    }

    [[noreturn]] void throw_past_table(index_t offset, index_t length) const {
        if (offset < 0)
            throw position_error("attend.position.past_table",
                                 detail::concat("position ", offset,
                                                " is negative; the learned table holds positions "
                                                "0 .. ",
                                                max_len() - 1, " (max_len ", max_len(), ')'));
        throw position_error("attend.position.past_table",
                             detail::concat("position ", offset > max_len() ? offset : max_len(),
                                            " is past the learned table of max_len ", max_len(), " (", length,
                                            " positions requested from offset ", offset, "); positions never wrap"));
    }

    tensor<T, 2> table_;
};

/// How rotary embeddings pair features. half_split (GPT-NeoX, LLaMA's rotate_half): feature i with i + dim/2.
/// interleaved (GPT-J, the RoFormer paper): feature 2i with 2i + 1.
enum class rotary_layout { half_split, interleaved };

/// Rotary position embedding (RoPE): rotates pairs of the first `dim` features of each q or k head vector by
/// the angle position * base^(-2i/dim), i = 0 .. dim/2 - 1, so q·k depends only on the relative position.
/// Features >= dim are untouched (partial rotary, GPT-NeoX's rotary_pct). Angles, sin and cos are computed in
/// double per call; nothing is cached between calls.
struct rotary_embedding {
    index_t dim = 0;                                   ///< rotated features per head; even, 1 .. head_dim
    double base = 10000;                               ///< frequency base, finite and > 0
    rotary_layout layout = rotary_layout::half_split;  ///< which features pair up

    /// Rotates x `[batch, heads, len, head_dim]` in place; row i has position position_offset + i (the number
    /// of tokens before it, e.g. the KV-cache length when decoding).
    /// Throws value_error `attend.value.rotary_dim` (dim odd or <= 0), `attend.value.rotary_base` (base <= 0
    /// or non-finite), shape_error `attend.shape.rotary_dim` (dim > head_dim), position_error
    /// `attend.position.negative_offset` (position_offset < 0). x is untouched when it throws.
    template <class T>
    void apply(strided_view<T> x, index_t position_offset) const {
        rotate(x, position_offset, 1.0);
    }
    /// apply for a `[batch, heads, len, head_dim]` tensor.
    template <class T>
    void apply(tensor<T, 4>& x, index_t position_offset) const {
        rotate(detail::as_mutable_view(x), position_offset, 1.0);
    }
    /// apply for a one-head `[batch, len, head_dim]` tensor.
    template <class T>
    void apply(tensor<T, 3>& x, index_t position_offset) const {
        rotate(detail::as_mutable_view(x), position_offset, 1.0);
    }

    /// The inverse (= transpose) rotation, by -angle: undoes apply, and maps gradients with respect to the
    /// rotated q/k back to gradients with respect to the inputs. Same shapes and errors as apply.
    template <class T>
    void apply_inverse(strided_view<T> x, index_t position_offset) const {
        rotate(x, position_offset, -1.0);
    }
    /// apply_inverse for a `[batch, heads, len, head_dim]` tensor.
    template <class T>
    void apply_inverse(tensor<T, 4>& x, index_t position_offset) const {
        rotate(detail::as_mutable_view(x), position_offset, -1.0);
    }
    /// apply_inverse for a one-head `[batch, len, head_dim]` tensor.
    template <class T>
    void apply_inverse(tensor<T, 3>& x, index_t position_offset) const {
        rotate(detail::as_mutable_view(x), position_offset, -1.0);
    }

    /// Checks dim, base, head_dim and position_offset without touching any data; apply calls it first.
    void validate(index_t head_dim, index_t position_offset) const {
        if (dim <= 0 || dim % 2 != 0)
            throw value_error("attend.value.rotary_dim",
                              detail::concat("rotary dim must be even and >= 2 (features rotate in pairs), got ", dim,
                                             " (head_dim ", head_dim, ')'));
        if (!(base > 0) || !std::isfinite(base))
            throw value_error("attend.value.rotary_base",
                              detail::concat("rotary base must be finite and > 0, got ", base));
        if (dim > head_dim)
            throw shape_error("attend.shape.rotary_dim",
                              detail::concat("rotary dim ", dim, " > head_dim ", head_dim,
                                             " (only the first dim features of a head rotate)"));
        if (position_offset < 0)
            throw position_error("attend.position.negative_offset",
                                 detail::concat("rotary position_offset must be >= 0, got ", position_offset));
    }

private:
    /// base^(-2i / dim) for i < dim / 2, kept by the calling thread for the (dim, base) it was last asked for: a
    /// decode step rotates one position of q and of k, and its dim / 2 pows had cost as much as the rotation.
    static const std::vector<double>& inverse_frequencies(index_t dim, double base) {
        thread_local std::vector<double> kept;
        thread_local index_t kept_dim = 0;
        thread_local double kept_base = 0;
        if (dim != kept_dim || base != kept_base) {
            std::vector<double> fresh(static_cast<std::size_t>(dim / 2));
            for (std::size_t i = 0; i < fresh.size(); ++i)
                fresh[i] = std::pow(base, -static_cast<double>(2 * i) / static_cast<double>(dim));
            kept.swap(fresh);
            kept_dim = dim;
            kept_base = base;
        }
        return kept;
    }

    template <class T>
    void rotate(strided_view<T> x, index_t position_offset, double direction) const {
        static_assert(is_storage_type_v<T>,
                      "attend: rotary embeddings are defined for float, double, Eigen::half and Eigen::bfloat16");
        using Acc = accumulator_t<T>;  // 16-bit features rotate in float and are rounded back once
        validate(x.dims[3], position_offset);
        ATTEND_ASSERT(x.strides[3] == 1);
        const index_t half = dim / 2;
        const auto h = static_cast<std::size_t>(half);
        const std::vector<double>& inv_freq = inverse_frequencies(dim, base);
        std::vector<Acc> cos_row(h), sin_row(h);
        // Features a[i] and b[i] form pair i: (x[i], x[i + half]) or (x[2i], x[2i + 1]).
        const index_t first_step = layout == rotary_layout::half_split ? 1 : 2;
        const index_t second_offset = layout == rotary_layout::half_split ? half : 1;
        for (index_t i = 0; i < x.dims[2]; ++i) {
            const double position = static_cast<double>(position_offset) + static_cast<double>(i);
            for (std::size_t k = 0; k < h; ++k) {
                const double angle = position * inv_freq[k];
                cos_row[k] = static_cast<Acc>(std::cos(angle));
                sin_row[k] = static_cast<Acc>(direction * std::sin(angle));
            }
            for (index_t b = 0; b < x.dims[0]; ++b) {
                for (index_t hd = 0; hd < x.dims[1]; ++hd) {
                    T* row = x.row(b, hd, i);
                    for (index_t k = 0; k < half; ++k) {
                        T& first = row[k * first_step];
                        T& second = row[k * first_step + second_offset];
                        const Acc c = cos_row[static_cast<std::size_t>(k)];
                        const Acc s = sin_row[static_cast<std::size_t>(k)];
                        const Acc a = static_cast<Acc>(first), bb = static_cast<Acc>(second);
                        first = static_cast<T>(a * c - bb * s);
                        second = static_cast<T>(bb * c + a * s);
                    }
                }
            }
        }
    }
};

/// T5's bucket of a relative position (relative_position = key_position - query_position), exactly as
/// HuggingFace's `T5Attention._relative_position_bucket` / Mesh TensorFlow compute it. bidirectional: half of
/// the buckets for keys after the query (offset by num_buckets/2), half for keys at or before it;
/// unidirectional: keys after the query all fall into bucket 0. Within a half of n buckets, distances below
/// n/2 get their own bucket and larger ones share log-spaced buckets up to max_distance, clamped to the last.
/// The log branch is computed in single precision because the original computes it in float32 and truncates
/// (`max_exact + (log(d / max_exact) / log(max_distance / max_exact) * (n - max_exact)).to(long)`): at
/// distances where the exact value is an integer, double rounding could land on the other side and give a
/// different bucket than the trained model saw.
/// Throws value_error `attend.value.bucket_config` if num_buckets < 2 (< 4 or odd when bidirectional) or
/// max_distance <= num_buckets' exact range (max_exact).
inline index_t relative_position_bucket(index_t relative_position, bool bidirectional, index_t num_buckets = 32,
                                        index_t max_distance = 128) {
    const index_t half = bidirectional ? num_buckets / 2 : num_buckets;
    const index_t max_exact = half / 2;
    if (num_buckets < 2 || (bidirectional && (num_buckets % 2 != 0 || num_buckets < 4)))
        throw value_error("attend.value.bucket_config",
                          detail::concat("num_buckets must be >= 2, and even and >= 4 when bidirectional; got ",
                                         num_buckets, (bidirectional ? " (bidirectional)" : " (unidirectional)")));
    if (max_distance <= max_exact)
        throw value_error("attend.value.bucket_config",
                          detail::concat("max_distance ", max_distance, " must exceed the exact range max_exact ",
                                         max_exact, " (num_buckets ", num_buckets,
                                         bidirectional ? ", bidirectional)" : ", unidirectional)"));
    index_t bucket = 0;
    index_t distance = 0;
    const bool most_negative = relative_position == std::numeric_limits<index_t>::min();
    if (bidirectional) {
        if (relative_position > 0) bucket += half;
        distance = most_negative ? std::numeric_limits<index_t>::max()
                                 : (relative_position < 0 ? -relative_position : relative_position);
    } else {
        distance = relative_position >= 0 ? 0
                                          : (most_negative ? std::numeric_limits<index_t>::max() : -relative_position);
    }
    if (distance < max_exact) return bucket + distance;
    // float32 as in the original: log(d / max_exact) / float(log(max_distance / max_exact)) * (n - max_exact).
    const float ratio = static_cast<float>(distance) / static_cast<float>(max_exact);
    const auto log_range =
        static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)));
    const float scaled = std::log(ratio) / log_range * static_cast<float>(half - max_exact);
    index_t large = half - 1;
    if (scaled < static_cast<float>(half))  // beyond that the clamp applies; avoids converting huge floats
        large = std::min(half - 1, max_exact + static_cast<index_t>(scaled));
    return bucket + large;
}

/// T5's learned relative-position bias: a table `[num_buckets, heads]` (T5's nn.Embedding(num_buckets, heads)
/// layout, so weights load 1:1) indexed by relative_position_bucket(key - query). Initialised N(0, 1) from
/// `seed` like learned_positions.
template <class T>
class relative_position_bias {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "attend: relative_position_bias<T> is defined for float and double");

public:
    /// Throws value_error `attend.value.bias_heads` if heads < 1 and `attend.value.bucket_config` for a bucket
    /// configuration relative_position_bucket rejects.
    relative_position_bias(index_t heads, bool bidirectional, index_t num_buckets = 32, index_t max_distance = 128,
                           std::uint64_t seed = 0)
        : bidirectional_(bidirectional), max_distance_(max_distance) {
        if (heads < 1)
            throw value_error("attend.value.bias_heads",
                              detail::concat("relative position bias needs heads >= 1, got ", heads));
        relative_position_bucket(0, bidirectional, num_buckets, max_distance);  // validates the configuration
        detail::require_valid_sizes(std::array<index_t, 2>{num_buckets, heads},
                                    "relative position bias table [num_buckets, heads]");
        detail::resize_guarded(table_, std::array<index_t, 2>{num_buckets, heads},
                               "relative position bias table [num_buckets, heads]", "Use fewer heads or buckets");
        detail::position_init::fill_standard_normal(table_, seed);
    }

    /// Number of heads (columns of the table).
    index_t heads() const { return table_.dimension(1); }
    /// Number of buckets (rows of the table).
    index_t num_buckets() const { return table_.dimension(0); }
    /// Whether keys after the query get their own buckets.
    bool bidirectional() const { return bidirectional_; }
    /// Distance at which the log-spaced buckets end.
    index_t max_distance() const { return max_distance_; }

    /// The table `[num_buckets, heads]`. Writable so trained weights can be loaded; keep its shape.
    tensor<T, 2>& table() { return table_; }
    /// The table `[num_buckets, heads]`.
    const tensor<T, 2>& table() const { return table_; }

    /// The bucket of key_position - query_position under this table's configuration.
    index_t bucket(index_t query_position, index_t key_position) const {
        return relative_position_bucket(detail::saturating_difference(key_position, query_position), bidirectional_,
                                        num_buckets(), max_distance_);
    }

    /// The bias head `head` adds to the score of (query_position, key_position): table(bucket, head).
    /// Throws shape_error `attend.shape.bias_head` if head is not in [0, heads).
    T value(index_t head, index_t query_position, index_t key_position) const {
        if (head < 0 || head >= heads())
            throw shape_error("attend.shape.bias_head",
                              detail::concat("head ", head, " is outside the relative position bias table of ", heads(),
                                             " heads (table ", detail::format_shape(table_.dimensions()), ')'));
        return table_(bucket(query_position, key_position), head);
    }

private:
    tensor<T, 2> table_;
    bool bidirectional_;
    index_t max_distance_;
};

/// ALiBi's per-head slopes (Press et al., `get_slopes`): for a power of two n, the geometric sequence
/// 2^(-8/n), 2^(-16/n), ..., 2^(-8); otherwise the n' = largest power of two below n slopes, then every other
/// slope of the 2n' sequence until there are n. Head h adds -slope[h] * distance to its scores.
/// Throws value_error `attend.value.alibi_heads` if heads < 1, resource_error `attend.resource.allocation` if the
/// slopes cannot be allocated.
inline std::vector<double> alibi_slopes(index_t heads) {
    if (heads < 1) throw value_error("attend.value.alibi_heads", detail::concat("ALiBi needs heads >= 1, got ", heads));
    // Same arithmetic as the reference: start = 2^(-2^-(log2(n) - 3)), slope_i = start * start^i. n is a double:
    // 2 x the largest power of two below heads may not fit Eigen::Index.
    const auto start_of = [](double n) { return std::pow(2.0, -std::pow(2.0, -(std::log2(n) - 3.0))); };
    index_t closest = 1;
    while (closest <= heads / 2) closest *= 2;
    std::vector<double> slopes = detail::allocating(
        [&] { return std::vector<double>(static_cast<std::size_t>(heads)); },
        [&] { return detail::allocation_text("ALiBi slopes", std::array<index_t, 1>{heads}, sizeof(double)); },
        "ALiBi needs one slope per head");
    const double start = start_of(static_cast<double>(closest));
    for (index_t i = 0; i < closest; ++i)
        slopes[static_cast<std::size_t>(i)] = start * std::pow(start, static_cast<double>(i));
    // Then every other slope of the sequence for 2 x closest heads.
    const double extra = start_of(2.0 * static_cast<double>(closest));
    for (index_t i = 0; i < heads - closest; ++i)
        slopes[static_cast<std::size_t>(closest + i)] = extra * std::pow(extra, 2.0 * static_cast<double>(i));
    return slopes;
}

}  // namespace attend
