// SPDX-License-Identifier: MIT
#pragma once
/// A mask of the full sequence read on one block of it: queries [query_begin, query_begin + query_len) x keys
/// [key_begin, key_begin + key_len) of the global score matrix. Ring attention computes each block with an
/// ordinary attention call whose local query i and key j are global query i + query_begin and key j + key_begin;
/// this wrapper makes the mask answer for those global positions, so causal, sliding windows, key padding and
/// dense masks keep their meaning on every shard without a rule of their own.

#include <type_traits>

#include "../../mask.hpp"

namespace attend::distributed::detail {

/// A bound global mask read at an offset: every question about local (i, j) is asked about
/// (i + query_begin, j + key_begin). Holds a pointer: the bound global mask outlives every block call.
template <class Bound>
struct bound_block {
    const Bound* global = nullptr;
    index_t query_begin = 0;
    index_t key_begin = 0;

    tile to_global(const tile& t) const {
        return tile{t.batch,
                    t.head,
                    t.query_begin + query_begin,
                    t.query_end + query_begin,
                    t.key_begin + key_begin,
                    t.key_end + key_begin};
    }
    bool allowed(index_t b, index_t h, index_t i, index_t j) const {
        return global->allowed(b, h, i + query_begin, j + key_begin);
    }
    bool query_padded(index_t b, index_t i) const { return global->query_padded(b, i + query_begin); }
    tile_class classify(const tile& t) const { return global->classify(to_global(t)); }
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        global->apply(to_global(t), scores, ld);  // apply writes relative to the tile's corner: same memory
    }
};

/// The mask expression of one block, passed to scaled_dot_product_attention(_backward) like any mask. Its
/// kind (allowed set or additive) is the global mask's, so the library treats it exactly as it would the whole.
template <class Bound, bool Additive, bool QueryPadding>
struct block_mask : std::conditional_t<Additive, attend::detail::additive_term, attend::detail::boolean_term> {
    static constexpr bool has_query_padding = QueryPadding;
    bound_block<Bound> block;
    bound_block<Bound> bind(const attention_shape&) const { return block; }
};

/// The block of `global` (a mask bound to the full `[batch, heads, total, total]` scores) at the given corner.
template <class Mask, class Bound>
auto block_of(const Bound& global, index_t query_begin, index_t key_begin) {
    return block_mask<Bound, attend::detail::is_additive_v<Mask>, Mask::has_query_padding>{
        {}, bound_block<Bound>{&global, query_begin, key_begin}};
}

/// True when the global mask allows no position of queries [q0, q1) x keys [k0, k1) in any (batch, head):
/// the block is skipped, and a shard whose blocks are all empty on a rank is not sent there.
template <class Bound>
bool block_is_empty(const Bound& global, index_t batch, index_t heads, index_t q0, index_t q1, index_t k0, index_t k1) {
    for (index_t b = 0; b < batch; ++b)
        for (index_t h = 0; h < heads; ++h)
            if (global.classify(tile{b, h, q0, q1, k0, k1}) != tile_class::empty) return false;
    return true;
}

}  // namespace attend::distributed::detail
