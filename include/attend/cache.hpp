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

#include "detail/input_scan.hpp"
#include "detail/memory.hpp"
#include "detail/widen.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace attend {

/// Sizes of a contiguous cache (kv_cache, quantized_kv_cache), named as they are set:
/// `kv_cache_config{}.with_batch(2).with_kv_heads(8).with_capacity(4096).with_head_dim(128)`; the setters return
/// a copy, as mha_config's do. value_dim = 0 means head_dim.
struct kv_cache_config {
    index_t batch = 1;      ///< sequences
    index_t kv_heads = 1;   ///< key/value heads
    index_t capacity = 0;   ///< positions the cache holds, fixed for its lifetime
    index_t head_dim = 0;   ///< width of a cached key
    index_t value_dim = 0;  ///< width of a cached value; 0: head_dim

    /// A copy with batch set.
    constexpr kv_cache_config with_batch(index_t n) const { return with(&kv_cache_config::batch, n); }
    /// A copy with kv_heads set.
    constexpr kv_cache_config with_kv_heads(index_t n) const { return with(&kv_cache_config::kv_heads, n); }
    /// A copy with capacity set.
    constexpr kv_cache_config with_capacity(index_t n) const { return with(&kv_cache_config::capacity, n); }
    /// A copy with head_dim set.
    constexpr kv_cache_config with_head_dim(index_t n) const { return with(&kv_cache_config::head_dim, n); }
    /// A copy with value_dim set (0: head_dim).
    constexpr kv_cache_config with_value_dim(index_t n) const { return with(&kv_cache_config::value_dim, n); }

    /// value_dim with its 0 default resolved.
    constexpr index_t resolved_value_dim() const { return value_dim == 0 ? head_dim : value_dim; }

private:
    constexpr kv_cache_config with(index_t kv_cache_config::*field, index_t value) const {
        kv_cache_config c = *this;
        c.*field = value;
        return c;
    }
};

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

/// The sizes of a contiguous cache, resolved (value_dim 0 is head_dim) and checked once for both cache kinds:
/// value_error attend.value.size for a size < 1, shape_error attend.shape.overflow when the storage of `what`
/// would overflow Eigen::Index.
struct cache_extent {
    index_t batch_, kv_heads_, capacity_, head_dim_, value_dim_;

    cache_extent(const kv_cache_config& c, const char* what)
        : batch_(c.batch),
          kv_heads_(c.kv_heads),
          capacity_(c.capacity),
          head_dim_(c.head_dim),
          value_dim_(c.resolved_value_dim()) {
        check_cache_sizes({batch_, kv_heads_, capacity_, head_dim_, value_dim_});
        if (product_overflows(batch_, kv_heads_, capacity_, head_dim_) ||
            product_overflows(batch_, kv_heads_, capacity_, value_dim_))
            throw shape_error("attend.shape.overflow",
                              concat(what, " storage [", batch_, ',', kv_heads_, ',', capacity_, ',',
                                     std::max(head_dim_, value_dim_), "] overflows Eigen::Index"));
    }

    /// Stores the new positions k and v `[batch, kv_heads, L, dim]` at positions at .. at + L - 1:
    /// store(row, dim, destination) per row, into key_at(b, h, position) and value_at(b, h, position).
    template <class In, class KeyAt, class ValueAt, class Store>
    void store_rows(const strided_view<const In>& k, const strided_view<const In>& v, index_t at, KeyAt key_at,
                    ValueAt value_at, Store store) const {
        for (index_t b = 0; b < batch_; ++b)
            for (index_t h = 0; h < kv_heads_; ++h)
                for (index_t i = 0; i < k.dims[2]; ++i) {
                    store(k.row(b, h, i), head_dim_, key_at(b, h, at + i));
                    store(v.row(b, h, i), value_dim_, value_at(b, h, at + i));
                }
    }
};

}  // namespace detail

/// Keys `[batch, kv_heads, length, head_dim]` and values `[batch, kv_heads, length, value_dim]` of the positions
/// seen so far, with a capacity fixed at construction. Copyable (a copy owns its own storage).
/// T may be 16-bit (Eigen::half, Eigen::bfloat16): the cache then takes half the bytes of a float one, and
/// attention over it accumulates in float (float queries over a 16-bit cache are a supported call).
template <class T>
class kv_cache : private detail::cache_extent {
    static_assert(is_storage_type_v<T>,
                  "attend: kv_cache<T> is defined for float, double, Eigen::half and "
                  "Eigen::bfloat16");

public:
    /// An empty cache for `config.capacity` positions. Throws value_error `attend.value.size` if a size is < 1,
    /// shape_error `attend.shape.overflow` if the storage size overflows Eigen::Index and resource_error
    /// `attend.resource.allocation` if the storage cannot be allocated.
    explicit kv_cache(const kv_cache_config& config) : cache_extent(config, "kv_cache") {
        const index_t batch = batch_, kv_heads = kv_heads_, capacity = capacity_, head_dim = head_dim_,
                      value_dim = value_dim_;
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
    /// (attend::tensor, a TensorMap of one, or a strided_view such as split_heads of a projected buffer), of T or,
    /// for a 16-bit cache, of float (rounded to T once, to nearest even, as a 16-bit module's projections are).
    /// Throws shape_error `attend.shape.cache` if a shape does not fit the cache, position_error
    /// `attend.position.cache_full` if length() + L > capacity(), shape_error `attend.shape.negative` if a size of
    /// k_new or v_new is negative, shape_error `attend.shape.aliasing` if k_new or
    /// v_new lies in the cache's own storage (appending writes there while reading them), and for float into a
    /// 16-bit cache value_error `attend.value.non_finite` for NaN, inf or a value T rounds to inf (beyond fp16's
    /// 65504); nothing is appended then.
    template <class K, class V>
    void append(const K& k_new, const V& v_new) {
        using In = detail::scalar_of<K>;
        static_assert(std::is_same_v<detail::scalar_of<V>, In> &&
                          (std::is_same_v<In, T> || (detail::is_16bit_v<T> && std::is_same_v<In, float>)),
                      "attend: kv_cache<T>::append takes keys and values of scalar type T, or float for an "
                      "Eigen::half or Eigen::bfloat16 cache (rounded once)");
        const auto k = detail::as_view(k_new);
        const auto v = detail::as_view(v_new);
        check_append(k, v);
        if constexpr (!std::is_same_v<In, T>) {
            detail::check_rounds_finite<T>(k, "new keys");
            detail::check_rounds_finite<T>(v, "new values");
        }
        store_rows(
            k, v, length_, [&](index_t b, index_t h, index_t i) { return key_row(b, h, i); },
            [&](index_t b, index_t h, index_t i) { return value_row(b, h, i); },
            [](const In* row, index_t dim, T* to) { detail::narrow(row, dim, to); });
        length_ += k.dims[2];
    }

    /// Throws what append(k_new, v_new) would throw for views of these shapes (the shape, capacity and aliasing
    /// checks), and changes nothing.
    template <class In>
    void check_append(const strided_view<const In>& k, const strided_view<const In>& v) const {
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

    index_t length_ = 0;
    std::vector<T> keys_;
    std::vector<T> values_;
};

}  // namespace attend
