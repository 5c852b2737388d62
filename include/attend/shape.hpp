// SPDX-License-Identifier: MIT
#pragma once
/// Shape rules of attention: q `[batch, heads, query_len, head_dim]`, k `[batch, kv_heads, key_len, head_dim]`,
/// v `[batch, kv_heads, key_len, value_dim]` (rank 3 drops the heads axis). Every rule has its own error id.

#include <array>
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
    index batch = 0;      ///< sequences
    index heads = 0;      ///< query heads
    index kv_heads = 0;   ///< key/value heads; heads % kv_heads == 0
    index query_len = 0;  ///< queries per sequence
    index key_len = 0;    ///< keys per sequence
    index head_dim = 0;   ///< width of a query and key head
    index value_dim = 0;  ///< width of a value head
    int rank = 4;         ///< rank of the inputs, 3 or 4

    /// Query heads that share one kv head (grouped-query attention); 1 for plain multi-head attention.
    index group_size() const { return heads / kv_heads; }
    /// The kv head that query head `h` reads.
    index kv_head(index h) const { return h / group_size(); }
};

namespace detail {

/// A shape as a message spells it ("[2,8,128,64]" and a note such as " (q8_0 blocks)"), kept as numbers and
/// spelled only when a message is written: spelling every call's shapes up front had been most of the time of a
/// small call (a one-key decode).
struct shape_words {
    std::array<index, 4> dims{};
    std::size_t rank = 0;
    const char* note = "";
    std::string text() const {
        return concat(format_shape(std::vector<index>(dims.begin(), dims.begin() + static_cast<std::ptrdiff_t>(rank))),
                      note);
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
