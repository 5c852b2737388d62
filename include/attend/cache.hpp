// SPDX-License-Identifier: MIT
#pragma once
/// kv_cache: the keys and values of past positions for incremental decoding. Storage is
/// `[batch, kv_heads, capacity, head_dim]` (and `[..., value_dim]` for values), allocated once at construction:
/// appending never reallocates, so views taken earlier stay valid, and appending past the capacity is a
/// position_error instead of a silent growth. Keys are stored as attention reads them (after any rotary
/// embedding), at global positions 0 .. length() - 1.

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#include "detail/memory.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace attend {

namespace detail {

/// The sizes of a cache: batch, kv_heads, capacity, head_dim, value_dim.
using cache_sizes = std::array<index_t, 5>;

/// Throws shape_error `attend.shape.negative` or `attend.shape.cache` unless new keys k `[batch, kv_heads, L,
/// head_dim]` and values v `[batch, kv_heads, L, value_dim]` fit a cache of these sizes.
template <class KV>
void check_append_shapes(const strided_view<const KV>& k, const strided_view<const KV>& v, const cache_sizes& c) {
    check_view_sizes(k, "new keys");
    check_view_sizes(v, "new values");
    const auto cache_shape = [&] {
        return concat(" (cache [batch ", c[0], ", kv_heads ", c[1], ", capacity ", c[2], ", head_dim ", c[3],
                      ", value_dim ", c[4], "])");
    };
    const std::array<index_t, 4> k_expected{c[0], c[1], k.dims[2], c[3]};
    const std::array<index_t, 4> v_expected{c[0], c[1], k.dims[2], c[4]};
    if (k.dims != k_expected)
        throw shape_error("attend.shape.cache",
                          concat("new keys ", spell_view(k), " do not fit: expected ", format_shape(k_expected),
                                 " = [batch, kv_heads, new tokens, head_dim]", cache_shape()));
    if (v.dims != v_expected)
        throw shape_error("attend.shape.cache",
                          concat("new values ", spell_view(v), " do not fit: expected ", format_shape(v_expected),
                                 " = [batch, kv_heads, new tokens (as the keys), value_dim]", cache_shape()));
}

/// Throws shape_error `attend.shape.negative` for new_tokens < 0 and position_error `attend.position.cache_full`
/// if they do not fit after `length` positions.
inline void check_cache_fits(index_t new_tokens, index_t length, index_t capacity) {
    if (new_tokens < 0)
        throw shape_error("attend.shape.negative",
                          concat("new tokens ", new_tokens, " is negative; appending needs >= 0 tokens"));
    if (new_tokens > capacity - length)
        throw position_error("attend.position.cache_full",
                             concat("cache is full: length ", length, " + ", new_tokens, " new tokens > capacity ",
                                    capacity, " (the capacity is fixed at construction; nothing was appended)"));
}

/// Throws position_error `attend.position.truncate` unless 0 <= length <= current.
inline void check_truncate(index_t length, index_t current) {
    if (length < 0 || length > current)
        throw position_error("attend.position.truncate",
                             concat("cannot truncate a cache of length ", current, " to length ", length,
                                    " (a truncation keeps 0 .. length() positions)"));
}

/// Throws value_error `attend.value.size` if a cache size is < 1.
inline void check_cache_sizes(const cache_sizes& c) {
    if (c[0] < 1 || c[1] < 1 || c[2] < 1 || c[3] < 1 || c[4] < 1)
        throw value_error("attend.value.size",
                          concat("kv_cache sizes must be >= 1, got batch ", c[0], ", kv_heads ", c[1], ", capacity ",
                                 c[2], ", head_dim ", c[3], ", value_dim ", c[4]));
}

}  // namespace detail

/// Keys `[batch, kv_heads, length, head_dim]` and values `[batch, kv_heads, length, value_dim]` of the positions
/// seen so far, with a capacity fixed at construction. Copyable (a copy owns its own storage).
/// T may be 16-bit (Eigen::half, Eigen::bfloat16): the cache then takes half the bytes of a float one, and
/// attention over it accumulates in float (float queries over a 16-bit cache are a supported call).
template <class T>
class kv_cache {
    static_assert(is_storage_type_v<T>,
                  "attend: kv_cache<T> is defined for float, double, Eigen::half and "
                  "Eigen::bfloat16");

public:
    /// An empty cache for `capacity` positions. Throws value_error `attend.value.size` if a size is < 1,
    /// shape_error `attend.shape.overflow` if the storage size overflows Eigen::Index and resource_error
    /// `attend.resource.allocation` if the storage cannot be allocated.
    kv_cache(index_t batch, index_t kv_heads, index_t capacity, index_t head_dim, index_t value_dim)
        : batch_(batch), kv_heads_(kv_heads), capacity_(capacity), head_dim_(head_dim), value_dim_(value_dim) {
        detail::check_cache_sizes({batch, kv_heads, capacity, head_dim, value_dim});
        if (detail::product_overflows(batch, kv_heads, capacity, head_dim) ||
            detail::product_overflows(batch, kv_heads, capacity, value_dim))
            throw shape_error("attend.shape.overflow",
                              detail::concat("kv_cache storage [", batch, ',', kv_heads, ',', capacity, ',',
                                             std::max(head_dim, value_dim), "] overflows Eigen::Index"));
        detail::allocating(
            [&] {
                keys_.assign(static_cast<std::size_t>(batch * kv_heads * capacity * head_dim), T(0));
                values_.assign(static_cast<std::size_t>(batch * kv_heads * capacity * value_dim), T(0));
            },
            [&] {
                return detail::allocation_text(
                    "kv_cache storage (keys and values x batch x kv_heads x capacity x dim)",
                    std::array<index_t, 5>{2, batch, kv_heads, capacity, std::max(head_dim, value_dim)}, sizeof(T));
            },
            "Choose a smaller capacity");
    }

    index_t batch() const { return batch_; }          ///< sequences
    index_t kv_heads() const { return kv_heads_; }    ///< key/value heads
    index_t head_dim() const { return head_dim_; }    ///< width of a cached key
    index_t value_dim() const { return value_dim_; }  ///< width of a cached value
    /// Positions the cache can hold; fixed for its lifetime.
    index_t capacity() const { return capacity_; }
    /// Positions held now; the next appended token has global position length().
    index_t length() const { return length_; }
    /// capacity() - length().
    index_t remaining() const { return capacity_ - length_; }

    /// Appends L positions: k_new `[batch, kv_heads, L, head_dim]`, v_new `[batch, kv_heads, L, value_dim]`
    /// (attend::tensor, a TensorMap of one, or a strided_view such as split_heads of a projected buffer).
    /// Throws shape_error `attend.shape.cache` if a shape does not fit the cache, position_error
    /// `attend.position.cache_full` if length() + L > capacity(), shape_error `attend.shape.negative` if a size of
    /// k_new or v_new is negative, shape_error `attend.shape.aliasing` if k_new or
    /// v_new lies in the cache's own storage (appending writes there while reading them); nothing is appended then.
    template <class K, class V>
    void append(const K& k_new, const V& v_new) {
        static_assert(std::is_same_v<detail::scalar_of<K>, T> && std::is_same_v<detail::scalar_of<V>, T>,
                      "attend: kv_cache<T>::append takes keys and values of scalar type T");
        const auto k = detail::as_view(k_new);
        const auto v = detail::as_view(v_new);
        check_append(k, v);
        const index_t L = k.dims[2];
        for (index_t b = 0; b < batch_; ++b)
            for (index_t h = 0; h < kv_heads_; ++h)
                for (index_t i = 0; i < L; ++i) {
                    std::copy(k.row(b, h, i), k.row(b, h, i) + head_dim_, key_row(b, h, length_ + i));
                    std::copy(v.row(b, h, i), v.row(b, h, i) + value_dim_, value_row(b, h, length_ + i));
                }
        length_ += L;
    }

    /// Throws what append(k_new, v_new) would throw for views of these shapes, and changes nothing.
    void check_append(const strided_view<const T>& k, const strided_view<const T>& v) const {
        detail::check_append_shapes(k, v, {batch_, kv_heads_, capacity_, head_dim_, value_dim_});
        check_fits(k.dims[2]);
        const std::array<index_t, 4> keys_dims{batch_, kv_heads_, capacity_, head_dim_};
        const std::array<index_t, 4> values_dims{batch_, kv_heads_, capacity_, value_dim_};
        detail::check_no_aliasing({detail::named("new keys", k), detail::named("new values", v)},
                                  {detail::named("cache keys", keys_.data(), keys_dims),
                                   detail::named("cache values", values_.data(), values_dims)});
    }

    /// Throws position_error `attend.position.cache_full` if `new_tokens` more positions do not fit, shape_error
    /// `attend.shape.negative` if new_tokens < 0.
    void check_fits(index_t new_tokens) const { detail::check_cache_fits(new_tokens, length_, capacity_); }

    /// Keys `[batch, kv_heads, length(), head_dim]` over the cache's own storage (row stride head_dim, head
    /// stride capacity * head_dim). Stays valid, and shows the same positions, across later appends.
    strided_view<const T> keys() const { return view(keys_.data(), head_dim_, length_); }
    /// Values `[batch, kv_heads, length(), value_dim]`, like keys().
    strided_view<const T> values() const { return view(values_.data(), value_dim_, length_); }

    /// Bytes of key and value storage the cache holds (allocated once, at construction).
    std::size_t storage_bytes() const { return (keys_.capacity() + values_.capacity()) * sizeof(T); }

    /// Forgets every position (length() becomes 0); the storage and capacity stay.
    void clear() { length_ = 0; }

    /// Keeps the first `length` positions and forgets the rest (rolling back rejected tokens); the storage and
    /// capacity stay. Throws position_error `attend.position.truncate` unless 0 <= length <= length(); the cache is
    /// unchanged then.
    void truncate(index_t length) {
        detail::check_truncate(length, length_);
        length_ = length;
    }

private:
    strided_view<const T> view(const T* data, index_t dim, index_t len) const {
        strided_view<const T> v;
        v.data = data;
        v.dims = {batch_, kv_heads_, len, dim};
        v.strides = {kv_heads_ * capacity_ * dim, capacity_ * dim, dim, 1};
        v.rank = 4;
        return v;
    }
    T* key_row(index_t b, index_t h, index_t i) {
        return keys_.data() + ((b * kv_heads_ + h) * capacity_ + i) * head_dim_;
    }
    T* value_row(index_t b, index_t h, index_t i) {
        return values_.data() + ((b * kv_heads_ + h) * capacity_ + i) * value_dim_;
    }

    index_t batch_, kv_heads_, capacity_, head_dim_, value_dim_;
    index_t length_ = 0;
    std::vector<T> keys_;
    std::vector<T> values_;
};

}  // namespace attend
