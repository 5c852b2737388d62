// SPDX-License-Identifier: MIT
#pragma once
/// Where a causal-style rule puts its diagonal when query_len != key_len: an alignment, an explicit offset (one
/// for every batch row or one per row), or the real key lengths of each row. Every rule and bias whose meaning
/// depends on the diagonal takes one of these, and none has a default.

#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "error.hpp"
#include "tensor.hpp"

namespace attend {

/// top_left: query i sees keys j <= i (PyTorch's is_causal). bottom_right: j <= i + key_len - query_len, so the
/// last query sees the last key (KV-cache decoding, FlashAttention >= 2.1). Equal when query_len == key_len.
enum class alignment { top_left, bottom_right };

/// A window side without a bound: `sliding_window(unbounded, 0, d)` is `causal(d)` (ONNX's -1 for a side).
inline constexpr index_t unbounded = std::numeric_limits<index_t>::max();

namespace detail {
/// A diagonal resolved against one call: query i of batch row b has its diagonal at key i + offset_of(b). Offsets
/// are as the caller gave them (any index); the rules clamp what they derive from them.
struct bound_diagonal {
    index_t offset = 0;                                     ///< every row's, unless per_batch is set
    std::shared_ptr<const std::vector<index_t>> per_batch;  ///< [batch] offsets, or null

    index_t offset_of(index_t b) const { return per_batch ? (*per_batch)[static_cast<std::size_t>(b)] : offset; }
};
/// The window_left of a Hugging Face config's `sliding_window: W` (W keys, the query's own included): W - 1.
/// Throws mask_error attend.mask.window_from_config for W <= 0.
inline index_t window_left_from_config(index_t window_keys) {
    if (window_keys <= 0)
        throw mask_error("attend.mask.window_from_config",
                         concat("a window from a config's sliding_window: ", window_keys,
                                " needs at least 1 key (the query's own)"));
    return window_keys - 1;
}

}  // namespace detail

/// The diagonal of a rule: query i of batch row b sees "its" key at i + offset(b). Build it from an alignment
/// (implicitly: `causal(alignment::bottom_right)`), from `diagonal_offset(n)` / `diagonal_offsets({..})`, or from
/// `aligned_to_key_lengths({..})`. Cheap to copy: per-row offsets are shared.
class diagonal {
public:
    /// top_left (offset 0) or bottom_right (offset key_len - query_len).
    diagonal(alignment a) : kind_(a == alignment::top_left ? kind::top_left : kind::bottom_right) {}  // NOLINT

    /// The same offset for every batch row: query i's diagonal is key i + offset (ONNX's past_sequence_length).
    static diagonal offset(index_t offset) {
        diagonal d(alignment::top_left);
        d.kind_ = kind::offset;
        d.offset_ = offset;
        return d;
    }
    /// One offset per batch row: row b's query i has its diagonal at key i + offsets[b].
    static diagonal offsets(std::vector<index_t> per_batch) {
        diagonal d(alignment::top_left);
        d.kind_ = kind::per_batch;
        d.values_ = std::make_shared<const std::vector<index_t>>(std::move(per_batch));
        return d;
    }
    /// Bottom-right per batch row over its real keys: row b's last query sits on key key_lengths[b] - 1, so
    /// offset(b) = key_lengths[b] - query_len (ONNX Attention's nonpad_kv_seqlen, ORT GroupQueryAttention's
    /// seqlens_k + 1, FlashAttention's seqused_k). Lengths must lie in [0, key_len] when bound.
    static diagonal key_lengths(std::vector<index_t> key_lengths) {
        diagonal d(alignment::top_left);
        d.kind_ = kind::key_lengths;
        d.values_ = std::make_shared<const std::vector<index_t>>(std::move(key_lengths));
        return d;
    }

    /// The diagonal resolved for a call of `batch` rows, query_len queries and key_len keys. Throws mask_error
    /// attend.mask.diagonal_batch when per-row values are not one per batch row, attend.mask.length_range when a
    /// key length lies outside [0, key_len]. `rule` names the rule in messages.
    detail::bound_diagonal bind(index_t batch, index_t query_len, index_t key_len, const char* rule) const {
        detail::bound_diagonal d;
        switch (kind_) {
            case kind::top_left: return d;
            case kind::bottom_right: d.offset = key_len - query_len; return d;
            case kind::offset: d.offset = offset_; return d;
            case kind::per_batch:
            case kind::key_lengths: break;
        }
        const char* what = kind_ == kind::per_batch ? "diagonal offsets" : "key lengths";
        if (static_cast<index_t>(values_->size()) != batch)
            throw mask_error("attend.mask.diagonal_batch",
                             detail::concat(rule, " has ", values_->size(), ' ', what, " for batch ", batch,
                                            " (one per batch row)"));
        std::vector<index_t> offsets(values_->size());
        for (std::size_t b = 0; b < offsets.size(); ++b) {
            const index_t v = (*values_)[b];
            if (kind_ == kind::key_lengths && (v < 0 || v > key_len))
                throw mask_error("attend.mask.length_range",
                                 detail::concat(rule, " key length ", v, " of batch ", b,
                                                " is outside [0, key_len = ", key_len, ']'));
            offsets[b] = kind_ == kind::key_lengths ? v - query_len : v;
        }
        d.per_batch = std::make_shared<const std::vector<index_t>>(std::move(offsets));
        return d;
    }

private:
    enum class kind { top_left, bottom_right, offset, per_batch, key_lengths };
    kind kind_;
    index_t offset_ = 0;
    std::shared_ptr<const std::vector<index_t>> values_;
};

/// The diagonal at key i + offset for every batch row (ONNX Attention's past_sequence_length as the offset).
inline diagonal diagonal_offset(index_t offset) { return diagonal::offset(offset); }
/// The diagonal of row b at key i + offsets[b] (one offset per batch row).
inline diagonal diagonal_offsets(std::vector<index_t> offsets) { return diagonal::offsets(std::move(offsets)); }
/// Bottom-right over each row's real keys: row b's last query sits on key key_lengths[b] - 1 (ONNX's
/// nonpad_kv_seqlen, ORT GQA's seqlens_k + 1). Combine with key_padding(key_lengths) to forbid the padded keys.
inline diagonal aligned_to_key_lengths(std::vector<index_t> key_lengths) {
    return diagonal::key_lengths(std::move(key_lengths));
}

}  // namespace attend
