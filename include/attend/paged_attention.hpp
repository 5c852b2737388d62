// SPDX-License-Identifier: MIT
#pragma once
/// paged_attention: attention of new queries over the sequences of a paged_kv_cache (paged_cache.hpp), a ragged
/// batch read in place through each sequence's block table. The data path is scaled_dot_product_attention's:
/// inputs -> checks (every sequence, before anything is written) -> the tiled kernel on the blocks -> outputs.

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "mask.hpp"
#include "paged_cache.hpp"
#include "sdpa.hpp"

namespace attend {

namespace detail {

/// The rule of a query over its own sequence in a cache: causal, aligned at the bottom right (query i of
/// query_len sits at position key_len - query_len + i), and with a rolling window only the `window_left`
/// positions before it. Without a window the band is unbounded, which classifies and masks exactly as causal alone.
inline auto cached_rule(index_t window_left) {
    return causal(alignment::bottom_right) && sliding_window(window_left, 0, alignment::bottom_right);
}

/// The shape of one sequence's call over a cache: `queries` new queries of `heads` heads over its key_len
/// positions of `kv_heads` heads (batch 1).
inline attention_shape sequence_shape(index_t heads, index_t kv_heads, index_t queries, index_t key_len,
                                      index_t head_dim, index_t value_dim) {
    attention_shape s;
    s.batch = 1;
    s.heads = heads;
    s.kv_heads = kv_heads;
    s.query_len = queries;
    s.key_len = key_len;
    s.head_dim = head_dim;
    s.value_dim = value_dim;
    return s;
}

/// Throws what a paged_attention call with these arguments throws for its shapes and sequences.
template <class Q, class T>
void check_paged_call(const strided_view<const Q>& q, const paged_kv_cache<T>& cache,
                      const std::vector<index_t>& sequences, const std::vector<index_t>& query_counts) {
    check_view_sizes(q, "query");
    const index_t B = q.dims[0], H = q.dims[1], L = q.dims[2];
    if (static_cast<index_t>(sequences.size()) != B || static_cast<index_t>(query_counts.size()) != B)
        throw shape_error("attend.shape.sequences",
                          concat("query ", spell_view(q), " has ", B, " batch rows but ", sequences.size(),
                                 " sequences and ", query_counts.size(), " query counts are given (one each)"));
    if (q.dims[3] != cache.head_dim())
        throw shape_error("attend.shape.key_dim", concat("query head_dim ", q.dims[3], " != cache head_dim ",
                                                         cache.head_dim(), " (query ", spell_view(q), ')'));
    if (H < 1 || H % cache.kv_heads() != 0)
        throw shape_error("attend.shape.gqa",
                          concat("heads ", H, " is not a positive multiple of the cache's kv_heads ", cache.kv_heads(),
                                 " (query ", spell_view(q), ')'));
    for (std::size_t n = 0; n < sequences.size(); ++n) {
        const index_t id = sequences[n], count = query_counts[n], length = cache.length(id);
        if (count < 0 || count > L || count > length)
            throw shape_error("attend.shape.sequences",
                              concat("sequence ", id, " (batch row ", n, ") has ", count,
                                     " queries, outside [0, min(query_len ", L, ", its length ", length,
                                     ")]: its queries are its last positions, appended before the call"));
        if (count > 0) cache.check_window(id, length - count);
    }
}

/// paged_attention on a checked view of q (of T, or float over a 16-bit or int8 cache), inside its allocation guard.
/// `mask_of(n)` is the rule of batch row n's sequence, bound as that sequence's own call `[1, heads, query_counts[n],
/// length]` and intersected with its cached rule.
template <class Q, class T, class MaskOf>
attention_result<Q, 4> paged_attention_views(const strided_view<const Q>& qv, const paged_kv_cache<T>& cache,
                                             const std::vector<index_t>& sequences,
                                             const std::vector<index_t>& query_counts, const MaskOf& mask_of,
                                             const sdpa_options& options) {
    using Acc = accumulator_t<Q>;
    check_paged_call(qv, cache, sequences, query_counts);
    if (options.need_weights)
        throw value_error("attend.value.need_weights",
                          "need_weights is not available over a paged cache: key_len differs per sequence; use "
                          "scaled_dot_product_attention over one sequence's keys for them");
    const index_t B = qv.dims[0], H = qv.dims[1], L = qv.dims[2], Dv = cache.value_dim();
    using call_type = decltype(check_call(qv, cache.key_blocks(0), cache.value_blocks(0), attention_shape{},
                                          mask_of(0) && cached_rule(unbounded), options));
    std::vector<call_type> calls;
    std::vector<attention_shape> shapes;
    allocating(
        [&] {
            calls.reserve(static_cast<std::size_t>(B));
            shapes.reserve(static_cast<std::size_t>(B));
        },
        [&] { return std::string("the per-sequence calls of paged_attention"); }, "Attend fewer sequences at once");
    // check_finite's scan of each sequence's keys and values is left to its kernel run (defer_kv_scan), which notes
    // them in its decode pass: a later sequence's error is thrown after earlier ones wrote into r, but r is this
    // call's own and never returned then, so the call still gives all or nothing.
    for (index_t n = 0; n < B; ++n) {
        const index_t id = sequences[static_cast<std::size_t>(n)];
        const auto k = cache.key_blocks(id), v = cache.value_blocks(id);
        const attention_shape s = sequence_shape(H, cache.kv_heads(), query_counts[static_cast<std::size_t>(n)],
                                                 k.dims[2], cache.head_dim(), Dv);
        shapes.push_back(s);
        calls.push_back(check_call(batch_rows(qv, n, s.query_len), k, v, s,
                                   mask_of(n) && cached_rule(cache.window_left()), options, true));
    }
    attention_result<Q, 4> r;
    const char* hint = "split the batch";
    resize_guarded(r.out, std::array<index_t, 4>{B, H, L, Dv}, "out", hint);
    if (options.need_lse) resize_guarded(r.lse, std::array<index_t, 3>{B, H, L}, "lse", hint);
    tensor<Acc, 1> lse_rows;  // one sequence's lse [1, heads, queries], contiguous as the kernel writes it
    if (options.need_lse) resize_guarded(lse_rows, std::array<index_t, 1>{H * L}, "lse scratch", hint);
    r.out.setConstant(Q(0));
    if (options.need_lse) r.lse.setConstant(-std::numeric_limits<Acc>::infinity());
    const auto out = as_mutable_view(r.out);
    for (index_t n = 0; n < B; ++n) {
        const attention_shape& s = shapes[static_cast<std::size_t>(n)];
        if (s.query_len == 0) continue;
        const index_t id = sequences[static_cast<std::size_t>(n)];
        attention_outputs<Q> o;
        o.out = batch_rows(out, n, s.query_len);
        o.lse = options.need_lse ? lse_rows.data() : nullptr;
        run_checked(batch_rows(qv, n, s.query_len), cache.key_blocks(id), cache.value_blocks(id), s,
                    calls[static_cast<std::size_t>(n)], o);
        if (options.need_lse)
            for (index_t h = 0; h < H; ++h)
                std::copy(lse_rows.data() + h * s.query_len, lse_rows.data() + (h + 1) * s.query_len,
                          r.lse.data() + (n * H + h) * L);
    }
    return r;
}

/// paged_attention with the rule of each batch row from mask_of(n): the query check, then the call in its
/// allocation guard.
template <class Q, class T, class MaskOf>
auto paged_attention_masked(const Q& q, const paged_kv_cache<T>& cache, const std::vector<index_t>& sequences,
                            const std::vector<index_t>& query_counts, const MaskOf& mask_of,
                            const sdpa_options& options) {
    static_assert(
        storage_pair_v<scalar_of<Q>, T> && rank_of<Q>() == 4,
        "attend: paged_attention takes a rank-4 query [batch, heads, query_len, head_dim] of the cache's "
        "scalar type, or a float query over an Eigen::half or Eigen::bfloat16 cache, or a float, Eigen::half or "
        "Eigen::bfloat16 query over a q8_0_block (int8) cache");
    const auto qv = checked_input(q);
    // Every allocation of the call (lists, scratch, messages) fails as a typed error, before anything is written.
    return allocating([&] { return paged_attention_views(qv, cache, sequences, query_counts, mask_of, options); },
                      [] { return std::string("paged_attention's bookkeeping"); }, "Attend fewer sequences");
}

}  // namespace detail

/// Attention of the newest positions of several sequences of `cache` over everything each of them holds:
/// q `[batch, heads, query_len, head_dim]`, batch row n for sequence sequences[n], whose first query_counts[n] rows
/// are its last query_counts[n] positions (appended to the cache before this call, so query i sits at position
/// length - query_counts[n] + i and sees positions up to its own: causal, bottom-right aligned; with a rolling
/// window only the last window of them). Rows past query_counts[n] are padding: zero output, lse -inf. Returns out
/// `[batch, heads, query_len, value_dim]` and lse `[batch, heads, query_len]` (options.need_lse).
///
/// Each sequence is computed as a call of its own over its blocks, read in place: its result is bit for bit what
/// scaled_dot_product_attention gives for it alone over a contiguous cache (the batch never changes a sequence's
/// bits), and options' score_mod, score_bias and dropout see batch 0 and the sequence's own query and key indices.
/// Throws value_error `attend.value.sequence`, shape_error `attend.shape.sequences` (list sizes, a count outside
/// [0, min(query_len, length)]), `attend.shape.key_dim`, `attend.shape.gqa`, position_error
/// `attend.position.window` (a query would see positions the rolling window dropped), value_error
/// `attend.value.need_weights` (weights are not available over a cache), and what scaled_dot_product_attention
/// throws for the options and values; all before anything is written.
template <class Q, class T>
auto paged_attention(const Q& q, const paged_kv_cache<T>& cache, const std::vector<index_t>& sequences,
                     const std::vector<index_t>& query_counts, const sdpa_options& options = {}) {
    return detail::paged_attention_masked(
        q, cache, sequences, query_counts, [](index_t) { return no_mask{}; }, options);
}

/// paged_attention under a rule besides the cached one: each sequence's queries see what `mask` allows of its
/// positions and what causality and the rolling window allow. The mask is bound as each sequence's own call,
/// scores `[1, heads, query_counts[n], length]` (batch 0, the sequence's own query and key indices, as score_mod
/// sees them): a rule with a diagonal takes alignment::bottom_right, as the queries are the last positions, e.g.
/// `chunked(C, alignment::bottom_right)`. Throws what the form above throws, and the mask's binding errors.
template <class Q, class T, class Mask, std::enable_if_t<detail::is_boolean_v<Mask>, int> = 0>
auto paged_attention(const Q& q, const paged_kv_cache<T>& cache, const std::vector<index_t>& sequences,
                     const std::vector<index_t>& query_counts, const Mask& mask, const sdpa_options& options = {}) {
    return detail::paged_attention_masked(
        q, cache, sequences, query_counts, [&](index_t) { return mask; }, options);
}

/// paged_attention under one rule per batch row (rules with per-sequence data, such as each sequence's
/// bidirectional_groups ids `[1, length]`): masks_per_sequence[n] is bound as sequence n's own call, as above.
/// Throws shape_error `attend.shape.sequences` unless there is one mask per batch row, and what the forms above
/// throw.
template <class Q, class T, class Mask, std::enable_if_t<detail::is_boolean_v<Mask>, int> = 0>
auto paged_attention(const Q& q, const paged_kv_cache<T>& cache, const std::vector<index_t>& sequences,
                     const std::vector<index_t>& query_counts, const std::vector<Mask>& masks_per_sequence,
                     const sdpa_options& options = {}) {
    if (masks_per_sequence.size() != sequences.size())
        throw shape_error("attend.shape.sequences",
                          detail::concat(masks_per_sequence.size(), " masks for ", sequences.size(),
                                         " sequences (one mask per batch row)"));
    return detail::paged_attention_masked(
        q, cache, sequences, query_counts, [&](index_t n) { return masks_per_sequence[static_cast<std::size_t>(n)]; },
        options);
}

}  // namespace attend
