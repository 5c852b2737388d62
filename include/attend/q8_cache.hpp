// SPDX-License-Identifier: MIT
#pragma once
/// quantized_kv_cache<Block>: a KV cache stored in ggml's quantized block layouts. Each row of keys or values is cut
/// into blocks of 32 values, each block one fp16 scale d and 32 small integers. Values are quantized when appended
/// and widened to float inside the tile loop, a K or V tile at a time into the worker's scratch (or in registers by
/// the decode's row kernels); they are never materialized whole in float. Attention over the cache is exactly
/// float attention over the values it holds: the only error is the quantization.
///
/// q8_kv_cache (q8_0_block, byte for byte ggml's block_q8_0): int8 q, x ~ d q, 34 bytes per 32 values, 0.27 of a
/// float cache. d = fp16(amax / 127), amax the largest |x| of its block (the next fp16 up where amax / 127 is so
/// small that fp16's subnormals round it far down), and q = round(x / d) with d as stored, so |x - d q| <= d / 2 ~
/// amax / 254 (up to 2^-16 d: x / d is rounded to float first). A block whose amax is below 127 x 2^-25 (d rounds
/// to 0) is stored as zeros. tests/unit/q8_cache_test.cpp.
///
/// q4_kv_cache (q4_0_block, ggml's block_q4_0): 4-bit q in [0, 15], x ~ d (q - 8), 18 bytes per 32 values, 0.14 of
/// a float cache. d = fp16(m / -8), m the value of largest magnitude, so m is held as -8 d (d a normal fp16) and
/// every value within |d| / 2 (+ 2^-19 |d|) = |m| / 16, except values of m's opposite sign beyond 7.5 |d| in
/// magnitude, which the format's [-8, 7] clamps to 7 d: within 1.5 |d| = 3 |m| / 16 (quantize_q4_0).
/// tests/unit/q4_cache_test.cpp.

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#include "cache.hpp"
#include "detail/input_scan.hpp"
#include "detail/memory.hpp"
#include "detail/quantized_rows.hpp"
#include "detail/widen.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace attend {

/// Keys `[batch, kv_heads, length, head_dim]` and values `[batch, kv_heads, length, value_dim]` of the positions
/// seen so far, as Block (q8_0_block or q4_0_block), with a capacity fixed at construction. Float queries attend
/// over it, and fp16 or bf16 ones (widened to float, the output rounded once):
/// `scaled_dot_product_attention(q, cache.keys(), cache.values(), mask, options)`, and `_into`.
template <class Block>
class quantized_kv_cache : private detail::cache_extent {
    static_assert(detail::is_quantized_block_v<Block>,
                  "attend: quantized_kv_cache<Block> takes q8_0_block or q4_0_block");

public:
    /// The largest |value| a block can hold: 127 (q8_0) or 8 (q4_0) x fp16's largest scale.
    static constexpr double max_magnitude = detail::block_format<Block>::max_magnitude;

    /// An empty cache for `config.capacity` positions. Throws value_error `attend.value.size` if a size is < 1,
    /// `attend.value.quantized_dim` if head_dim or value_dim is not a multiple of 32 (the block size), shape_error
    /// `attend.shape.overflow` if the storage size overflows Eigen::Index and resource_error
    /// `attend.resource.allocation` if it cannot be allocated.
    explicit quantized_kv_cache(const kv_cache_config& config) : cache_extent(config, "quantized_kv_cache") {
        const index_t batch = batch_, kv_heads = kv_heads_, capacity = capacity_, head_dim = head_dim_,
                      value_dim = value_dim_;
        if (head_dim % Block::size != 0 || value_dim % Block::size != 0)
            throw value_error("attend.value.quantized_dim",
                              detail::concat("an ", detail::block_format<Block>::name,
                                             " cache stores blocks of 32 values: head_dim ", head_dim,
                                             " and value_dim ", value_dim, " must be multiples of 32"));
        detail::allocating(
            [&] {
                keys_.resize(static_cast<std::size_t>(batch * kv_heads * capacity * (head_dim / Block::size)));
                values_.resize(static_cast<std::size_t>(batch * kv_heads * capacity * (value_dim / Block::size)));
            },
            [&] {
                return detail::allocation_text(
                    "quantized_kv_cache storage (keys and values x batch x kv_heads x capacity x blocks)",
                    std::array<index_t, 5>{2, batch, kv_heads, capacity, std::max(head_dim, value_dim) / 32},
                    sizeof(Block));
            },
            "Choose a smaller capacity");
    }

    index_t batch() const { return batch_; }                   ///< sequences
    index_t kv_heads() const { return kv_heads_; }             ///< key/value heads
    index_t head_dim() const { return head_dim_; }             ///< width of a cached key
    index_t value_dim() const { return value_dim_; }           ///< width of a cached value
    index_t capacity() const { return capacity_; }             ///< positions the cache can hold; fixed
    index_t length() const { return length_; }                 ///< positions held now
    index_t remaining() const { return capacity_ - length_; }  ///< capacity() - length()

    /// Quantizes and appends L positions: k_new `[batch, kv_heads, L, head_dim]`, v_new `[batch, kv_heads, L,
    /// value_dim]` of float, double, Eigen::half or Eigen::bfloat16 (tensors, TensorMaps or strided views).
    /// Throws shape_error `attend.shape.cache` / `attend.shape.negative`, position_error
    /// `attend.position.cache_full`, value_error `attend.value.non_finite` for NaN or +-inf and
    /// `attend.value.quantized_range` for a magnitude above max_magnitude; nothing is appended then.
    template <class K, class V>
    void append(const K& k_new, const V& v_new) {
        check_append(k_new, v_new);
        const auto k = detail::as_view(k_new);
        const auto v = detail::as_view(v_new);
        store_rows(
            k, v, length_, [&](index_t b, index_t h, index_t i) { return key_row(b, h, i); },
            [&](index_t b, index_t h, index_t i) { return value_row(b, h, i); },
            [](const auto* row, index_t dim, Block* to) { detail::quantize_row(row, dim, to); });
        length_ += k.dims[2];
    }

    /// Throws what append(k_new, v_new) would throw, and changes nothing: a caller's checks before its own
    /// mutations (multi_head_attention::forward_cached appends only when everything else has been checked).
    template <class K, class V>
    void check_append(const K& k_new, const V& v_new) const {
        static_assert(std::is_same_v<detail::scalar_of<K>, detail::scalar_of<V>>,
                      "attend: quantized_kv_cache::append takes keys and values of one scalar type");
        const auto k = detail::as_view(k_new);
        const auto v = detail::as_view(v_new);
        detail::check_append_shapes(k, v, {batch_, kv_heads_, capacity_, head_dim_, value_dim_});
        detail::check_cache_fits(k.dims[2], length_, capacity_);
        detail::check_quantizable<Block>(k, "new keys");
        detail::check_quantizable<Block>(v, "new values");
    }

    /// Throws position_error `attend.position.cache_full` if `new_tokens` more positions do not fit, shape_error
    /// `attend.shape.negative` if new_tokens < 0.
    void check_fits(index_t new_tokens) const { detail::check_cache_fits(new_tokens, length_, capacity_); }

    /// Keys `[batch, kv_heads, length(), head_dim]` over the cache's own blocks; valid across later appends.
    detail::quantized_view<Block> keys() const { return view(keys_.data(), head_dim_); }
    /// Values `[batch, kv_heads, length(), value_dim]`, like keys().
    detail::quantized_view<Block> values() const { return view(values_.data(), value_dim_); }

    /// The blocks of keys `[batch, kv_heads, capacity, head_dim / 32]`, ggml's layout, for mapping a
    /// llama.cpp cache or reading what was stored.
    const std::vector<Block>& key_blocks() const { return keys_; }
    /// The blocks of values `[batch, kv_heads, capacity, value_dim / 32]`.
    const std::vector<Block>& value_blocks() const { return values_; }

    /// Bytes of key and value storage the cache holds (allocated once, at construction).
    std::size_t storage_bytes() const { return (keys_.capacity() + values_.capacity()) * sizeof(Block); }

    /// Forgets every position; storage and capacity stay.
    void clear() { length_ = 0; }

    /// Keeps the first `length` positions (rolling back rejected tokens). Throws position_error
    /// `attend.position.truncate` unless 0 <= length <= length(); the cache is unchanged then.
    void truncate(index_t length) {
        detail::check_truncate(length, length_);
        length_ = length;
    }

private:
    detail::quantized_view<Block> view(const Block* data, index_t dim) const {
        detail::quantized_view<Block> v;
        v.data = data;
        v.dims = {batch_, kv_heads_, length_, dim};
        const index_t blocks = dim / Block::size;
        v.strides = {kv_heads_ * capacity_ * blocks, capacity_ * blocks, blocks};
        return v;
    }
    Block* key_row(index_t b, index_t h, index_t i) {
        return keys_.data() + ((b * kv_heads_ + h) * capacity_ + i) * (head_dim_ / Block::size);
    }
    Block* value_row(index_t b, index_t h, index_t i) {
        return values_.data() + ((b * kv_heads_ + h) * capacity_ + i) * (value_dim_ / Block::size);
    }

    index_t length_ = 0;
    std::vector<Block> keys_;
    std::vector<Block> values_;
};

/// An int8 cache in ggml's q8_0 layout (llama.cpp's `--cache-type-k q8_0`).
using q8_kv_cache = quantized_kv_cache<q8_0_block>;
/// An int4 cache in ggml's q4_0 layout (llama.cpp's `--cache-type-k q4_0`).
using q4_kv_cache = quantized_kv_cache<q4_0_block>;

}  // namespace attend
