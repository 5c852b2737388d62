// SPDX-License-Identifier: MIT
#pragma once
/// The tiled backward of scaled dot-product attention (backward.hpp has the API and the formulas):
/// FlashAttention-2's backward on the forward's micro-kernels (micro_kernel.hpp: K and V packed once per key
/// tile for every query tile, dO and Q once per tile for the transposed products dV += Pᵀ dO and dK += dSᵀ Q),
/// through the same score pipeline as the forward (score_pipeline.hpp). Inputs and gradients in the storage type,
/// arithmetic in the accumulation type.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "kernel_interface.hpp"
#include "mask_nodes.hpp"
#include "memory.hpp"
#include "micro_kernel.hpp"
#include "parallel_for.hpp"
#include "score_pipeline.hpp"
#include "tiled_kernel.hpp"

namespace attend::detail {

/// Tile sizes of the tiled backward: a tile is block_q queries x block_k keys of one (batch, head). They depend
/// on the shape only, never on the thread count.
struct backward_tiling {
    index_t block_q = 64;
    index_t block_k = 64;
};

/// The default tiling, by measurement (fp32, batch 1, 8 heads, head_dim 64, L = S = 1024 and 2048, one thread,
/// rate relative to a 512^3 Eigen sgemm in the same binary): with SSE2 only, 64x64 tiles reach 73 %, 64x128 and
/// larger 77-80 %; with -march=native (AVX-512) 64x64 reach 67 %, 128x128 74-80 %, 128x256 83 %. 128 x 128 is
/// near the best on both while its scratch (P, dP / dS and, with dropout, two more tiles of 64 KiB each, plus
/// the K / dK / dV tiles of the key tile) stays in L2, and it wastes less work than 256-key tiles on the diagonal
/// of a causal mask. Double halves the query tile so the tiles take the same bytes.
template <class T>
backward_tiling default_backward_tiling(const attention_shape& s) {
    backward_tiling t;
    t.block_q = sizeof(T) == 4 ? 128 : 64;
    t.block_k = 128;
    if (std::max(s.head_dim, s.value_dim) > 128) t.block_k = 64;
    return t;
}

/// One worker's scratch, allocated before the workers start: O(block_q x block_k + block_k x dim) per thread.
/// All in the accumulation type.
template <class Acc>
struct backward_workspace {
    row_matrix<Acc> probs;              ///< [block_q, block_k]: scores, then P
    row_matrix<Acc> dropped;            ///< [block_q, block_k]: P with dropout applied (dropout only)
    row_matrix<Acc> keep;               ///< [block_q, block_k]: 0 or 1 / (1 - p) (dropout only)
    row_matrix<Acc> grad;               ///< [block_q, block_k]: dP, then dS
    row_matrix<Acc> slope;              ///< [block_q, block_k]: d score / d dot product (score modifiers only)
    row_matrix<Acc> keys;               ///< [block_k, head_dim]: scale * K of the key tile
    row_matrix<Acc> dk;                 ///< [block_k, head_dim]: dK of the key tile, unscaled
    row_matrix<Acc> dv;                 ///< [block_k, value_dim]: dV of the key tile
    aligned_vector<Acc> lse;            ///< [block_q]: what P = exp(s - lse) * inv_sum shifts by, +inf for zero rows
    aligned_vector<Acc> inv_sum;        ///< [block_q]: 1, or 1 / sum for rows with exact statistics
    aligned_vector<Acc> delta;          ///< [block_q]: rowsum(d_out * out)
    aligned_vector<Acc> query_stage;    ///< [block_q, head_dim] converted queries, when storage is not Acc
    aligned_vector<Acc> d_out_stage;    ///< [block_q, value_dim] converted d_out, when storage is not Acc
    aligned_vector<Acc> value_stage;    ///< [block_k, value_dim] converted values, when storage is not Acc
    aligned_vector<Acc> key_panels;     ///< scale * K of the key tile packed for Q Kᵀ (micro_kernel.hpp)
    aligned_vector<Acc> key_columns;    ///< the same packed for dS (scale * K)
    aligned_vector<Acc> value_panels;   ///< V of the key tile packed for dO Vᵀ
    aligned_vector<Acc> d_out_columns;  ///< dO of the query tile packed for dV += Pᵀ dO
    aligned_vector<Acc> query_columns;  ///< Q of the query tile packed for dK += dSᵀ Q

    backward_workspace(const backward_tiling& t, const attention_shape& s, bool dropout, bool stage, bool modifiers)
        : probs(t.block_q, t.block_k),
          dropped(dropout ? t.block_q : 0, dropout ? t.block_k : 0),
          keep(dropout ? t.block_q : 0, dropout ? t.block_k : 0),
          grad(t.block_q, t.block_k),
          slope(modifiers ? t.block_q : 0, modifiers ? t.block_k : 0),
          keys(t.block_k, s.head_dim),
          dk(t.block_k, s.head_dim),
          dv(t.block_k, s.value_dim),
          lse(static_cast<std::size_t>(t.block_q)),
          inv_sum(static_cast<std::size_t>(t.block_q)),
          delta(static_cast<std::size_t>(t.block_q)),
          query_stage(stage ? static_cast<std::size_t>(t.block_q * s.head_dim) : 0),
          d_out_stage(stage ? static_cast<std::size_t>(t.block_q * s.value_dim) : 0),
          value_stage(stage ? static_cast<std::size_t>(t.block_k * s.value_dim) : 0),
          key_panels(static_cast<std::size_t>(micro_tile<Acc>::panel_elements(t.block_k, s.head_dim))),
          key_columns(static_cast<std::size_t>(t.block_k * s.head_dim)),
          value_panels(static_cast<std::size_t>(micro_tile<Acc>::panel_elements(t.block_k, s.value_dim))),
          d_out_columns(static_cast<std::size_t>(t.block_q * s.value_dim)),
          query_columns(static_cast<std::size_t>(t.block_q * s.head_dim)) {}
};

/// How many chunks the keys of one (batch, kv head) are split into. One chunk per (batch, kv head) needs no
/// extra memory; when there are fewer than `target_units` (batch, kv head) pairs, the keys are split so that
/// about target_units units exist, as long as the extra dQ partials (one dq-sized buffer per chunk after the
/// first) stay within `partial_budget` bytes. A function of the shape only: the same decomposition, hence the
/// same bits, for any thread count.
inline index_t backward_key_chunks(const attention_shape& s, index_t key_tiles, std::size_t scalar_bytes) {
    constexpr index_t target_units = 16;
    constexpr double partial_budget = 16.0 * 1024 * 1024;
    const index_t pairs = s.batch * s.kv_heads;
    if (pairs == 0 || pairs >= target_units || key_tiles <= 1 || s.query_len == 0) return 1;
    const index_t wanted = std::min(key_tiles, (target_units + pairs - 1) / pairs);
    const double dq_bytes = static_cast<double>(s.batch) * static_cast<double>(s.heads) *
                            static_cast<double>(s.query_len) * static_cast<double>(s.head_dim) *
                            static_cast<double>(scalar_bytes);
    const double affordable = 1.0 + std::floor(partial_budget / std::max(dq_bytes, 1.0));
    return std::max<index_t>(1, std::min<index_t>(wanted, static_cast<index_t>(std::min(affordable, 1e9))));
}

/// The tiled backward (FlashAttention-2's backward on the micro-kernels of micro_kernel.hpp); P is recomputed tile by
/// tile from lse, never stored (from an exact max and sum instead for the rare rows whose |lse| is too large for that,
/// see imprecise_lse). Memory beyond inputs and outputs: O(threads x tile) of workspace, the dQ partials of a key split
/// (at most 16 MiB, see backward_key_chunks), only with a score_bias and a d_score_bias output one
/// `[group, query_len + key_len - 1]` row of partial sums per unit, and only when some |lse| is huge two
/// `[batch, heads, query_len]` vectors of row statistics; never O(query_len x key_len).
///
/// Parallel decomposition. A work unit is (batch, kv head, key chunk), a chunk being a run of consecutive key
/// tiles. For each key tile of its chunk a unit loops over the query heads of the group (ascending) and, inside,
/// over the query tiles (ascending), skipping empty tiles: it accumulates that key tile's dK and dV in its
/// scratch and writes them once at the end, so dK and dV (summed over the group, in this fixed order) need no
/// atomics and no reduction. dQ of a query tile receives one product per key tile; the unit of chunk 0
/// accumulates straight into the caller's dq, the unit of chunk c > 0 into a zeroed dq-sized partial buffer of
/// its own, and after all units a second parallel pass adds the partials to dq in chunk order 1, 2, ... (when the
/// gradients' type is not the accumulation type, chunk 0 has a partial buffer too, and that pass writes dq once).
/// The score_bias gradient is accumulated per unit and reduced in unit order. The decomposition (tiles, chunks)
/// depends on the shape only and every sum runs in a fixed order, so the result is bit-identical for any thread
/// count. Units are dealt to the thread pool's workers forward and backward in turn (parallel_for, worker_of),
/// which spreads the uneven units of a causal mask evenly.
template <class Storage, class Acc, class Grad>
class tiled_backward_runner {
public:
    tiled_backward_runner(const backward_inputs<Storage>& in, const attention_shape& s, const mask_tiles& mask,
                          const kernel_params<Acc>& p, const gradient_outputs<Grad>& o, const backward_tiling& t)
        : in_(in), s_(s), mask_(mask), pipe_(s, mask, p), p_(p), o_(o), t_(t) {
        group_ = s.group_size();
        diagonals_ = s.query_len + s.key_len - 1;
        key_tiles_ = (s.key_len + t.block_k - 1) / t.block_k;
        query_tiles_ = (s.query_len + t.block_q - 1) / t.block_q;
        chunks_ = backward_key_chunks(s, key_tiles_, sizeof(Acc));
        tiles_per_chunk_ = (key_tiles_ + chunks_ - 1) / chunks_;
        chunks_ = (key_tiles_ + tiles_per_chunk_ - 1) / tiles_per_chunk_;
    }

    void run(int threads) {
        const bool bias_grad = pipe_.has_bias() && o_.d_score_bias;
        if (s_.batch == 0) {  // nothing to attend; the bias gradient is still an output, and it is zero
            if (bias_grad) std::fill(o_.d_score_bias, o_.d_score_bias + s_.heads * diagonals_, Grad(0));
            if (p_.has_sinks() && o_.d_sinks) std::fill(o_.d_sinks, o_.d_sinks + s_.heads, Grad(0));
            return;
        }
        const index_t units = s_.batch * s_.kv_heads * chunks_;
        const index_t dq_size = s_.batch * s_.heads * s_.query_len * s_.head_dim;
        const index_t partial_buffers = staged_dq ? chunks_ : chunks_ - 1;
        const int workers = static_cast<int>(std::min<index_t>(std::max(threads, 1), units));
        std::vector<backward_workspace<Acc>> ws;
        const index_t rows = s_.batch * s_.heads * s_.query_len;
        const bool exact = std::any_of(in_.lse, in_.lse + rows, [](Lse l) { return imprecise_lse(l); });
        allocating(
            [&] {
                if (exact) {
                    row_shift_.resize(static_cast<std::size_t>(rows));
                    std::transform(in_.lse, in_.lse + rows, row_shift_.begin(),
                                   [](Lse l) { return static_cast<Acc>(l); });
                    row_inv_sum_.assign(static_cast<std::size_t>(rows), Acc(1));
                }
                partials_.assign(static_cast<std::size_t>(partial_buffers * dq_size), Acc(0));
                if (bias_grad) bias_partials_.assign(static_cast<std::size_t>(units * group_ * diagonals_), Acc(0));
                ws.reserve(static_cast<std::size_t>(workers));
                for (int w = 0; w < workers; ++w)
                    ws.emplace_back(t_, s_, p_.dropout.active(), staged_inputs, pipe_.modifies_scores());
            },
            [&] {
                const index_t tile = t_.block_q * t_.block_k,
                              dims = t_.block_k * (2 * s_.head_dim + s_.value_dim) +
                                     micro_tile<Acc>::panel_elements(t_.block_k, s_.head_dim) +
                                     t_.block_k * s_.head_dim +
                                     micro_tile<Acc>::panel_elements(t_.block_k, s_.value_dim) +
                                     t_.block_q * (s_.head_dim + s_.value_dim);
                const index_t tiles = pipe_.modifies_scores() ? 5 : 4;
                return allocation_text("the tiled backward's scratch (workers x elements)",
                                       std::array<index_t, 2>{workers, tiles * tile + dims}, sizeof(Acc)) +
                       allocation_text(" and dq partials (partial buffers x batch x heads x query_len x head_dim)",
                                       std::array<index_t, 5>{partial_buffers, s_.batch, s_.heads, s_.query_len,
                                                              s_.head_dim},
                                       sizeof(Acc));
            },
            "Fewer threads need less scratch");
        // Both passes index ws by worker, so neither may run more workers than ws has (exact_statistics has more
        // units than run_unit when the query tiles outnumber the key chunks).
        exact_statistics(ws, workers);
        parallel_for(units, workers,
                     [&](index_t unit, int worker) { run_unit(ws[static_cast<std::size_t>(worker)], unit); });
        if (partial_buffers > 0 && s_.query_len > 0)
            parallel_for(s_.batch * s_.heads, threads,
                         [&](index_t bh, int) { add_partials(bh / s_.heads, bh % s_.heads); });
        if (bias_grad) reduce_bias_gradient();
        if (p_.has_sinks() && o_.d_sinks) sum_sink_gradient();
    }

private:
    using Lse = accumulator_t<Storage>;  // the forward's lse: float for 16-bit storage
    /// Inputs stored in another type than Acc are converted tile by tile into the workspace's stages.
    static constexpr bool staged_inputs = !std::is_same_v<Storage, Acc>;
    /// Gradients of another type than Acc: dq is accumulated in partial buffers and rounded once at the end.
    static constexpr bool staged_dq = !std::is_same_v<Grad, Acc>;

    /// dq rows of head h for chunk c, in Acc: the caller's dq for chunk 0 (when it is stored in Acc), a partial
    /// buffer otherwise.
    tile_map<Acc> dq_rows(index_t b, index_t h, index_t c, index_t query_begin, index_t rows) {
        if constexpr (!staged_dq)
            if (c == 0)
                return tile_map<Acc>(o_.d_query.row(b, h, query_begin), rows, s_.head_dim,
                                     Eigen::OuterStride<>(o_.d_query.strides[2]));
        const index_t buffer = staged_dq ? c : c - 1;
        Acc* base = partials_.data() + ((buffer * s_.batch + b) * s_.heads + h) * s_.query_len * s_.head_dim;
        return tile_map<Acc>(base + query_begin * s_.head_dim, rows, s_.head_dim, Eigen::OuterStride<>(s_.head_dim));
    }

    void run_unit(backward_workspace<Acc>& w, index_t unit) {
        const index_t c = unit % chunks_, pair = unit / chunks_;
        const index_t b = pair / s_.kv_heads, kvh = pair % s_.kv_heads;
        if (c == 0 && !staged_dq)
            for (index_t hh = 0; hh < group_; ++hh) dq_rows(b, kvh * group_ + hh, 0, 0, s_.query_len).setZero();
        Acc* bias_grad = bias_partials_.empty() ? nullptr : bias_partials_.data() + unit * group_ * diagonals_;
        const index_t first = c * tiles_per_chunk_, last = std::min(key_tiles_, first + tiles_per_chunk_);
        for (index_t kt = first; kt < last; ++kt) {
            const index_t k0 = kt * t_.block_k, k1 = std::min(s_.key_len, k0 + t_.block_k), nk = k1 - k0;
            load_keys(w, b, kvh, k0, nk);
            pack_for_gradients(w, b, kvh, k0, nk);
            w.dk.topRows(nk).setZero();
            w.dv.topRows(nk).setZero();
            for (index_t hh = 0; hh < group_; ++hh) {
                const index_t h = kvh * group_ + hh;
                for (index_t qt = 0; qt < query_tiles_; ++qt) {
                    const index_t q0 = qt * t_.block_q, q1 = std::min(s_.query_len, q0 + t_.block_q);
                    const tile t{b, h, q0, q1, k0, k1};
                    const tile_class cls = mask_.classify(t);
                    if (cls == tile_class::empty) continue;
                    run_tile(w, t, c, cls, bias_grad ? bias_grad + hh * diagonals_ : nullptr);
                }
            }
            tile_map<Grad> dk(o_.d_key.row(b, kvh, k0), nk, s_.head_dim, Eigen::OuterStride<>(o_.d_key.strides[2]));
            tile_map<Grad> dv(o_.d_value.row(b, kvh, k0), nk, s_.value_dim,
                              Eigen::OuterStride<>(o_.d_value.strides[2]));
            dk = (pipe_.scale() * w.dk.topRows(nk)).template cast<Grad>();
            dv = w.dv.topRows(nk).template cast<Grad>();
        }
    }

    /// scale * K of the key tile [k0, k0 + nk) into w.keys, and packed for the scores (w.key_panels): the scale
    /// folded into the operand that both the scores and dQ use. Once per key tile, for every query tile.
    void load_keys(backward_workspace<Acc>& w, index_t b, index_t kvh, index_t k0, index_t nk) const {
        const_tile_map<Storage> keys(in_.k.row(b, kvh, k0), nk, s_.head_dim, Eigen::OuterStride<>(in_.k.strides[2]));
        w.keys.topRows(nk) = pipe_.scale() * keys.template cast<Acc>();
        pack_key_panels(w.keys.data(), s_.head_dim, nk, s_.head_dim, w.key_panels.data());
    }

    /// The key tile's other packed operands: scale * K for dQ += dS (scale * K), V for dP = dO Vᵀ.
    void pack_for_gradients(backward_workspace<Acc>& w, index_t b, index_t kvh, index_t k0, index_t nk) const {
        pack_value_panels(w.keys.data(), s_.head_dim, nk, s_.head_dim, w.key_columns.data());
        const auto values = rows_as_accumulator<Acc>(in_.v, b, kvh, k0, nk, w.value_stage.data());
        pack_key_panels(values.data(), values.outerStride(), nk, s_.value_dim, w.value_panels.data());
    }

    /// One tile t (queries of head t.head against the key tile of w.keys and the packed panels, key chunk c);
    /// adds to w.dk, w.dv and the dq rows.
    void run_tile(backward_workspace<Acc>& w, const tile& t, index_t c, tile_class cls, Acc* bias_grad) {
        const index_t b = t.batch, h = t.head, q0 = t.query_begin, k0 = t.key_begin;
        const index_t nq = t.query_end - q0, nk = t.key_end - k0, ld = t_.block_k, dv = s_.value_dim;
        const Lse* lse = in_.lse + (b * s_.heads + h) * s_.query_len;
        const index_t row0 = (b * s_.heads + h) * s_.query_len + q0;
        bool any = false, normalize = false;
        for (index_t r = 0; r < nq; ++r) {  // lse -inf: the forward's zero row, whose gradients are zero
            const Acc l = static_cast<Acc>(lse[q0 + r]);
            const auto u = static_cast<std::size_t>(r), row = static_cast<std::size_t>(row0 + r);
            any = any || l != minus_infinity<Acc>();
            w.lse[u] = l == minus_infinity<Acc>() ? std::numeric_limits<Acc>::infinity()
                                                  : (row_shift_.empty() ? l : row_shift_[row]);
            w.inv_sum[u] = row_inv_sum_.empty() ? Acc(1) : row_inv_sum_[row];
            normalize = normalize || w.inv_sum[u] != Acc(1);
        }
        if (!any) return;
        for (index_t r = 0; r < nq; ++r) {
            w.delta[static_cast<std::size_t>(r)] =
                dot_of_rows<Acc>(in_.out.row(b, h, q0 + r), in_.d_out.row(b, h, q0 + r), dv);
        }
        const auto queries = query_rows(w, t);
        const auto d_out = rows_as_accumulator<Acc>(in_.d_out, b, h, q0, nq, w.d_out_stage.data());
        auto probs = w.probs.topLeftCorner(nq, nk);
        // P = exp(scale q k^T + bias + mask - lse), the forward's probabilities, recomputed (exp(s - max) / sum
        // for the rows of exact_statistics).
        tile_scores(w, t, cls, queries, pipe_.modifies_scores() ? w.slope.data() : nullptr);
        for (index_t r = 0; r < nq; ++r) exp_shifted(w.probs.data() + r * ld, nk, w.lse[static_cast<std::size_t>(r)]);
        if (normalize)
            for (index_t r = 0; r < nq; ++r) probs.row(r) *= w.inv_sum[static_cast<std::size_t>(r)];
        // dV += P'^T dO; dP = dO V^T (then masked and rescaled by dropout).
        const bool drop = p_.dropout.active();
        if (drop) {
            for (index_t r = 0; r < nq; ++r) p_.dropout.factors(w.keep.data() + r * ld, nk, b, h, q0 + r, k0);
            w.dropped.topLeftCorner(nq, nk) = (probs.array() * w.keep.topLeftCorner(nq, nk).array()).matrix();
        }
        // The transposed products read P', dS by columns (row stride 1, column stride ld).
        pack_value_panels(d_out.data(), d_out.outerStride(), nq, dv, w.d_out_columns.data());
        accumulate_from_values((drop ? w.dropped : w.probs).data(), index_t(1), ld, nk, nq, d_out.data(),
                               d_out.outerStride(), dv, w.d_out_columns.data(), nq * micro_tile<Acc>::cols, w.dv.data(),
                               dv);
        scores_from_panels(d_out.data(), d_out.outerStride(), nq, dv, w.value_panels.data(), nk, w.grad.data(), ld);
        score_gradient(w, nq, nk, drop);
        if (bias_grad) pipe_.add_bias_gradient(t, w.grad.data(), ld, bias_grad);
        pipe_.to_dot_product_gradient(nq, nk, w.grad.data(), w.slope.data(), ld);
        // dQ += dS (scale K); dK += dS^T Q (scaled once per key tile in run_unit).
        auto dq = dq_rows(b, h, c, q0, nq);
        accumulate_from_values(w.grad.data(), ld, index_t(1), nq, nk, w.keys.data(), s_.head_dim, s_.head_dim,
                               w.key_columns.data(), nk * micro_tile<Acc>::cols, dq.data(), dq.outerStride());
        pack_value_panels(queries.data(), queries.outerStride(), nq, s_.head_dim, w.query_columns.data());
        accumulate_from_values(w.grad.data(), index_t(1), ld, nk, nq, queries.data(), queries.outerStride(),
                               s_.head_dim, w.query_columns.data(), nq * micro_tile<Acc>::cols, w.dk.data(),
                               s_.head_dim);
    }

    /// dS = P * (dP - delta) row by row, in place of dP in w.grad (dP first multiplied by the dropout factors):
    /// the one place the backward differentiates the softmax. (run_tile then takes dS to the bias gradient and,
    /// through the score modifiers' slope, to the dot products.)
    void score_gradient(backward_workspace<Acc>& w, index_t nq, index_t nk, bool drop) const {
        const index_t ld = t_.block_k;
        for (index_t r = 0; r < nq; ++r) {
            Eigen::Map<Eigen::Array<Acc, 1, Eigen::Dynamic>> g(w.grad.data() + r * ld, nk);
            const Eigen::Map<const Eigen::Array<Acc, 1, Eigen::Dynamic>> pr(w.probs.data() + r * ld, nk);
            const Acc delta = w.delta[static_cast<std::size_t>(r)];
            if (drop) {
                const Eigen::Map<const Eigen::Array<Acc, 1, Eigen::Dynamic>> keep(w.keep.data() + r * ld, nk);
                g = pr * (g * keep - delta);
            } else {
                g = pr * (g - delta);
            }
        }
    }

    /// The tile's query rows in Acc (converted into w.query_stage when stored in another type).
    const_tile_map<Acc> query_rows(backward_workspace<Acc>& w, const tile& t) const {
        return rows_as_accumulator<Acc>(in_.q, t.batch, t.head, t.query_begin, t.query_end - t.query_begin,
                                        w.query_stage.data());
    }

    /// Scores of tile t, whose scaled keys are in w.keys, through the score pipeline into w.probs (and the
    /// modifiers' slope into `slope` when not null). One function for both passes, so both see the same bits.
    void tile_scores(backward_workspace<Acc>& w, const tile& t, tile_class cls, const const_tile_map<Acc>& queries,
                     Acc* slope = nullptr) const {
        const index_t nq = t.query_end - t.query_begin, nk = t.key_end - t.key_begin;
        const bool capped = pipe_.products_with_cap([&](const auto& epilogue) {
            scores_from_panels(queries.data(), queries.outerStride(), nq, s_.head_dim, w.key_panels.data(), nk,
                               w.probs.data(), t_.block_k, epilogue);
        });
        pipe_.finish_tile(t, cls, w.probs.data(), t_.block_k, capped, slope);
    }

    /// exp(s - lse) gives P only to about |lse| ulps: lse = max + log(sum) rounded to its type keeps none
    /// of log(sum) when |max| is huge (scores of 1e30 with a tied maximum, a row filled with a finite -1e30), and
    /// P would not sum to 1. Beyond this size of |lse| (P off by 1e-5 in float, 5e-10 in double) a row's max and
    /// sum are recomputed exactly, in a pass over its keys, and P = exp(s - max) / sum as in the forward.
    static bool imprecise_lse(Lse stored) {
        const Acc lse = static_cast<Acc>(stored);
        const Acc limit = Acc(1) / (16 * std::sqrt(static_cast<Acc>(std::numeric_limits<Lse>::epsilon())));
        return std::isfinite(lse) && std::abs(lse) > limit;
    }

    /// row_shift_ and row_inv_sum_ of the rows whose lse is imprecise: their max and 1 / sum over all keys, from
    /// the scores run_tile computes (same tiles, same function). A no-op when no row needs it.
    void exact_statistics(std::vector<backward_workspace<Acc>>& ws, int threads) {
        if (row_shift_.empty()) return;
        const index_t units = s_.batch * s_.heads * query_tiles_;
        parallel_for(units, threads, [&](index_t unit, int worker) {
            auto& w = ws[static_cast<std::size_t>(worker)];
            const index_t qt = unit % query_tiles_, bh = unit / query_tiles_, b = bh / s_.heads, h = bh % s_.heads;
            const index_t q0 = qt * t_.block_q, q1 = std::min(s_.query_len, q0 + t_.block_q), nq = q1 - q0;
            const index_t row0 = bh * s_.query_len + q0, ld = t_.block_k;
            if (std::none_of(in_.lse + row0, in_.lse + row0 + nq, [](Lse l) { return imprecise_lse(l); })) return;
            for (index_t r = 0; r < nq; ++r) {  // running max and sum, starting from the sink when there is one
                w.lse[static_cast<std::size_t>(r)] = p_.has_sinks() ? p_.sink(h) : minus_infinity<Acc>();
                w.delta[static_cast<std::size_t>(r)] = p_.has_sinks() ? Acc(1) : Acc(0);
            }
            for (index_t k0 = 0; k0 < s_.key_len; k0 += t_.block_k) {
                const index_t k1 = std::min(s_.key_len, k0 + t_.block_k), nk = k1 - k0;
                const tile t{b, h, q0, q1, k0, k1};
                const tile_class cls = mask_.classify(t);
                if (cls == tile_class::empty) continue;
                load_keys(w, b, h / group_, k0, nk);
                tile_scores(w, t, cls, query_rows(w, t));
                for (index_t r = 0; r < nq; ++r) {
                    const Acc* x = w.probs.data() + r * ld;
                    Acc& max = w.lse[static_cast<std::size_t>(r)];
                    Acc& sum = w.delta[static_cast<std::size_t>(r)];
                    const Acc m = std::max(max, *std::max_element(x, x + nk));
                    if (m == minus_infinity<Acc>()) continue;
                    sum *= std::exp(max - m);  // exp(-inf) = 0 while the row had no allowed key
                    for (index_t j = 0; j < nk; ++j) sum += std::exp(x[j] - m);
                    max = m;
                }
            }
            for (index_t r = 0; r < nq; ++r) {
                const auto row = static_cast<std::size_t>(row0 + r), u = static_cast<std::size_t>(r);
                if (!imprecise_lse(in_.lse[row]) || !(w.delta[u] > 0)) continue;
                row_shift_[row] = w.lse[u];
                row_inv_sum_[row] = Acc(1) / w.delta[u];
            }
        });
    }

    /// dq of (b, h): its chunks added in chunk order (and rounded to the gradients' type once when staged).
    void add_partials(index_t b, index_t h) {
        auto dq = dq_rows(b, h, 0, 0, s_.query_len);
        for (index_t c = 1; c < chunks_; ++c) dq += dq_rows(b, h, c, 0, s_.query_len);
        if constexpr (staged_dq)
            tile_map<Grad>(o_.d_query.row(b, h, 0), s_.query_len, s_.head_dim,
                           Eigen::OuterStride<>(o_.d_query.strides[2])) = dq.template cast<Grad>();
    }

    /// d loss / d sink of every head: -sum over its rows of p_sink * rowsum(d_out * out) (sinks.hpp), p_sink =
    /// exp(sink - lse), or exp(sink - max) / sum for the rows exact_statistics recomputed; rows with lse -inf
    /// (padded queries) add nothing. Summed in (batch, query) order, so the same bits for any thread count.
    void sum_sink_gradient() const {
        for (index_t h = 0; h < s_.heads; ++h) {
            const Acc z = p_.sink(h);
            Acc sum = 0;
            for (index_t b = 0; b < s_.batch; ++b)
                for (index_t i = 0; i < s_.query_len; ++i) {
                    const auto row = static_cast<std::size_t>((b * s_.heads + h) * s_.query_len + i);
                    const Acc lse = static_cast<Acc>(in_.lse[row]);
                    if (lse == minus_infinity<Acc>()) continue;
                    const Acc shift = row_shift_.empty() ? lse : row_shift_[row];
                    const Acc inv_sum = row_inv_sum_.empty() ? Acc(1) : row_inv_sum_[row];
                    const Acc delta = dot_of_rows<Acc>(in_.out.row(b, h, i), in_.d_out.row(b, h, i), s_.value_dim);
                    sum -= std::exp(z - shift) * inv_sum * delta;
                }
            o_.d_sinks[h] = static_cast<Grad>(sum);
        }
    }

    /// The score_bias gradient of every head: the units' partial sums added in unit order.
    void reduce_bias_gradient() const {
        Grad* out = o_.d_score_bias;
        for (index_t h = 0; h < s_.heads; ++h) {
            const index_t kvh = h / group_, hh = h % group_;
            for (index_t n = 0; n < diagonals_; ++n) {
                Acc sum = 0;
                for (index_t b = 0; b < s_.batch; ++b)
                    for (index_t c = 0; c < chunks_; ++c) {
                        const index_t unit = (b * s_.kv_heads + kvh) * chunks_ + c;
                        sum += bias_partials_[static_cast<std::size_t>((unit * group_ + hh) * diagonals_ + n)];
                    }
                out[h * diagonals_ + n] = static_cast<Grad>(sum);
            }
        }
    }

    const backward_inputs<Storage>& in_;
    const attention_shape& s_;
    const mask_tiles& mask_;
    score_pipeline<Acc> pipe_;
    const kernel_params<Acc>& p_;
    const gradient_outputs<Grad>& o_;
    backward_tiling t_;
    index_t group_ = 1, diagonals_ = 0, key_tiles_ = 0, query_tiles_ = 0, chunks_ = 1, tiles_per_chunk_ = 1;
    aligned_vector<Acc> row_shift_;  ///< [batch, heads, query_len]: lse, or the row max (exact_statistics); or empty
    aligned_vector<Acc>
        row_inv_sum_;               ///< [batch, heads, query_len]: 1, or 1 / the row sum (exact_statistics); or empty
    aligned_vector<Acc> partials_;  ///< dq-sized buffers [batch, heads, query_len, head_dim] (see dq_rows)
    aligned_vector<Acc> bias_partials_;  ///< per unit [group, diagonals]
};

/// The tiled backward: `Storage` in memory, arithmetic in `Acc`, gradients written as `Grad` (the storage type, or
/// float for 16-bit inputs on request); one instantiation per (Storage, Acc, Grad), masks come type-erased.
template <class Storage, class Acc, class Grad>
void tiled_backward(const backward_inputs<Storage>& in, const attention_shape& s, const mask_tiles& mask,
                    const kernel_params<Acc>& p, const gradient_outputs<Grad>& o, const backward_tiling& tiling,
                    int threads) {
    tiled_backward_runner<Storage, Acc, Grad>(in, s, mask, p, o, tiling).run(threads);
}

#if defined(ATTEND_KERNEL_INSTANCE)
#define ATTEND_TILED_BACKWARD_INSTANCE(S, A, G)                                                            \
    ATTEND_KERNEL_INSTANCE void tiled_backward<S, A, G>(const backward_inputs<S>&, const attention_shape&, \
                                                        const mask_tiles&, const kernel_params<A>&,        \
                                                        const gradient_outputs<G>&, const backward_tiling&, int);
ATTEND_TILED_BACKWARD_INSTANCE(float, float, float)
ATTEND_TILED_BACKWARD_INSTANCE(double, double, double)
ATTEND_TILED_BACKWARD_INSTANCE(float, double, float)
ATTEND_TILED_BACKWARD_INSTANCE(Eigen::half, float, Eigen::half)
ATTEND_TILED_BACKWARD_INSTANCE(Eigen::half, float, float)
ATTEND_TILED_BACKWARD_INSTANCE(Eigen::bfloat16, float, Eigen::bfloat16)
ATTEND_TILED_BACKWARD_INSTANCE(Eigen::bfloat16, float, float)
#undef ATTEND_TILED_BACKWARD_INSTANCE
#endif

}  // namespace attend::detail
