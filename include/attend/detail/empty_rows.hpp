// SPDX-License-Identifier: MIT
#pragma once
/// Finding queries with no allowed key before any output is written, by recursive tile classification:
/// O(log key_len) classifications per row for structured rules, never a scan of the whole score matrix.

#include <array>
#include <optional>

#include "../shape.hpp"
#include "mask_nodes.hpp"

namespace attend::detail {

/// True when some key in [key_begin, key_end) is allowed for query i of (b, h).
template <class Bound>
bool row_has_allowed_key(const Bound& mask, index b, index h, index i, index key_begin, index key_end) {
    const tile_class c = mask.classify(tile{b, h, i, i + 1, key_begin, key_end});
    if (c != tile_class::mixed) return c == tile_class::full;
    if (key_end - key_begin <= 32) {
        for (index j = key_begin; j < key_end; ++j)
            if (mask.allowed(b, h, i, j)) return true;
        return false;
    }
    const index middle = key_begin + (key_end - key_begin) / 2;
    return row_has_allowed_key(mask, b, h, i, key_begin, middle) || row_has_allowed_key(mask, b, h, i, middle, key_end);
}

/// The first (batch, head, query) that is not a padded query and has no allowed key, in that order.
template <class Bound>
std::optional<std::array<index, 3>> first_empty_row(const Bound& mask, const attention_shape& s) {
    for (index b = 0; b < s.batch; ++b)
        for (index h = 0; h < s.heads; ++h)
            for (index i = 0; i < s.query_len; ++i)
                if (!mask.query_padded(b, i) && !row_has_allowed_key(mask, b, h, i, 0, s.key_len))
                    return std::array<index, 3>{b, h, i};
    return std::nullopt;
}

}  // namespace attend::detail
