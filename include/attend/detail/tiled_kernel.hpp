// SPDX-License-Identifier: MIT
#pragma once
/// The tiled kernel: FlashAttention-2's forward pass on register-blocked micro-tiles (micro_kernel.hpp: each K and
/// V tile packed once for the query blocks of a work unit, Q·Kᵀ and P·V on packets). Per work unit (batch, kv
/// head, a few query blocks run side by side) the keys stream by in tiles; each row keeps a running max, a running
/// sum and an accumulator that is rescaled when the max grows, so memory is O(threads x tile), never
/// O(query_len x key_len) (except the weights output, when asked for). Semantics are the reference kernel's
/// (reference_kernel.hpp) within rounding: scores = scale q.k + score_bias, masked, softmax along keys, lse kept,
/// dropout on the probabilities that multiply V (replayed from dropout_rule, the same decisions as the reference),
/// padded queries and empty rows give zero rows and lse -inf, never NaN.
///
/// Grouped-query attention: a work unit holds all `heads / kv_heads` query heads of one kv head, their query rows
/// stacked into one block ([head 0 rows; head 1 rows; ...]), so each K and V tile is read from memory and packed
/// once for the whole group. Mask classification, score_bias and dropout stay per head: the block is made of
/// per-head sub-blocks, each classified and masked as its own tile. (A block of at most gemv_rows rows, e.g. one
/// decoded query on 4 query heads per kv head, uses the row kernels of row_kernel.hpp, which read K and V in place,
/// instead of the micro-kernels, which would first copy K into packed panels.)
///
/// Masks: a tile classified empty for every head is skipped before its products; a full tile gets no per-element
/// mask work; a mixed tile is cut into runs of 32-key strips, the strips every row may see go through one block,
/// the others through 32-query slabs each trimmed to the keys it may see (a causal diagonal or a window edge costs
/// about a slab-sized triangle, not a block-sized one).
///
/// Decoding (query_len <= 16, no weights asked): a block has too few rows to keep threads busy, so the keys are
/// also split into fixed-size chunks (the chunk size depends on the shape only, never on the thread count); the
/// chunks run in parallel and their partial outputs are combined with merge_partials' formula (merge_rows.hpp) in
/// chunk order, so the result is bit-identical for any thread count. When the call leaves check_finite's scan of K
/// and V to the kernel (kernel_params::kv_scan), the decode pass does it on the rows it reads anyway and asks for
/// the verdict before the merge writes anything; every other path runs the scan first.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../score_bias.hpp"
#include "../shape.hpp"
#include "dropout.hpp"
#include "kernel_interface.hpp"
#include "mask_nodes.hpp"
#include "memory.hpp"
#include "merge_rows.hpp"
#include "micro_kernel.hpp"
#include "micro_kernel_amx.hpp"
#include "micro_kernel_bf16.hpp"
#include "parallel_for.hpp"
#include "quantized_rows.hpp"
#include "row_kernel.hpp"
#include "score_pipeline.hpp"
#include "widen.hpp"

namespace attend::detail {

/// Tile sizes of the tiled kernel. They depend only on the call's shape, never on the thread count, which is
/// part of why results are bit-identical for any thread count.
struct tile_config {
    index_t query_rows = 128;     ///< rows of a query block: the group's heads x queries per head (about)
    index_t key_tile = 512;       ///< keys per tile
    index_t trim_step = 32;       ///< a mixed tile drops empty key columns from both ends in steps of this many
    index_t slab_rows = 32;       ///< a mixed tile is processed in slabs of this many queries of one head
    index_t gemv_rows = 8;        ///< slabs of at most this many rows (<= 8) use the row kernels, not the micro-kernels
    index_t decode_queries = 16;  ///< query_len at or below which keys are split into chunks (decode path)
    index_t decode_chunk = 2048;  ///< keys per chunk of the decode path
    index_t shared_blocks = 8;    ///< query blocks of one (batch, kv head) a unit runs over each packed K and V tile
};

/// Rows of a tiled_runner's query blocks for shape s: every query head of a kv head, times as many queries as
/// c.query_rows holds (at least one).
inline index_t block_rows(const attention_shape& s, const tile_config& c) {
    const index_t group = s.group_size();
    return group * std::max<index_t>(1, std::min(s.query_len, (c.query_rows + group - 1) / group));
}

/// Tile sizes chosen by measurement (bench/README.md has the sweep, `attend_bench --benchmark_filter=tiled_tiles`),
/// fp32, head_dim 64, L = S = 2048, one thread. With Eigen GEMMs per tile (Zen 4, AVX-512), blocks of 64 to 256
/// query rows x 256 to 1024 keys ran within about 5 % of each other; 32 rows or 128 keys were up to 50 % slower,
/// as Eigen re-packed both operands on every call. With the micro-kernels (Zen 3, AVX2), which pack K and V once
/// per block and tile, 128 to 256 rows x 128 to 512 keys ran within the machine's noise (about 10 %) and 1024-key
/// tiles were about 20 % slower. 128 rows x 512 keys was among the fastest on both and keeps the score tile
/// (256 KiB) and the K and V tiles (128 KiB each) in L2; more rows would put more of a causal diagonal or a
/// window edge into mixed tiles (those are cut into 32-key strips and 32-query slabs). Double uses half the keys,
/// so its tiles take the same bytes; head dims of 128 or more halve the key tile again. The decode chunk is 4 key
/// tiles: at key_len 8192, head_dim 128 that is 8 chunks per kv head to spread over threads.
/// Since then, blocks of 256 rows: a block packed every K and V tile it read, so twice the rows packed half as often
/// (the score tile grows to 512 KiB). On an Emerald Rapids Xeon (AVX-512, 2 MiB L2; alternating runs of both
/// binaries) that was 4 to 10 % faster at L = 1024 to 4096, head_dim 64 and 128, causal or not, 1 and 2 threads.
/// A fixed size, not one picked from the batch or the heads: a row's sums are grouped by its block's micro-tiles,
/// strips and slabs, so a size that followed the batch would give a sequence other bits in another batch (the
/// paged cache promises each sequence the bits it gets alone). Small calls get fewer blocks to spread over threads
/// (1 head, L = 1024: 4).
/// Now up to shared_blocks blocks share each packed tile (run_blocks), which blocks of 384 or 512 rows could not do
/// (measured before that change: their score tiles outgrow L2, and they were slower than 256).
/// Blocks of at most gemv_rows rows (a decode's query heads of one kv head) read K and V in place through the row
/// kernels, with no panels to keep in L2: their key tile is a whole decode chunk. Each tile is a pass over its keys,
/// a softmax step and a pass over its values; four times fewer of them took 0.93 to 0.97 of the time of an fp32,
/// bf16 or q8_0 decode from memory (Zen 5, 1 thread, versions alternated). Decided by the shape, as above, so the
/// decode path and the blocks' path still give a call the same bits.
template <class T>
tile_config default_tile_config(const attention_shape& s) {
    tile_config c;
    c.query_rows = 256;
    c.key_tile = sizeof(accumulator_t<T>) == 4 ? 512 : 256;  // tiles hold the accumulation type
    if (std::max(s.head_dim, s.value_dim) >= 128) c.key_tile /= 2;
    c.decode_chunk = 4 * c.key_tile;
    if (block_rows(s, c) <= c.gemv_rows) c.key_tile = c.decode_chunk;
    return c;
}

/// Rows [j0, j0 + n) of (b, h) of keys or values (a strided_view, a paged_view or quantized rows) as a matrix of the
/// accumulation type: the rows themselves when they are contiguous and of that type, otherwise a copy in `stage`,
/// converted (one conversion per tile or slice, shared by every query row of the block; 16-bit rows widen to float
/// in widen.hpp's vectorized loops; quantized rows exactly, widen_rows). Which of the two it is never changes a result: the same values reach the same products.
template <class Acc, class Rows>
const_tile_map<Acc> rows_as_accumulator(const Rows& x, index_t b, index_t h, index_t j0, index_t n, Acc* stage) {
    using Storage = row_scalar_t<Rows>;
    const index_t cols = x.dims[3];
    if constexpr (is_quantized_block_v<Storage>) {
        widen_rows(x, b, h, j0, n, stage);
    } else {
        if constexpr (std::is_same_v<Acc, Storage>)
            if (n > 0 && rows_contiguous(x, j0, n))
                return const_tile_map<Acc>(x.row(b, h, j0), n, cols, Eigen::OuterStride<>(row_stride(x)));
        for (index_t r = 0; r < n;) {  // run by run of rows packed one after another (a block, a dense view)
            const index_t run = std::min(n - r, packed_rows(x, j0 + r));
            widen(x.row(b, h, j0 + r), run * cols, stage + r * cols);
            r += run;
        }
    }
    return const_tile_map<Acc>(stage, n, cols, Eigen::OuterStride<>(cols));
}

/// Rows [i, i + n) of (b, h) of keys or values, at most row_run::most of them and as far as they follow each other
/// at one stride: where a row kernel's prefetch runs on to after its own rows.
template <class View>
row_run run_of_rows(const View& x, index_t b, index_t h, index_t i, index_t n) {
    if (n <= 0) return {};
    n = rows_following(x, i, std::min(n, row_run::most));
    const auto* first = reinterpret_cast<const char*>(x.row(b, h, i));
    return {first, n > 1 ? reinterpret_cast<const char*>(x.row(b, h, i + 1)) - first : 0, n};
}

/// What one decode unit's pass saw of its keys and values, for check_finite (deferred_kv_scan): the largest |k| and
/// whether any key or value was NaN or +-inf, over every row from the chunk's first key to `scanned_to`, always
/// gathered as a row_scan. Rows the row kernels read are noted in the same registers; rows copied for the float
/// panels are scanned in the copy, while it is in cache (scan_of); rows the pass skips (tiles the mask empties, the
/// trimmed ends of mixed tiles) are read for the scan alone.
template <class Acc>
struct kv_findings {
    bool active = false;
    Acc key_max_abs = 0;
    bool non_finite = false;
    index_t scanned_to = 0;

    void reset(bool on, index_t key_begin) {
        active = on;
        key_max_abs = 0;
        non_finite = false;
        scanned_to = key_begin;
    }
    /// Notes what a pass saw of keys: their largest |k|, or that one was NaN or +-inf.
    void keys(const row_scan<Acc>& seen) {
        if (seen.non_finite()) non_finite = true;
        else key_max_abs = std::max(key_max_abs, seen.largest());
    }
    /// Notes what a pass saw of values: whether one was NaN or +-inf.
    void values(const row_scan<Acc>& seen) { non_finite = non_finite || seen.non_finite(); }
};

/// The scan of a tile of rows already in the accumulation type (a stage, or rows read in place).
template <class Acc>
row_scan<Acc> scan_of(const const_tile_map<Acc>& x, bool magnitude) {
    row_scan<Acc> seen;
    scan_rows(
        x.rows(), x.cols(), [&](index_t j) { return x.data() + j * x.outerStride(); }, magnitude, seen);
    return seen;
}

/// One worker's scratch memory, allocated once per call before the workers start (never inside the tile loop).
/// All in the accumulation type.
template <class Acc>
struct tiled_workspace {
    // The buffers each block or tile writes before it reads them are not zeroed when sized (unzeroed_vector).
    unzeroed_vector<Acc> queries;       ///< [rows, head_dim], scaled
    unzeroed_vector<Acc> scores;        ///< [rows, key_tile], scores then probabilities
    unzeroed_vector<Acc> acc;           ///< [rows, value_dim], zeroed as a block starts (start_stream)
    online_softmax<Acc> softmax;        ///< [rows] running max and sum
    std::vector<tile_class> classes;    ///< [group]
    unzeroed_vector<Acc> key_stage;     ///< [key_tile, head_dim] converted keys for the float panels, when not Acc
    unzeroed_vector<Acc> value_stage;   ///< [key_tile, value_dim] converted values for the float panels, when not Acc
    kv_findings<Acc> found;             ///< the decode path's check_finite findings, when it scans
    unzeroed_vector<Acc> key_panels;    ///< [key_tile rounded to panels, head_dim]: keys packed for the micro-kernel
    unzeroed_vector<Acc> value_panels;  ///< [key_tile, value_dim]: values packed for the micro-kernel
    pair_scratch pairs;                 ///< bf16 pairs instead of the panels, where the pair path runs
    /// Which keys or values the panels hold (batch -1: none), and the tile being streamed, whose keys and values
    /// are packed whole the first time a slab of it needs them, so every slab of the tile reads the same panels.
    struct key_range {
        index_t batch = -1, kv_head = 0, begin = 0, end = 0;
        bool operator==(const key_range& o) const {
            return batch == o.batch && kv_head == o.kv_head && begin == o.begin && end == o.end;
        }
    } packed_keys, packed_values, tile;

    /// What a query block keeps from one key tile to the next, parked while the worker runs another block of its
    /// unit over the same packed tile (tiled_runner::run_blocks); switch_to swaps buffers, it copies nothing.
    struct block_state {
        unzeroed_vector<Acc> queries, acc;
        online_softmax<Acc> softmax;
        aligned_vector<std::uint32_t> pair_queries;
    };
    std::vector<block_state> parked;  ///< [blocks per unit]; the current block's slot holds spare buffers
    index_t current = 0;              ///< the block whose state queries, acc, softmax and pairs.queries hold

    /// Makes queries, acc, softmax and pairs.queries block g's (of the unit's blocks; allocated by park).
    void switch_to(index_t g) {
        if (g == current) return;
        swap_state(parked[static_cast<std::size_t>(current)]);
        swap_state(parked[static_cast<std::size_t>(g)]);
        current = g;
    }

    /// Room for `blocks` blocks' states of `rows` rows, each as large as this workspace's own.
    void park(index_t blocks, index_t rows) {
        parked.resize(static_cast<std::size_t>(blocks));
        for (std::size_t g = 1; g < parked.size(); ++g) {
            parked[g].queries.resize(queries.size());
            parked[g].acc.resize(acc.size());
            parked[g].softmax = online_softmax<Acc>(rows);
            parked[g].pair_queries.resize(pairs.queries.size());
        }
    }

    /// `panels`: whether any slab can take the micro-kernels (more than gemv_rows rows); a decode's blocks never do,
    /// and leave the panels empty. `bf16_pairs`: whether they take the bf16 pair kernels instead (then the float
    /// panels stay empty).
    tiled_workspace(index_t rows, index_t head_dim, index_t key_tile, index_t value_dim, index_t group, bool stage,
                    bool panels, bool bf16_pairs)
        : queries(static_cast<std::size_t>(rows * head_dim)),
          scores(static_cast<std::size_t>(rows * key_tile)),
          acc(static_cast<std::size_t>(rows * value_dim)),
          softmax(rows),
          classes(static_cast<std::size_t>(group)),
          key_stage(stage ? static_cast<std::size_t>(key_tile * head_dim) : 0),
          value_stage(stage ? static_cast<std::size_t>(key_tile * value_dim) : 0),
          key_panels(panels && !bf16_pairs
                         ? static_cast<std::size_t>(micro_tile<Acc>::panel_elements(key_tile, head_dim))
                         : 0),
          value_panels(panels && !bf16_pairs ? static_cast<std::size_t>(key_tile * value_dim) : 0) {
        if (!bf16_pairs) return;
        pairs.queries.resize(static_cast<std::size_t>(rows * (head_dim / 2)));
        pairs.keys.resize(static_cast<std::size_t>(bf16_tile::key_panel_words(key_tile, head_dim)));
        pairs.values.resize(static_cast<std::size_t>(bf16_tile::value_panel_words(key_tile, value_dim)));
        pairs.probabilities.resize(static_cast<std::size_t>(rows * bf16_tile::probability_row_words(key_tile)));
    }

private:
    void swap_state(block_state& st) {
        std::swap(queries, st.queries);
        std::swap(acc, st.acc);
        std::swap(softmax, st.softmax);
        std::swap(pairs.queries, st.pair_queries);
    }
};

/// The tiled forward pass of one call; see the file comment. Reads Storage, computes in Acc; keys and values come
/// as `Rows`: strided views, or the blocks of a paged cache (paged_view).
template <class Storage, class Acc, class Rows = strided_view<const Storage>>
class tiled_runner {
public:
    tiled_runner(const strided_view<const Storage>& q, const Rows& k, const Rows& v, const attention_shape& s,
                 const mask_tiles& mask, const kernel_params<Acc>& p, const attention_outputs<Storage>& o,
                 const tile_config& c)
        : q_(q), k_(k), v_(v), s_(s), mask_(mask), pipe_(s, mask, p), p_(p), o_(o), c_(c) {
        group_ = s.group_size();
        // At least 1 even for query_len == 0, where query_blocks_ becomes 0 and there is no work.
        rows_ = block_rows(s, c);
        block_queries_ = rows_ / group_;
        query_blocks_ = (s.query_len + block_queries_ - 1) / block_queries_;
        // Fewer keys than a tile are one tile whatever its size, so the scratch is sized for them (to 64 keys, a
        // whole number of micro-kernel panels): zeroing a full tile's scores and panels had been a tenth of a
        // 64-token prefill. No bit changes.
        c_.key_tile = std::min(c_.key_tile, std::max<index_t>(64, (s.key_len + 63) / 64 * 64));
    }

    void run(int threads) {
        // A decode with check_finite's scan handed over takes the decode path within one chunk too (one unit per
        // block, as run_blocks, and the same bits): the scan then rides on the pass that reads K and V anyway, where
        // a pass of its own first had doubled a short decode's time.
        const bool decode = s_.query_len <= c_.decode_queries && o_.weights == nullptr &&
                            (s_.key_len > c_.decode_chunk || (p_.kv_scan && s_.key_len > 0));
        // Only the decode path scans keys and values in its own pass: elsewhere the scan goes first.
        if (p_.kv_scan && !(decode && s_.batch > 0 && s_.query_len > 0)) p_.kv_scan->scan_now(threads);
        if (s_.batch == 0 || s_.query_len == 0) return;
        if (decode) run_decode(threads);
        else run_blocks(threads);
    }

private:
    /// Rows reach the products through a copy when their type is not Acc or they may cross a block edge.
    static constexpr bool staged = !std::is_same_v<Rows, strided_view<const Acc>>;
    /// Whether the workers need stages: only the float panels copy rows (the row and pair kernels read them in
    /// place).
    bool uses_stage() const { return staged && uses_panels() && !uses_pairs(); }

    // ---- work units -------------------------------------------------------------------------------------------
    struct block {
        index_t batch, kv_head, query_begin, queries;
    };
    block block_of(index_t n) const {  // n in [0, batch * kv_heads * query_blocks)
        const index_t qb = n % query_blocks_, bg = n / query_blocks_;
        const index_t q0 = qb * block_queries_;
        return {bg / s_.kv_heads, bg % s_.kv_heads, q0, std::min(block_queries_, s_.query_len - q0)};
    }
    index_t block_count() const { return s_.batch * s_.kv_heads * query_blocks_; }
    /// Query head and query position of row r of a block (its rows are stacked head after head).
    index_t head_of(const block& blk, index_t r) const { return blk.kv_head * group_ + r / blk.queries; }
    index_t query_of(const block& blk, index_t r) const { return blk.query_begin + r % blk.queries; }

    /// Whether a slab can have more than gemv_rows rows, and so use the packed panels (a slab has at most a
    /// block's rows).
    bool uses_panels() const { return rows_ > c_.gemv_rows; }

    /// Whether those slabs take the bf16 pair path (micro_kernel_bf16.hpp, on AMX tiles where the target has them:
    /// micro_kernel_amx.hpp) instead of the float panels: bf16 queries, keys and values in strided views, with the
    /// dimensions bf16_pairs_for takes (head dims of 64 and 128 among them).
    static constexpr bool pair_target = bf16_dot_products && std::is_same_v<Storage, Eigen::bfloat16> &&
                                        std::is_same_v<Rows, strided_view<const Eigen::bfloat16>>;
    bool uses_pairs() const { return pair_target && uses_panels() && bf16_pairs_for(s_.head_dim, s_.value_dim); }

    std::vector<tiled_workspace<Acc>> workspaces(index_t units, int threads) const {
        const int workers = static_cast<int>(std::min<index_t>(std::max(threads, 1), units));
        return allocating(
            [&] {
                std::vector<tiled_workspace<Acc>> w;
                w.reserve(static_cast<std::size_t>(workers));
                for (int n = 0; n < workers; ++n)
                    w.emplace_back(rows_, s_.head_dim, c_.key_tile, s_.value_dim, group_, uses_stage(), uses_panels(),
                                   uses_pairs());
                return w;
            },
            [&] {
                const index_t panels =
                    !uses_panels() ? 0
                    : uses_pairs()  // words, as many bytes as floats
                        ? rows_ * (s_.head_dim / 2 + bf16_tile::probability_row_words(c_.key_tile)) +
                              bf16_tile::key_panel_words(c_.key_tile, s_.head_dim) +
                              bf16_tile::value_panel_words(c_.key_tile, s_.value_dim)
                        : micro_tile<Acc>::panel_elements(c_.key_tile, s_.head_dim) + c_.key_tile * s_.value_dim;
                const index_t per_worker = rows_ * (s_.head_dim + c_.key_tile + s_.value_dim + 4) +
                                           (uses_stage() ? c_.key_tile * (s_.head_dim + s_.value_dim) : 0) + panels;
                return allocation_text("the tiled kernel's scratch (workers x elements)",
                                       std::array<index_t, 2>{workers, per_worker}, sizeof(Acc));
            },
            "Fewer threads need less scratch");
    }

    /// Query blocks of one (batch, kv head) a unit runs side by side, key tile by key tile, so that each K and V
    /// tile is packed once for all of them, not once per block (blocks on the micro-kernels' panels only): at most
    /// c.shared_blocks, fewer where the units would be too few to keep `threads` threads busy. A block's sums are
    /// the same whatever unit it is in, so this changes no bit. (Zen 5, fp32, L = S 1024 to 4096, D 64 / 128,
    /// alternated: 8 blocks 0.93 to 0.99 of the time of one, 4 blocks 0.96 to 0.99.)
    index_t blocks_per_unit(int threads) const {
        if (!uses_panels()) return 1;
        index_t together = std::max<index_t>(1, std::min(c_.shared_blocks, query_blocks_));
        const index_t wanted = threads > 1 ? 2 * index_t{threads} : 1;
        while (together > 1 && s_.batch * s_.kv_heads * ((query_blocks_ + together - 1) / together) < wanted)
            together = (together + 1) / 2;
        return together;
    }

    void run_blocks(int threads) {
        const index_t together = blocks_per_unit(threads);
        const index_t runs = (query_blocks_ + together - 1) / together;  // units per (batch, kv head)
        const index_t units = s_.batch * s_.kv_heads * runs;
        auto ws = workspaces(units, threads);
        if (together > 1)
            allocating(
                [&] {
                    for (auto& w : ws) w.park(together, rows_);
                },
                [&] {
                    return allocation_text("the tiled kernel's parked query blocks (workers x blocks x elements)",
                                           std::array<index_t, 3>{static_cast<index_t>(ws.size()), together - 1,
                                                                  rows_ * (s_.head_dim + s_.value_dim + 4)},
                                           sizeof(Acc));
                },
                "Fewer threads need less scratch");
        parallel_for(units, threads, [&](index_t unit, int worker) {
            auto& w = ws[static_cast<std::size_t>(worker)];
            const index_t first = unit / runs * query_blocks_ + unit % runs * together;
            const index_t count = std::min(together, (unit / runs + 1) * query_blocks_ - first);
            const auto blk = [&](index_t g) { return block_of(first + g); };
            for (index_t g = 0; g < count; ++g) {
                w.switch_to(g);
                load_queries(w, blk(g));
                start_stream(w, blk(g));
            }
            for (index_t k0 = 0; k0 < s_.key_len; k0 += c_.key_tile)
                for (index_t g = 0; g < count; ++g) {
                    w.switch_to(g);
                    stream_range(w, blk(g), k0, std::min(s_.key_len, k0 + c_.key_tile), s_.key_len);
                }
            for (index_t g = 0; g < count; ++g) {
                w.switch_to(g);
                end_stream(w, blk(g), 0, s_.key_len);
                finish_rows(w, blk(g));
                if (o_.weights) write_weights(w, blk(g));
            }
        });
    }

    void run_decode(int threads) {
        const index_t chunks = (s_.key_len + c_.decode_chunk - 1) / c_.decode_chunk;
        const index_t blocks = block_count(), units = blocks * chunks;
        const index_t dv = s_.value_dim;
        // Partial results of every (block, chunk), normalized: out = acc / sum, lse = max + log(sum).
        aligned_vector<Acc> part_out, part_lse;
        allocating(
            [&] {
                part_out.resize(static_cast<std::size_t>(units * rows_ * dv));
                part_lse.resize(static_cast<std::size_t>(units * rows_));
            },
            [&] {
                return allocation_text("the decode path's partial outputs (units x rows x (value_dim + 1))",
                                       std::array<index_t, 3>{units, rows_, dv + 1}, sizeof(Acc));
            },
            "Split the call over the batch");
        std::vector<kv_findings<Acc>> found(p_.kv_scan ? static_cast<std::size_t>(units) : 0);
        auto ws = workspaces(units, threads);
        parallel_for(units, threads, [&](index_t unit, int worker) {
            auto& w = ws[static_cast<std::size_t>(worker)];
            const block blk = block_of(unit / chunks);
            const index_t chunk = unit % chunks;
            const index_t k0 = chunk * c_.decode_chunk, k1 = std::min(s_.key_len, k0 + c_.decode_chunk);
            w.found.reset(p_.kv_scan != nullptr, k0);
            load_queries(w, blk);
            stream_keys(w, blk, k0, k1);
            if (w.found.active) found[static_cast<std::size_t>(unit)] = w.found;
            const index_t rows = group_ * blk.queries;
            for (index_t r = 0; r < rows; ++r)
                part_lse[static_cast<std::size_t>(unit * rows_ + r)] =
                    w.softmax.normalize_into(r, w.acc.data() + r * dv, dv, part_out.data() + (unit * rows_ + r) * dv);
        });
        if (p_.kv_scan) verify_scan(found, chunks);  // throws before the first output is written
        // Combine the chunks of each block in chunk order, one block per unit; a single chunk is only copied out,
        // which is not worth starting threads for.
        parallel_for(blocks, chunks > 1 ? threads : 1, [&](index_t n, int) {
            const block blk = block_of(n);
            const index_t rows = group_ * blk.queries;
            for (index_t r = 0; r < rows; ++r) {
                Acc* first = part_out.data() + (n * chunks * rows_ + r) * dv;
                Acc lse = part_lse[static_cast<std::size_t>(n * chunks * rows_ + r)];
                for (index_t c = 1; c < chunks; ++c) {
                    const index_t at = (n * chunks + c) * rows_ + r;
                    lse = merge_row(first, lse, part_out.data() + at * dv, part_lse[static_cast<std::size_t>(at)],
                                    first, dv);
                }
                const index_t h = head_of(blk, r), i = query_of(blk, r);
                if (mask_.query_padded(blk.batch, i)) lse = minus_infinity<Acc>();
                write_merged_row(blk.batch, h, i, lse == minus_infinity<Acc>() ? nullptr : first, lse);
            }
        });
    }

    /// Hands what the decode units found to the deferred scan: the largest |k| per (batch, kv head), whether any
    /// key or value was not finite.
    void verify_scan(const std::vector<kv_findings<Acc>>& found, index_t chunks) const {
        std::vector<double> key_max_abs(static_cast<std::size_t>(s_.batch * s_.kv_heads), 0.0);
        bool non_finite = false;
        for (index_t unit = 0; unit < static_cast<index_t>(found.size()); ++unit) {
            const block blk = block_of(unit / chunks);
            double& m = key_max_abs[static_cast<std::size_t>(blk.batch * s_.kv_heads + blk.kv_head)];
            m = std::max(m, static_cast<double>(found[static_cast<std::size_t>(unit)].key_max_abs));
            non_finite = non_finite || found[static_cast<std::size_t>(unit)].non_finite;
        }
        p_.kv_scan->verify(key_max_abs, non_finite);
    }

    /// Keys and values [w.found.scanned_to, upto) of the block's (batch, kv head) read for the scan alone: the
    /// decode pass skipped them (an empty tile, the trimmed end of a mixed one).
    void scan_skipped(tiled_workspace<Acc>& w, const block& blk, index_t upto) const {
        if (upto > w.found.scanned_to) scan_in_place(w, blk, w.found.scanned_to, upto, true, true);
        w.found.scanned_to = std::max(w.found.scanned_to, upto);
    }

    /// Notes keys and / or values [j0, j1) of the block's (batch, kv head) in w.found, read where they are stored.
    void scan_in_place(tiled_workspace<Acc>& w, const block& blk, index_t j0, index_t j1, bool keys,
                       bool values) const {
        row_scan<Acc> seen_keys, seen_values;
        if (keys) {
            scan_rows(j1 - j0, s_.head_dim, rows_of<Rows>{&k_, blk.batch, blk.kv_head, j0}, true, seen_keys);
            w.found.keys(seen_keys);
        }
        if (values) {
            scan_rows(j1 - j0, s_.value_dim, rows_of<Rows>{&v_, blk.batch, blk.kv_head, j0}, false, seen_values);
            w.found.values(seen_values);
        }
    }

    /// Row (b, h, i) of out from a merged, normalized row (Acc, value_dim long; nullptr for a zero row), rounded
    /// to the storage type once, and its lse.
    void write_merged_row(index_t b, index_t h, index_t i, const Acc* row, Acc lse) const {
        Storage* out = o_.out.row(b, h, i);
        if (row) narrow(row, s_.value_dim, out);
        else std::fill(out, out + s_.value_dim, Storage(0));
        write_lse(b, h, i, row ? lse : minus_infinity<Acc>());
    }

    void write_lse(index_t b, index_t h, index_t i, Acc lse) const {
        // In the storage's accumulation type: float for 16-bit storage (and for float storage accumulated in double).
        if (o_.lse) o_.lse[(b * s_.heads + h) * s_.query_len + i] = static_cast<accumulator_t<Storage>>(lse);
    }

    // ---- one block --------------------------------------------------------------------------------------------
    /// The block's query rows, head after head, times the scale (folded in once instead of per score); for the pair
    /// kernels also as stored, in pairs.
    void load_queries(tiled_workspace<Acc>& w, const block& blk) const {
        const index_t d = s_.head_dim;
        const Acc scale = pipe_.scale();
        for (index_t hh = 0; hh < group_; ++hh)
            for (index_t r = 0; r < blk.queries; ++r) {
                const Storage* src = q_.row(blk.batch, blk.kv_head * group_ + hh, blk.query_begin + r);
                Acc* dst = w.queries.data() + (hh * blk.queries + r) * d;
                widen(src, d, dst);
                for (index_t x = 0; x < d; ++x) dst[x] *= scale;
                if constexpr (pair_target)  // as stored: the pair kernels scale the products
                    if (uses_pairs())
                        for (index_t x = 0; x < d / 2; ++x)
                            w.pairs.queries[static_cast<std::size_t>((hh * blk.queries + r) * (d / 2) + x)] =
                                pair_at(src + 2 * x);
            }
    }

    /// A slab of a block: query heads [head_begin, head_end) of the group x queries [query_begin, query_end) of the
    /// block (offsets from blk.query_begin), either whole heads or part of one head, so its rows are contiguous:
    /// row r of the block is head r / blk.queries, query r % blk.queries.
    struct slab {
        index_t head_begin, head_end, query_begin, query_end;
        index_t first_row(const block& blk) const { return head_begin * blk.queries + query_begin; }
        index_t rows(const block& blk) const {
            return (head_end - head_begin - 1) * blk.queries + (query_end - query_begin);
        }
    };
    slab whole(const block& blk) const { return {0, group_, 0, blk.queries}; }

    tile query_tile(const block& blk, const slab& sl, index_t hh, index_t k0, index_t k1) const {
        return tile{
            blk.batch, blk.kv_head * group_ + hh, blk.query_begin + sl.query_begin, blk.query_begin + sl.query_end, k0,
            k1};
    }

    /// Classifies the slab's per-head tiles over keys [k0, k1) into w.classes; returns empty when all are empty,
    /// full when all are full, mixed otherwise.
    tile_class classify(tiled_workspace<Acc>& w, const block& blk, const slab& sl, index_t k0, index_t k1) const {
        bool any_empty = false, any_full = false, any_mixed = false;
        for (index_t hh = sl.head_begin; hh < sl.head_end; ++hh) {
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

    bool all_empty(const block& blk, const slab& sl, index_t k0, index_t k1) const {
        for (index_t hh = sl.head_begin; hh < sl.head_end; ++hh)
            if (mask_.classify(query_tile(blk, sl, hh, k0, k1)) != tile_class::empty) return false;
        return true;
    }

    /// What to pack for keys [k0, k1) of the block's (batch, kv head): the whole tile being streamed when [k0, k1)
    /// lies in it at a multiple of `step` keys from its start (every slab of a mixed tile then reads the panels
    /// packed for the first), exactly [k0, k1) otherwise.
    typename tiled_workspace<Acc>::key_range pack_range(const tiled_workspace<Acc>& w, const block& blk, index_t k0,
                                                        index_t k1, index_t step) const {
        const auto& t = w.tile;
        const bool in_tile = t.batch == blk.batch && t.kv_head == blk.kv_head && t.begin <= k0 && k1 <= t.end &&
                             (k0 - t.begin) % step == 0;
        return in_tile ? t : typename tiled_workspace<Acc>::key_range{blk.batch, blk.kv_head, k0, k1};
    }

    /// Keys [k0, k1) packed for scores_from_panels: a pointer into w.key_panels (see pack_range).
    const Acc* key_panels(tiled_workspace<Acc>& w, const block& blk, index_t k0, index_t k1) const {
        ATTEND_ASSERT(uses_panels());
        const auto want = pack_range(w, blk, k0, k1, micro_tile<Acc>::cols);
        if (!(w.packed_keys == want)) {
            const index_t n = want.end - want.begin;
            const auto keys = rows_as_accumulator<Acc>(k_, blk.batch, blk.kv_head, want.begin, n, w.key_stage.data());
            pack_key_panels(keys.data(), keys.outerStride(), n, s_.head_dim, w.key_panels.data());
            if (w.found.active) w.found.keys(scan_of(keys, true));
            w.packed_keys = want;
        }
        return w.key_panels.data() + (k0 - want.begin) * s_.head_dim;
    }

    /// acc += P V over keys [k0, k1) for `rows` rows from r0: V's whole column blocks from w.value_panels (packed
    /// as pack_range says), its last value_dim % cols columns read in place.
    void accumulate_values(tiled_workspace<Acc>& w, const block& blk, index_t r0, index_t rows, index_t k0,
                           index_t k1) const {
        const index_t dv = s_.value_dim, ld = c_.key_tile, nk = k1 - k0;
        ATTEND_ASSERT(uses_panels());
        const auto want = pack_range(w, blk, k0, k1, 1);
        if (!(w.packed_values == want)) {
            const index_t n = want.end - want.begin;
            const auto values =
                rows_as_accumulator<Acc>(v_, blk.batch, blk.kv_head, want.begin, n, w.value_stage.data());
            pack_value_panels(values.data(), values.outerStride(), n, dv, w.value_panels.data());
            if (w.found.active) w.found.values(scan_of(values, false));
            w.packed_values = want;
        }
        const Acc* in_place = nullptr;
        index_t ldv = dv;
        if (dv % micro_tile<Acc>::cols != 0) {
            const auto values = rows_as_accumulator<Acc>(v_, blk.batch, blk.kv_head, k0, nk, w.value_stage.data());
            in_place = values.data();
            ldv = values.outerStride();
        }
        const index_t panel_stride = (want.end - want.begin) * micro_tile<Acc>::cols;
        accumulate_from_values(w.scores.data() + r0 * ld, ld, index_t(1), rows, nk, in_place, ldv, dv,
                               w.value_panels.data() + (k0 - want.begin) * micro_tile<Acc>::cols, panel_stride,
                               w.acc.data() + r0 * dv, dv);
    }

    /// The pair path's versions of key_panels, compute_scores' products and accumulate_values (uses_pairs()): keys
    /// and values packed from their bf16 rows into pairs, P rounded to bf16 pairs. Compiled only for pair_target.
    const std::uint32_t* key_pairs(tiled_workspace<Acc>& w, const block& blk, index_t k0, index_t k1) const {
        const auto want = pack_range(w, blk, k0, k1, bf16_tile::cols);
        if (!(w.packed_keys == want)) {
            const index_t n = want.end - want.begin;
            if constexpr (pair_target)
                pack_key_pairs(k_.row(blk.batch, blk.kv_head, want.begin), row_stride(k_), n, s_.head_dim,
                               w.pairs.keys.data());
            if (w.found.active) scan_in_place(w, blk, want.begin, want.end, true, false);  // a decode of many rows
            w.packed_keys = want;
        }
        return w.pairs.keys.data() + (k0 - want.begin) * (s_.head_dim / 2);
    }
    bool pair_scores(tiled_workspace<Acc>& w, const block& blk, index_t r0, index_t rows, index_t k0,
                     index_t k1) const {
        if constexpr (pair_target) {
            const std::uint32_t* panels = key_pairs(w, blk, k0, k1);
            const index_t pairs = s_.head_dim / 2;
            return pipe_.products_with_cap([&](const auto& epilogue) {
                scores_on_pair_path(w.pairs.queries.data() + r0 * pairs, pairs, rows, s_.head_dim, panels, k1 - k0,
                                    pipe_.scale(), w.scores.data() + r0 * c_.key_tile, c_.key_tile, epilogue);
            });
        }
        return false;
    }
    /// Row r's probabilities (nk at p) rounded to bf16 pairs for accumulate_value_pairs, as the softmax leaves them.
    void round_probability_pairs(tiled_workspace<Acc>& w, index_t r, const Acc* p, index_t nk) const {
        if constexpr (pair_target) {
            const index_t ldp = bf16_tile::probability_row_words(c_.key_tile);
            round_to_pairs(p, c_.key_tile, 1, nk, w.pairs.probabilities.data() + r * ldp, ldp);
        }
    }
    void accumulate_value_pairs(tiled_workspace<Acc>& w, const block& blk, index_t r0, index_t rows, index_t k0,
                                index_t k1) const {
        if constexpr (pair_target) {
            const auto want = pack_range(w, blk, k0, k1, 2);  // pairs of keys from the packed range's start
            const index_t n = want.end - want.begin;
            if (!(w.packed_values == want)) {
                pack_value_pairs(v_.row(blk.batch, blk.kv_head, want.begin), row_stride(v_), n, s_.value_dim,
                                 w.pairs.values.data());
                if (w.found.active) scan_in_place(w, blk, want.begin, want.end, false, true);
                w.packed_values = want;
            }
            const index_t ldp = bf16_tile::probability_row_words(c_.key_tile);
            accumulate_on_pair_path(w.pairs.probabilities.data() + r0 * ldp, ldp, rows, k1 - k0, s_.value_dim,
                                    w.pairs.values.data() + (k0 - want.begin) / 2 * bf16_tile::cols,
                                    (n + 1) / 2 * bf16_tile::cols, w.acc.data() + r0 * s_.value_dim, s_.value_dim);
        }
    }

    /// Scores of the slab against keys [k0, k1) into its rows of w.scores: the micro-kernel on the stacked rows and
    /// the tile's packed keys (the row kernels for a few rows, which read K straight from its rows where the
    /// micro-kernel would first pack it), then the score pipeline per head. Needs w.classes from classify on the same slab and keys.
    /// `then`: the rows read next, where the row kernels' prefetch runs on to.
    void compute_scores(tiled_workspace<Acc>& w, const block& blk, const slab& sl, index_t k0, index_t k1,
                        const row_run& then) const {
        const index_t r0 = sl.first_row(blk), rows = sl.rows(blk), nk = k1 - k0, ld = c_.key_tile;
        const_tile_map<Acc> queries(w.queries.data() + r0 * s_.head_dim, rows, s_.head_dim,
                                    Eigen::OuterStride<>(s_.head_dim));
        tile_map<Acc> scores(w.scores.data() + r0 * ld, rows, nk, Eigen::OuterStride<>(ld));
        bool capped = false;
        if (rows <= c_.gemv_rows) {
            // Each key row read once, where it is stored, for every row of the slab (and the scan, when on).
            row_scan<Acc> seen;
            scores_of_rows(rows, queries.data(), s_.head_dim, s_.head_dim, nk,
                           rows_of<Rows>{&k_, blk.batch, blk.kv_head, k0}, scores.data(), ld,
                           w.found.active ? &seen : nullptr, then);
            if (w.found.active) w.found.keys(seen);
        } else if (uses_pairs()) {
            capped = pair_scores(w, blk, r0, rows, k0, k1);
        } else {
            const Acc* panels = key_panels(w, blk, k0, k1);
            capped = pipe_.products_with_cap([&](const auto& epilogue) {
                scores_from_panels(queries.data(), s_.head_dim, rows, s_.head_dim, panels, nk, scores.data(), ld,
                                   epilogue);
            });
        }
        for (index_t hh = sl.head_begin; hh < sl.head_end; ++hh)
            pipe_.finish_tile(query_tile(blk, sl, hh, k0, k1), w.classes[static_cast<std::size_t>(hh)],
                              w.scores.data() + (hh * blk.queries + sl.query_begin) * ld, ld, capped);
    }

    /// The steps the online softmax takes over keys [key_begin, key_end), in order: step(slab, k0, k1) for each,
    /// its keys trimmed (trim; steps left with no key are skipped), w.classes classified for them and w.tile naming
    /// the tile being streamed. A mixed tile (a causal diagonal, the edge of a window) is cut into runs of key
    /// strips: runs every row of the block may fully see go through the whole block at once, the rest in slabs of
    /// slab_rows queries of one head, each trimmed to the key columns it may see, so masked-out work shrinks with
    /// the slab, not with the block. The forward pass and the weights' second pass
    /// both take these steps, so a score reaches the weights with the bits it had in the softmax.
    template <class Step>
    void for_each_step(tiled_workspace<Acc>& w, const block& blk, index_t key_begin, index_t key_end,
                       const Step& step) const {
        const auto trimmed_step = [&](const slab& sl, index_t k0, index_t k1, bool mixed) {
            if (trim(w, blk, sl, k0, k1, mixed)) step(sl, k0, k1);
        };
        const slab all = whole(blk);
        for (index_t k0 = key_begin; k0 < key_end; k0 += c_.key_tile) {
            const index_t k1 = std::min(key_end, k0 + c_.key_tile);
            const tile_class c = classify(w, blk, all, k0, k1);
            if (c == tile_class::empty) continue;
            w.tile = {blk.batch, blk.kv_head, k0, k1};
            if (c == tile_class::mixed && blk.queries > c_.slab_rows) {
                // Runs of trim_step-wide key strips: strips full for the whole block go through one block-wide
                // step (the part of a causal tile left of the diagonal), the others through slabs.
                for (index_t a = k0; a < k1;) {
                    const bool full = classify(w, blk, all, a, std::min(k1, a + c_.trim_step)) == tile_class::full;
                    index_t b = std::min(k1, a + c_.trim_step);
                    while (b < k1 &&
                           (classify(w, blk, all, b, std::min(k1, b + c_.trim_step)) == tile_class::full) == full)
                        b = std::min(k1, b + c_.trim_step);
                    if (full) {
                        trimmed_step(all, a, b, false);
                    } else {
                        for (index_t hh = 0; hh < group_; ++hh)
                            for (index_t q = 0; q < blk.queries; q += c_.slab_rows)
                                trimmed_step(slab{hh, hh + 1, q, std::min(blk.queries, q + c_.slab_rows)}, a, b, true);
                    }
                    a = b;
                }
            } else {
                trimmed_step(all, k0, k1, c == tile_class::mixed);
            }
        }
    }

    /// A step's keys [k0, k1) for the slab: when mixed, without the key strips at either end no row of the slab may
    /// see; false if it may see none. Leaves w.classes classified for the slab and the keys that are left.
    bool trim(tiled_workspace<Acc>& w, const block& blk, const slab& sl, index_t& k0, index_t& k1, bool mixed) const {
        if (mixed) {
            const tile_class c = classify(w, blk, sl, k0, k1);
            if (c == tile_class::empty) return false;
            if (c == tile_class::mixed) {
                // Drop key columns no row of the slab may see (the far side of a causal diagonal, the outside of
                // a window); what is left is classified again below.
                while (k1 - k0 > c_.trim_step && all_empty(blk, sl, k0, k0 + c_.trim_step)) k0 += c_.trim_step;
                while (k1 - k0 > c_.trim_step && all_empty(blk, sl, k1 - c_.trim_step, k1)) k1 -= c_.trim_step;
            }
        }
        classify(w, blk, sl, k0, k1);
        return true;
    }

    /// The online softmax over keys [key_begin, key_end) (for_each_step): leaves w.acc (unnormalized, dropout
    /// applied) and w.softmax (max and the undropped normalizer, with the sinks when key_begin is 0) for the
    /// block's rows.
    void stream_keys(tiled_workspace<Acc>& w, const block& blk, index_t key_begin, index_t key_end) const {
        start_stream(w, blk);
        stream_range(w, blk, key_begin, key_end, key_end);
        end_stream(w, blk, key_begin, key_end);
    }

    /// stream_keys in parts: the block's accumulators and softmax state emptied; keys [k0, k1) of a stream that
    /// ends at key_end (k0 on a key tile's edge, so the steps are those of the whole stream); the end.
    void start_stream(tiled_workspace<Acc>& w, const block& blk) const {
        const index_t rows = group_ * blk.queries;
        std::fill(w.acc.begin(), w.acc.begin() + rows * s_.value_dim, Acc(0));
        w.softmax.reset(rows);
    }
    void stream_range(tiled_workspace<Acc>& w, const block& blk, index_t k0, index_t k1, index_t key_end) const {
        for_each_step(w, blk, k0, k1,
                      [&](const slab& sl, index_t a, index_t b) { stream_tile(w, blk, sl, a, b, key_end); });
    }
    void end_stream(tiled_workspace<Acc>& w, const block& blk, index_t key_begin, index_t key_end) const {
        const index_t rows = group_ * blk.queries, dv = s_.value_dim;
        if (w.found.active) scan_skipped(w, blk, key_end);
        // The sinks join the softmax of the first key range only, so the decode path's chunks count them once.
        if (key_begin == 0 && p_.has_sinks())
            for (index_t r = 0; r < rows; ++r)
                w.softmax.absorb_sink(r, p_.sink(head_of(blk, r)), w.acc.data() + r * dv, dv);
    }

    /// One step of the online softmax: the slab's rows against keys [k0, k1) (as for_each_step trimmed them) of a
    /// stream that ends at key_end.
    void stream_tile(tiled_workspace<Acc>& w, const block& blk, const slab& sl, index_t k0, index_t k1,
                     index_t key_end) const {
        const index_t r0 = sl.first_row(blk), rows = sl.rows(blk), nk = k1 - k0, ld = c_.key_tile, dv = s_.value_dim;
        if (w.found.active) scan_skipped(w, blk, k0);
        // A few rows read K and V in place (the row kernels): their prefetch runs on from the keys into their
        // values, and from them into the next keys.
        const bool in_place = rows <= c_.gemv_rows;
        compute_scores(w, blk, sl, k0, k1, in_place ? run_of_rows(v_, blk.batch, blk.kv_head, k0, nk) : row_run{});
        const bool pairs = !in_place && uses_pairs();
        w.softmax.absorb(w.scores.data() + r0 * ld, ld, r0, rows, nk, w.acc.data() + r0 * dv, dv,
                         [&](index_t r, Acc* p) {
                             if (p_.dropout.active())
                                 p_.dropout.apply(p, nk, blk.batch, head_of(blk, r), query_of(blk, r), k0);
                             if (pairs) round_probability_pairs(w, r, p, nk);
                         });
        tile_map<Acc> acc(w.acc.data() + r0 * dv, rows, dv, Eigen::OuterStride<>(dv));
        const_tile_map<Acc> probabilities(w.scores.data() + r0 * ld, rows, nk, Eigen::OuterStride<>(ld));
        if (in_place) {
            row_scan<Acc> seen;
            accumulate_rows(rows, probabilities.data(), ld, nk, dv, rows_of<Rows>{&v_, blk.batch, blk.kv_head, k0},
                            acc.data(), dv, w.found.active ? &seen : nullptr,
                            run_of_rows(k_, blk.batch, blk.kv_head, k1, key_end - k1));
            if (w.found.active) w.found.values(seen);
        } else if (pairs) {
            accumulate_value_pairs(w, blk, r0, rows, k0, k1);
        } else {
            accumulate_values(w, blk, r0, rows, k0, k1);
        }
        if (w.found.active) w.found.scanned_to = std::max(w.found.scanned_to, k1);
    }

    /// out = acc / sum, lse = max + log(sum); zero rows and lse -inf for padded queries and empty rows. Marks
    /// padded rows empty in w.softmax, so write_weights writes zeros there.
    void finish_rows(tiled_workspace<Acc>& w, const block& blk) const {
        const index_t rows = group_ * blk.queries, dv = s_.value_dim;
        for (index_t r = 0; r < rows; ++r) {
            const index_t h = head_of(blk, r), i = query_of(blk, r);
            if (mask_.query_padded(blk.batch, i)) w.softmax.clear(r);
            Storage* out = o_.out.row(blk.batch, h, i);
            write_lse(blk.batch, h, i, w.softmax.normalize_into(r, w.acc.data() + r * dv, dv, out));
        }
    }

    /// Second pass for the weights output: P = exp(S - max) / sum, written straight into weights, over the steps
    /// of the forward pass (for_each_step), so each score comes from the kernel and the sums that gave it in the
    /// softmax: a single allowed key gets weight 1 exactly. Not exp(S - lse): lse rounded in T would cost |lse| ulps
    /// of relative accuracy when scores are large.
    void write_weights(tiled_workspace<Acc>& w, const block& blk) const {
        const index_t rows = group_ * blk.queries, ld = c_.key_tile, S = s_.key_len;
        const bool drop = p_.weights_after_dropout && p_.dropout.active();
        const auto weights_row = [&](index_t r) {
            return o_.weights + ((blk.batch * s_.heads + head_of(blk, r)) * s_.query_len + query_of(blk, r)) * S;
        };
        for (index_t r = 0; r < rows; ++r) std::fill(weights_row(r), weights_row(r) + S, Storage(0));
        for_each_step(w, blk, 0, S, [&](const slab& sl, index_t k0, index_t k1) {
            compute_scores(w, blk, sl, k0, k1, row_run{});
            const index_t r0 = sl.first_row(blk), nk = k1 - k0;
            for (index_t r = r0; r < r0 + sl.rows(blk); ++r) {
                if (w.softmax.empty(r)) continue;
                Acc* p = w.scores.data() + r * ld;
                exp_shifted<Acc, true>(p, nk, w.softmax.max(r));  // the softmax's own scores: none above its max
                const Acc l = w.softmax.sum(r);
                for (index_t j = 0; j < nk; ++j) p[j] /= l;
                if (drop) p_.dropout.apply(p, nk, blk.batch, head_of(blk, r), query_of(blk, r), k0);
                narrow(p, nk, weights_row(r) + k0);
            }
        });
    }

    const strided_view<const Storage>& q_;
    const Rows& k_;
    const Rows& v_;
    const attention_shape& s_;
    const mask_tiles& mask_;
    score_pipeline<Acc> pipe_;
    const kernel_params<Acc>& p_;
    const attention_outputs<Storage>& o_;
    tile_config c_;
    index_t group_ = 1;          ///< query heads per kv head
    index_t block_queries_ = 1;  ///< queries per head in a block
    index_t query_blocks_ = 1;   ///< blocks per (batch, kv head)
    index_t rows_ = 1;           ///< rows of a full block: group_ * block_queries_
};

/// The tiled forward kernel: `Storage` in memory, arithmetic in `Acc`, keys and values as `Rows` (strided_view or
/// paged_view), `threads` threads (>= 1), the given tile sizes; same contract as reference_attention. One
/// instantiation per (Storage, Acc, Rows): masks come type-erased.
template <class Storage, class Acc, class Rows>
void tiled_forward(const strided_view<const Storage>& q, const Rows& k, const Rows& v, const attention_shape& s,
                   const mask_tiles& mask, const kernel_params<Acc>& p, const attention_outputs<Storage>& o,
                   int threads, const tile_config& config) {
    tiled_runner<Storage, Acc, Rows>(q, k, v, s, mask, p, o, config).run(threads);
}

/// The tiled kernel on `threads` threads (>= 1) with the given tile sizes, for any bound mask; same contract as
/// reference_attention. Queries and outputs in T, keys and values as `Rows`: strided views (of T, or of a 16-bit
/// type under float queries), or a paged cache's paged_view; arithmetic in accumulator_t<T>.
template <class T, class Rows, class Bound>
void tiled_attention(const strided_view<const T>& q, const Rows& k, const Rows& v, const attention_shape& s,
                     const Bound& mask, const kernel_params<accumulator_t<T>>& p, const attention_outputs<T>& o,
                     int threads, const tile_config& config) {
    with_mask_tiles(mask, [&](const mask_tiles& m) {
        tiled_forward<T, accumulator_t<T>, Rows>(q, k, v, s, m, p, o, threads, config);
    });
}

/// The tiled kernel with the default tile sizes for this shape.
template <class T, class Rows, class Bound>
void tiled_attention(const strided_view<const T>& q, const Rows& k, const Rows& v, const attention_shape& s,
                     const Bound& mask, const kernel_params<accumulator_t<T>>& p, const attention_outputs<T>& o,
                     int threads) {
    tiled_attention(q, k, v, s, mask, p, o, threads, default_tile_config<T>(s));
}

#if defined(ATTEND_KERNEL_INSTANCE)
#define ATTEND_TILED_FORWARD_INSTANCE(S, A, R)                                                                    \
    ATTEND_KERNEL_INSTANCE void tiled_forward<S, A, R>(const strided_view<const S>&, const R&, const R&,          \
                                                       const attention_shape&, const mask_tiles&,                 \
                                                       const kernel_params<A>&, const attention_outputs<S>&, int, \
                                                       const tile_config&);
ATTEND_TILED_FORWARD_INSTANCE(float, float, strided_view<const float>)
ATTEND_TILED_FORWARD_INSTANCE(double, double, strided_view<const double>)
ATTEND_TILED_FORWARD_INSTANCE(float, double, strided_view<const float>)
ATTEND_TILED_FORWARD_INSTANCE(float, float, paged_view<float>)
ATTEND_TILED_FORWARD_INSTANCE(double, double, paged_view<double>)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::half, float, strided_view<const Eigen::half>)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::bfloat16, float, strided_view<const Eigen::bfloat16>)
ATTEND_TILED_FORWARD_INSTANCE(float, float, strided_view<const Eigen::half>)
ATTEND_TILED_FORWARD_INSTANCE(float, float, strided_view<const Eigen::bfloat16>)
ATTEND_TILED_FORWARD_INSTANCE(float, float, q8_view)
ATTEND_TILED_FORWARD_INSTANCE(float, float, paged_view<q8_0_block>)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::half, float, q8_view)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::bfloat16, float, q8_view)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::half, float, paged_view<q8_0_block>)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::bfloat16, float, paged_view<q8_0_block>)
ATTEND_TILED_FORWARD_INSTANCE(float, float, q4_view)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::half, float, q4_view)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::bfloat16, float, q4_view)
ATTEND_TILED_FORWARD_INSTANCE(float, float, paged_view<q4_0_block>)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::half, float, paged_view<q4_0_block>)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::bfloat16, float, paged_view<q4_0_block>)
ATTEND_TILED_FORWARD_INSTANCE(float, float, paged_view<Eigen::half>)
ATTEND_TILED_FORWARD_INSTANCE(float, float, paged_view<Eigen::bfloat16>)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::half, float, paged_view<Eigen::half>)
ATTEND_TILED_FORWARD_INSTANCE(Eigen::bfloat16, float, paged_view<Eigen::bfloat16>)
#undef ATTEND_TILED_FORWARD_INSTANCE
#endif

}  // namespace attend::detail
