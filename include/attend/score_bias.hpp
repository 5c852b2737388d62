// SPDX-License-Identifier: MIT
#pragma once
/// score_bias: a position-dependent value added to the scaled scores of each (batch, head, query, key), applied
/// tile by tile inside the kernels and never materialized as `[query_len, key_len]`.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "alignment.hpp"
#include "error.hpp"
#include "position.hpp"
#include "tensor.hpp"

namespace attend {

/// What attention adds to the scaled score of query i and key j of head h before masking and softmax. A small
/// closed type so kernels can inline it: none, ALiBi (-slope[h] * |i' - j|) or a T5 relative-position bias
/// (table(bucket(j - i'), h)), where i' = i for alignment::top_left and i + key_len - query_len for
/// alignment::bottom_right (so the last query sits at the last key, as in KV-cache decoding). The alignment has no
/// default: the two differ whenever query_len != key_len. The bias is the same for every batch entry. Copies are cheap: a relative table is shared, not copied.
class score_bias {
public:
    /// No bias; empty() is true and kernels skip it.
    score_bias() = default;

    /// No bias; empty() is true and kernels skip it.
    static score_bias none() { return score_bias(); }

    /// ALiBi: head h adds -slopes_per_head[h] * |i' - j| (see alibi_slopes for the paper's slopes).
    /// Throws value_error `attend.value.alibi_slopes` if a slope is not finite.
    static score_bias alibi(std::vector<double> slopes_per_head, alignment align) {
        for (std::size_t h = 0; h < slopes_per_head.size(); ++h)
            if (!std::isfinite(slopes_per_head[h]))
                throw value_error("attend.value.alibi_slopes",
                                  detail::concat("ALiBi slope of head ", h, " is ", slopes_per_head[h],
                                                 "; slopes must be finite"));
        score_bias b;
        b.kind_ = kind::alibi;
        b.align_ = align;
        b.slopes_ = std::move(slopes_per_head);
        return b;
    }

    /// T5 relative-position bias: head h adds table.value(h, i', j) = table(bucket(j - i'), h). The table is
    /// copied into shared ownership, so the bias stays valid after `table` goes away.
    static score_bias relative(const relative_position_bias<double>& table, alignment align) {
        return relative(std::make_shared<const relative_position_bias<double>>(table), align);
    }

    /// As above for a float table, converted to double once here (every float is exact in double).
    static score_bias relative(const relative_position_bias<float>& table, alignment align) {
        auto converted = std::make_shared<relative_position_bias<double>>(table.heads(), table.bidirectional(),
                                                                          table.num_buckets(), table.max_distance());
        // An element loop, not Eigen's cast(): g++ 12 reports a false -Warray-bounds on the vectorized cast of
        // small tensors, which would break users who build with -Werror.
        const auto& from = table.table();
        auto& to = converted->table();
        for (index_t n = 0; n < from.size(); ++n) to.data()[n] = static_cast<double>(from.data()[n]);
        return relative(std::shared_ptr<const relative_position_bias<double>>(std::move(converted)), align);
    }

    /// As above, sharing a table the caller keeps updating (e.g. during training) instead of copying it.
    /// Throws value_error `attend.value.score_bias_table` if table is null.
    static score_bias relative(std::shared_ptr<const relative_position_bias<double>> table, alignment align) {
        if (!table) throw value_error("attend.value.score_bias_table", "score_bias::relative got a null table");
        score_bias b;
        b.kind_ = kind::relative;
        b.align_ = align;
        b.table_ = std::move(table);
        return b;
    }

    /// True for none(): there is nothing to add.
    bool empty() const { return kind_ == kind::none; }

    /// The alignment i' is computed with.
    alignment bias_alignment() const { return align_; }

    /// The bias of a block of a longer call (ring attention): the block's query 0 is query `query_begin` and its key
    /// 0 key `key_begin` of scores with query_len queries and key_len keys, so the block, computed on its own, adds
    /// what the whole call adds there. Validate against the whole call's shape.
    score_bias block_of(index_t query_begin, index_t key_begin, index_t query_len, index_t key_len) const {
        score_bias b = *this;
        b.offset_ = shift(query_len, key_len) + query_begin - key_begin;
        b.align_ = alignment::top_left;
        return b;
    }

    /// Checks the bias fits scores `[batch, heads, query_len, key_len]`; kernels call it before writing output.
    /// Throws shape_error `attend.shape.score_bias_heads` if the ALiBi slopes or the table's heads != heads;
    /// value_error `attend.value.alibi_slopes` / `attend.value.score_bias_table` if a slope times the largest
    /// distance, or a table value, is beyond the range of T (the scores' scalar type).
    template <class T = double>
    void validate(index_t heads, index_t query_len, index_t key_len) const {
        const auto shape = [&] {
            return detail::concat(" (scores [batch,", heads, ',', query_len, ',', key_len, "])");
        };
        if (kind_ == kind::alibi && static_cast<index_t>(slopes_.size()) != heads)
            throw shape_error("attend.shape.score_bias_heads",
                              detail::concat("ALiBi has ", slopes_.size(), " slopes but attention has ", heads,
                                             " heads", shape()));
        if (kind_ == kind::relative && table_->heads() != heads)
            throw shape_error("attend.shape.score_bias_heads",
                              detail::concat("relative position bias table has ", table_->heads(),
                                             " heads but attention has ", heads, " heads (table ",
                                             detail::format_shape(table_->table().dimensions()), ')', shape()));
        // The bias must be finite in the scores' type T: a slope or table value beyond T's range becomes +-inf
        // there, and inf * 0 (the diagonal) or inf - inf is NaN.
        const double largest = static_cast<double>(std::numeric_limits<T>::max());
        const char* type = detail::scalar_name<T>();
        if (kind_ == kind::alibi) {
            const double reach = static_cast<double>(query_len) + static_cast<double>(key_len);  // > |key - query|
            for (std::size_t h = 0; h < slopes_.size(); ++h)
                if (std::abs(slopes_[h]) * reach > largest)
                    throw value_error("attend.value.alibi_slopes",
                                      detail::concat("ALiBi slope of head ", h, " is ", slopes_[h],
                                                     ": times distances up to ", reach, " it leaves the range of ",
                                                     type, ", the scalar type of the scores", shape()));
        }
        if (kind_ == kind::relative) {
            const auto& t = table_->table();
            for (index_t n = 0; n < t.size(); ++n)
                if (std::abs(t.data()[n]) > largest)
                    throw value_error("attend.value.score_bias_table",
                                      detail::concat("relative position bias table holds ", t.data()[n],
                                                     ", beyond the range of ", type, ", the scalar type of the scores",
                                                     shape()));
        }
    }

    /// The bias of query i, key j of head `head` for scores with query_len queries and key_len keys, in T.
    /// add_tile adds exactly this value. Call validate first; head must be in [0, heads).
    template <class T>
    T value(index_t head, index_t i, index_t j, index_t query_len, index_t key_len) const {
        require_scalar<T>();
        if (kind_ == kind::none) return T(0);
        ATTEND_ASSERT(head >= 0);
        ATTEND_ASSERT(kind_ != kind::alibi || head < static_cast<index_t>(slopes_.size()));
        ATTEND_ASSERT(kind_ != kind::relative || head < table_->heads());
        const index_t distance = j - (i + shift(query_len, key_len));  // key - query, as T5 defines it
        if (kind_ == kind::alibi) return alibi_value<T>(head, distance);
        return relative_value<T>(head, distance);
    }

    /// Adds the bias to a row-major tile of scores: scores[r * ld + c] is query query_begin + r and key
    /// key_begin + c of head `head`, r < rows, c < cols, in scores of query_len x key_len. Call validate first.
    /// The bias depends only on the diagonal j - i', so it is computed once per diagonal of the tile
    /// (rows + cols - 1 values; ALiBi splits at the diagonal, no abs per element) and every row adds a
    /// contiguous slice of it: the inner loop is a plain vectorizable add.
    template <class T>
    void add_tile(index_t head, index_t query_begin, index_t key_begin, index_t rows, index_t cols, index_t query_len,
                  index_t key_len, T* scores, index_t ld) const {
        require_scalar<T>();
        if (kind_ == kind::none || rows <= 0 || cols <= 0) return;
        ATTEND_ASSERT(head >= 0);
        ATTEND_ASSERT(ld >= cols);
        const index_t diagonals = rows + cols - 1;
        // Covers the kernels' largest tile (128 queries x 512 keys -> 639 diagonals) without a heap allocation.
        constexpr index_t stack_size = 1024;
        T stack[stack_size];
        std::vector<T> heap;
        T* bias = stack;
        if (diagonals > stack_size) {
            heap.resize(static_cast<std::size_t>(diagonals));
            bias = heap.data();
        }
        // bias[rows - 1 - r + c] belongs to distance j - i' = first + (rows - 1 - r + c).
        const index_t first = key_begin - (query_begin + rows - 1 + shift(query_len, key_len));
        if (kind_ == kind::alibi) {
            ATTEND_ASSERT(head < static_cast<index_t>(slopes_.size()));
            const T slope = static_cast<T>(slopes_[static_cast<std::size_t>(head)]);
            const index_t split = std::clamp<index_t>(-first, 0, diagonals);  // first diagonal with j >= i'
            for (index_t d = 0; d < split; ++d) bias[d] = -(slope * static_cast<T>(-(first + d)));
            for (index_t d = split; d < diagonals; ++d) bias[d] = -(slope * static_cast<T>(first + d));
        } else {
            ATTEND_ASSERT(head < table_->heads());
            for (index_t d = 0; d < diagonals; ++d) bias[d] = relative_value<T>(head, first + d);
        }
        for (index_t r = 0; r < rows; ++r) {
            T* row = scores + r * ld;
            const T* b = bias + (rows - 1 - r);
            for (index_t c = 0; c < cols; ++c) row[c] += b[c];
        }
    }

private:
    enum class kind { none, alibi, relative };

    template <class T>
    static constexpr void require_scalar() {
        static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                      "attend: score_bias adds to float or double scores");
    }

    index_t shift(index_t query_len, index_t key_len) const {
        return offset_ + (align_ == alignment::bottom_right ? key_len - query_len : 0);
    }

    template <class T>
    T alibi_value(index_t head, index_t distance) const {
        const T slope = static_cast<T>(slopes_[static_cast<std::size_t>(head)]);
        return -(slope * static_cast<T>(distance < 0 ? -distance : distance));
    }

    template <class T>
    T relative_value(index_t head, index_t distance) const {
        const index_t bucket =
            relative_position_bucket(distance, table_->bidirectional(), table_->num_buckets(), table_->max_distance());
        return static_cast<T>(table_->table()(bucket, head));
    }

    kind kind_ = kind::none;
    alignment align_ = alignment::top_left;
    index_t offset_ = 0;  ///< added to i' (block_of)
    std::vector<double> slopes_;
    std::shared_ptr<const relative_position_bias<double>> table_;
};

}  // namespace attend
