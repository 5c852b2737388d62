// SPDX-License-Identifier: MIT
#pragma once
/// How a sequence is cut into the shards of ring attention, one shard per rank, and how to cut a full tensor into
/// shards or join shards back (tests, examples, data loaders). Needs no MPI: every rank computes the same layout
/// from the shard lengths alone. The sequence axis is axis 2 of `[batch, heads, len, dim]` and of
/// `[batch, heads, len]` (lse).

#include <array>
#include <cstddef>
#include <vector>

#include "../error.hpp"
#include "../tensor.hpp"

namespace attend::distributed {

/// Which positions of the sequence a rank holds.
enum class sharding {
    contiguous,  ///< rank r holds one run, after the runs of ranks 0 .. r-1. Under a causal mask the last rank
                 ///< does about twice the mean work and rank 0 almost none.
    zigzag       ///< rank r holds two runs: chunk r and chunk 2N-1-r of 2N chunks (context-parallel training's
                 ///< load balancing), so every rank has as many early as late queries and causal work is even.
};

/// One contiguous run of a shard: `length` positions of the full sequence starting at `global_begin`, stored at
/// rows `local_begin ..` of the shard.
struct shard_segment {
    index_t global_begin = 0;  ///< first position in the full sequence
    index_t local_begin = 0;   ///< first row in the shard
    index_t length = 0;        ///< positions in the run
};

/// The shards of a sequence of total() positions over ranks() ranks. With zigzag, a shard of n positions is its
/// first n - n / 2 positions (chunk r) followed by its last n / 2 (chunk 2N-1-r); the sequence is chunks
/// 0 .. 2N-1 in order, i.e. the first runs of ranks 0 .. N-1, then the second runs of ranks N-1 .. 0.
class shard_layout {
public:
    /// From the shard length of every rank (the length of rank r at position r). Throws value_error
    /// attend.value.shard_lengths when the list is empty or a length is negative.
    shard_layout(sharding kind, std::vector<index_t> shard_lengths)
        : kind_(kind), lengths_(std::move(shard_lengths)), segments_(lengths_.size()) {
        if (lengths_.empty()) throw value_error("attend.value.shard_lengths", "a shard layout needs at least one rank");
        for (std::size_t r = 0; r < lengths_.size(); ++r)
            if (lengths_[r] < 0)
                throw value_error("attend.value.shard_lengths",
                                  attend::detail::concat("shard length ", lengths_[r], " of rank ", r, " is negative"));
        index_t position = 0;
        const auto add = [&](std::size_t r, index_t local_begin, index_t length) {
            if (length > 0) segments_[r].push_back(shard_segment{position, local_begin, length});
            position += length;
        };
        if (kind_ == sharding::contiguous) {
            for (std::size_t r = 0; r < lengths_.size(); ++r) add(r, 0, lengths_[r]);
        } else {
            for (std::size_t r = 0; r < lengths_.size(); ++r) add(r, 0, first_run(r));
            for (std::size_t r = lengths_.size(); r-- > 0;) add(r, first_run(r), lengths_[r] - first_run(r));
        }
        total_ = position;
    }

    /// Shard lengths that split `total` positions as evenly as `kind` allows: contiguous runs differ by at most
    /// one; zigzag chunks (2 * ranks of them) differ by at most one. Throws value_error attend.value.shard_lengths
    /// for ranks < 1 or total < 0.
    static std::vector<index_t> balanced_lengths(sharding kind, index_t total, int ranks) {
        if (ranks < 1 || total < 0)
            throw value_error("attend.value.shard_lengths",
                              attend::detail::concat("cannot split ", total, " positions over ", ranks, " ranks"));
        const auto n = static_cast<index_t>(ranks);
        std::vector<index_t> lengths(static_cast<std::size_t>(ranks));
        if (kind == sharding::contiguous) {
            for (index_t r = 0; r < n; ++r) lengths[static_cast<std::size_t>(r)] = total / n + (r < total % n ? 1 : 0);
        } else {
            const auto chunk = [&](index_t c) { return total / (2 * n) + (c < total % (2 * n) ? 1 : 0); };
            for (index_t r = 0; r < n; ++r) lengths[static_cast<std::size_t>(r)] = chunk(r) + chunk(2 * n - 1 - r);
        }
        return lengths;
    }

    sharding kind() const { return kind_; }                          ///< contiguous or zigzag
    int ranks() const { return static_cast<int>(lengths_.size()); }  ///< ranks sharing the sequence
    index_t total() const { return total_; }                         ///< positions of the full sequence
    /// Positions `rank` holds.
    index_t shard_length(int rank) const { return lengths_.at(static_cast<std::size_t>(rank)); }
    /// The runs of `rank`'s shard in local order (zero-length runs omitted).
    const std::vector<shard_segment>& segments(int rank) const { return segments_.at(static_cast<std::size_t>(rank)); }

private:
    index_t first_run(std::size_t r) const { return lengths_[r] - lengths_[r] / 2; }

    sharding kind_;
    std::vector<index_t> lengths_;
    std::vector<std::vector<shard_segment>> segments_;
    index_t total_ = 0;
};

/// Which axis of a tensor is the sequence. Rank 4 (`[batch, heads, len, dim]`) and rank 2 (the lse `[batch, len]`
/// of rank-3 inputs) say it themselves; rank 3 is either an input without heads (`[batch, len, dim]`: axis 1) or
/// an lse with heads (`[batch, heads, len]`: axis 2), so there it is named: take_shard(x, layout, rank,
/// sequence_axis{1}).
struct sequence_axis {
    int axis = 0;  ///< the sequence axis, in [0, rank)
};

namespace detail {

template <int Rank>
void check_sequence_axis(sequence_axis a) {
    if (a.axis < 0 || a.axis >= Rank)
        throw value_error("attend.value.sequence_axis",
                          attend::detail::concat("sequence axis ", a.axis, " is not an axis of a rank-", Rank,
                                                 " tensor"));
}

template <int Rank>
constexpr sequence_axis implied_sequence_axis() {
    static_assert(Rank == 4 || Rank == 2,
                  "attend: a rank-3 tensor is [batch, len, dim] or an lse [batch, heads, len]: name its sequence "
                  "axis with sequence_axis{1} or sequence_axis{2}");
    return sequence_axis{Rank == 4 ? 2 : 1};
}

}  // namespace detail

/// Rank `rank`'s shard of a full tensor along its sequence axis `a`. Throws shape_error attend.shape.shard_total
/// when that axis is not layout.total(), value_error attend.value.sequence_axis for an axis outside [0, Rank).
template <class T, int Rank>
tensor<T, Rank> take_shard(const tensor<T, Rank>& full, const shard_layout& layout, int rank, sequence_axis a) {
    detail::check_sequence_axis<Rank>(a);
    const auto axis = static_cast<std::size_t>(a.axis);
    if (full.dimension(axis) != layout.total())
        throw shape_error("attend.shape.shard_total",
                          attend::detail::concat("tensor ", attend::detail::format_shape(full.dimensions()), " has ",
                                                 full.dimension(axis), " positions on axis ", a.axis, ", the layout ",
                                                 layout.total()));
    auto dims = full.dimensions();
    dims[axis] = layout.shard_length(rank);
    tensor<T, Rank> shard(dims);
    for (const shard_segment& s : layout.segments(rank)) {
        std::array<index_t, Rank> from{}, to{}, extent = dims;
        from[axis] = s.global_begin;
        to[axis] = s.local_begin;
        extent[axis] = s.length;
        shard.slice(to, extent) = full.slice(from, extent);
    }
    return shard;
}

/// Rank `rank`'s shard of `[batch, heads, len, dim]` (axis 2) or of an lse `[batch, len]` (axis 1); rank 3 names
/// its axis (above).
template <class T, int Rank>
tensor<T, Rank> take_shard(const tensor<T, Rank>& full, const shard_layout& layout, int rank) {
    return take_shard(full, layout, rank, detail::implied_sequence_axis<Rank>());
}

/// The full tensor from every rank's shard (shards[r] is rank r's) along sequence axis `a`, the inverse of
/// take_shard. Throws shape_error attend.shape.shard_total when the shards do not match the layout, value_error
/// attend.value.sequence_axis for an axis outside [0, Rank).
template <class T, int Rank>
tensor<T, Rank> join_shards(const std::vector<tensor<T, Rank>>& shards, const shard_layout& layout, sequence_axis a) {
    detail::check_sequence_axis<Rank>(a);
    const auto axis = static_cast<std::size_t>(a.axis);
    if (shards.size() != static_cast<std::size_t>(layout.ranks()))
        throw shape_error("attend.shape.shard_total",
                          attend::detail::concat(shards.size(), " shards for a layout of ", layout.ranks(), " ranks"));
    auto dims = shards[0].dimensions();
    dims[axis] = layout.total();
    tensor<T, Rank> full(dims);
    for (int r = 0; r < layout.ranks(); ++r) {
        const auto& shard = shards[static_cast<std::size_t>(r)];
        auto expected = dims;
        expected[axis] = layout.shard_length(r);
        if (shard.dimensions() != expected)
            throw shape_error("attend.shape.shard_total",
                              attend::detail::concat("shard of rank ", r, ' ',
                                                     attend::detail::format_shape(shard.dimensions()), " != expected ",
                                                     attend::detail::format_shape(expected)));
        for (const shard_segment& s : layout.segments(r)) {
            std::array<index_t, Rank> from{}, to{}, extent = dims;
            from[axis] = s.local_begin;
            to[axis] = s.global_begin;
            extent[axis] = s.length;
            full.slice(to, extent) = shard.slice(from, extent);
        }
    }
    return full;
}

/// join_shards of `[batch, heads, len, dim]` (axis 2) or `[batch, len]` (axis 1) shards; rank 3 names its axis.
template <class T, int Rank>
tensor<T, Rank> join_shards(const std::vector<tensor<T, Rank>>& shards, const shard_layout& layout) {
    return join_shards(shards, layout, detail::implied_sequence_axis<Rank>());
}

}  // namespace attend::distributed
