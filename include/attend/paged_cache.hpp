// SPDX-License-Identifier: MIT
#pragma once
/// paged_kv_cache: the keys and values of many sequences of different lengths in one pool of fixed-size blocks,
/// for serving. Sequences join and leave; each has its own length and positions; a block table per sequence maps
/// its positions to blocks (vLLM's PagedAttention, FlashAttention's block_table); blocks are shared by reference
/// count, so fork and reorder copy block numbers, never keys or values; a rolling window hands back the blocks
/// no query can see any more; truncate rolls back rejected tokens. paged_attention.hpp attends over it in place.
/// Its storage: float, double, fp16, bf16, or int8 / int4 as q8_0 / q4_0 blocks (paged_kv_cache<q8_0_block>,
/// paged_kv_cache<q4_0_block>: quantized on append as quantized_kv_cache does, q8_cache.hpp: the error bounds;
/// float, fp16 or bf16 queries read them).
///
/// Every operation is all or nothing: when it throws (a bad argument, a full pool, an allocation) the cache is
/// exactly as it was, block numbers and free list included.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "alignment.hpp"
#include "detail/input_scan.hpp"
#include "detail/memory.hpp"
#include "detail/paged_view.hpp"
#include "detail/quantized_rows.hpp"
#include "detail/widen.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace attend {

namespace detail {

/// Asks Linux to back [data, data + bytes) with transparent huge pages where the system allows it (madvise
/// mode): a paged cache's blocks are read in table order, scattered over the pool, and with 4 KiB pages every
/// jump is a TLB miss (a cache of 16-position blocks interleaved between sequences decoded at 0.71 of a
/// contiguous cache, at 0.80 with huge pages; bench/README.md). Must run before the memory is first touched. Only
/// a hint: elsewhere, or when it is refused, nothing changes.
inline void advise_huge_pages(const void* data, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr std::uintptr_t huge = std::uintptr_t(2) << 20;
    const auto at = reinterpret_cast<std::uintptr_t>(data);
    const std::uintptr_t begin = (at + huge - 1) & ~(huge - 1), end = (at + bytes) & ~(huge - 1);
    if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
    (void)data;
    (void)bytes;
#endif
}

}  // namespace detail

/// Sizes of a paged_kv_cache, fixed at construction.
struct paged_cache_config {
    index_t kv_heads = 1;       ///< key/value heads
    index_t head_dim = 0;       ///< width of a cached key
    index_t value_dim = 0;      ///< width of a cached value; 0: head_dim
    index_t block_size = 16;    ///< positions per block; multiples of 64 let decoding read every key in place
    index_t blocks = 0;         ///< blocks in the pool: 2 x blocks x kv_heads x block_size x dim scalars, all allocated
                                ///< at construction
    index_t max_sequences = 1;  ///< sequence slots: ids 0 .. max_sequences - 1
    /// A rolling window (Mistral, Gemma local layers) in sliding_window's convention: a query at position p sees
    /// positions p - window_left to p, attention adds sliding_window(window_left, 0, bottom_right), and each append
    /// hands back the blocks that only hold positions no later query can see. unbounded (the default): every
    /// position is kept. From a Hugging Face config's `sliding_window: W` (W keys, the query's own included) use
    /// with_window_from_config(W), which sets W - 1.
    index_t window_left = unbounded;

    /// A copy with kv_heads set.
    constexpr paged_cache_config with_kv_heads(index_t n) const { return with(&paged_cache_config::kv_heads, n); }
    /// A copy with head_dim set.
    constexpr paged_cache_config with_head_dim(index_t n) const { return with(&paged_cache_config::head_dim, n); }
    /// A copy with value_dim set (0: head_dim).
    constexpr paged_cache_config with_value_dim(index_t n) const { return with(&paged_cache_config::value_dim, n); }
    /// A copy with block_size set.
    constexpr paged_cache_config with_block_size(index_t n) const { return with(&paged_cache_config::block_size, n); }
    /// A copy with the pool's block count set.
    constexpr paged_cache_config with_blocks(index_t n) const { return with(&paged_cache_config::blocks, n); }
    /// A copy with max_sequences set.
    constexpr paged_cache_config with_max_sequences(index_t n) const {
        return with(&paged_cache_config::max_sequences, n);
    }
    /// A copy with a rolling window of `left` positions before each query (sliding_window's left).
    constexpr paged_cache_config with_window(index_t left) const {
        return with(&paged_cache_config::window_left, left);
    }
    /// A copy with Hugging Face's `sliding_window: W` (W positions, the query's own included) as window_left
    /// W - 1. Throws mask_error attend.mask.window_from_config for W <= 0.
    paged_cache_config with_window_from_config(index_t sliding_window) const {
        return with_window(detail::window_left_from_config(sliding_window));
    }
    /// Keys a query sees under the rolling window, itself included; 0 without a window.
    constexpr index_t window_keys() const { return window_left == unbounded ? 0 : window_left + 1; }

private:
    constexpr paged_cache_config with(index_t paged_cache_config::*field, index_t value) const {
        paged_cache_config c = *this;
        c.*field = value;
        return c;
    }
};

template <class T>
class paged_kv_cache;

namespace detail {
template <class T, class In>
class paged_append;

/// What a pool of T stores for "nothing": zeros (the zero block, fresh blocks); for a quantized block every bit
/// zero, so its scale is +0 and it reads as zeros whatever its integers.
template <class T>
T zero_value() {
    if constexpr (is_quantized_block_v<T>) {
        T zero;
        std::memset(static_cast<void*>(&zero), 0, sizeof zero);
        return zero;
    } else {
        return T(0);
    }
}
}  // namespace detail

/// Keys `[kv_heads, length, head_dim]` and values `[kv_heads, length, value_dim]` of up to max_sequences
/// sequences in a pool `[kv_heads, blocks, block_size, dim]` (head-major, so a sequence whose blocks follow each
/// other reads as one stream per head). Position i of a sequence is row i % block_size of
/// block block_table(id)[i / block_size]. Copyable (a copy owns its own pool). With T = q8_0_block or q4_0_block
/// a row is dim / 32 blocks (ggml's q8_0 / q4_0), filled by quantizing what append is given.
template <class T>
class paged_kv_cache {
    static_assert(is_storage_type_v<T> || detail::is_quantized_block_v<T>,
                  "attend: paged_kv_cache<T> is defined for float, double, Eigen::half, Eigen::bfloat16, q8_0_block "
                  "(int8) and q4_0_block (int4)");
    static constexpr bool quantized = detail::is_quantized_block_v<T>;

public:
    /// An empty cache. Throws value_error `attend.value.size` if kv_heads, head_dim, block_size, blocks or
    /// max_sequences is < 1 (value_dim < 0, window < 0), `attend.value.quantized_dim` if T is a quantized block and
    /// head_dim or value_dim is not a multiple of 32, shape_error `attend.shape.overflow` if the pool's size
    /// overflows Eigen::Index, resource_error `attend.resource.allocation` if it cannot be allocated.
    explicit paged_kv_cache(const paged_cache_config& config) : c_(resolved(config)) {
        const index_t positions = c_.blocks + 1;  // + the zero block
        const auto key_size = static_cast<std::size_t>(positions * c_.kv_heads * c_.block_size * key_units());
        const auto value_size = static_cast<std::size_t>(positions * c_.kv_heads * c_.block_size * value_units());
        detail::allocating(
            [&] {
                // Reserved (not yet touched), advised, then zeroed: the advice must come before the first touch.
                keys_.reserve(key_size);
                values_.reserve(value_size);
                detail::advise_huge_pages(keys_.data(), keys_.capacity() * sizeof(T));
                detail::advise_huge_pages(values_.data(), values_.capacity() * sizeof(T));
                keys_.assign(key_size, detail::zero_value<T>());
                values_.assign(value_size, detail::zero_value<T>());
                refs_.assign(static_cast<std::size_t>(c_.blocks), 0);
                free_.resize(static_cast<std::size_t>(c_.blocks));
                for (index_t b = 0; b < c_.blocks; ++b) free_[static_cast<std::size_t>(b)] = c_.blocks - 1 - b;
                free_count_ = c_.blocks;  // block 0 is handed out first
                sequences_.resize(static_cast<std::size_t>(c_.max_sequences));
            },
            [&] {
                return detail::allocation_text(
                    "paged_kv_cache pool (keys and values x blocks x kv_heads x block_size x dim)",
                    std::array<index_t, 5>{2, positions, c_.kv_heads, c_.block_size,
                                           std::max(key_units(), value_units())},
                    sizeof(T));
            },
            "Choose fewer or smaller blocks");
    }

    const paged_cache_config& config() const { return c_; }  ///< with value_dim resolved
    index_t kv_heads() const { return c_.kv_heads; }         ///< key/value heads
    index_t head_dim() const { return c_.head_dim; }         ///< width of a cached key
    index_t value_dim() const { return c_.value_dim; }       ///< width of a cached value
    index_t block_size() const { return c_.block_size; }     ///< positions per block
    index_t blocks() const { return c_.blocks; }             ///< blocks in the pool
    /// The rolling window: positions a query sees before its own; unbounded: none.
    index_t window_left() const { return c_.window_left; }
    index_t free_blocks() const { return free_count_; }  ///< blocks no sequence holds
    /// The block every dropped position maps to (rolling window): all zeros, never written, held by no one.
    index_t zero_block() const { return c_.blocks; }
    /// Bytes of key and value storage the pool holds (allocated once, at construction, the zero block included).
    std::size_t storage_bytes() const { return (keys_.capacity() + values_.capacity()) * sizeof(T); }

    /// Ids of the sequences in the cache, ascending.
    std::vector<index_t> sequences() const {
        std::vector<index_t> ids;
        for (index_t id = 0; id < c_.max_sequences; ++id)
            if (slot(id).active) ids.push_back(id);
        return ids;
    }
    /// True when `id` is a sequence in the cache.
    bool contains(index_t id) const { return id >= 0 && id < c_.max_sequences && slot(id).active; }
    /// Positions appended to sequence `id`: its next token has position length(id). Throws value_error
    /// `attend.value.sequence` unless contains(id).
    index_t length(index_t id) const { return checked(id).length; }
    /// Positions below this were dropped by the rolling window (0 without one): they read as zeros.
    index_t dropped(index_t id) const { return checked(id).dropped_blocks * c_.block_size; }
    /// The blocks of sequence `id`, position i in entry i / block_size; dropped positions show zero_block().
    const std::vector<index_t>& block_table(index_t id) const { return checked(id).table; }
    /// How many sequences hold `block` (0: free).
    index_t references(index_t block) const {
        if (block < 0 || block >= c_.blocks)
            throw value_error("attend.value.block",
                              detail::concat("block ", block, " is not in the pool of ", c_.blocks, " blocks"));
        return refs_[static_cast<std::size_t>(block)];
    }

    /// Key `[head_dim]` (quantized: `[head_dim / 32]` blocks) of (sequence, kv head, position) in the pool (a dropped
    /// position gives the zero block's row). Throws value_error `attend.value.sequence` or position_error
    /// `attend.position.range`.
    const T* key_row(index_t id, index_t head, index_t position) const {
        return row_of(keys_.data(), key_units(), id, head, position);
    }
    /// Value `[value_dim]` (quantized: `[value_dim / 32]` blocks) of (sequence, kv head, position), like key_row.
    const T* value_row(index_t id, index_t head, index_t position) const {
        return row_of(values_.data(), value_units(), id, head, position);
    }

    /// Adds an empty sequence and returns its id (the lowest free slot). Throws position_error
    /// `attend.position.sequence_slots` when all max_sequences slots are taken.
    index_t add_sequence() {
        const index_t id = free_slot();
        sequence& s = slot(id);
        s = sequence{};
        s.active = true;
        return id;
    }

    /// Removes sequence `id`, handing back the blocks no other sequence holds. Throws value_error
    /// `attend.value.sequence` unless contains(id).
    void remove_sequence(index_t id) {
        sequence& s = checked_mut(id);
        for (index_t b : s.table) release(b);
        s.table.clear();
        s.active = false;
    }

    /// A new sequence that shares every block of `from` (its prefix, as beam search and shared prompts need): block
    /// numbers are copied and reference counts raised, no key or value is. The first append into a shared,
    /// partly filled block copies that one block (copy on write). Returns the new id. Throws value_error
    /// `attend.value.sequence`, position_error `attend.position.sequence_slots`.
    index_t fork(index_t from) {
        return detail::allocating([&] { return fork_unguarded(from); },
                                  [] { return std::string("paged_kv_cache::fork's block table"); },
                                  "Free sequences first");
    }

    /// Keeps the first `length` positions of sequence `id` (speculative decoding's rollback of rejected tokens).
    /// Throws value_error `attend.value.sequence`, position_error `attend.position.truncate` unless
    /// 0 <= length <= length(id), position_error `attend.position.window` when the rolling window already
    /// dropped positions a query at `length` would see (a truncation back to the length before the last append is
    /// always possible).
    void truncate(index_t id, index_t length) {
        sequence& s = checked_mut(id);
        if (length < 0 || length > s.length)
            throw position_error("attend.position.truncate",
                                 detail::concat("cannot truncate sequence ", id, " of length ", s.length, " to length ",
                                                length, " (a truncation keeps 0 .. length positions)"));
        check_window(id, length);
        const index_t keep = blocks_for(length);
        while (static_cast<index_t>(s.table.size()) > keep) {
            release(s.table.back());
            s.table.pop_back();
        }
        s.length = length;
        s.dropped_blocks = std::min(s.dropped_blocks, keep);
    }

    /// Beam search's reorder: sequence ids[n] becomes a copy of what sources[n] held (sources may repeat and may
    /// be any sequences of the cache), by block numbers and reference counts. Throws value_error
    /// `attend.value.sequence` (an id not in the cache, or listed twice in ids), shape_error
    /// `attend.shape.sequences` if the two lists differ in size.
    void reorder(const std::vector<index_t>& ids, const std::vector<index_t>& sources) {
        if (ids.size() != sources.size())
            throw shape_error("attend.shape.sequences",
                              detail::concat("reorder takes one source per id, got ", ids.size(), " ids and ",
                                             sources.size(), " sources"));
        check_distinct(ids);
        for (index_t id : sources) checked(id);
        std::vector<sequence> next = detail::allocating(
            [&] {
                std::vector<sequence> n;
                n.reserve(ids.size());
                for (index_t id : sources) n.push_back(slot(id));
                return n;
            },
            [] { return std::string("the block tables of a reorder"); }, "Free sequences first");
        for (const sequence& s : next)
            for (index_t b : s.table) hold(b);
        for (std::size_t n = 0; n < ids.size(); ++n) {
            sequence& s = slot(ids[n]);
            for (index_t b : s.table) release(b);
            s = std::move(next[n]);
        }
    }

    /// Appends new_tokens[n] positions to sequence ids[n] (ragged: each its own count): its first new_tokens[n]
    /// rows of k_new `[ids.size(), kv_heads, max new tokens, head_dim]` and v_new `[..., value_dim]`
    /// (attend::tensor, TensorMap or strided_view), of T, for a 16-bit pool also of float (rounded once, a value
    /// rounding to inf is `attend.value.non_finite`), or for a quantized pool of float, double, Eigen::half or
    /// Eigen::bfloat16 (quantized as they are stored). With a rolling window, the blocks that hold only positions
    /// the first new token cannot see are handed back after the new blocks are taken. Throws value_error
    /// `attend.value.sequence`, shape_error `attend.shape.sequences` (list sizes, a count outside [0, max new
    /// tokens]), shape_error `attend.shape.cache` (k_new or v_new does not fit), value_error
    /// `attend.value.non_finite` (NaN or inf in what would be appended), `attend.value.quantized_range` (quantized:
    /// a magnitude above quantized_kv_cache<T>::max_magnitude), shape_error `attend.shape.aliasing` (k_new or v_new
    /// inside the pool), position_error `attend.position.cache_full` (not enough free blocks), resource_error
    /// `attend.resource.allocation`; nothing is appended then.
    template <class K, class V>
    void append(const std::vector<index_t>& ids, const K& k_new, const V& v_new,
                const std::vector<index_t>& new_tokens) {
        using In = detail::scalar_of<K>;
        static_assert(std::is_same_v<detail::scalar_of<V>, In> &&
                          (std::is_same_v<In, T> || (quantized && is_storage_type_v<In>) ||
                           (detail::is_16bit_v<T> && std::is_same_v<In, float>)),
                      "attend: paged_kv_cache<T>::append takes keys and values of scalar type T (a quantized pool: "
                      "float, double, Eigen::half or Eigen::bfloat16; a 16-bit pool: also float, rounded once; one "
                      "type for both)");
        const auto k = detail::as_view(k_new), v = detail::as_view(v_new);
        // Every allocation of the call (lists, messages) fails as a typed error; the cache changes only in commit.
        detail::allocating([&] { append_views(ids, k, v, new_tokens); },
                           [] { return std::string("paged_kv_cache::append's bookkeeping"); },
                           "Append to fewer sequences at once");
    }

    /// Appends every row of k_new `[1, kv_heads, L, head_dim]` and v_new `[1, kv_heads, L, value_dim]` to sequence
    /// `id`; throws what the ragged append throws.
    template <class K, class V>
    void append(index_t id, const K& k_new, const V& v_new) {
        append(std::vector<index_t>{id}, k_new, v_new, std::vector<index_t>{detail::as_view(k_new).dims[2]});
    }

    /// Keys of sequence `id` as the kernels read them: `[1, kv_heads, length(id), head_dim]` through its block
    /// table. Valid until the sequence's table changes (append, truncate, reorder, remove).
    detail::paged_view<T> key_blocks(index_t id) const { return view(keys_.data(), c_.head_dim, checked(id)); }
    /// Values of sequence `id` `[1, kv_heads, length(id), value_dim]`, like key_blocks.
    detail::paged_view<T> value_blocks(index_t id) const { return view(values_.data(), c_.value_dim, checked(id)); }

    /// Throws position_error `attend.position.window` when the rolling window already dropped positions that a
    /// query at position `position` of sequence `id` would see.
    void check_window(index_t id, index_t position) const {
        const sequence& s = checked(id);
        if (c_.window_left == unbounded || s.dropped_blocks == 0) return;
        const index_t first_needed = position - c_.window_left;
        if (first_needed < s.dropped_blocks * c_.block_size)
            throw position_error(
                "attend.position.window",
                detail::concat("a query at position ", position, " of sequence ", id, " sees positions from ",
                               std::max<index_t>(0, first_needed), " (window_left ", c_.window_left,
                               "), but the rolling window has already dropped positions below ",
                               s.dropped_blocks * c_.block_size,
                               "; only the tokens of the last append can be rolled back or attended again"));
    }

private:
    template <class, class>
    friend class detail::paged_append;

    /// Elements of T in a key row and in a value row of the pool.
    index_t key_units() const { return detail::row_units<T>(c_.head_dim); }
    index_t value_units() const { return detail::row_units<T>(c_.value_dim); }

    index_t fork_unguarded(index_t from) {
        const sequence& source = checked(from);
        const index_t id = free_slot();
        std::vector<index_t> table = source.table;
        for (index_t b : table) hold(b);
        sequence& s = slot(id);
        s.active = true;
        s.length = source.length;
        s.dropped_blocks = source.dropped_blocks;
        s.table = std::move(table);
        return id;
    }

    /// append on views, inside its allocation guard.
    template <class In>
    void append_views(const std::vector<index_t>& ids, const strided_view<const In>& k, const strided_view<const In>& v,
                      const std::vector<index_t>& new_tokens) {
        detail::check_view_sizes(k, "new keys");
        detail::check_view_sizes(v, "new values");
        if (ids.size() != new_tokens.size() || k.dims[0] != static_cast<index_t>(ids.size()) || k.dims[0] != v.dims[0])
            throw shape_error("attend.shape.sequences",
                              detail::concat("append takes one new-token count and one batch row of k_new and v_new "
                                             "per sequence, got ",
                                             ids.size(), " ids, ", new_tokens.size(), " counts, k_new ",
                                             detail::spell_view(k), " and v_new ", detail::spell_view(v)));
        std::vector<strided_view<const In>> keys, values;
        detail::allocating(
            [&] {
                keys.reserve(ids.size());
                values.reserve(ids.size());
            },
            [&] { return std::string("the append's list of sequences"); }, "Append to fewer sequences at once");
        for (std::size_t n = 0; n < ids.size(); ++n) {
            const index_t t = new_tokens[n];
            if (t < 0 || t > k.dims[2])
                throw shape_error("attend.shape.sequences",
                                  detail::concat("sequence ", ids[n], " appends ", t, " new tokens, outside [0, ",
                                                 k.dims[2], "] (the rows of k_new)"));
            keys.push_back(detail::batch_rows(k, static_cast<index_t>(n), t));
            values.push_back(detail::batch_rows(v, static_cast<index_t>(n), t));
        }
        detail::paged_append<T, In> append(*this, ids, keys, values);
        append.commit();
        append.done();
    }

    struct sequence {
        bool active = false;
        index_t length = 0;
        index_t dropped_blocks = 0;  ///< leading table entries that map to the zero block
        std::vector<index_t> table;
    };

    static paged_cache_config resolved(paged_cache_config c) {
        if (c.value_dim == 0) c.value_dim = c.head_dim;
        if (c.kv_heads < 1 || c.head_dim < 1 || c.value_dim < 1 || c.block_size < 1 || c.blocks < 1 ||
            c.max_sequences < 1 || c.window_left < 0)
            throw value_error("attend.value.size",
                              detail::concat("paged_kv_cache sizes must be >= 1 (window_left >= 0), got kv_heads ",
                                             c.kv_heads, ", head_dim ", c.head_dim, ", value_dim ", c.value_dim,
                                             ", block_size ", c.block_size, ", blocks ", c.blocks, ", max_sequences ",
                                             c.max_sequences, ", window_left ", c.window_left));
        if constexpr (quantized)
            if (c.head_dim % T::size != 0 || c.value_dim % T::size != 0)
                throw value_error("attend.value.quantized_dim",
                                  detail::concat("an ", detail::block_format<T>::name,
                                                 " pool stores blocks of 32 values: head_dim ", c.head_dim,
                                                 " and value_dim ", c.value_dim, " must be multiples of 32"));
        if (detail::product_overflows(c.blocks + 1, c.kv_heads, c.block_size, std::max(c.head_dim, c.value_dim)))
            throw shape_error("attend.shape.overflow",
                              detail::concat("paged_kv_cache pool [", c.blocks + 1, ',', c.kv_heads, ',', c.block_size,
                                             ',', std::max(c.head_dim, c.value_dim), "] overflows Eigen::Index"));
        return c;
    }

    index_t blocks_for(index_t positions) const { return (positions + c_.block_size - 1) / c_.block_size; }
    sequence& slot(index_t id) { return sequences_[static_cast<std::size_t>(id)]; }
    const sequence& slot(index_t id) const { return sequences_[static_cast<std::size_t>(id)]; }

    const sequence& checked(index_t id) const {
        if (!contains(id))
            throw value_error("attend.value.sequence",
                              detail::concat("sequence ", id, " is not in the cache (ids 0 .. ", c_.max_sequences - 1,
                                             "; add_sequence or fork make one)"));
        return slot(id);
    }
    sequence& checked_mut(index_t id) {
        checked(id);
        return slot(id);
    }
    void check_distinct(const std::vector<index_t>& ids) const {
        for (std::size_t n = 0; n < ids.size(); ++n) {
            checked(ids[n]);
            for (std::size_t m = 0; m < n; ++m)
                if (ids[m] == ids[n])
                    throw value_error("attend.value.sequence",
                                      detail::concat("sequence ", ids[n], " is listed twice (entries ", m, " and ", n,
                                                     ")"));
        }
    }
    index_t free_slot() const {
        for (index_t id = 0; id < c_.max_sequences; ++id)
            if (!slot(id).active) return id;
        throw position_error("attend.position.sequence_slots",
                             detail::concat("all ", c_.max_sequences,
                                            " sequence slots are taken; remove a sequence or make the cache with "
                                            "more max_sequences"));
    }

    void hold(index_t block) noexcept {
        if (block != zero_block()) ++refs_[static_cast<std::size_t>(block)];
    }
    void release(index_t block) noexcept {
        if (block == zero_block()) return;
        if (--refs_[static_cast<std::size_t>(block)] == 0) push_free(block);
    }
    index_t take() noexcept {
        const index_t b = free_[static_cast<std::size_t>(--free_count_)];
        refs_[static_cast<std::size_t>(b)] = 1;
        return b;
    }
    /// The free list is a stack in a vector sized for every block, so handing a block back never allocates.
    void push_free(index_t block) noexcept { free_[static_cast<std::size_t>(free_count_++)] = block; }

    /// The pool is `[kv_heads, blocks + 1, block_size, units]` (detail/paged_view.hpp says why head-major), units
    /// the T of a row.
    T* block_row(std::vector<T>& pool, index_t units, index_t block, index_t head, index_t row) {
        return pool.data() + ((head * (c_.blocks + 1) + block) * c_.block_size + row) * units;
    }
    const T* row_of(const T* pool, index_t units, index_t id, index_t head, index_t position) const {
        const sequence& s = checked(id);
        if (head < 0 || head >= c_.kv_heads || position < 0 || position >= s.length)
            throw position_error("attend.position.range",
                                 detail::concat("(kv head ", head, ", position ", position, ") is outside sequence ",
                                                id, " (kv_heads ", c_.kv_heads, ", length ", s.length, ")"));
        const index_t block = s.table[static_cast<std::size_t>(position / c_.block_size)];
        return pool + ((head * (c_.blocks + 1) + block) * c_.block_size + position % c_.block_size) * units;
    }
    detail::paged_view<T> view(const T* pool, index_t dim, const sequence& s) const {
        detail::paged_view<T> v;
        v.pool = pool;
        v.table = s.table.data();
        v.dims = {1, c_.kv_heads, s.length, dim};
        v.block_size = c_.block_size;
        v.pool_blocks = c_.blocks + 1;
        return v;
    }

    paged_cache_config c_;
    std::vector<T> keys_, values_;  ///< `[kv_heads, blocks + 1, block_size, units]`; block `blocks` is the zero block
    std::vector<index_t> refs_;     ///< `[blocks]` sequences holding each block
    std::vector<index_t> free_;     ///< `[blocks]`: free blocks in [0, free_count_), a stack
    index_t free_count_ = 0;
    std::vector<sequence> sequences_;
};

namespace detail {

/// One append to a paged cache as a transaction: the constructor checks everything and reserves every byte it
/// will need (nothing changes), commit() writes (it cannot fail), and until done() rollback() restores the cache
/// exactly, block numbers and free list included. Multi-head attention appends, attends and only then calls
/// done(), so a failure in between takes the new positions back out. In: the new keys' and values' type (T, or
/// what a quantized pool quantizes).
template <class T, class In = T>
class paged_append {
public:
    /// keys[n] `[1, kv_heads, new tokens, head_dim]` and values[n] `[1, kv_heads, new tokens, value_dim]` go to
    /// sequence ids[n] (the lists as long as ids).
    paged_append(paged_kv_cache<T>& cache, const std::vector<index_t>& ids,
                 const std::vector<strided_view<const In>>& keys, const std::vector<strided_view<const In>>& values)
        : c_(cache), ids_(ids), k_(keys), v_(values) {
        check();
        allocating(
            [&] {
                journal_.resize(ids.size());
                for (std::size_t n = 0; n < ids.size(); ++n) {
                    const auto& s = c_.slot(ids[n]);
                    const index_t grow = c_.blocks_for(s.length + tokens(n)) - static_cast<index_t>(s.table.size());
                    c_.slot(ids[n]).table.reserve(s.table.size() + static_cast<std::size_t>(grow));
                    journal_[n].released.reserve(static_cast<std::size_t>(droppable(s.length, s.dropped_blocks)));
                }
            },
            [&] { return std::string("the append's block tables"); }, "Append fewer tokens at once");
    }
    paged_append(const paged_append&) = delete;
    paged_append& operator=(const paged_append&) = delete;
    ~paged_append() {
        if (committed_ && !done_) rollback();
    }

    /// Writes the new positions: copies shared partly filled blocks (copy on write), takes new blocks, copies the
    /// rows, then hands back the blocks the rolling window drops. Cannot fail.
    void commit() noexcept {
        for (std::size_t n = 0; n < ids_.size(); ++n) append_one(n);
        for (std::size_t n = 0; n < ids_.size(); ++n) drop_out_of_window(n);
        committed_ = true;
    }
    /// Keeps what commit wrote.
    void done() noexcept { done_ = true; }

    /// Undoes commit in reverse order: the cache is as it was before the constructor.
    void rollback() noexcept {
        for (std::size_t n = ids_.size(); n-- > 0;) {
            auto& s = c_.slot(ids_[n]);
            entry& e = journal_[n];
            for (std::size_t r = e.released.size(); r-- > 0;) {
                const auto [at, block, freed] = e.released[r];
                if (freed) --c_.free_count_;
                ++c_.refs_[static_cast<std::size_t>(block)];
                s.table[static_cast<std::size_t>(at)] = block;
            }
            s.dropped_blocks = e.dropped_blocks;
        }
        for (std::size_t n = ids_.size(); n-- > 0;) {
            auto& s = c_.slot(ids_[n]);
            entry& e = journal_[n];
            while (static_cast<index_t>(s.table.size()) > e.table_size) {
                c_.refs_[static_cast<std::size_t>(s.table.back())] = 0;
                c_.push_free(s.table.back());
                s.table.pop_back();
            }
            if (e.copied >= 0) {
                const index_t at = e.table_size - 1;
                c_.refs_[static_cast<std::size_t>(s.table[static_cast<std::size_t>(at)])] = 0;
                c_.push_free(s.table[static_cast<std::size_t>(at)]);
                s.table[static_cast<std::size_t>(at)] = e.copied;
                ++c_.refs_[static_cast<std::size_t>(e.copied)];
            }
            s.length = e.length;
        }
        done_ = true;
    }

private:
    struct released_block {
        index_t at, block;
        bool freed;
    };
    struct entry {
        index_t length = 0, table_size = 0, dropped_blocks = 0;
        index_t copied = -1;  ///< the shared block replaced by a private copy, or -1
        std::vector<released_block> released;
    };

    index_t tokens(std::size_t n) const { return k_[n].dims[2]; }

    void check() {
        c_.check_distinct(ids_);
        index_t needed = 0;
        for (std::size_t n = 0; n < ids_.size(); ++n) {
            const auto &k = k_[n], &v = v_[n];
            const index_t t = k.dims[2];
            const std::array<index_t, 4> k_expected{1, c_.kv_heads(), t, c_.head_dim()};
            const std::array<index_t, 4> v_expected{1, c_.kv_heads(), t, c_.value_dim()};
            if (k.rank != 4 || k.dims != k_expected || v.rank != 4 || v.dims != v_expected)
                throw shape_error("attend.shape.cache",
                                  concat("new keys ", spell_view(k), " and values ", spell_view(v), " of sequence ",
                                         ids_[n], " do not fit: expected ", format_shape(k_expected), " and ",
                                         format_shape(v_expected),
                                         " = [1, kv_heads, new tokens, head_dim / value_dim] per sequence"));
            const auto& s = c_.slot(ids_[n]);
            needed += c_.blocks_for(s.length + t) - static_cast<index_t>(s.table.size());
            if (t > 0 && s.length % c_.block_size() != 0 && c_.refs_[static_cast<std::size_t>(s.table.back())] > 1)
                ++needed;  // copy on write
            check_values(k, "new keys");
            check_values(v, "new values");
        }
        if (needed > c_.free_blocks())
            throw position_error("attend.position.cache_full",
                                 concat("the pool has ", c_.free_blocks(), " free blocks of ", c_.block_size(),
                                        " positions and this append needs ", needed,
                                        " (nothing was appended; remove or truncate sequences, or make a larger "
                                        "pool)"));
        const std::array<index_t, 4> pool_k{c_.kv_heads(), c_.blocks() + 1, c_.block_size(), c_.key_units()};
        const std::array<index_t, 4> pool_v{c_.kv_heads(), c_.blocks() + 1, c_.block_size(), c_.value_units()};
        for (std::size_t n = 0; n < ids_.size(); ++n)
            check_no_aliasing({named("new keys", k_[n]), named("new values", v_[n])},
                              {named("cache keys", c_.keys_.data(), pool_k),
                               named("cache values", c_.values_.data(), pool_v)});
    }

    /// Throws value_error `attend.value.non_finite` for a NaN or +-inf in x, and into a quantized pool
    /// `attend.value.quantized_range` for a magnitude its blocks cannot hold.
    static void check_values(const strided_view<const In>& x, const char* name) {
        if constexpr (is_quantized_block_v<T>) {
            check_quantizable<T>(x, name);
        } else {
            if constexpr (std::is_same_v<In, T>) check_finite(x, name);
            else check_rounds_finite<T>(x, name);
        }
    }

    /// Stores a new row of `dim` values: copied, or quantized into a quantized pool.
    static void store_row(const In* row, index_t dim, T* to) {
        if constexpr (is_quantized_block_v<T>) quantize_row(row, dim, to);
        else narrow(row, dim, to);
    }

    /// Leading blocks, of a sequence of this length with this many blocks dropped, that hold only positions a
    /// token appended next cannot see.
    index_t droppable(index_t length, index_t dropped_blocks) const {
        if (c_.window_left() == unbounded) return 0;
        const index_t first_needed = length - c_.window_left();
        return first_needed <= 0 ? 0 : first_needed / c_.block_size() - dropped_blocks;
    }

    void append_one(std::size_t n) noexcept {
        const index_t id = ids_[n], t = tokens(n), bs = c_.block_size();
        auto& s = c_.slot(id);
        entry& e = journal_[n];
        e.length = s.length;
        e.table_size = static_cast<index_t>(s.table.size());
        e.dropped_blocks = s.dropped_blocks;
        if (t == 0) return;
        if (s.length % bs != 0 && c_.refs_[static_cast<std::size_t>(s.table.back())] > 1) {
            const index_t shared = s.table.back(), copy = c_.take();
            for (index_t h = 0; h < c_.kv_heads(); ++h) {
                std::copy(c_.block_row(c_.keys_, c_.key_units(), shared, h, 0),
                          c_.block_row(c_.keys_, c_.key_units(), shared, h, s.length % bs),
                          c_.block_row(c_.keys_, c_.key_units(), copy, h, 0));
                std::copy(c_.block_row(c_.values_, c_.value_units(), shared, h, 0),
                          c_.block_row(c_.values_, c_.value_units(), shared, h, s.length % bs),
                          c_.block_row(c_.values_, c_.value_units(), copy, h, 0));
            }
            --c_.refs_[static_cast<std::size_t>(shared)];
            s.table.back() = copy;
            e.copied = shared;
        }
        for (index_t i = 0; i < t; ++i) {
            const index_t p = s.length + i;
            if (p % bs == 0) s.table.push_back(c_.take());  // capacity reserved: cannot throw
            const index_t block = s.table[static_cast<std::size_t>(p / bs)];
            for (index_t h = 0; h < c_.kv_heads(); ++h) {
                store_row(k_[n].row(0, h, i), c_.head_dim(), c_.block_row(c_.keys_, c_.key_units(), block, h, p % bs));
                store_row(v_[n].row(0, h, i), c_.value_dim(),
                          c_.block_row(c_.values_, c_.value_units(), block, h, p % bs));
            }
        }
        s.length += t;
    }

    void drop_out_of_window(std::size_t n) noexcept {
        auto& s = c_.slot(ids_[n]);
        entry& e = journal_[n];
        const index_t drop = droppable(e.length, e.dropped_blocks);
        for (index_t at = s.dropped_blocks; at < s.dropped_blocks + drop; ++at) {
            const index_t block = s.table[static_cast<std::size_t>(at)];
            const bool freed = c_.refs_[static_cast<std::size_t>(block)] == 1;
            c_.release(block);
            s.table[static_cast<std::size_t>(at)] = c_.zero_block();
            e.released.push_back({at, block, freed});  // capacity reserved: cannot throw
        }
        s.dropped_blocks += drop;
    }
    paged_kv_cache<T>& c_;
    const std::vector<index_t>& ids_;
    const std::vector<strided_view<const In>>& k_;
    const std::vector<strided_view<const In>>& v_;
    std::vector<entry> journal_;
    bool committed_ = false, done_ = false;
};

}  // namespace detail

}  // namespace attend
