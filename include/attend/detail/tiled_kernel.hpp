#pragma once
/// The tiled kernel: FlashAttention-2's forward pass on Eigen GEMM tiles. Per work unit (batch, kv head, query
/// block) the keys stream by in tiles; each row keeps a running max, a running sum and an accumulator that is
/// rescaled when the max grows, so memory is O(threads x tile), never O(query_len x key_len) (except the weights
/// output, when asked for). Semantics are the reference kernel's (reference_kernel.hpp) within rounding:
/// scores = scale q.k + score_bias, masked, softmax along keys, lse kept, dropout on the probabilities that
/// multiply V (replayed from dropout_rule, the same decisions as the reference), padded queries and empty rows
/// give zero rows and lse -inf, never NaN.
///
/// Grouped-query attention: a work unit holds all `heads / kv_heads` query heads of one kv head, their query rows
/// stacked into one block ([head 0 rows; head 1 rows; ...]), so each K and V tile is read from memory and packed
/// once for the whole group. Mask classification, score_bias and dropout stay per head: the block is made of
/// per-head sub-blocks, each classified and masked as its own tile. (A block of at most gemv_rows rows, e.g. one
/// decoded query on 4 query heads per kv head, uses one GEMV per row over L1-sized key slices instead of a GEMM,
/// which would copy K and V into packed panels first.)
///
/// Masks: a tile classified empty for every head is skipped before its GEMM; a full tile gets no per-element mask
/// work; a mixed tile is cut into runs of 32-key strips, the strips every row may see go through one block GEMM,
/// the others through 32-query slabs each trimmed to the keys it may see (a causal diagonal or a window edge costs
/// about a slab-sized triangle, not a block-sized one).
///
/// Decoding (query_len <= 16, no weights asked): a block has too few rows to keep threads busy, so the keys are
/// also split into fixed-size chunks (the chunk size depends on the shape only, never on the thread count); the
/// chunks run in parallel and their partial outputs are combined with merge_partials' formula (merge_rows.hpp) in
/// chunk order, so the result is bit-identical for any thread count.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../score_bias.hpp"
#include "../shape.hpp"
#include "dropout.hpp"
#include "mask_nodes.hpp"
#include "memory.hpp"
#include "merge_rows.hpp"
#include "reference_kernel.hpp"
#include "thread_pool.hpp"

namespace attend::detail {

/// Tile sizes of the tiled kernel. They depend only on the call's shape, never on the thread count, which is
/// part of why results are bit-identical for any thread count.
struct tile_config {
    index query_rows = 128;      ///< rows of a query block: the group's heads x queries per head (about)
    index key_tile = 512;        ///< keys per tile
    index trim_step = 32;        ///< a mixed tile drops empty key columns from both ends in steps of this many
    index slab_rows = 32;        ///< a mixed tile is processed in slabs of this many queries of one head
    index gemv_rows = 8;         ///< slabs of at most this many rows use one GEMV per row instead of a GEMM
    index decode_queries = 16;   ///< query_len at or below which keys are split into chunks (decode path)
    index decode_chunk = 2048;   ///< keys per chunk of the decode path
};

/// Tile sizes chosen by measurement (bench/README.md has the sweep, `attend_bench --benchmark_filter=tiled_tiles`)
/// on Zen 4 (AVX-512, 1 MiB L2 per core), fp32, head_dim 64, L = S = 2048, one thread. Blocks of 64 to 256 query
/// rows x 256 to 1024 keys all ran within about 5 % of each other and of the same work done as two materialized
/// GEMMs; 32 rows or 128 keys were up to 50 % slower: Eigen packs both GEMM operands on every call, so each K and
/// V tile is re-packed once per query block, and small blocks pay that, plus the per-tile softmax bookkeeping, too
/// often. 128 rows x 512 keys was among the fastest and keeps the score tile (256 KiB) and the K and V tiles
/// (128 KiB each) in L2; more rows would put more of a causal diagonal or a window edge into mixed tiles (those
/// are cut into 32-key strips and 32-query slabs, but each slab is a smaller, slower GEMM). Double uses half the
/// keys, so its tiles take the same bytes; head dims of 128 or more halve the key tile again. The decode chunk is
/// 4 key tiles: at key_len 8192, head_dim 128 that is 8 chunks per kv head to spread over threads.
template <class T>
tile_config default_tile_config(const attention_shape& s) {
    tile_config c;
    c.query_rows = 128;
    c.key_tile = sizeof(T) == 4 ? 512 : 256;
    if (std::max(s.head_dim, s.value_dim) >= 128) c.key_tile /= 2;
    c.decode_chunk = 4 * c.key_tile;
    return c;
}

template <class T>
using tile_map = Eigen::Map<row_matrix<T>, 0, Eigen::OuterStride<>>;
template <class T>
using const_tile_map = Eigen::Map<const row_matrix<T>, 0, Eigen::OuterStride<>>;

/// A contiguous run of scores as an Eigen array, for Eigen's vectorized reductions.
template <class T>
Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> row_array(T* x, index n) {
    return Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(x, n);
}

/// x[j] = exp(x[j] - shift) on a contiguous run, exactly 0 where x[j] is -inf (a forbidden key) and where the
/// result would be subnormal (below 1e-38 in float next to a row maximum of 1: no effect on any sum, and it keeps
/// subnormals, which are slow on many cores, out of the GEMM). Eigen's vectorized exp does the work; on its own it
/// returns a tiny positive number, not 0, for -inf in double.
template <class T>
void exp_shifted(T* x, index n, T shift) {
    auto a = row_array(x, n);
    a = (a - shift).exp();
    constexpr T tiny = std::numeric_limits<T>::min();
    for (index j = 0; j < n; ++j) x[j] = x[j] < tiny ? T(0) : x[j];
}

/// One worker's scratch memory, allocated once per call before the workers start (never inside the tile loop).
template <class T>
struct tiled_workspace {
    std::vector<T> queries;   ///< [rows, head_dim], scaled
    std::vector<T> scores;    ///< [rows, key_tile], scores then probabilities
    std::vector<T> acc;       ///< [rows, value_dim]
    std::vector<T> row_max;   ///< [rows]
    std::vector<T> row_sum;   ///< [rows]
    std::vector<T> row_new_max;  ///< [rows], the running max after the current tile
    std::vector<T> row_scale;    ///< [rows], exp(old max - new max): what the accumulator is rescaled by
    std::vector<tile_class> classes;  ///< [group]

    tiled_workspace(index rows, index head_dim, index key_tile, index value_dim, index group)
        : queries(static_cast<std::size_t>(rows * head_dim)),
          scores(static_cast<std::size_t>(rows * key_tile)),
          acc(static_cast<std::size_t>(rows * value_dim)),
          row_max(static_cast<std::size_t>(rows)),
          row_sum(static_cast<std::size_t>(rows)),
          row_new_max(static_cast<std::size_t>(rows)),
          row_scale(static_cast<std::size_t>(rows)),
          classes(static_cast<std::size_t>(group)) {}
};

/// The tiled forward pass of one call; see the file comment.
template <class T, class Bound>
class tiled_runner {
public:
    tiled_runner(const strided_view<const T>& q, const strided_view<const T>& k, const strided_view<const T>& v,
                 const attention_shape& s, const Bound& mask, const kernel_params<T>& p,
                 const attention_outputs<T>& o, const tile_config& c)
        : q_(q), k_(k), v_(v), s_(s), mask_(mask), p_(p), o_(o), c_(c) {
        group_ = s.group_size();
        // At least 1 even for query_len == 0, where query_blocks_ becomes 0 and there is no work.
        block_queries_ = std::max<index>(1, std::min(s.query_len, (c.query_rows + group_ - 1) / group_));
        query_blocks_ = (s.query_len + block_queries_ - 1) / block_queries_;
        rows_ = group_ * block_queries_;
        bias_ = p.bias && !p.bias->empty() ? p.bias : nullptr;
    }

    void run(int threads) {
        if (s_.batch == 0 || s_.query_len == 0) return;
        const bool decode = s_.query_len <= c_.decode_queries && o_.weights == nullptr && s_.key_len > c_.decode_chunk;
        if (decode) run_decode(threads);
        else run_blocks(threads);
    }

private:
    // ---- work units -------------------------------------------------------------------------------------------
    struct block {
        index batch, kv_head, query_begin, queries;
    };
    block block_of(index n) const {  // n in [0, batch * kv_heads * query_blocks)
        const index qb = n % query_blocks_, bg = n / query_blocks_;
        const index q0 = qb * block_queries_;
        return {bg / s_.kv_heads, bg % s_.kv_heads, q0, std::min(block_queries_, s_.query_len - q0)};
    }
    index block_count() const { return s_.batch * s_.kv_heads * query_blocks_; }

    std::vector<tiled_workspace<T>> workspaces(index units, int threads) const {
        const int workers = static_cast<int>(std::min<index>(std::max(threads, 1), units));
        return allocating(
            [&] {
                std::vector<tiled_workspace<T>> w;
                w.reserve(static_cast<std::size_t>(workers));
                for (int n = 0; n < workers; ++n) w.emplace_back(rows_, s_.head_dim, c_.key_tile, s_.value_dim, group_);
                return w;
            },
            [&] {
                const index per_worker = rows_ * (s_.head_dim + c_.key_tile + s_.value_dim + 4);
                return allocation_text("the tiled kernel's scratch (workers x elements)",
                                       std::array<index, 2>{workers, per_worker}, sizeof(T));
            },
            "Fewer threads need less scratch");
    }

    void run_blocks(int threads) {
        const index units = block_count();
        auto ws = workspaces(units, threads);
        parallel_for(units, threads, [&](index unit, int worker) {
            auto& w = ws[static_cast<std::size_t>(worker)];
            const block blk = block_of(unit);
            load_queries(w, blk);
            stream_keys(w, blk, 0, s_.key_len);
            finish_rows(w, blk);
            if (o_.weights) write_weights(w, blk);
        });
    }

    void run_decode(int threads) {
        const index chunks = (s_.key_len + c_.decode_chunk - 1) / c_.decode_chunk;
        const index blocks = block_count(), units = blocks * chunks;
        const index dv = s_.value_dim;
        // Partial results of every (block, chunk), normalized: out = acc / sum, lse = max + log(sum).
        std::vector<T> part_out, part_lse;
        allocating(
            [&] {
                part_out.resize(static_cast<std::size_t>(units * rows_ * dv));
                part_lse.resize(static_cast<std::size_t>(units * rows_));
            },
            [&] {
                return allocation_text("the decode path's partial outputs (units x rows x (value_dim + 1))",
                                       std::array<index, 3>{units, rows_, dv + 1}, sizeof(T));
            },
            "Split the call over the batch");
        auto ws = workspaces(units, threads);
        parallel_for(units, threads, [&](index unit, int worker) {
            auto& w = ws[static_cast<std::size_t>(worker)];
            const block blk = block_of(unit / chunks);
            const index chunk = unit % chunks;
            const index k0 = chunk * c_.decode_chunk, k1 = std::min(s_.key_len, k0 + c_.decode_chunk);
            load_queries(w, blk);
            stream_keys(w, blk, k0, k1);
            const index rows = group_ * blk.queries;
            for (index r = 0; r < rows; ++r) {
                T* out = part_out.data() + (unit * rows_ + r) * dv;
                T& lse = part_lse[static_cast<std::size_t>(unit * rows_ + r)];
                const T m = w.row_max[static_cast<std::size_t>(r)], l = w.row_sum[static_cast<std::size_t>(r)];
                const T* acc = w.acc.data() + r * dv;
                if (m == minus_infinity<T>() || !(l > 0)) {
                    std::fill(out, out + dv, T(0));
                    lse = minus_infinity<T>();
                } else {
                    for (index d = 0; d < dv; ++d) out[d] = acc[d] / l;
                    lse = m + std::log(l);
                }
            }
        });
        // Combine the chunks of each block in chunk order, one block per unit.
        parallel_for(blocks, threads, [&](index n, int) {
            const block blk = block_of(n);
            const index rows = group_ * blk.queries;
            for (index r = 0; r < rows; ++r) {
                T* first = part_out.data() + (n * chunks * rows_ + r) * dv;
                T lse = part_lse[static_cast<std::size_t>(n * chunks * rows_ + r)];
                for (index c = 1; c < chunks; ++c) {
                    const index at = (n * chunks + c) * rows_ + r;
                    lse = merge_row(first, lse, part_out.data() + at * dv, part_lse[static_cast<std::size_t>(at)],
                                    first, dv);
                }
                const index h = blk.kv_head * group_ + r / blk.queries, i = blk.query_begin + r % blk.queries;
                T* out = o_.out.row(blk.batch, h, i);
                T* lse_out = o_.lse ? o_.lse + (blk.batch * s_.heads + h) * s_.query_len + i : nullptr;
                if (mask_.query_padded(blk.batch, i) || lse == minus_infinity<T>()) {
                    std::fill(out, out + dv, T(0));
                    if (lse_out) *lse_out = minus_infinity<T>();
                } else {
                    std::copy(first, first + dv, out);
                    if (lse_out) *lse_out = lse;
                }
            }
        });
    }

    // ---- one block --------------------------------------------------------------------------------------------
    /// The block's query rows, head after head, times the scale (folded in once instead of per score).
    void load_queries(tiled_workspace<T>& w, const block& blk) const {
        const index d = s_.head_dim;
        for (index hh = 0; hh < group_; ++hh)
            for (index r = 0; r < blk.queries; ++r) {
                const T* src = q_.row(blk.batch, blk.kv_head * group_ + hh, blk.query_begin + r);
                T* dst = w.queries.data() + (hh * blk.queries + r) * d;
                for (index x = 0; x < d; ++x) dst[x] = p_.scale * src[x];
            }
    }

    /// A slab of a block: query heads [head_begin, head_end) of the group x queries [query_begin, query_end) of the
    /// block (offsets from blk.query_begin), either whole heads or part of one head, so its rows are contiguous:
    /// row r of the block is head r / blk.queries, query r % blk.queries.
    struct slab {
        index head_begin, head_end, query_begin, query_end;
        index first_row(const block& blk) const { return head_begin * blk.queries + query_begin; }
        index rows(const block& blk) const {
            return (head_end - head_begin - 1) * blk.queries + (query_end - query_begin);
        }
    };
    slab whole(const block& blk) const { return {0, group_, 0, blk.queries}; }

    tile query_tile(const block& blk, const slab& sl, index hh, index k0, index k1) const {
        return tile{blk.batch, blk.kv_head * group_ + hh, blk.query_begin + sl.query_begin,
                    blk.query_begin + sl.query_end, k0, k1};
    }

    /// Classifies the slab's per-head tiles over keys [k0, k1) into w.classes; returns empty when all are empty,
    /// full when all are full, mixed otherwise.
    tile_class classify(tiled_workspace<T>& w, const block& blk, const slab& sl, index k0, index k1) const {
        bool any_empty = false, any_full = false, any_mixed = false;
        for (index hh = sl.head_begin; hh < sl.head_end; ++hh) {
            const tile_class c = mask_.classify(query_tile(blk, sl, hh, k0, k1));
            w.classes[static_cast<std::size_t>(hh)] = c;
            any_empty = any_empty || c == tile_class::empty;
            any_full = any_full || c == tile_class::full;
            any_mixed = any_mixed || c == tile_class::mixed;
        }
        if (!any_full && !any_mixed) return tile_class::empty;
        if (!any_empty && !any_mixed) return tile_class::full;
        return tile_class::mixed;
    }

    bool all_empty(const block& blk, const slab& sl, index k0, index k1) const {
        for (index hh = sl.head_begin; hh < sl.head_end; ++hh)
            if (mask_.classify(query_tile(blk, sl, hh, k0, k1)) != tile_class::empty) return false;
        return true;
    }

    /// Scores of the slab against keys [k0, k1) into its rows of w.scores: one GEMM on the stacked rows (one GEMV
    /// per row for a few rows, which reads K straight from its rows where a GEMM would first copy it into
    /// packed panels), then per head the bias and the mask (nothing per element on a full tile without bias;
    /// -inf rows for a head whose tile is empty). Needs w.classes from classify on the same slab and keys.
    void compute_scores(tiled_workspace<T>& w, const block& blk, const slab& sl, index k0, index k1) const {
        const index r0 = sl.first_row(blk), rows = sl.rows(blk), nk = k1 - k0, ld = c_.key_tile;
        const_tile_map<T> queries(w.queries.data() + r0 * s_.head_dim, rows, s_.head_dim,
                                  Eigen::OuterStride<>(s_.head_dim));
        const_tile_map<T> keys(k_.row(blk.batch, blk.kv_head, k0), nk, s_.head_dim,
                               Eigen::OuterStride<>(k_.strides[2]));
        tile_map<T> scores(w.scores.data() + r0 * ld, rows, nk, Eigen::OuterStride<>(ld));
        if (rows <= c_.gemv_rows) {
            // Key slices small enough for L1, so every row after the first reads them from there.
            const index step = gemv_keys(s_.head_dim);
            for (index j0 = 0; j0 < nk; j0 += step) {
                const index nj = std::min(step, nk - j0);
                for (index r = 0; r < rows; ++r)
                    scores.row(r).segment(j0, nj).noalias() = queries.row(r) * keys.middleRows(j0, nj).transpose();
            }
        } else {
            scores.noalias() = queries * keys.transpose();
        }
        const index queries_per_head = sl.query_end - sl.query_begin;
        for (index hh = sl.head_begin; hh < sl.head_end; ++hh) {
            T* sub = w.scores.data() + (hh * blk.queries + sl.query_begin) * ld;
            const tile_class c = w.classes[static_cast<std::size_t>(hh)];
            if (c == tile_class::empty) {
                for (index r = 0; r < queries_per_head; ++r)
                    std::fill(sub + r * ld, sub + r * ld + nk, minus_infinity<T>());
                continue;
            }
            const index h = blk.kv_head * group_ + hh;
            if (bias_)
                bias_->add_tile(h, blk.query_begin + sl.query_begin, k0, queries_per_head, nk, s_.query_len,
                                s_.key_len, sub, ld);
            if (c == tile_class::mixed) mask_.apply(query_tile(blk, sl, hh, k0, k1), sub, ld);
        }
    }

    /// The online softmax over keys [key_begin, key_end): leaves w.acc (unnormalized, dropout applied),
    /// w.row_max and w.row_sum (the undropped normalizer) for the block's rows. A mixed tile (a causal diagonal,
    /// the edge of a window) is cut into runs of key strips: runs every row of the block may fully see go through one
    /// block-wide GEMM, the rest in slabs of slab_rows queries of one head, each trimmed to the key columns it may
    /// see, so masked-out work shrinks with the slab, not with the block.
    void stream_keys(tiled_workspace<T>& w, const block& blk, index key_begin, index key_end) const {
        const index rows = group_ * blk.queries, dv = s_.value_dim;
        std::fill(w.acc.begin(), w.acc.begin() + rows * dv, T(0));
        std::fill(w.row_max.begin(), w.row_max.begin() + rows, minus_infinity<T>());
        std::fill(w.row_sum.begin(), w.row_sum.begin() + rows, T(0));
        const slab all = whole(blk);
        for (index k0 = key_begin; k0 < key_end; k0 += c_.key_tile) {
            const index k1 = std::min(key_end, k0 + c_.key_tile);
            const tile_class c = classify(w, blk, all, k0, k1);
            if (c == tile_class::empty) continue;
            if (c == tile_class::mixed && blk.queries > c_.slab_rows) {
                // Runs of trim_step-wide key strips: strips full for the whole block go through one block-wide
                // GEMM (the part of a causal tile left of the diagonal), the others through slabs.
                for (index a = k0; a < k1;) {
                    const bool full = classify(w, blk, all, a, std::min(k1, a + c_.trim_step)) == tile_class::full;
                    index b = std::min(k1, a + c_.trim_step);
                    while (b < k1 &&
                           (classify(w, blk, all, b, std::min(k1, b + c_.trim_step)) == tile_class::full) == full)
                        b = std::min(k1, b + c_.trim_step);
                    if (full) {
                        stream_tile(w, blk, all, a, b, false);
                    } else {
                        for (index hh = 0; hh < group_; ++hh)
                            for (index q = 0; q < blk.queries; q += c_.slab_rows)
                                stream_tile(w, blk, slab{hh, hh + 1, q, std::min(blk.queries, q + c_.slab_rows)}, a,
                                            b, true);
                    }
                    a = b;
                }
            } else {
                stream_tile(w, blk, all, k0, k1, c == tile_class::mixed);
            }
        }
    }

    /// One step of the online softmax: the slab's rows against keys [k0, k1) (trimmed first when mixed).
    void stream_tile(tiled_workspace<T>& w, const block& blk, const slab& sl, index k0, index k1, bool mixed) const {
        if (mixed) {
            const tile_class c = classify(w, blk, sl, k0, k1);
            if (c == tile_class::empty) return;
            if (c == tile_class::mixed) {
                // Drop key columns no row of the slab may see (the far side of a causal diagonal, the outside of
                // a window); what is left is classified again below.
                while (k1 - k0 > c_.trim_step && all_empty(blk, sl, k0, k0 + c_.trim_step)) k0 += c_.trim_step;
                while (k1 - k0 > c_.trim_step && all_empty(blk, sl, k1 - c_.trim_step, k1)) k1 -= c_.trim_step;
            }
        }
        classify(w, blk, sl, k0, k1);
        const index r0 = sl.first_row(blk), rows = sl.rows(blk), nk = k1 - k0, ld = c_.key_tile, dv = s_.value_dim;
        compute_scores(w, blk, sl, k0, k1);
        // New running max per row, and the factor exp(old max - new max) for all rows in one vectorized exp.
        for (index r = r0; r < r0 + rows; ++r) {
            const auto u = static_cast<std::size_t>(r);
            const T tile_max = row_array(w.scores.data() + r * ld, nk).maxCoeff();
            const T m = w.row_max[u];
            w.row_new_max[u] = std::max(m, tile_max);
            // exp(-inf) = 0 when the row had no allowed key before; exp(0) = 1 when the max stays.
            w.row_scale[u] = m == minus_infinity<T>() ? minus_infinity<T>() : m - w.row_new_max[u];
        }
        exp_shifted(w.row_scale.data() + r0, rows, T(0));
        tile_map<T> acc(w.acc.data() + r0 * dv, rows, dv, Eigen::OuterStride<>(dv));
        const T keep_scale = static_cast<T>(p_.dropout.keep_scale);
        for (index r = r0; r < r0 + rows; ++r) {
            const auto u = static_cast<std::size_t>(r);
            T* row = w.scores.data() + r * ld;
            const T m_new = w.row_new_max[u];
            if (m_new == minus_infinity<T>()) {  // nothing allowed so far: no contribution
                std::fill(row, row + nk, T(0));
                continue;
            }
            exp_shifted(row, nk, m_new);
            const T alpha = w.row_scale[u];
            if (alpha != T(1)) acc.row(r - r0) *= alpha;
            w.row_sum[u] = alpha * w.row_sum[u] + row_array(row, nk).sum();
            w.row_max[u] = m_new;
            if (p_.dropout.active()) {
                const index h = blk.kv_head * group_ + r / blk.queries, i = blk.query_begin + r % blk.queries;
                for (index j = 0; j < nk; ++j)
                    if (row[j] != T(0)) row[j] = p_.dropout.keep(blk.batch, h, i, k0 + j) ? row[j] * keep_scale : T(0);
            }
        }
        const_tile_map<T> probabilities(w.scores.data() + r0 * ld, rows, nk, Eigen::OuterStride<>(ld));
        const_tile_map<T> values(v_.row(blk.batch, blk.kv_head, k0), nk, dv, Eigen::OuterStride<>(v_.strides[2]));
        if (rows <= c_.gemv_rows) {
            const index step = gemv_keys(dv);
            for (index j0 = 0; j0 < nk; j0 += step) {
                const index nj = std::min(step, nk - j0);
                for (index r = 0; r < rows; ++r)
                    acc.row(r).noalias() += probabilities.row(r).segment(j0, nj) * values.middleRows(j0, nj);
            }
        } else {
            acc.noalias() += probabilities * values;
        }
    }

    /// Keys per slice of the GEMV path: 16 KiB of K or V rows, half of a 32 KiB L1.
    static index gemv_keys(index dim) {
        return std::max<index>(8, 16384 / (static_cast<index>(sizeof(T)) * std::max<index>(dim, 1)));
    }

    bool row_is_zero(const tiled_workspace<T>& w, const block& blk, index r) const {
        return mask_.query_padded(blk.batch, blk.query_begin + r % blk.queries) ||
               w.row_max[static_cast<std::size_t>(r)] == minus_infinity<T>() ||
               !(w.row_sum[static_cast<std::size_t>(r)] > 0);
    }

    /// out = acc / sum, lse = max + log(sum); zero rows and lse -inf for padded queries and empty rows. Leaves
    /// max = -inf in w.row_max for zero rows, so write_weights writes zeros there.
    void finish_rows(tiled_workspace<T>& w, const block& blk) const {
        const index rows = group_ * blk.queries, dv = s_.value_dim;
        for (index r = 0; r < rows; ++r) {
            const index h = blk.kv_head * group_ + r / blk.queries, i = blk.query_begin + r % blk.queries;
            T* out = o_.out.row(blk.batch, h, i);
            T& m = w.row_max[static_cast<std::size_t>(r)];
            T lse = minus_infinity<T>();
            if (row_is_zero(w, blk, r)) {
                std::fill(out, out + dv, T(0));
                m = minus_infinity<T>();
            } else {
                const T l = w.row_sum[static_cast<std::size_t>(r)];
                const T* acc = w.acc.data() + r * dv;
                for (index d = 0; d < dv; ++d) out[d] = acc[d] / l;
                lse = m + std::log(l);
            }
            if (o_.lse) o_.lse[(blk.batch * s_.heads + h) * s_.query_len + i] = lse;
        }
    }

    /// Second pass for the weights output: P = exp(S - max) / sum tile by tile, written straight into weights.
    /// Not exp(S - lse): lse rounded in T would cost |lse| ulps of relative accuracy when scores are large.
    void write_weights(tiled_workspace<T>& w, const block& blk) const {
        const index rows = group_ * blk.queries, ld = c_.key_tile, S = s_.key_len;
        const T keep_scale = static_cast<T>(p_.dropout.keep_scale);
        const bool drop = p_.weights_after_dropout && p_.dropout.active();
        const slab all = whole(blk);
        const auto weights_row = [&](index r) {
            const index h = blk.kv_head * group_ + r / blk.queries, i = blk.query_begin + r % blk.queries;
            return o_.weights + ((blk.batch * s_.heads + h) * s_.query_len + i) * S;
        };
        for (index k0 = 0; k0 < S; k0 += c_.key_tile) {
            const index k1 = std::min(S, k0 + c_.key_tile), nk = k1 - k0;
            if (classify(w, blk, all, k0, k1) == tile_class::empty) {
                for (index r = 0; r < rows; ++r) std::fill(weights_row(r) + k0, weights_row(r) + k1, T(0));
                continue;
            }
            compute_scores(w, blk, all, k0, k1);
            for (index r = 0; r < rows; ++r) {
                T* out = weights_row(r) + k0;
                const T m = w.row_max[static_cast<std::size_t>(r)];
                if (m == minus_infinity<T>()) {
                    std::fill(out, out + nk, T(0));
                    continue;
                }
                const T l = w.row_sum[static_cast<std::size_t>(r)];
                std::copy(w.scores.data() + r * ld, w.scores.data() + r * ld + nk, out);
                exp_shifted(out, nk, m);
                for (index j = 0; j < nk; ++j) out[j] /= l;
                if (drop) {
                    const index h = blk.kv_head * group_ + r / blk.queries, i = blk.query_begin + r % blk.queries;
                    for (index j = 0; j < nk; ++j)
                        if (out[j] != T(0))
                            out[j] = p_.dropout.keep(blk.batch, h, i, k0 + j) ? out[j] * keep_scale : T(0);
                }
            }
        }
    }

    const strided_view<const T>& q_;
    const strided_view<const T>& k_;
    const strided_view<const T>& v_;
    const attention_shape& s_;
    const Bound& mask_;
    const kernel_params<T>& p_;
    const attention_outputs<T>& o_;
    tile_config c_;
    const score_bias* bias_ = nullptr;
    index group_ = 1;           ///< query heads per kv head
    index block_queries_ = 1;   ///< queries per head in a block
    index query_blocks_ = 1;    ///< blocks per (batch, kv head)
    index rows_ = 1;            ///< rows of a full block: group_ * block_queries_
};

/// The tiled kernel on `threads` threads (>= 1) with the given tile sizes; same contract as reference_attention.
template <class T, class Bound>
void tiled_attention(const strided_view<const T>& q, const strided_view<const T>& k, const strided_view<const T>& v,
                     const attention_shape& s, const Bound& mask, const kernel_params<T>& p,
                     const attention_outputs<T>& o, int threads, const tile_config& config) {
    tiled_runner<T, Bound>(q, k, v, s, mask, p, o, config).run(threads);
}

/// The tiled kernel with the default tile sizes for this shape.
template <class T, class Bound>
void tiled_attention(const strided_view<const T>& q, const strided_view<const T>& k, const strided_view<const T>& v,
                     const attention_shape& s, const Bound& mask, const kernel_params<T>& p,
                     const attention_outputs<T>& o, int threads) {
    tiled_attention(q, k, v, s, mask, p, o, threads, default_tile_config<T>(s));
}

}  // namespace attend::detail
