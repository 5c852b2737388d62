// SPDX-License-Identifier: MIT
#pragma once
/// The bound forms of masks: what kernels evaluate. A user builds an unbound expression (mask.hpp); `bind(shape)`
/// checks it against one attention call and returns one of these, with broadcasting and alignment resolved.
/// Every bound node answers, for a tile of the score matrix `[batch, heads, query_len, key_len]`:
///   classify(tile)       empty (nothing allowed), full (all allowed, nothing added) or mixed;
///   apply(tile, scores)  write -inf at forbidden positions and add additive terms, in place;
///   allowed(b, h, i, j)  one position, for the generic paths and for materialize;
///   query_padded(b, i)   the row is a padded query: zero output whatever the empty-row policy.

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "../alignment.hpp"
#include "../tensor.hpp"
#include "checked_arithmetic.hpp"

namespace attend {

/// What a rule says about a rectangle of scores.
enum class tile_class {
    empty,  ///< no position is allowed: the kernel skips the tile
    full,   ///< every position is allowed and nothing is added: the kernel does not test it
    mixed   ///< anything else: the kernel applies the mask to the tile
};

/// Queries [query_begin, query_end) x keys [key_begin, key_end) of one (batch, head).
struct tile {
    index_t batch = 0;
    index_t head = 0;
    index_t query_begin = 0;
    index_t query_end = 0;
    index_t key_begin = 0;
    index_t key_end = 0;
};

namespace detail {

template <class T>
constexpr T minus_infinity() {
    return -std::numeric_limits<T>::infinity();
}

inline tile_class intersect(tile_class a, tile_class b) {
    if (a == tile_class::empty || b == tile_class::empty) return tile_class::empty;
    if (a == tile_class::full && b == tile_class::full) return tile_class::full;
    return tile_class::mixed;
}

inline tile_class unite(tile_class a, tile_class b) {
    if (a == tile_class::full || b == tile_class::full) return tile_class::full;
    if (a == tile_class::empty && b == tile_class::empty) return tile_class::empty;
    return tile_class::mixed;
}

inline tile_class complement(tile_class a) {
    if (a == tile_class::empty) return tile_class::full;
    if (a == tile_class::full) return tile_class::empty;
    return tile_class::mixed;
}

/// Writes -inf into a row of a score tile outside the allowed key interval [lo, hi).
template <class T>
void forbid_outside(T* row, index_t key_begin, index_t key_end, index_t lo, index_t hi) {
    const index_t cut_lo = std::clamp(lo, key_begin, key_end);
    const index_t cut_hi = std::clamp(hi, cut_lo, key_end);
    std::fill(row, row + (cut_lo - key_begin), minus_infinity<T>());
    std::fill(row + (cut_hi - key_begin), row + (key_end - key_begin), minus_infinity<T>());
}

/// Generic application through allowed(): for unions and complements, whose tiles are rare and small.
template <class Node, class T>
void apply_by_position(const Node& node, const tile& t, T* scores, index_t ld) {
    for (index_t i = t.query_begin; i < t.query_end; ++i) {
        T* row = scores + (i - t.query_begin) * ld;
        for (index_t j = t.key_begin; j < t.key_end; ++j)
            if (!node.allowed(t.batch, t.head, i, j)) row[j - t.key_begin] = minus_infinity<T>();
    }
}

/// Every structured rule allows, per row, one interval of keys [lo, hi) (maybe empty). The rules differ only in
/// the interval and in how they classify a tile exactly; the application is shared.
template <class Rule>
struct interval_rule {
    bool allowed(index_t b, index_t, index_t i, index_t j) const {
        const auto [lo, hi] = self().interval(b, i);
        return lo <= j && j < hi;
    }
    bool query_padded(index_t, index_t) const { return false; }
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        for (index_t i = t.query_begin; i < t.query_end; ++i) {
            const auto [lo, hi] = self().interval(t.batch, i);
            forbid_outside(scores + (i - t.query_begin) * ld, t.key_begin, t.key_end, lo, hi);
        }
    }

private:
    const Rule& self() const { return static_cast<const Rule&>(*this); }
};

/// Keys j with i + low <= j <= i + high, low = offset - left and high = offset + right for the diagonal offset of
/// the row's batch entry: causal is a band with right = 0 and an unbounded left. Both edges are clamped to
/// [-query_len, key_len], which changes no row (an edge below -query_len leaves no row a key before 0 to cut, one
/// above key_len no key to reach) and keeps every sum in range, whatever offsets and sizes the caller gave.
struct bound_band : interval_rule<bound_band> {
    std::array<index_t, 2> edges{};                                        ///< {low, high} of every batch row
    std::shared_ptr<const std::vector<std::array<index_t, 2>>> per_batch;  ///< [batch] {low, high}, or null
    index_t key_len = 0;

    /// The band of `left` keys before and `right` after diagonal `d` of a call with query_len queries.
    static bound_band around(const bound_diagonal& d, index_t left, index_t right, index_t query_len,
                             index_t key_len_) {
        const auto edges_of = [&](index_t offset) -> std::array<index_t, 2> {
            // An unbounded side is no bound at all, not offset -+ the largest index.
            return {left == unbounded ? -query_len
                                      : std::clamp(saturating_difference(offset, left), -query_len, key_len_),
                    right == unbounded ? key_len_
                                       : std::clamp(saturating_difference(offset, -right), -query_len, key_len_)};
        };
        bound_band band;
        band.key_len = key_len_;
        band.edges = edges_of(d.offset);
        if (d.per_batch) {
            std::vector<std::array<index_t, 2>> rows;
            rows.reserve(d.per_batch->size());
            for (index_t offset : *d.per_batch) rows.push_back(edges_of(offset));
            band.per_batch = std::make_shared<const std::vector<std::array<index_t, 2>>>(std::move(rows));
        }
        return band;
    }

    std::array<index_t, 2> interval(index_t b, index_t i) const {
        const auto& e = per_batch ? (*per_batch)[static_cast<std::size_t>(b)] : edges;
        return {std::max<index_t>(0, i + e[0]), std::min(key_len, i + e[1] + 1)};
    }
    tile_class classify(const tile& t) const {
        const index_t first = t.query_begin, last = t.query_end - 1;
        const auto first_row = interval(t.batch, first), last_row = interval(t.batch, last);
        // The interval slides right by one per row, so the first row has the lowest bounds and the last the highest.
        if (last_row[1] <= t.key_begin || first_row[0] >= t.key_end) return tile_class::empty;
        if (last_row[0] <= t.key_begin && first_row[1] >= t.key_end) return tile_class::full;
        return tile_class::mixed;
    }
};

/// Keys j < prefix_len, or j <= i + offset (bidirectional over the prefix, causal after it). Offsets are clamped
/// to [-query_len, key_len], as bound_band's edges.
struct bound_prefix_lm : interval_rule<bound_prefix_lm> {
    index_t prefix_len = 0;
    bound_diagonal diagonal;  ///< the causal part's diagonal, per batch row
    index_t query_len = 0;
    index_t key_len = 0;

    std::array<index_t, 2> interval(index_t b, index_t i) const {
        const index_t offset = std::clamp(diagonal.offset_of(b), -query_len, key_len);
        return {0, std::min(key_len, std::max(prefix_len, i + offset + 1))};
    }
    tile_class classify(const tile& t) const {
        if (interval(t.batch, t.query_end - 1)[1] <= t.key_begin) return tile_class::empty;
        if (interval(t.batch, t.query_begin)[1] >= t.key_end) return tile_class::full;
        return tile_class::mixed;
    }
};

/// Keys j < lengths[b]: the rest of each sequence is padding.
struct bound_key_padding : interval_rule<bound_key_padding> {
    std::shared_ptr<const std::vector<index_t>> lengths;

    std::array<index_t, 2> interval(index_t b, index_t) const { return {0, (*lengths)[static_cast<std::size_t>(b)]}; }
    tile_class classify(const tile& t) const {
        const index_t n = interval(t.batch, 0)[1];
        if (n <= t.key_begin) return tile_class::empty;
        if (n >= t.key_end) return tile_class::full;
        return tile_class::mixed;
    }
};

/// Queries i >= lengths[b] are padding: they see nothing and their output rows are zero.
struct bound_query_padding : interval_rule<bound_query_padding> {
    std::shared_ptr<const std::vector<index_t>> lengths;
    index_t key_len = 0;

    std::array<index_t, 2> interval(index_t b, index_t i) const {
        return {0, i < (*lengths)[static_cast<std::size_t>(b)] ? key_len : 0};
    }
    bool query_padded(index_t b, index_t i) const { return i >= (*lengths)[static_cast<std::size_t>(b)]; }
    tile_class classify(const tile& t) const {
        const index_t n = (*lengths)[static_cast<std::size_t>(t.batch)];
        if (n <= t.query_begin) return tile_class::empty;
        if (n >= t.query_end) return tile_class::full;
        return tile_class::mixed;
    }
};

/// Packed variable-length sequences: query i sees the keys of its own sequence only.
struct bound_block_diagonal : interval_rule<bound_block_diagonal> {
    std::shared_ptr<const std::vector<index_t>> starts;  ///< sequence s is [starts[s], starts[s + 1])

    index_t block_of(index_t position) const {
        const auto& s = *starts;
        return static_cast<index_t>(std::upper_bound(s.begin(), s.end(), position) - s.begin()) - 1;
    }
    std::array<index_t, 2> interval(index_t, index_t i) const {
        const auto s = static_cast<std::size_t>(block_of(i));
        return {(*starts)[s], (*starts)[s + 1]};
    }
    tile_class classify(const tile& t) const {
        const index_t q_first = block_of(t.query_begin), q_last = block_of(t.query_end - 1);
        const index_t k_first = block_of(t.key_begin), k_last = block_of(t.key_end - 1);
        if (q_last < k_first || k_last < q_first) return tile_class::empty;
        if (q_first == q_last && k_first == k_last && q_first == k_first) return tile_class::full;
        return tile_class::mixed;
    }
};

/// Packed segments (packed_segments in mask.hpp), resolved against a call: segment n's real queries
/// [query_begin[n], query_end[n]) see keys in [key_begin[n], key_end[n]), inside a band around the segment's own
/// diagonal when windowed. Offsets are ascending, so a position's segment is a binary search.
struct packed_layout {
    std::vector<index_t> query_slots;  ///< [segments + 1] slot offsets along the query axis (cu_seqlens_q)
    std::vector<index_t> query_end;    ///< [segments] end of the real queries of each slot
    std::vector<index_t> key_begin;    ///< [segments] first key of each segment
    std::vector<index_t> key_end;      ///< [segments] end of the real keys of each segment
    std::vector<index_t> diagonal;     ///< [segments] key on the diagonal of the segment's first query slot
    index_t left = 0, right = 0;       ///< the band around each diagonal (capped, so nothing overflows)
};

struct bound_packed_segments : interval_rule<bound_packed_segments> {
    std::shared_ptr<const packed_layout> layout;

    /// The segment whose slot holds query i, or -1 outside every slot.
    index_t segment_of(index_t i) const {
        const auto& slots = layout->query_slots;
        const auto n = static_cast<index_t>(std::upper_bound(slots.begin(), slots.end(), i) - slots.begin()) - 1;
        return n < 0 || n + 1 >= static_cast<index_t>(slots.size()) ? -1 : n;
    }
    bool query_padded(index_t, index_t i) const {
        const index_t n = segment_of(i);
        return n < 0 || i >= layout->query_end[static_cast<std::size_t>(n)];
    }
    std::array<index_t, 2> interval(index_t b, index_t i) const {
        if (query_padded(b, i)) return {0, 0};
        const auto n = static_cast<std::size_t>(segment_of(i));
        const packed_layout& l = *layout;
        const index_t diagonal = l.diagonal[n] + (i - l.query_slots[n]);
        return {std::max(l.key_begin[n], diagonal - l.left), std::min(l.key_end[n], diagonal + l.right + 1)};
    }
    /// Exact both ways. Within a segment, row i's keys are [max(kb, d - left), min(ke, d + right + 1)) with its
    /// diagonal d growing by one per row, so over the tile's rows d0..d1 of the segment some row reaches keys
    /// [a, b) = [max(kb, k0), min(ke, k1)) iff a < b, d1 + right + 1 > a and d0 - left < b; every row sees all of
    /// [k0, k1) iff kb <= k0, k1 <= ke, d1 - left <= k0 and d0 + right + 1 >= k1 (and no row is padding).
    tile_class classify(const tile& t) const {
        const packed_layout& l = *layout;
        if (t.query_begin >= l.query_slots.back()) return tile_class::empty;  // past the last slot: all padding
        const index_t first = std::max<index_t>(0, segment_of(t.query_begin));
        index_t last = segment_of(t.query_end - 1);
        if (last < 0) last = static_cast<index_t>(l.query_end.size()) - 1;
        bool any = false,
             all = !query_padded(t.batch, t.query_begin) && !query_padded(t.batch, t.query_end - 1) && first == last;
        for (index_t n = first; n <= last && !any; ++n) {
            const auto u = static_cast<std::size_t>(n);
            const index_t q0 = std::max(t.query_begin, l.query_slots[u]), q1 = std::min(t.query_end, l.query_end[u]);
            if (q0 >= q1) continue;
            const index_t d0 = l.diagonal[u] + (q0 - l.query_slots[u]), d1 = d0 + (q1 - 1 - q0);
            const index_t a = std::max(l.key_begin[u], t.key_begin), b = std::min(l.key_end[u], t.key_end);
            any = a < b && d1 + l.right + 1 > a && d0 - l.left < b;
            all = all && l.key_begin[u] <= t.key_begin && t.key_end <= l.key_end[u] && d1 - l.left <= t.key_begin &&
                  d0 + l.right + 1 >= t.key_end;
        }
        if (!any) return tile_class::empty;
        return all ? tile_class::full : tile_class::mixed;
    }
};

/// x mod m in [0, m) for m > 0, whatever the sign of x.
inline index_t floor_mod(index_t x, index_t m) {
    const index_t r = x % m;
    return r < 0 ? r + m : r;
}

/// Same-chunk attention (chunked in mask.hpp): the keys are cut into chunks of `chunk_size` starting at each row's
/// chunk start, and query i of batch row b, at key i + offset(b) on its diagonal, sees the keys of its own chunk.
/// Row i's keys are one interval that moves right as i grows, a whole chunk at a time, so the intervals of a tile's
/// rows join without gaps: classification from the first and last rows is exact both ways.
struct bound_chunked : interval_rule<bound_chunked> {
    /// {diagonal offset, where query 0 sits inside its chunk} of every batch row
    std::array<index_t, 2> row{};
    std::shared_ptr<const std::vector<std::array<index_t, 2>>> per_batch;  ///< [batch] of the same, or null
    index_t chunk_size = 1;
    index_t key_len = 0;

    /// The row data of a row with diagonal offset `offset` whose chunks start at key `start` (and every chunk_size
    /// keys before and after it), reduced so nothing below overflows.
    static std::array<index_t, 2> row_of(index_t offset, index_t start, index_t chunk_size) {
        const index_t phase = floor_mod(offset, chunk_size) - floor_mod(start, chunk_size);
        return {offset, phase < 0 ? phase + chunk_size : phase};
    }
    std::array<index_t, 2> interval(index_t b, index_t i) const {
        const auto& r = per_batch ? (*per_batch)[static_cast<std::size_t>(b)] : row;
        // Query i's place inside its chunk, (phase + i) mod chunk_size, without forming phase + i.
        const index_t inside = i < chunk_size - r[1] ? r[1] + i : (i - (chunk_size - r[1])) % chunk_size;
        const index_t first = saturating_difference(saturating_difference(r[0], -i), inside);
        const index_t last = saturating_difference(first, -chunk_size);
        return {std::clamp<index_t>(first, 0, key_len), std::clamp<index_t>(last, 0, key_len)};
    }
    tile_class classify(const tile& t) const {
        const auto first_row = interval(t.batch, t.query_begin), last_row = interval(t.batch, t.query_end - 1);
        // The rows' intervals cover [first_row[0], last_row[1]) without gaps; each bound grows with the row.
        if (std::max(first_row[0], t.key_begin) >= std::min(last_row[1], t.key_end)) return tile_class::empty;
        if (last_row[0] <= t.key_begin && first_row[1] >= t.key_end) return tile_class::full;
        return tile_class::mixed;
    }
};

/// Bidirectional groups (bidirectional_groups in mask.hpp): `ids [batch, key_len]` give each key position a group
/// (-1: none), and query i of batch row b takes the group of its diagonal key i + offset(b) (none outside the keys).
/// A query of a group sees every key of its group. Runs of equal ids are precomputed so a tile is classified by
/// walking runs, not positions: exact both ways.
struct bound_bidirectional_groups {
    std::shared_ptr<const std::vector<index_t>> ids;      ///< [batch, key_len] row-major
    std::shared_ptr<const std::vector<index_t>> run_end;  ///< [batch, key_len]: end of the run of equal ids at j
    bound_diagonal diagonal;
    index_t key_len = 0;

    index_t id_at(index_t b, index_t j) const { return (*ids)[static_cast<std::size_t>(b * key_len + j)]; }
    index_t run_end_at(index_t b, index_t j) const { return (*run_end)[static_cast<std::size_t>(b * key_len + j)]; }
    /// Query i's key position on the diagonal (saturated: far outside the keys either way).
    index_t position_of(index_t b, index_t i) const { return saturating_difference(diagonal.offset_of(b), -i); }
    index_t query_group(index_t b, index_t i) const {
        const index_t p = position_of(b, i);
        return p >= 0 && p < key_len ? id_at(b, p) : -1;
    }
    bool allowed(index_t b, index_t, index_t i, index_t j) const {
        const index_t g = query_group(b, i);
        return g >= 0 && g == id_at(b, j);
    }
    bool query_padded(index_t, index_t) const { return false; }
    tile_class classify(const tile& t) const {
        const index_t p0 = position_of(t.batch, t.query_begin), p1 = position_of(t.batch, t.query_end - 1);
        const index_t a = std::clamp<index_t>(p0, 0, key_len), c = std::clamp<index_t>(p1, -1, key_len - 1) + 1;
        const bool rows_outside = p0 < 0 || p1 >= key_len;  // such rows have no group: the tile is not full
        if (!rows_outside && a < c && run_end_at(t.batch, a) >= c && id_at(t.batch, a) >= 0 &&
            id_at(t.batch, t.key_begin) == id_at(t.batch, a) && run_end_at(t.batch, t.key_begin) >= t.key_end)
            return tile_class::full;
        // Some query run's group among the key runs? At most (query runs x key runs) comparisons, no more than
        // the tile's positions.
        for (index_t p = a; p < c; p = run_end_at(t.batch, p)) {
            const index_t g = id_at(t.batch, p);
            if (g < 0) continue;
            for (index_t j = t.key_begin; j < t.key_end; j = run_end_at(t.batch, j))
                if (id_at(t.batch, j) == g) return tile_class::mixed;
        }
        return tile_class::empty;
    }
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        for (index_t i = t.query_begin; i < t.query_end; ++i) {
            T* row = scores + (i - t.query_begin) * ld;
            const index_t g = query_group(t.batch, i);
            for (index_t j = t.key_begin; j < t.key_end; ++j)
                if (g < 0 || id_at(t.batch, j) != g) row[j - t.key_begin] = minus_infinity<T>();
        }
    }
};

/// Every position allowed: what a call without a mask binds to.
struct bound_everything {
    bool allowed(index_t, index_t, index_t, index_t) const { return true; }
    bool query_padded(index_t, index_t) const { return false; }
    tile_class classify(const tile&) const { return tile_class::full; }
    template <class T>
    void apply(const tile&, T*, index_t) const {}
};

/// Whether bytes p[0], p[stride], ..., p[(n - 1) stride] include a nonzero one and a zero one.
struct byte_kinds_found {
    bool nonzero = false, zero = false;
};
inline byte_kinds_found byte_kinds(const std::uint8_t* p, index_t n, index_t stride) {
    std::uint8_t any = 0, none = 0;  // OR of the bytes, OR of (byte == 0): reductions the compiler vectorizes
    if (stride == 1) {
        for (index_t j = 0; j < n; ++j) {
            any = static_cast<std::uint8_t>(any | p[j]);
            none = static_cast<std::uint8_t>(none | (p[j] == 0));
        }
    } else {
        for (index_t j = 0; j < n; ++j) {
            any = static_cast<std::uint8_t>(any | p[j * stride]);
            none = static_cast<std::uint8_t>(none | (p[j * stride] == 0));
        }
    }
    return {any != 0, none != 0};
}

/// A dense Boolean grid broadcast onto `[batch, heads, query_len, key_len]` by strides (0 on broadcast axes).
/// `inverted` is true when the stored values follow the forbidden convention (true = blocked). Keys at or past
/// key_end are forbidden (an ONNX mask shorter than key_len); it is key_len otherwise.
struct bound_dense_boolean {
    const std::uint8_t* data = nullptr;
    std::array<index_t, 4> strides{};
    index_t key_end = std::numeric_limits<index_t>::max();
    bool inverted = false;

    bool allowed(index_t b, index_t h, index_t i, index_t j) const {
        return j < key_end &&
               (data[b * strides[0] + h * strides[1] + i * strides[2] + j * strides[3]] != 0) != inverted;
    }
    bool query_padded(index_t, index_t) const { return false; }
    /// Row by row, each row's bytes in one branch-free pass (vectorized where the key axis is contiguous), stopping
    /// at the first row that shows both kinds: the kernels classify every tile of every head, and most tiles of a
    /// block-diagonal or padded mask are wholly one kind, so they are read to the end.
    tile_class classify(const tile& t) const {
        const index_t stored_end = std::min(t.key_end, key_end);
        if (stored_end <= t.key_begin) return tile_class::empty;
        bool nonzero = false, zero = false;
        const std::uint8_t* row = data + t.batch * strides[0] + t.head * strides[1] + t.key_begin * strides[3];
        for (index_t i = t.query_begin; i < t.query_end && !(nonzero && zero); ++i) {
            const auto kinds = byte_kinds(row + i * strides[2], stored_end - t.key_begin, strides[3]);
            nonzero = nonzero || kinds.nonzero;
            zero = zero || kinds.zero;
        }
        const bool any_allowed = inverted ? zero : nonzero,
                   any_forbidden = (inverted ? nonzero : zero) || stored_end < t.key_end;
        if (!any_allowed) return tile_class::empty;
        return any_forbidden ? tile_class::mixed : tile_class::full;
    }
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        apply_by_position(*this, t, scores, ld);
    }
};

/// A dense additive grid broadcast like bound_dense_boolean; -inf forbids, finite values bias the scores, and keys
/// at or past key_end are forbidden.
template <class V>
struct bound_dense_additive {
    const V* data = nullptr;
    std::array<index_t, 4> strides{};
    index_t key_end = std::numeric_limits<index_t>::max();

    V value(index_t b, index_t h, index_t i, index_t j) const {
        if (j >= key_end) return minus_infinity<V>();
        return data[b * strides[0] + h * strides[1] + i * strides[2] + j * strides[3]];
    }
    bool allowed(index_t b, index_t h, index_t i, index_t j) const { return value(b, h, i, j) != minus_infinity<V>(); }
    bool query_padded(index_t, index_t) const { return false; }
    tile_class classify(const tile& t) const {
        bool all_forbidden = true, all_zero = true;
        for (index_t i = t.query_begin; i < t.query_end; ++i)
            for (index_t j = t.key_begin; j < t.key_end; ++j) {
                const V x = value(t.batch, t.head, i, j);
                all_forbidden = all_forbidden && x == minus_infinity<V>();
                all_zero = all_zero && x == V(0);
                if (!all_forbidden && !all_zero) return tile_class::mixed;
            }
        return all_forbidden ? tile_class::empty : tile_class::full;
    }
    /// -inf stays -inf; a finite bias saturates at the finite range of T, on both ends. At the low end a finite
    /// fill (say -1e300 on float scores, or two float lowest() added) never turns into -inf and silently empties a
    /// row that the empty-row check saw as allowed; at the high end a large bias (1e300 on float scores, two float
    /// max() added) never turns into +inf, whose softmax is NaN.
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        constexpr T lowest = std::numeric_limits<T>::lowest(), highest = std::numeric_limits<T>::max();
        for (index_t i = t.query_begin; i < t.query_end; ++i) {
            T* row = scores + (i - t.query_begin) * ld;
            for (index_t j = t.key_begin; j < t.key_end; ++j) {
                const V x = value(t.batch, t.head, i, j);
                T& s = row[j - t.key_begin];
                if (x == minus_infinity<V>()) {
                    s = minus_infinity<T>();
                } else if (s != minus_infinity<T>()) {
                    // Clamped in double before the conversion: a double outside T's range has no T value.
                    const T bias = static_cast<T>(
                        std::clamp(static_cast<double>(x), static_cast<double>(lowest), static_cast<double>(highest)));
                    s = std::clamp(s + bias, lowest, highest);
                }
            }
        }
    }
};

/// Intersection of allowed sets, and the sum of additive terms: both forbid where either forbids.
template <class A, class B>
struct bound_intersection {
    A a;
    B b;
    bool allowed(index_t bb, index_t h, index_t i, index_t j) const {
        return a.allowed(bb, h, i, j) && b.allowed(bb, h, i, j);
    }
    bool query_padded(index_t bb, index_t i) const { return a.query_padded(bb, i) || b.query_padded(bb, i); }
    tile_class classify(const tile& t) const {
        const tile_class first = a.classify(t);
        return first == tile_class::empty ? first : intersect(first, b.classify(t));
    }
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        a.apply(t, scores, ld);
        b.apply(t, scores, ld);
    }
};

/// Union of allowed sets (Boolean terms only).
template <class A, class B>
struct bound_union {
    A a;
    B b;
    bool allowed(index_t bb, index_t h, index_t i, index_t j) const {
        return a.allowed(bb, h, i, j) || b.allowed(bb, h, i, j);
    }
    bool query_padded(index_t bb, index_t i) const { return a.query_padded(bb, i) && b.query_padded(bb, i); }
    tile_class classify(const tile& t) const {
        const tile_class first = a.classify(t);
        return first == tile_class::full ? first : unite(first, b.classify(t));
    }
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        apply_by_position(*this, t, scores, ld);
    }
};

/// Complement of an allowed set (Boolean terms without query padding only).
template <class A>
struct bound_complement {
    A a;
    bool allowed(index_t b, index_t h, index_t i, index_t j) const { return !a.allowed(b, h, i, j); }
    bool query_padded(index_t, index_t) const { return false; }
    tile_class classify(const tile& t) const { return complement(a.classify(t)); }
    template <class T>
    void apply(const tile& t, T* scores, index_t ld) const {
        apply_by_position(*this, t, scores, ld);
    }
};

/// The kernels' view of any bound mask. A kernel instantiated per mask expression costs minutes of compile time
/// per expression; through this interface each kernel is compiled once per scalar type, at the price of one
/// virtual call per tile (or per row), which is nothing next to a tile's GEMM.
class mask_tiles {
public:
    virtual ~mask_tiles() = default;
    virtual tile_class classify(const tile& t) const = 0;
    virtual void apply(const tile& t, float* scores, index_t ld) const = 0;
    virtual void apply(const tile& t, double* scores, index_t ld) const = 0;
    virtual bool allowed(index_t b, index_t h, index_t i, index_t j) const = 0;
    virtual bool query_padded(index_t b, index_t i) const = 0;
};

/// A bound mask behind mask_tiles; holds a reference, so it lives no longer than the call it serves.
template <class Bound>
class erased_mask final : public mask_tiles {
public:
    explicit erased_mask(const Bound& bound) : bound_(bound) {}
    tile_class classify(const tile& t) const override { return bound_.classify(t); }
    void apply(const tile& t, float* scores, index_t ld) const override { bound_.apply(t, scores, ld); }
    void apply(const tile& t, double* scores, index_t ld) const override { bound_.apply(t, scores, ld); }
    bool allowed(index_t b, index_t h, index_t i, index_t j) const override { return bound_.allowed(b, h, i, j); }
    bool query_padded(index_t b, index_t i) const override { return bound_.query_padded(b, i); }

private:
    const Bound& bound_;
};

/// Calls f with `mask` as a mask_tiles: itself when it is one already, else erased for the duration of the call.
/// The kernels are compiled once per scalar type on mask_tiles; this is how any bound mask reaches them.
template <class Bound, class F>
decltype(auto) with_mask_tiles(const Bound& mask, F&& f) {
    if constexpr (std::is_base_of_v<mask_tiles, Bound>) {
        return f(static_cast<const mask_tiles&>(mask));
    } else {
        const erased_mask<Bound> erased(mask);
        return f(static_cast<const mask_tiles&>(erased));
    }
}

}  // namespace detail
}  // namespace attend
