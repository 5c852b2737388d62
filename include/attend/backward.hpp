#pragma once
/// Backward of scaled dot-product attention: the gradients dq, dk, dv of a loss given d_out = d loss / d out,
/// for out = softmax(scale * q k^T + score_bias + mask) v with the forward's options (scale, empty rows, dropout
/// replayed from its seed, score_bias). Shapes as in sdpa.hpp: q `[batch, heads, query_len, head_dim]`,
/// k `[batch, kv_heads, key_len, head_dim]`, v `[batch, kv_heads, key_len, value_dim]`,
/// out and d_out `[batch, heads, query_len, value_dim]`, lse `[batch, heads, query_len]` (rank 3: one head).
///
/// With P = softmax of the masked scores, P' = P with dropout applied (kept weights times 1 / (1 - p), dropped 0):
///   dv = P'^T d_out,  dP' = d_out v^T,  dP = dP' at kept positions times 1 / (1 - p), 0 at dropped ones,
///   D = rowsum(d_out * out) = rowsum(P * dP),  dS = P * (dP - D),  dq = scale dS k,  dk = scale dS^T q.
/// Under grouped-query attention dk and dv are summed over the query heads of each group. Padded queries and
/// empty rows (lse = -inf) have zero gradients, never NaN. An ALiBi bias is fixed (no gradient); the gradient of
/// any score_bias per key - query offset is returned, and relative_bias_gradient turns it into the gradient of
/// a T5 relative-position table.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "detail/dropout.hpp"
#include "detail/mask_nodes.hpp"
#include "detail/memory.hpp"
#include "detail/reference_kernel.hpp"
#include "detail/thread_pool.hpp"
#include "detail/tiled_kernel.hpp"
#include "error.hpp"
#include "mask.hpp"
#include "position.hpp"
#include "score_bias.hpp"
#include "sdpa.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace attend {

/// Gradients of scaled dot-product attention; Rank is the rank of the inputs (3 or 4).
template <class T, int Rank>
struct attention_gradients {
    tensor<T, Rank> dq;  ///< `[batch, heads, query_len, head_dim]`
    tensor<T, Rank> dk;  ///< `[batch, kv_heads, key_len, head_dim]`, summed over the query heads of each group
    tensor<T, Rank> dv;  ///< `[batch, kv_heads, key_len, value_dim]`, summed over the query heads of each group
    /// `[heads, query_len + key_len - 1]` when options.score_bias is not none, else empty: entry (h, n) is
    /// d loss / d (the bias head h adds where key - query = n - (query_len - 1)), summed over the batch and over
    /// every (query, key) pair on that diagonal. Input of relative_bias_gradient; for ALiBi it is informational.
    tensor<T, 2> score_bias_gradient;
};

namespace detail {

/// The inputs of a backward call as strided views, so multi-head attention can pass heads of its projected
/// `[batch, len, heads * dim]` buffers (split_heads) without copying. out and d_out are `[batch, heads,
/// query_len, value_dim]`; lse is contiguous `[batch, heads, query_len]`.
template <class T>
struct backward_inputs {
    strided_view<const T> q, k, v, out, d_out;
    const T* lse = nullptr;
    std::array<index, 3> lse_dims{};  ///< batch, heads, query_len (rank-2 lse `[batch, query_len]`: heads = 1)
    int lse_rank = 3;                 ///< rank of the lse the caller passed (2 or 3), for messages
};

/// Where the gradients go. dq, dk, dv are overwritten (not accumulated into) and must not overlap each other
/// or the inputs. score_bias_gradient, when not null, is contiguous `[heads, query_len + key_len - 1]` and is
/// written only when the call has a score_bias.
template <class T>
struct gradient_outputs {
    strided_view<T> dq, dk, dv;
    T* score_bias_gradient = nullptr;
};

/// Tile sizes of the tiled backward: a tile is block_q queries x block_k keys of one (batch, head). They depend
/// on the shape only, never on the thread count.
struct backward_tiling {
    index block_q = 64;
    index block_k = 64;
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

/// A backward call that passed every check.
template <class T, class Bound>
struct checked_backward {
    attention_shape shape;
    checked_call<T, Bound> call;
};

template <class T>
std::string spell_lse(const backward_inputs<T>& in) {
    if (in.lse_rank == 2) return format_shape(std::array<index, 2>{in.lse_dims[0], in.lse_dims[2]});
    return format_shape(in.lse_dims);
}

template <class View>
void check_view_dims(const View& x, const std::array<index, 4>& expected, int rank, const char* id,
                     const char* what, const std::string& context) {
    if (x.dims != expected || x.rank != rank) {
        strided_view<const scalar_of<View>> want;
        want.dims = expected;
        want.rank = rank;
        throw shape_error(id, concat(what, ' ', spell_view(x), " != expected ", spell_view(want), context));
    }
}

/// Every check of a backward call before anything is written: the forward's checks (shapes of q, k, v; options;
/// the mask against the shape; finite q, k, v; empty rows under empty_rows::error), the shapes of out, lse and
/// d_out (attend.shape.backward_out, backward_lse, backward_d_out), the gradient outputs when `out` is not null
/// (attend.shape.backward_dq, backward_dk, backward_dv), finite out and d_out and an lse without NaN or +inf
/// when check_finite is on (attend.value.non_finite, attend.value.lse).
template <class T, class Mask>
auto check_backward(const backward_inputs<T>& in, const gradient_outputs<T>* out, const Mask& mask,
                    const sdpa_options& o) {
    const attention_shape s = check_views(in.q, in.k, in.v);
    const int rank = s.rank;
    const std::string context = concat(" (query ", spell_view(in.q), ", key ", spell_view(in.k), ", value ",
                                       spell_view(in.v), ')');
    const std::array<index, 4> out_dims{s.batch, s.heads, s.query_len, s.value_dim};
    check_view_dims(in.out, out_dims, rank, "attend.shape.backward_out", "out", context);
    const std::array<index, 3> lse_expected{s.batch, s.heads, s.query_len};
    if (in.lse_dims != lse_expected || in.lse_rank != rank - 1) {
        backward_inputs<T> want;
        want.lse_dims = lse_expected;
        want.lse_rank = rank - 1;
        throw shape_error("attend.shape.backward_lse",
                          concat("lse ", spell_lse(in), " != expected ", spell_lse(want), context));
    }
    check_view_dims(in.d_out, out_dims, rank, "attend.shape.backward_d_out", "d_out", context);
    if (out) {
        check_view_dims(out->dq, in.q.dims, rank, "attend.shape.backward_dq", "dq", context);
        check_view_dims(out->dk, in.k.dims, rank, "attend.shape.backward_dk", "dk", context);
        check_view_dims(out->dv, in.v.dims, rank, "attend.shape.backward_dv", "dv", context);
    }
    checked_backward<T, decltype(mask.bind(s))> checked{s, check_call(in.q, in.k, in.v, s, mask, o)};
    if (o.check_finite) {
        check_finite(in.out, "out");
        check_finite(in.d_out, "d_out");
        const index rows = s.batch * s.heads * s.query_len;
        for (index n = 0; n < rows; ++n) {
            const T x = in.lse[n];
            if (std::isnan(x) || x == std::numeric_limits<T>::infinity())
                throw value_error("attend.value.lse",
                                  concat("lse ", spell_lse(in), " holds ", x, " at flat index ", n,
                                         "; it must be finite, or -inf for a padded query or an empty row"));
        }
    }
    return checked;
}

// ---- the reference backward ---------------------------------------------------------------------------------

/// The oracle: per (batch, head) materializes the scores `[query_len, key_len]`, recomputes the softmax from
/// scratch (it reads neither out nor lse) and applies the textbook formulas of the file comment. Sequential,
/// written for obviousness.
template <class T, class Bound>
void reference_backward(const backward_inputs<T>& in, const attention_shape& s, const Bound& mask,
                        const kernel_params<T>& p, const gradient_outputs<T>& o) {
    const index L = s.query_len, S = s.key_len, diagonals = L + S - 1;
    const bool bias = p.bias && !p.bias->empty();
    row_matrix<T> probs, dropped, dp;  // allocated before the first write to an output
    allocating(
        [&] {
            probs.resize(L, S);
            dropped.resize(L, S);
            dp.resize(L, S);
        },
        [&] { return allocation_text("the reference backward's score matrices (3 x query_len x key_len)",
                                     std::array<index, 3>{3, L, S}, sizeof(T)); },
        "kernel::reference materializes the scores of one (batch, head); the tiled backward needs O(threads x tile)");
    for (index b = 0; b < s.batch; ++b) {
        for (index h = 0; h < s.heads; ++h) matrix_of(o.dq, b, h).setZero();
        for (index h = 0; h < s.kv_heads; ++h) {
            matrix_of(o.dk, b, h).setZero();
            matrix_of(o.dv, b, h).setZero();
        }
    }
    if (o.score_bias_gradient && bias) std::fill(o.score_bias_gradient, o.score_bias_gradient + s.heads * diagonals, T(0));
    if (L == 0) return;
    const T keep_scale = static_cast<T>(p.dropout.keep_scale);
    for (index b = 0; b < s.batch; ++b)
        for (index h = 0; h < s.heads; ++h) {
            const index kvh = s.kv_head(h);
            const auto q = matrix_of(in.q, b, h), k = matrix_of(in.k, b, kvh), v = matrix_of(in.v, b, kvh);
            const auto d_out = matrix_of(in.d_out, b, h);
            probs.noalias() = q * k.transpose();
            probs *= p.scale;
            if (bias) p.bias->add_tile(h, 0, 0, L, S, L, S, probs.data(), S);
            mask.apply(tile{b, h, 0, L, 0, S}, probs.data(), S);
            for (index i = 0; i < L; ++i) {
                auto row = probs.row(i);
                const T max = mask.query_padded(b, i) ? minus_infinity<T>() : row.maxCoeff();
                if (max == minus_infinity<T>()) {  // padded query or empty row: constant zero output
                    row.setZero();
                    continue;
                }
                // std::exp: forbidden probabilities must be exactly 0 (see reference_kernel.hpp).
                for (index j = 0; j < S; ++j) row(j) = std::exp(row(j) - max);
                row /= row.sum();
            }
            dropped = probs;
            if (p.dropout.active())
                for (index i = 0; i < L; ++i)
                    for (index j = 0; j < S; ++j)
                        dropped(i, j) = p.dropout.keep(b, h, i, j) ? probs(i, j) * keep_scale : T(0);
            matrix_of(o.dv, b, kvh).noalias() += dropped.transpose() * d_out;
            dp.noalias() = d_out * v.transpose();  // d loss / d (dropped weights)
            if (p.dropout.active())
                for (index i = 0; i < L; ++i)
                    for (index j = 0; j < S; ++j) dp(i, j) = p.dropout.keep(b, h, i, j) ? dp(i, j) * keep_scale : T(0);
            for (index i = 0; i < L; ++i) {  // dS = P * (dP - rowsum(P * dP)), in place of dP
                const T delta = probs.row(i).dot(dp.row(i));
                dp.row(i) = (probs.row(i).array() * (dp.row(i).array() - delta)).matrix();
            }
            if (o.score_bias_gradient && bias)
                for (index i = 0; i < L; ++i)
                    for (index j = 0; j < S; ++j) o.score_bias_gradient[h * diagonals + j - i + L - 1] += dp(i, j);
            matrix_of(o.dq, b, h).noalias() = p.scale * (dp * k);
            matrix_of(o.dk, b, kvh).noalias() += p.scale * (dp.transpose() * q);
        }
}

// ---- the tiled backward -------------------------------------------------------------------------------------

/// One worker's scratch, allocated before the workers start: O(block_q x block_k + block_k x dim) per thread.
template <class T>
struct backward_workspace {
    row_matrix<T> probs;        ///< [block_q, block_k]: scores, then P
    row_matrix<T> dropped;      ///< [block_q, block_k]: P with dropout applied (dropout only)
    row_matrix<T> keep;         ///< [block_q, block_k]: 0 or 1 / (1 - p) (dropout only)
    row_matrix<T> grad;         ///< [block_q, block_k]: dP, then dS
    row_matrix<T> keys;         ///< [block_k, head_dim]: scale * K of the key tile
    row_matrix<T> dk;           ///< [block_k, head_dim]: dK of the key tile, unscaled
    row_matrix<T> dv;           ///< [block_k, value_dim]: dV of the key tile
    std::vector<T> lse;         ///< [block_q]: what P = exp(s - lse) * inv_sum shifts by, +inf for zero rows
    std::vector<T> inv_sum;     ///< [block_q]: 1, or 1 / sum for rows with exact statistics
    std::vector<T> delta;       ///< [block_q]: rowsum(d_out * out)

    backward_workspace(const backward_tiling& t, const attention_shape& s, bool dropout)
        : probs(t.block_q, t.block_k),
          dropped(dropout ? t.block_q : 0, dropout ? t.block_k : 0),
          keep(dropout ? t.block_q : 0, dropout ? t.block_k : 0),
          grad(t.block_q, t.block_k),
          keys(t.block_k, s.head_dim),
          dk(t.block_k, s.head_dim),
          dv(t.block_k, s.value_dim),
          lse(static_cast<std::size_t>(t.block_q)),
          inv_sum(static_cast<std::size_t>(t.block_q)),
          delta(static_cast<std::size_t>(t.block_q)) {}
};

/// How many chunks the keys of one (batch, kv head) are split into. One chunk per (batch, kv head) needs no
/// extra memory; when there are fewer than `target_units` (batch, kv head) pairs, the keys are split so that
/// about target_units units exist, as long as the extra dQ partials (one dq-sized buffer per chunk after the
/// first) stay within `partial_budget` bytes. A function of the shape only: the same decomposition, hence the
/// same bits, for any thread count.
inline index backward_key_chunks(const attention_shape& s, index key_tiles, std::size_t scalar_bytes) {
    constexpr index target_units = 16;
    constexpr double partial_budget = 16.0 * 1024 * 1024;
    const index pairs = s.batch * s.kv_heads;
    if (pairs == 0 || pairs >= target_units || key_tiles <= 1 || s.query_len == 0) return 1;
    const index wanted = std::min(key_tiles, (target_units + pairs - 1) / pairs);
    const double dq_bytes = static_cast<double>(s.batch) * static_cast<double>(s.heads) *
                            static_cast<double>(s.query_len) * static_cast<double>(s.head_dim) *
                            static_cast<double>(scalar_bytes);
    const double affordable = 1.0 + std::floor(partial_budget / std::max(dq_bytes, 1.0));
    return std::max<index>(1, std::min<index>(wanted, static_cast<index>(std::min(affordable, 1e9))));
}

/// The tiled backward (FlashAttention-2's backward on Eigen GEMM tiles); P is recomputed tile by tile from lse,
/// never stored (from an exact max and sum instead for the rare rows whose |lse| is too large for that, see
/// imprecise_lse). Memory beyond inputs and outputs: O(threads x tile) of workspace, the dQ partials of a key split
/// (at most 16 MiB, see backward_key_chunks), only with a score_bias and a score_bias_gradient output one
/// `[group, query_len + key_len - 1]` row of partial sums per unit, and only when some |lse| is huge two
/// `[batch, heads, query_len]` vectors of row statistics; never O(query_len x key_len).
///
/// Parallel decomposition. A work unit is (batch, kv head, key chunk), a chunk being a run of consecutive key
/// tiles. For each key tile of its chunk a unit loops over the query heads of the group (ascending) and, inside,
/// over the query tiles (ascending), skipping empty tiles: it accumulates that key tile's dK and dV in its
/// scratch and writes them once at the end, so dK and dV (summed over the group, in this fixed order) need no
/// atomics and no reduction. dQ of a query tile receives one product per key tile; the unit of chunk 0
/// accumulates straight into the caller's dq, the unit of chunk c > 0 into a zeroed dq-sized partial buffer of
/// its own, and after all units a second parallel pass adds the partials to dq in chunk order 1, 2, ... .
/// The score_bias gradient is accumulated per unit and reduced in unit order. The decomposition (tiles, chunks)
/// depends on the shape only and every sum runs in a fixed order, so the result is bit-identical for any thread
/// count. Units run round robin on the thread pool (parallel_for), which spreads the uneven units of a causal
/// mask evenly.
template <class T, class Bound>
class tiled_backward_runner {
public:
    tiled_backward_runner(const backward_inputs<T>& in, const attention_shape& s, const Bound& mask,
                          const kernel_params<T>& p, const gradient_outputs<T>& o, const backward_tiling& t)
        : in_(in), s_(s), mask_(mask), p_(p), o_(o), t_(t) {
        group_ = s.group_size();
        bias_ = p.bias && !p.bias->empty() ? p.bias : nullptr;
        diagonals_ = s.query_len + s.key_len - 1;
        key_tiles_ = (s.key_len + t.block_k - 1) / t.block_k;
        query_tiles_ = (s.query_len + t.block_q - 1) / t.block_q;
        chunks_ = backward_key_chunks(s, key_tiles_, sizeof(T));
        tiles_per_chunk_ = (key_tiles_ + chunks_ - 1) / chunks_;
        chunks_ = (key_tiles_ + tiles_per_chunk_ - 1) / tiles_per_chunk_;
    }

    void run(int threads) {
        if (s_.batch == 0) {  // nothing to attend; the bias gradient is still an output, and it is zero
            if (bias_ && o_.score_bias_gradient)
                std::fill(o_.score_bias_gradient, o_.score_bias_gradient + s_.heads * diagonals_, T(0));
            return;
        }
        const index units = s_.batch * s_.kv_heads * chunks_;
        const index dq_size = s_.batch * s_.heads * s_.query_len * s_.head_dim;
        const bool bias_grad = bias_ && o_.score_bias_gradient;
        const int workers = static_cast<int>(std::min<index>(std::max(threads, 1), units));
        std::vector<backward_workspace<T>> ws;
        const index rows = s_.batch * s_.heads * s_.query_len;
        const bool exact = std::any_of(in_.lse, in_.lse + rows, [](T l) { return imprecise_lse(l); });
        allocating(
            [&] {
                if (exact) {
                    row_shift_.assign(in_.lse, in_.lse + rows);
                    row_inv_sum_.assign(static_cast<std::size_t>(rows), T(1));
                }
                partials_.assign(static_cast<std::size_t>((chunks_ - 1) * dq_size), T(0));
                if (bias_grad) bias_partials_.assign(static_cast<std::size_t>(units * group_ * diagonals_), T(0));
                ws.reserve(static_cast<std::size_t>(workers));
                for (int w = 0; w < workers; ++w) ws.emplace_back(t_, s_, p_.dropout.active());
            },
            [&] {
                const index tile = t_.block_q * t_.block_k, dims = t_.block_k * (2 * s_.head_dim + s_.value_dim);
                return allocation_text("the tiled backward's scratch (workers x elements)",
                                       std::array<index, 2>{workers, 4 * tile + dims}, sizeof(T)) +
                       allocation_text(" and dq partials (key chunks - 1 x batch x heads x query_len x head_dim)",
                                       std::array<index, 5>{chunks_ - 1, s_.batch, s_.heads, s_.query_len,
                                                            s_.head_dim},
                                       sizeof(T));
            },
            "Fewer threads need less scratch");
        // Both passes index ws by worker, so neither may run more workers than ws has (exact_statistics has more
        // units than run_unit when the query tiles outnumber the key chunks).
        exact_statistics(ws, workers);
        parallel_for(units, workers, [&](index unit, int worker) { run_unit(ws[static_cast<std::size_t>(worker)], unit); });
        if (chunks_ > 1 && s_.query_len > 0)
            parallel_for(s_.batch * s_.heads, threads, [&](index bh, int) { add_partials(bh / s_.heads, bh % s_.heads); });
        if (bias_grad) reduce_bias_gradient();
    }

private:
    /// dq rows of head h for chunk c: the caller's dq for chunk 0, a partial buffer otherwise.
    tile_map<T> dq_rows(index b, index h, index c, index query_begin, index rows) {
        if (c == 0)
            return tile_map<T>(o_.dq.row(b, h, query_begin), rows, s_.head_dim, Eigen::OuterStride<>(o_.dq.strides[2]));
        T* base = partials_.data() + (((c - 1) * s_.batch + b) * s_.heads + h) * s_.query_len * s_.head_dim;
        return tile_map<T>(base + query_begin * s_.head_dim, rows, s_.head_dim, Eigen::OuterStride<>(s_.head_dim));
    }

    void run_unit(backward_workspace<T>& w, index unit) {
        const index c = unit % chunks_, pair = unit / chunks_;
        const index b = pair / s_.kv_heads, kvh = pair % s_.kv_heads;
        if (c == 0)
            for (index hh = 0; hh < group_; ++hh) dq_rows(b, kvh * group_ + hh, 0, 0, s_.query_len).setZero();
        T* bias_grad = bias_partials_.empty() ? nullptr : bias_partials_.data() + unit * group_ * diagonals_;
        const index first = c * tiles_per_chunk_, last = std::min(key_tiles_, first + tiles_per_chunk_);
        for (index kt = first; kt < last; ++kt) {
            const index k0 = kt * t_.block_k, k1 = std::min(s_.key_len, k0 + t_.block_k), nk = k1 - k0;
            const_tile_map<T> keys(in_.k.row(b, kvh, k0), nk, s_.head_dim, Eigen::OuterStride<>(in_.k.strides[2]));
            w.keys.topRows(nk) = p_.scale * keys;
            w.dk.topRows(nk).setZero();
            w.dv.topRows(nk).setZero();
            for (index hh = 0; hh < group_; ++hh) {
                const index h = kvh * group_ + hh;
                for (index qt = 0; qt < query_tiles_; ++qt) {
                    const index q0 = qt * t_.block_q, q1 = std::min(s_.query_len, q0 + t_.block_q);
                    const tile_class cls = mask_.classify(tile{b, h, q0, q1, k0, k1});
                    if (cls == tile_class::empty) continue;
                    run_tile(w, b, kvh, h, c, q0, q1, k0, k1, cls,
                             bias_grad ? bias_grad + hh * diagonals_ : nullptr);
                }
            }
            tile_map<T> dk(o_.dk.row(b, kvh, k0), nk, s_.head_dim, Eigen::OuterStride<>(o_.dk.strides[2]));
            tile_map<T> dv(o_.dv.row(b, kvh, k0), nk, s_.value_dim, Eigen::OuterStride<>(o_.dv.strides[2]));
            dk = p_.scale * w.dk.topRows(nk);
            dv = w.dv.topRows(nk);
        }
    }

    /// One tile: queries [q0, q1) of head h against keys [k0, k1); adds to w.dk, w.dv and the dq rows.
    void run_tile(backward_workspace<T>& w, index b, index kvh, index h, index c, index q0, index q1, index k0,
                  index k1, tile_class cls, T* bias_grad) {
        const index nq = q1 - q0, nk = k1 - k0, ld = t_.block_k, dv = s_.value_dim;
        const T* lse = in_.lse + (b * s_.heads + h) * s_.query_len;
        const index row0 = (b * s_.heads + h) * s_.query_len + q0;
        bool any = false, normalize = false;
        for (index r = 0; r < nq; ++r) {  // lse -inf: the forward's zero row, whose gradients are zero
            const T l = lse[q0 + r];
            const auto u = static_cast<std::size_t>(r), row = static_cast<std::size_t>(row0 + r);
            any = any || l != minus_infinity<T>();
            w.lse[u] = l == minus_infinity<T>() ? std::numeric_limits<T>::infinity()
                                                : (row_shift_.empty() ? l : row_shift_[row]);
            w.inv_sum[u] = row_inv_sum_.empty() ? T(1) : row_inv_sum_[row];
            normalize = normalize || w.inv_sum[u] != T(1);
        }
        if (!any) return;
        for (index r = 0; r < nq; ++r) {
            const T* o = in_.out.row(b, h, q0 + r);
            const T* g = in_.d_out.row(b, h, q0 + r);
            T sum = 0;
            for (index d = 0; d < dv; ++d) sum += o[d] * g[d];
            w.delta[static_cast<std::size_t>(r)] = sum;
        }
        const_tile_map<T> queries(in_.q.row(b, h, q0), nq, s_.head_dim, Eigen::OuterStride<>(in_.q.strides[2]));
        const_tile_map<T> d_out(in_.d_out.row(b, h, q0), nq, dv, Eigen::OuterStride<>(in_.d_out.strides[2]));
        const_tile_map<T> values(in_.v.row(b, kvh, k0), nk, dv, Eigen::OuterStride<>(in_.v.strides[2]));
        auto probs = w.probs.topLeftCorner(nq, nk);
        auto grad = w.grad.topLeftCorner(nq, nk);
        // P = exp(scale q k^T + bias + mask - lse), the forward's probabilities, recomputed (exp(s - max) / sum
        // for the rows of exact_statistics).
        tile_scores(w, b, h, q0, q1, k0, k1, cls);
        for (index r = 0; r < nq; ++r) exp_shifted(w.probs.data() + r * ld, nk, w.lse[static_cast<std::size_t>(r)]);
        if (normalize)
            for (index r = 0; r < nq; ++r) probs.row(r) *= w.inv_sum[static_cast<std::size_t>(r)];
        // dV += P'^T dO; dP = dO V^T (then masked and rescaled by dropout).
        const bool drop = p_.dropout.active();
        if (drop) {
            const T keep_scale = static_cast<T>(p_.dropout.keep_scale);
            for (index r = 0; r < nq; ++r)
                for (index j = 0; j < nk; ++j)
                    w.keep(r, j) = p_.dropout.keep(b, h, q0 + r, k0 + j) ? keep_scale : T(0);
            w.dropped.topLeftCorner(nq, nk) = (probs.array() * w.keep.topLeftCorner(nq, nk).array()).matrix();
            w.dv.topRows(nk).noalias() += w.dropped.topLeftCorner(nq, nk).transpose() * d_out;
        } else {
            w.dv.topRows(nk).noalias() += probs.transpose() * d_out;
        }
        grad.noalias() = d_out * values.transpose();
        // dS = P * (dP - delta), row by row.
        for (index r = 0; r < nq; ++r) {
            Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>> g(w.grad.data() + r * ld, nk);
            const Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>> pr(w.probs.data() + r * ld, nk);
            const T delta = w.delta[static_cast<std::size_t>(r)];
            if (drop) {
                const Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>> keep(w.keep.data() + r * ld, nk);
                g = pr * (g * keep - delta);
            } else {
                g = pr * (g - delta);
            }
        }
        if (bias_grad)  // key - query = k0 + j - (q0 + r) lands at n = k0 + j - q0 - r + query_len - 1
            for (index r = 0; r < nq; ++r) {
                T* diagonal = bias_grad + (k0 - q0 - r + s_.query_len - 1);
                const T* g = w.grad.data() + r * ld;
                for (index j = 0; j < nk; ++j) diagonal[j] += g[j];
            }
        // dQ += dS (scale K); dK += dS^T Q (scaled once per key tile in run_unit).
        dq_rows(b, h, c, q0, nq).noalias() += grad * w.keys.topRows(nk);
        w.dk.topRows(nk).noalias() += grad.transpose() * queries;
    }

    /// Scores of queries [q0, q1) of head h against the key tile [k0, k1) whose scaled keys are in w.keys, with
    /// bias and mask, into w.probs. One function for both passes, so both see the same bits.
    void tile_scores(backward_workspace<T>& w, index b, index h, index q0, index q1, index k0, index k1,
                     tile_class cls) const {
        const index nq = q1 - q0, nk = k1 - k0, ld = t_.block_k;
        const_tile_map<T> queries(in_.q.row(b, h, q0), nq, s_.head_dim, Eigen::OuterStride<>(in_.q.strides[2]));
        w.probs.topLeftCorner(nq, nk).noalias() = queries * w.keys.topRows(nk).transpose();
        if (bias_) bias_->add_tile(h, q0, k0, nq, nk, s_.query_len, s_.key_len, w.probs.data(), ld);
        if (cls == tile_class::mixed) mask_.apply(tile{b, h, q0, q1, k0, k1}, w.probs.data(), ld);
    }

    /// exp(s - lse) gives P only to about |lse| ulps: lse = max + log(sum) rounded to T keeps none of log(sum)
    /// when |max| is huge (scores of 1e30 with a tied maximum, a row filled with a finite -1e30), and P would not
    /// sum to 1. Beyond this size of |lse| (P off by 1e-5 in float, 5e-10 in double) a row's max and sum are
    /// recomputed exactly, in a pass over its keys, and P = exp(s - max) / sum as in the forward.
    static bool imprecise_lse(T lse) {
        const T limit = T(1) / (16 * std::sqrt(std::numeric_limits<T>::epsilon()));
        return std::isfinite(lse) && std::abs(lse) > limit;
    }

    /// row_shift_ and row_inv_sum_ of the rows whose lse is imprecise: their max and 1 / sum over all keys, from
    /// the scores run_tile computes (same tiles, same function). A no-op when no row needs it.
    void exact_statistics(std::vector<backward_workspace<T>>& ws, int threads) {
        if (row_shift_.empty()) return;
        const index units = s_.batch * s_.heads * query_tiles_;
        parallel_for(units, threads, [&](index unit, int worker) {
            auto& w = ws[static_cast<std::size_t>(worker)];
            const index qt = unit % query_tiles_, bh = unit / query_tiles_, b = bh / s_.heads, h = bh % s_.heads;
            const index q0 = qt * t_.block_q, q1 = std::min(s_.query_len, q0 + t_.block_q), nq = q1 - q0;
            const index row0 = bh * s_.query_len + q0, ld = t_.block_k;
            if (std::none_of(in_.lse + row0, in_.lse + row0 + nq, [](T l) { return imprecise_lse(l); })) return;
            std::fill(w.lse.begin(), w.lse.begin() + nq, minus_infinity<T>());  // running max
            std::fill(w.delta.begin(), w.delta.begin() + nq, T(0));               // running sum
            for (index k0 = 0; k0 < s_.key_len; k0 += t_.block_k) {
                const index k1 = std::min(s_.key_len, k0 + t_.block_k), nk = k1 - k0;
                const tile_class cls = mask_.classify(tile{b, h, q0, q1, k0, k1});
                if (cls == tile_class::empty) continue;
                const_tile_map<T> keys(in_.k.row(b, h / group_, k0), nk, s_.head_dim,
                                       Eigen::OuterStride<>(in_.k.strides[2]));
                w.keys.topRows(nk) = p_.scale * keys;
                tile_scores(w, b, h, q0, q1, k0, k1, cls);
                for (index r = 0; r < nq; ++r) {
                    const T* x = w.probs.data() + r * ld;
                    T& max = w.lse[static_cast<std::size_t>(r)];
                    T& sum = w.delta[static_cast<std::size_t>(r)];
                    const T m = std::max(max, *std::max_element(x, x + nk));
                    if (m == minus_infinity<T>()) continue;
                    sum *= std::exp(max - m);  // exp(-inf) = 0 while the row had no allowed key
                    for (index j = 0; j < nk; ++j) sum += std::exp(x[j] - m);
                    max = m;
                }
            }
            for (index r = 0; r < nq; ++r) {
                const auto row = static_cast<std::size_t>(row0 + r), u = static_cast<std::size_t>(r);
                if (!imprecise_lse(in_.lse[row]) || !(w.delta[u] > 0)) continue;
                row_shift_[row] = w.lse[u];
                row_inv_sum_[row] = T(1) / w.delta[u];
            }
        });
    }

    void add_partials(index b, index h) {
        auto dq = dq_rows(b, h, 0, 0, s_.query_len);
        for (index c = 1; c < chunks_; ++c) dq += dq_rows(b, h, c, 0, s_.query_len);
    }

    void reduce_bias_gradient() const {
        T* out = o_.score_bias_gradient;
        std::fill(out, out + s_.heads * diagonals_, T(0));
        for (index h = 0; h < s_.heads; ++h) {
            const index kvh = h / group_, hh = h % group_;
            for (index b = 0; b < s_.batch; ++b)
                for (index c = 0; c < chunks_; ++c) {
                    const index unit = (b * s_.kv_heads + kvh) * chunks_ + c;
                    const T* part = bias_partials_.data() + (unit * group_ + hh) * diagonals_;
                    for (index n = 0; n < diagonals_; ++n) out[h * diagonals_ + n] += part[n];
                }
        }
    }

    const backward_inputs<T>& in_;
    const attention_shape& s_;
    const Bound& mask_;
    const kernel_params<T>& p_;
    const gradient_outputs<T>& o_;
    backward_tiling t_;
    const score_bias* bias_ = nullptr;
    index group_ = 1, diagonals_ = 0, key_tiles_ = 0, query_tiles_ = 0, chunks_ = 1, tiles_per_chunk_ = 1;
    std::vector<T> row_shift_;      ///< [batch, heads, query_len]: lse, or the row max (exact_statistics); or empty
    std::vector<T> row_inv_sum_;    ///< [batch, heads, query_len]: 1, or 1 / the row sum (exact_statistics); or empty
    std::vector<T> partials_;       ///< (chunks - 1) dq-sized buffers [batch, heads, query_len, head_dim]
    std::vector<T> bias_partials_;  ///< per unit [group, diagonals]
};

/// Runs the kernel of a checked backward call: kernel::reference is the oracle, anything else the tiled path.
template <class T, class Bound>
void run_backward(const backward_inputs<T>& in, const checked_backward<T, Bound>& checked,
                  const gradient_outputs<T>& out, const backward_tiling& tiling) {
    const erased_mask<Bound> erased(checked.call.mask);
    const mask_tiles& mask = erased;
    if (checked.call.kernel == kernel::reference)
        reference_backward(in, checked.shape, mask, checked.call.params, out);
    else
        tiled_backward_runner<T, mask_tiles>(in, checked.shape, mask, checked.call.params, out, tiling)
            .run(checked.call.threads);
}

template <class T, class Bound>
void run_backward(const backward_inputs<T>& in, const checked_backward<T, Bound>& checked,
                  const gradient_outputs<T>& out) {
    run_backward(in, checked, out, default_backward_tiling<T>(checked.shape));
}

/// The backward on strided views, for multi-head attention (heads read from and written to projected
/// `[batch, len, heads * dim]` buffers through split_heads): checks everything, then writes dq, dk, dv and,
/// when not null and the call has a score_bias, score_bias_gradient. Throws as
/// scaled_dot_product_attention_backward, before any write.
template <class T, class Mask>
void sdpa_backward_views(const backward_inputs<T>& in, const Mask& mask, const sdpa_options& options,
                         const gradient_outputs<T>& out) {
    require_mask<Mask>();
    const auto checked = check_backward(in, &out, mask, options);
    run_backward(in, checked, out);
}

template <class Lse, class T, int Rank>
constexpr void require_lse() {
    using traits = tensor_traits<std::decay_t<Lse>>;
    static_assert(traits::supported, "attend: lse must be an attend::tensor (row-major Eigen::Tensor) or a TensorMap "
                                     "of one, as scaled_dot_product_attention returns it");
    if constexpr (traits::supported) {
        static_assert(traits::row_major, "attend: lse must be Eigen::RowMajor (PyTorch's layout)");
        static_assert(traits::rank == Rank - 1,
                      "attend: lse has one axis less than the query: [batch, heads, query_len] for rank-4 inputs, "
                      "[batch, query_len] for rank 3");
        static_assert(std::is_same_v<typename traits::scalar, T>, "attend: lse must have the query's scalar type");
    }
}

template <int Rank, class Q, class K, class V, class Out, class Lse, class DOut>
auto backward_inputs_of(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse, const DOut& d_out) {
    using T = scalar_of<Q>;
    static_assert(std::is_same_v<T, scalar_of<K>> && std::is_same_v<T, scalar_of<V>> &&
                      std::is_same_v<T, scalar_of<Out>> && std::is_same_v<T, scalar_of<DOut>>,
                  "attend: query, key, value, out and d_out must have the same scalar type");
    static_assert(rank_of<K>() == Rank && rank_of<V>() == Rank && rank_of<Out>() == Rank && rank_of<DOut>() == Rank,
                  "attend: query, key, value, out and d_out must have the same rank");
    require_lse<Lse, T, Rank>();
    backward_inputs<T> in;
    in.q = checked_input(q);
    in.k = checked_input(k);
    in.v = checked_input(v);
    in.out = checked_input(out);
    in.d_out = checked_input(d_out);
    in.lse = lse.data();
    in.lse_rank = Rank - 1;
    if constexpr (Rank == 4) in.lse_dims = {lse.dimension(0), lse.dimension(1), lse.dimension(2)};
    else in.lse_dims = {lse.dimension(0), 1, lse.dimension(1)};
    return in;
}

}  // namespace detail

/// Gradients of scaled_dot_product_attention(q, k, v, mask, options) for d_out = d loss / d out, given that
/// call's out `[batch, heads, query_len, value_dim]` and lse `[batch, heads, query_len]` (need_lse, on by
/// default; or pass the forward's result whole, below). Pass the forward's options: scale, empty_rows, score_bias and dropout (replayed from its seed, so
/// the same weights are dropped) must be the same; threads and kernel may differ (kernel::reference is the
/// oracle, anything else the tiled path, O(threads x tile) memory). Returns dq, dk, dv (dk and dv summed over
/// the query heads of each group) and, with a score_bias, score_bias_gradient.
/// Throws before computing anything: everything scaled_dot_product_attention throws, shape_error
/// attend.shape.backward_out / backward_lse / backward_d_out for out, lse, d_out of the wrong shape, value_error
/// attend.value.non_finite for NaN / Inf in out or d_out and attend.value.lse for NaN / +inf in lse (both
/// when check_finite).
template <class Q, class K, class V, class Out, class Lse, class DOut, class Mask>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse,
                                           const DOut& d_out, const Mask& mask, const sdpa_options& options = {}) {
    detail::require_mask<Mask>();
    using T = detail::scalar_of<Q>;
    constexpr int rank = detail::rank_of<Q>();
    const auto in = detail::backward_inputs_of<rank>(q, k, v, out, lse, d_out);
    const auto checked = detail::check_backward(in, static_cast<const detail::gradient_outputs<T>*>(nullptr), mask,
                                                options);
    const attention_shape& s = checked.shape;
    attention_gradients<T, rank> g;
    const char* hint = "The gradients are as large as q, k and v; split the call over the batch";
    detail::resize_guarded(g.dq, detail::rank_dims<rank>(s, s.head_dim), "dq", hint);
    if constexpr (rank == 4) {
        detail::resize_guarded(g.dk, std::array<index, 4>{s.batch, s.kv_heads, s.key_len, s.head_dim}, "dk", hint);
        detail::resize_guarded(g.dv, std::array<index, 4>{s.batch, s.kv_heads, s.key_len, s.value_dim}, "dv", hint);
    } else {
        detail::resize_guarded(g.dk, std::array<index, 3>{s.batch, s.key_len, s.head_dim}, "dk", hint);
        detail::resize_guarded(g.dv, std::array<index, 3>{s.batch, s.key_len, s.value_dim}, "dv", hint);
    }
    detail::gradient_outputs<T> o;
    o.dq = detail::as_mutable_view(g.dq);
    o.dk = detail::as_mutable_view(g.dk);
    o.dv = detail::as_mutable_view(g.dv);
    if (!options.score_bias.empty()) {
        detail::resize_guarded(g.score_bias_gradient, std::array<index, 2>{s.heads, s.query_len + s.key_len - 1},
                               "score_bias_gradient", hint);
        o.score_bias_gradient = g.score_bias_gradient.data();
    }
    detail::run_backward(in, checked, o);
    return g;
}

/// Gradients of attention without a mask.
template <class Q, class K, class V, class Out, class Lse, class DOut>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse,
                                           const DOut& d_out, const sdpa_options& options = {}) {
    return scaled_dot_product_attention_backward(q, k, v, out, lse, d_out, no_mask{}, options);
}

/// Gradients from the forward's result as scaled_dot_product_attention returned it: its out and lse (need_lse
/// is on by default). Throws shape_error attend.shape.backward_lse, saying so, when the forward ran with
/// need_lse = false, and everything the form with out and lse throws.
template <class Q, class K, class V, class T, int Rank, class DOut, class Mask>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const attention_result<T, Rank>& forward,
                                           const DOut& d_out, const Mask& mask, const sdpa_options& options = {}) {
    if (forward.lse.size() == 0 && forward.out.size() != 0)
        throw shape_error("attend.shape.backward_lse",
                          detail::concat("the forward result holds out ", detail::format_shape(forward.out.dimensions()),
                                         " but no lse: run the forward with need_lse = true (the default)"));
    return scaled_dot_product_attention_backward(q, k, v, forward.out, forward.lse, d_out, mask, options);
}

/// Gradients of attention without a mask from the forward's result.
template <class Q, class K, class V, class T, int Rank, class DOut>
auto scaled_dot_product_attention_backward(const Q& q, const K& k, const V& v, const attention_result<T, Rank>& forward,
                                           const DOut& d_out, const sdpa_options& options = {}) {
    return scaled_dot_product_attention_backward(q, k, v, forward, d_out, no_mask{}, options);
}

/// Writes the gradients into caller-owned tensors of the inputs' rank (attend::tensor or TensorMap):
/// dq like q, dk like k, dv like v, and unless nullptr score_bias_gradient `[heads, query_len + key_len - 1]`
/// (written only when options.score_bias is not none). On any error nothing is written: the throws of
/// scaled_dot_product_attention_backward and shape_error attend.shape.backward_dq / backward_dk / backward_dv /
/// backward_score_bias for outputs of the wrong shape, and attend.shape.aliasing, naming both tensors, when an
/// output overlaps q, k, v, out, d_out, lse or another output in memory (measured conservatively, from each
/// tensor's lowest to its highest element address; adjacent buffers are fine).
template <class Q, class K, class V, class Out, class Lse, class DOut, class Mask, class DQ, class DK, class DV,
          class BiasGrad = std::nullptr_t>
void scaled_dot_product_attention_backward_into(const Q& q, const K& k, const V& v, const Out& out, const Lse& lse,
                                                const DOut& d_out, const Mask& mask, DQ&& dq, DK&& dk, DV&& dv,
                                                const sdpa_options& options = {},
                                                BiasGrad&& score_bias_gradient = nullptr) {
    detail::require_mask<Mask>();
    using T = detail::scalar_of<Q>;
    constexpr int rank = detail::rank_of<Q>();
    static_assert(std::is_same_v<T, detail::scalar_of<DQ>> && std::is_same_v<T, detail::scalar_of<DK>> &&
                      std::is_same_v<T, detail::scalar_of<DV>>,
                  "attend: dq, dk and dv must have the query's scalar type");
    static_assert(detail::rank_of<DQ>() == rank && detail::rank_of<DK>() == rank && detail::rank_of<DV>() == rank,
                  "attend: dq, dk and dv must have the query's rank");
    const auto in = detail::backward_inputs_of<rank>(q, k, v, out, lse, d_out);
    detail::gradient_outputs<T> o;
    o.dq = detail::as_mutable_view(dq);
    o.dk = detail::as_mutable_view(dk);
    o.dv = detail::as_mutable_view(dv);
    if constexpr (!std::is_same_v<std::decay_t<BiasGrad>, std::nullptr_t>) {
        static_assert(std::is_same_v<T, detail::scalar_of<BiasGrad>> && detail::rank_of<BiasGrad>() == 2,
                      "attend: score_bias_gradient is a rank-2 tensor [heads, query_len + key_len - 1] of the "
                      "query's scalar type");
        const std::array<index, 2> expected{in.q.dims[1], in.q.dims[2] + in.k.dims[2] - 1};
        const std::array<index, 2> got{score_bias_gradient.dimension(0), score_bias_gradient.dimension(1)};
        if (!options.score_bias.empty() && got != expected)
            throw shape_error("attend.shape.backward_score_bias",
                              detail::concat("score_bias_gradient ", detail::format_shape(got), " != expected ",
                                             detail::format_shape(expected), " [heads, query_len + key_len - 1]"));
        o.score_bias_gradient = options.score_bias.empty() ? nullptr : score_bias_gradient.data();
    }
    detail::check_no_aliasing(
        {detail::named("query", in.q), detail::named("key", in.k), detail::named("value", in.v),
         detail::named("out", in.out), detail::named("d_out", in.d_out), detail::named("lse", in.lse, in.lse_dims)},
        {detail::named("dq", o.dq), detail::named("dk", o.dk), detail::named("dv", o.dv),
         detail::named("score_bias_gradient", o.score_bias_gradient,
                       std::array<index, 2>{in.q.dims[1], in.q.dims[2] + in.k.dims[2] - 1})});
    const auto checked = detail::check_backward(in, &o, mask, options);
    detail::run_backward(in, checked, o);
}

/// The gradient of a T5 relative-position bias table `[num_buckets, heads]` (d loss / d table(bucket, h)) from
/// the score_bias_gradient of a backward call whose options.score_bias was built from `table`
/// (score_bias::relative(table, alignment)): each key - query offset adds its gradient to its bucket.
/// `bias` is that call's options.score_bias; the table must reproduce it at every offset of the call.
/// Throws shape_error attend.shape.relative_bias_gradient when grads has no score_bias_gradient or its heads
/// differ from the table's, value_error attend.value.relative_bias_table when the table does not give bias's
/// values (another table, another alignment, or a table changed since).
template <class U, class T, int Rank>
tensor<U, 2> relative_bias_gradient(const relative_position_bias<U>& table, const attention_gradients<T, Rank>& grads,
                                    const score_bias& bias) {
    const index L = grads.dq.dimension(Rank - 2), S = grads.dk.dimension(Rank - 2);
    const index heads = Rank == 4 ? grads.dq.dimension(1) : 1;
    const index diagonals = L + S - 1;
    const auto& g = grads.score_bias_gradient;
    if (g.dimension(0) != heads || g.dimension(1) != diagonals || table.heads() != heads || bias.empty())
        throw shape_error("attend.shape.relative_bias_gradient",
                          detail::concat("score_bias_gradient ", detail::format_shape(g.dimensions()), " must be [",
                                         heads, ',', diagonals, "] (heads, query_len + key_len - 1; empty means the "
                                         "backward ran without a score_bias) and the table ",
                                         detail::format_shape(table.table().dimensions()),
                                         " must have heads ", heads));
    const index shift = bias.bias_alignment() == alignment::bottom_right ? S - L : 0;
    tensor<U, 2> d_table(table.num_buckets(), heads);
    d_table.setZero();
    for (index h = 0; h < heads; ++h)
        for (index n = 0; n < diagonals; ++n) {
            const index offset = n - (L - 1);  // key - query
            const index i = std::max<index>(0, -offset), j = i + offset;
            const index bucket = table.bucket(i + shift, j);
            if (bias.value<double>(h, i, j, L, S) != static_cast<double>(table.table()(bucket, h)))
                throw value_error("attend.value.relative_bias_table",
                                  detail::concat("the table does not give the call's score_bias at head ", h,
                                                 ", key - query ", offset, ": ", table.table()(bucket, h), " != ",
                                                 bias.value<double>(h, i, j, L, S),
                                                 " (pass the table and alignment the bias was built from)"));
            d_table(bucket, h) += static_cast<U>(g(h, n));
        }
    return d_table;
}

}  // namespace attend
