// SPDX-License-Identifier: MIT
#pragma once
/// Finding queries with no allowed key before any output is written, by tile classification, never a scan of the
/// whole score matrix for structured rules: a block of queries is settled at once when one tile of keys is fully
/// allowed for all of it (a segment's own keys, a causal mask's first keys), and only the rows of blocks that are
/// not are searched one by one, in O(log key_len) classifications each.

#include <algorithm>
#include <array>
#include <optional>

#include "../shape.hpp"
#include "mask_nodes.hpp"

namespace attend::detail {

/// True when some key in [key_begin, key_end) is allowed for query i of (b, h).
template <class Bound>
bool row_has_allowed_key(const Bound& mask, index_t b, index_t h, index_t i, index_t key_begin, index_t key_end) {
    const tile_class c = mask.classify(tile{b, h, i, i + 1, key_begin, key_end});
    if (c != tile_class::mixed) return c == tile_class::full;
    if (key_end - key_begin <= 32) {
        for (index_t j = key_begin; j < key_end; ++j)
            if (mask.allowed(b, h, i, j)) return true;
        return false;
    }
    const index_t middle = key_begin + (key_end - key_begin) / 2;
    return row_has_allowed_key(mask, b, h, i, key_begin, middle) || row_has_allowed_key(mask, b, h, i, middle, key_end);
}

/// True when one tile of keys (16 across the key range, each of at least 32 keys) is allowed for every query in
/// [query_begin, query_end) of (b, h): then each of those queries has an allowed key. Tiles in order, not by
/// halving the range: a dense mask classifies by reading its bytes, and large mixed ranges would be read again at
/// every level; these 16 read the block's bytes once.
template <class Bound>
bool block_has_allowed_key_tile(const Bound& mask, index_t b, index_t h, index_t query_begin, index_t query_end,
                                index_t key_len) {
    const index_t width = std::max<index_t>(32, (key_len + 15) / 16);
    for (index_t k0 = 0; k0 < key_len; k0 += width)
        if (mask.classify(tile{b, h, query_begin, query_end, k0, std::min(key_len, k0 + width)}) == tile_class::full)
            return true;
    return false;
}

/// The first (batch, head, query) that is not a padded query and has no allowed key, in that order: blocks of 16
/// queries settled by one fully allowed tile of keys where they can be, the rows of the others one by one.
template <class Bound>
std::optional<std::array<index_t, 3>> first_empty_row(const Bound& mask, const attention_shape& s) {
    constexpr index_t block = 16;
    for (index_t b = 0; b < s.batch; ++b)
        for (index_t h = 0; h < s.heads; ++h)
            for (index_t i0 = 0; i0 < s.query_len; i0 += block) {
                const index_t i1 = std::min(s.query_len, i0 + block);
                if (block_has_allowed_key_tile(mask, b, h, i0, i1, s.key_len)) continue;
                for (index_t i = i0; i < i1; ++i)
                    if (!mask.query_padded(b, i) && !row_has_allowed_key(mask, b, h, i, 0, s.key_len))
                        return std::array<index_t, 3>{b, h, i};
            }
    return std::nullopt;
}

}  // namespace attend::detail
