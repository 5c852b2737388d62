// SPDX-License-Identifier: MIT
#pragma once
/// Shape rules of attention: q `[batch, heads, query_len, head_dim]`, k `[batch, kv_heads, key_len, head_dim]`,
/// v `[batch, kv_heads, key_len, value_dim]` (rank 3 drops the heads axis). Every rule has its own error id.

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "detail/checked_arithmetic.hpp"
#include "error.hpp"
#include "tensor.hpp"

namespace attend {

/// The sizes of one attention call, checked. `rank` is the rank of the inputs (3 or 4); masks broadcast
/// against the score shape of that rank, as NumPy and PyTorch do.
struct attention_shape {
    index_t batch = 0;      ///< sequences
    index_t heads = 0;      ///< query heads
    index_t kv_heads = 0;   ///< key/value heads; heads % kv_heads == 0
    index_t query_len = 0;  ///< queries per sequence
    index_t key_len = 0;    ///< keys per sequence
    index_t head_dim = 0;   ///< width of a query and key head
    index_t value_dim = 0;  ///< width of a value head
    int rank = 4;           ///< rank of the inputs, 3 or 4

    /// Query heads that share one kv head (grouped-query attention); 1 for plain multi-head attention.
    index_t group_size() const { return heads / kv_heads; }
    /// The kv head that query head `h` reads.
    index_t kv_head(index_t h) const { return h / group_size(); }
};

/// The type of the batch, head, query and key a mask_mod or score_mod function receives: 32 bits, as
/// FlexAttention's int32 indices, so that a function converting positions to float scores
/// (`s - slope * std::abs(i - j)`) compiles to vector code; 64-bit integers have no vector conversion to float
/// before AVX-512, and the function runs on every score. Calls whose batch, heads, query_len or key_len exceed its
/// range throw shape_error attend.shape.mod_positions.
using mod_index = std::int32_t;

namespace detail {

/// Throws shape_error attend.shape.mod_positions when a call of shape s cannot pass its positions to `what`
/// (mask_mod or score_mod) as mod_index.
inline void check_mod_positions(const attention_shape& s, const char* what) {
    constexpr index_t most = std::numeric_limits<mod_index>::max();
    if (s.batch <= most && s.heads <= most && s.query_len <= most && s.key_len <= most) return;
    throw shape_error("attend.shape.mod_positions",
                      concat(what, " receives batch, head, query and key as 32-bit integers, but the call has batch ",
                             s.batch, ", heads ", s.heads, ", query_len ", s.query_len, " and key_len ", s.key_len,
                             " (each must be <= ", most, ')'));
}

}  // namespace detail

namespace detail {

/// A shape as a message spells it ("[2,8,128,64]" and a note such as " (q8_0 blocks)"), kept as numbers and
/// spelled only when a message is written: spelling every call's shapes up front had been most of the time of a
/// small call (a one-key decode).
struct shape_words {
    std::array<index_t, 4> dims{};
    std::size_t rank = 0;
    const char* note = "";
    std::string text() const {
        return concat(
            format_shape(std::vector<index_t>(dims.begin(), dims.begin() + static_cast<std::ptrdiff_t>(rank))), note);
    }
};

template <class T>
shape_words words_of(const strided_view<T>& v) {
    if (v.rank == 3) return {{v.dims[0], v.dims[2], v.dims[3], 0}, 3};
    return {v.dims, 4};
}

template <class T>
std::string spell_view(const strided_view<T>& v) {
    return words_of(v).text();
}

/// Throws shape_error attend.shape.negative when a view has a negative size (a hand-made strided_view, or
/// split_heads with a negative length): every later size product and row offset assumes sizes >= 0.
template <class T>
void check_view_sizes(const strided_view<T>& x, const char* name) {
    if (any_negative(x.dims))
        throw shape_error("attend.shape.negative",
                          concat(name, ' ', spell_view(x), " has a negative size; sizes must be >= 0"));
}

/// Throws shape_error attend.shape.output_strides when two elements of an output view would share an address
/// (a stride of 0 or below on an axis of more than one element, or axes whose rows overlap): the kernels write the
/// tiles of one output from several threads, each element once. Sufficient test: taken by increasing stride, each
/// axis must step past everything the smaller ones span.
template <class T>
void check_output_strides(const strided_view<T>& x, const char* name) {
    std::array<std::size_t, 4> axes{0, 1, 2, 3};
    std::sort(axes.begin(), axes.end(), [&](std::size_t a, std::size_t b) { return x.strides[a] < x.strides[b]; });
    index_t span = 1;  // one past the largest offset the smaller axes reach
    for (const std::size_t a : axes) {
        if (x.dims[a] <= 1) continue;
        if (x.strides[a] < span || product_overflows(x.strides[a], x.dims[a] - 1) ||
            sum_overflows(span, x.strides[a] * (x.dims[a] - 1)))
            throw shape_error("attend.shape.output_strides",
                              concat(name, ' ', spell_view(x), " with strides ", format_shape(x.strides),
                                     " has elements that share memory; an output needs one address per element "
                                     "(split_heads over a buffer of its size, or a tensor)"));
        span += x.strides[a] * (x.dims[a] - 1);
    }
}

/// q strided, k and v strided or an int8 cache's q8_view (one kind for both).
template <class T, class KeyView>
attention_shape check_views(const strided_view<const T>& q, const KeyView& k, const KeyView& v) {
    // Spelled only for a message (see shape_words).
    const auto qs = [&] { return spell_view(q); };
    const auto ks = [&] { return spell_view(k); };
    const auto vs = [&] { return spell_view(v); };
    check_view_sizes(q, "query");
    check_view_sizes(k, "key");
    check_view_sizes(v, "value");
    const auto both = [](const char* a, const std::string& as, const char* b, const std::string& bs) {
        return concat(" (", a, ' ', as, ", ", b, ' ', bs, ')');
    };
    if (q.rank != k.rank || q.rank != v.rank)
        throw shape_error("attend.shape.rank",
                          concat("query, key and value must have the same rank, got ", q.rank, ", ", k.rank, ", ",
                                 v.rank, " (query ", qs(), ", key ", ks(), ", value ", vs(), ')'));
    if (q.dims[0] != k.dims[0] || q.dims[0] != v.dims[0])
        throw shape_error("attend.shape.batch",
                          concat("batch differs: query ", q.dims[0], ", key ", k.dims[0], ", value ", v.dims[0],
                                 " (query ", qs(), ", key ", ks(), ", value ", vs(), ')'));
    if (k.dims[1] != v.dims[1])
        throw shape_error("attend.shape.kv_heads", concat("key kv_heads ", k.dims[1], " != value kv_heads ", v.dims[1],
                                                          both("key", ks(), "value", vs())));
    if (k.dims[2] != v.dims[2])
        throw shape_error("attend.shape.key_len", concat("key key_len ", k.dims[2], " != value key_len ", v.dims[2],
                                                         both("key", ks(), "value", vs())));
    if (q.dims[3] != k.dims[3])
        throw shape_error("attend.shape.key_dim", concat("query head_dim ", q.dims[3], " != key head_dim ", k.dims[3],
                                                         both("query", qs(), "key", ks())));
    if (q.dims[1] == 0 || k.dims[1] == 0)
        throw shape_error("attend.shape.empty_heads",
                          concat("heads and kv_heads must be >= 1, got heads ", q.dims[1], ", kv_heads ", k.dims[1],
                                 both("query", qs(), "key", ks())));
    if (q.dims[1] % k.dims[1] != 0)
        throw shape_error("attend.shape.gqa", concat("heads ", q.dims[1], " is not a multiple of kv_heads ", k.dims[1],
                                                     " (grouped-query attention needs heads % kv_heads "
                                                     "== 0)",
                                                     both("query", qs(), "key", ks())));
    if (k.dims[2] == 0)
        throw shape_error("attend.shape.empty_keys",
                          concat("key_len is 0: no query has a key to attend", both("query", qs(), "key", ks())));
    if (q.dims[3] == 0)
        throw shape_error("attend.shape.empty_head_dim",
                          concat("head_dim is 0: scores are undefined", both("query", qs(), "key", ks())));
    attention_shape s;
    s.batch = q.dims[0];
    s.heads = q.dims[1];
    s.kv_heads = k.dims[1];
    s.query_len = q.dims[2];
    s.key_len = k.dims[2];
    s.head_dim = q.dims[3];
    s.value_dim = v.dims[3];
    s.rank = q.rank;
    if (product_overflows(s.batch, s.heads, s.query_len, s.head_dim) ||
        product_overflows(s.batch, s.kv_heads, s.key_len, s.head_dim) ||
        product_overflows(s.batch, s.kv_heads, s.key_len, s.value_dim) ||
        product_overflows(s.batch, s.heads, s.query_len, s.value_dim) ||
        product_overflows(s.batch, s.heads, s.query_len, s.key_len))
        throw shape_error("attend.shape.overflow",
                          concat("element counts overflow Eigen::Index (query ", qs(), ", key ", ks(), ", value ", vs(),
                                 ", scores [", s.batch, ',', s.heads, ',', s.query_len, ',', s.key_len, "])"));
    return s;
}

}  // namespace detail

/// Checks q `[batch, heads, query_len, head_dim]`, k `[batch, kv_heads, key_len, head_dim]` and
/// v `[batch, kv_heads, key_len, value_dim]` (or their rank-3 forms) and returns their sizes.
/// Throws shape_error: attend.shape.{rank, batch, kv_heads, key_len, key_dim, empty_heads, gqa, empty_keys,
/// empty_head_dim, overflow, negative}. Zero batch or query_len is valid and gives an empty result.
template <class Q, class K, class V>
attention_shape check_shapes(const Q& q, const K& k, const V& v) {
    static_assert(std::is_same_v<detail::scalar_of<K>, detail::scalar_of<V>> &&
                      detail::storage_pair_v<detail::scalar_of<Q>, detail::scalar_of<K>>,
                  ATTEND_STORAGE_PAIR_MESSAGE);
    return detail::check_views(detail::as_view(q), detail::as_view(k), detail::as_view(v));
}

}  // namespace attend
