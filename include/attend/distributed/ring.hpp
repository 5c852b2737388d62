// SPDX-License-Identifier: MIT
#pragma once
/// Ring attention over MPI: exact scaled-dot-product attention of a sequence sharded over the ranks of a
/// communicator (Ring Attention, Liu et al. 2023; context parallelism). Each rank holds a shard of the queries,
/// keys and values, `[batch, heads, shard_len, head_dim]` / `[batch, kv_heads, shard_len, head_dim | value_dim]`;
/// K / V shards travel around the ring with non-blocking sends and receives posted before the computation on
/// the shard in hand, and each rank merges its partial results by their log-sum-exp (merge_partials) in ring
/// order, a fixed order, so results do not depend on timing. Masks are written for the full sequence (causal,
/// sliding_window, key_padding, dense masks of the full `[.., total, total]` shape, and their combinations)
/// and every block is evaluated in global coordinates; a block the mask leaves empty is not computed and a shard
/// no later rank needs is not sent. Dropout, score_bias and score_mod use global positions, so they give what one
/// process would; sinks join each row once.
/// Not included by attend.hpp: link attend::distributed (attend plus MPI::MPI_CXX).
///
/// A step's blocks are computed on a worker thread while the calling thread keeps the transfers moving; only the
/// calling thread calls MPI, so initialize MPI with at least MPI_THREAD_FUNNELED (MPI_Init_thread).
///
/// Every rank must call with the same mask and options. Errors: any check that fails on one rank (shapes,
/// options, non-finite inputs, empty rows) is thrown on every rank with the same id and message, and no rank
/// is left waiting. Rank-3 inputs are not supported: give them a heads axis of 1.

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <initializer_list>
#include <limits>
#include <optional>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

#include "../backward.hpp"
#include "../merge.hpp"
#include "../sdpa.hpp"
#include "detail/block_mask.hpp"
#include "detail/mpi_agreement.hpp"
#include "sharding.hpp"

namespace attend::distributed {

/// Options of ring_attention and ring_attention_backward; the same on every rank (checked:
/// attend.value.ring_options). Where the shards sit is not an option: the shard_layout argument says it.
struct ring_options {
    /// The attention of the whole sequence, as scaled_dot_product_attention takes it, each feature evaluated at
    /// global positions: scale, softcap, empty_rows (judged on the full sequence, not per block), dropout (its
    /// offsets, if any, added to the shards' global positions), score_bias and score_mod (query and key indices of
    /// the whole sequence), sinks (joined once into each row's softmax), kernel and check_finite (every shard,
    /// agreed across ranks). threads: 0 (the default, as in SDPA) is this rank's share of the node's logical CPUs,
    /// std::thread::hardware_concurrency() divided by the ranks on this node (MPI_COMM_TYPE_SHARED), at least 1, so
    /// N ranks on one machine do not start N x all of its threads; results do not depend on it. need_weights is not
    /// available (value_error attend.value.need_weights); lse is always returned.
    sdpa_options attention;
};

/// What one rank did in one call. Everything but threads and compute_seconds is deterministic (a function of
/// shapes, mask and layout only).
struct ring_statistics {
    int threads = 0;              ///< threads each block computation ran with (ring_options::threads resolved)
    index_t blocks_computed = 0;  ///< (query run, key run) blocks computed on this rank
    index_t blocks_skipped = 0;   ///< blocks the mask leaves empty, neither computed nor (when no later rank needs
                                  ///< the shard) received
    index_t shards_sent = 0;      ///< K / V shards (with their gradients, backward) sent to the next rank
    std::int64_t bytes_sent = 0;  ///< every byte this rank sent
    double compute_seconds = 0;   ///< wall time in this rank's block computations and merges (not in waits):
                                  ///< the work balance of a sharding, as time
};

/// This rank's share of ring attention: out `[batch, heads, shard_len, value_dim]` and lse `[batch, heads,
/// shard_len]` of its queries over the whole sequence, as one process would compute for those rows.
/// Rank 3 (inputs without a heads axis): out `[batch, shard_len, value_dim]`, lse `[batch, shard_len]`.
template <class T, int Rank = 4>
struct ring_attention_result {
    tensor<T, Rank> out;                     ///< `[batch, heads, shard_len, value_dim]`, rounded once for 16-bit
    tensor<accumulator_t<T>, Rank - 1> lse;  ///< `[batch, heads, shard_len]`, float for 16-bit storage
    ring_statistics statistics;              ///< what this rank did
};

/// This rank's gradients: dq like its q, dk / dv like its k / v, each over the whole sequence's loss.
template <class T, int Rank = 4>
struct ring_gradients {
    tensor<T, Rank> d_query;  ///< like this rank's q
    tensor<T, Rank> d_key;    ///< like this rank's k
    tensor<T, Rank> d_value;  ///< like this rank's v
    /// `[heads]` when options.attention.sinks is not empty, else empty: d loss / d sink logit of each query head
    /// over the whole sequence, the same on every rank
    tensor<T, 1> d_sinks;
    ring_statistics statistics;  ///< what this rank did
};

namespace detail {

using attend::detail::concat;
using attend::detail::format_shape;

/// The gradients' type of ring_attention_backward<Gradient>: the inputs' type T unless asked for another.
template <class Gradient, class T>
using gradient_of = std::conditional_t<std::is_void_v<Gradient>, T, Gradient>;

/// The MPI type of a buffer the ring sends: 16-bit storage travels as its bits.
template <class T>
MPI_Datatype mpi_type() {
    static_assert(attend::is_storage_type_v<T>,
                  "attend: ring attention runs on float, double, Eigen::half or Eigen::bfloat16 tensors");
    if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
    else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
    else return MPI_UINT16_T;
}

/// Adds the wall time of its scope to `seconds`.
class stopwatch {
public:
    explicit stopwatch(double& seconds) : seconds_(seconds), start_(std::chrono::steady_clock::now()) {}
    ~stopwatch() { seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
    stopwatch(const stopwatch&) = delete;
    stopwatch& operator=(const stopwatch&) = delete;

private:
    double& seconds_;
    std::chrono::steady_clock::time_point start_;
};

/// A duplicate of the caller's communicator for the duration of one call, so the ring's messages can never match
/// messages the caller has in flight on the same communicator. Creating and freeing it are collective, like the
/// call itself.
class private_communicator {
public:
    explicit private_communicator(MPI_Comm comm) { MPI_Comm_dup(comm, &comm_); }
    ~private_communicator() { MPI_Comm_free(&comm_); }
    private_communicator(const private_communicator&) = delete;
    private_communicator& operator=(const private_communicator&) = delete;
    MPI_Comm get() const { return comm_; }

private:
    MPI_Comm comm_ = MPI_COMM_NULL;
};

/// Message tags: K / V shards, gradient accumulators on their way along the ring, and finished gradients going
/// home to the shard's owner.
enum ring_tag : int { tag_kv = 7101, tag_accumulator = 7102, tag_home = 7103 };

/// Non-blocking sends and receives of a buffer of any length (MPI counts are int: long buffers go in pieces).
class request_set {
public:
    template <class T>
    void send(const T* data, std::size_t count, int peer, int tag, MPI_Comm comm) {
        for_pieces(count, [&](std::size_t at, int n) {
            requests_.emplace_back();
            MPI_Isend(data + at, n, mpi_type<T>(), peer, tag, comm, &requests_.back());
        });
    }
    template <class T>
    void receive(T* data, std::size_t count, int peer, int tag, MPI_Comm comm) {
        for_pieces(count, [&](std::size_t at, int n) {
            requests_.emplace_back();
            MPI_Irecv(data + at, n, mpi_type<T>(), peer, tag, comm, &requests_.back());
        });
    }
    void wait() {
        if (!requests_.empty()) MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
        requests_.clear();
    }
    /// Lets MPI move data of pending requests; true when all are complete.
    bool test() {
        int done = 1;
        if (!requests_.empty())
            MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE);
        return done != 0;
    }
    ~request_set() { wait(); }  // never leave a request pending on the way out of an exception

private:
    template <class F>
    static void for_pieces(std::size_t count, F&& f) {
        constexpr std::size_t piece = std::size_t(1) << 30;
        for (std::size_t at = 0; at < count; at += piece) f(at, static_cast<int>(std::min(piece, count - at)));
    }
    std::vector<MPI_Request> requests_;
};

/// Runs `compute` (which must not throw) on a worker thread while this thread keeps the transfers moving.
/// Many MPI transports (TCP, shared-memory copy-in / copy-out) move a large message only while the MPI library
/// is called; without these calls a transfer posted before the compute would happen inside the final wait, after
/// it, and nothing would overlap. Only the calling thread calls MPI (MPI_THREAD_FUNNELED is enough). The results
/// do not depend on when the polls happen.
template <class F>
void compute_while_progressing(F& compute, std::initializer_list<request_set*> transfers, double multiply_adds) {
    const auto all_done = [&] {
        bool done = true;
        for (request_set* r : transfers) done = r->test() && done;
        return done;
    };
    // A step too small to hide anything behind (4 M multiply-adds, a fraction of a millisecond) runs here: a thread
    // would cost about as much as the transfer it could hide.
    if (multiply_adds < 1 << 22 || all_done()) {
        compute();
        return;
    }
    std::future<void> running;
    try {
        running = std::async(std::launch::async, [&compute] { compute(); });
    } catch (const std::system_error&) {  // no thread to be had: compute here, the transfers finish in the wait
        compute();
        return;
    }
    while (running.wait_for(std::chrono::milliseconds(1)) != std::future_status::ready)
        if (all_done()) break;
    running.get();
}

/// The shapes every rank agreed on, the layouts of the query and key shards over the sequence, and the score
/// shape of the full sequence that masks are bound to.
struct ring_geometry {
    int rank = 0;
    int ranks = 1;
    int node_ranks = 1;  ///< ranks of comm on this rank's node (shared memory), this one included
    index_t batch = 0, heads = 0, kv_heads = 0, head_dim = 0, value_dim = 0;
    shard_layout queries{sharding::contiguous, {0}};
    shard_layout keys{sharding::contiguous, {0}};
    attention_shape global;

    int next() const { return (rank + 1) % ranks; }
    int previous() const { return (rank + ranks - 1) % ranks; }
    /// The shard rank `r` holds at step t: the ring moves shards forward by one rank per step.
    int shard_at(int r, int t) const { return ((r - t) % ranks + ranks) % ranks; }
    /// Elements of shard s's keys and values, packed [k | v] in one buffer.
    std::size_t kv_elements(int s) const {
        return static_cast<std::size_t>(batch * kv_heads * keys.shard_length(s) * (head_dim + value_dim));
    }
    std::size_t largest_kv_elements() const {
        std::size_t largest = 0;
        for (int s = 0; s < ranks; ++s) largest = std::max(largest, kv_elements(s));
        return largest;
    }
};

/// Multiply-adds of one step's attention without a mask (an upper bound: masked tiles are skipped).
inline double step_work(const ring_geometry& g, index_t query_len, index_t key_len, bool computing) {
    return computing
               ? double(g.batch * g.heads) * double(query_len) * double(key_len) * double(g.head_dim + g.value_dim)
               : 0;
}

/// What every rank reports about its call before anything is sent: its error (if a local check failed), its
/// shapes and its options, gathered from all ranks so every rank takes the same decision.
struct rank_summary {
    std::int64_t failed = 0, storage = 0, kv_storage = 0, batch = 0, heads = 0, kv_heads = 0, query_len = 0,
                 key_len = 0, head_dim = 0, value_dim = 0;
    std::int64_t options[18] = {};
};

inline std::int64_t bits_of(double x) {
    std::int64_t b = 0;
    std::memcpy(&b, &x, sizeof b);
    return b;
}

/// FNV-1a over 64-bit words: one number for a list (sink logits, shard lengths) that every rank must agree on.
class fingerprint {
public:
    void add(std::int64_t word) {
        for (int byte = 0; byte < 8; ++byte) {
            hash_ ^= static_cast<std::uint64_t>(word >> (8 * byte)) & 0xffu;
            hash_ *= 0x100000001b3u;
        }
    }
    std::int64_t value() const { return static_cast<std::int64_t>(hash_); }

private:
    std::uint64_t hash_ = 0xcbf29ce484222325u;
};

/// What every rank must pass alike. Functions (score_mod) and biases are compared by presence and kind only.
inline void describe_options(const ring_options& options, const shard_layout& layout, std::int64_t (&out)[18]) {
    const sdpa_options& o = options.attention;
    out[0] = o.scale ? 1 : 0;
    out[1] = o.scale ? bits_of(*o.scale) : 0;
    out[2] = static_cast<std::int64_t>(o.empty_rows);
    out[3] = bits_of(o.dropout.probability);
    out[4] = static_cast<std::int64_t>(o.dropout.seed);
    out[5] = o.dropout.training ? 1 : 0;
    out[6] = o.dropout.query_offset;
    out[7] = o.dropout.key_offset;
    out[8] = static_cast<std::int64_t>(layout.kind());
    out[9] = o.softcap ? 1 : 0;
    out[10] = o.softcap ? bits_of(*o.softcap) : 0;
    fingerprint lengths, sinks;
    for (int r = 0; r < layout.ranks(); ++r) lengths.add(layout.shard_length(r));
    for (index_t h = 0; h < o.sinks.size(); ++h) sinks.add(bits_of(o.sinks[h]));
    out[11] = lengths.value();
    out[12] = sinks.value();
    out[13] = o.sinks.size();
    out[14] = o.score_mod.empty() ? 0 : 1;
    out[15] = o.score_bias.empty() ? 0 : 1 + static_cast<std::int64_t>(o.score_bias.bias_alignment());
    out[16] = o.need_weights ? 1 : 0;
    out[17] = o.check_finite ? 1 : 0;
}

/// The checks of a rank's own shard against the layout and of the options against the whole sequence's shape s
/// (batch, heads and dims of this rank, lengths of the layout): shape_error attend.shape.ring_layout, and what a
/// single call with these options throws for its score_bias, score_mod and sinks.
template <class T>
void check_layout_and_options(const attention_shape& mine, const shard_layout& layout, int rank, int ranks,
                              const ring_options& options) {
    if (layout.ranks() != ranks)
        throw shape_error("attend.shape.ring_layout", concat("the shard layout is for ", layout.ranks(),
                                                             " ranks but the communicator has ", ranks));
    if (mine.query_len != layout.shard_length(rank) || mine.key_len != layout.shard_length(rank))
        throw shape_error("attend.shape.ring_layout",
                          concat("rank ", rank, " holds ", mine.query_len, " queries and ", mine.key_len,
                                 " keys but the shard layout gives it ", layout.shard_length(rank),
                                 " positions (cut each rank's shard with take_shard(x, layout, rank))"));
    const sdpa_options& o = options.attention;
    if (o.need_weights)
        throw value_error("attend.value.need_weights",
                          "need_weights is not available in ring attention: no rank holds a row's weights over the "
                          "whole sequence; use scaled_dot_product_attention over the whole sequence for them");
    if (o.need_scores || o.accumulation != accumulation::standard)
        throw value_error("attend.value.sdpa_only",
                          concat(o.need_scores ? "need_scores" : "accumulation::float64",
                                 " is served by scaled_dot_product_attention and its _into form only, not by ring "
                                 "attention; unset it"));
    attention_shape whole = mine;
    whole.query_len = whole.key_len = layout.total();
    o.score_mod.validate(whole);
    o.score_bias.validate<accumulator_t<T>>(whole.heads, whole.query_len, whole.key_len);
    o.sinks.validate<T>(whole.heads);
}

/// Collective. Checks q, k, v on this rank (plus `local_checks`, e.g. the backward's out / lse / d_out) and their
/// lengths against the layout, gathers every rank's storage type, shapes and options, and throws the same error on
/// every rank when one rank's check failed (that rank's error), when the storage types differ
/// (attend.value.ring_storage), batch, heads or kv_heads differ (attend.shape.ring_heads), head_dim or value_dim
/// differ (attend.shape.ring_head_dim), or the options or layouts differ (attend.value.ring_options).
template <class Q, class K, class V, class LocalChecks>
ring_geometry agree_on_geometry(const Q& q, const K& k, const V& v, const shard_layout& layout, MPI_Comm comm,
                                const ring_options& options, int input_rank, LocalChecks&& local_checks) {
    ring_geometry g;
    MPI_Comm_rank(comm, &g.rank);
    MPI_Comm_size(comm, &g.ranks);
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, g.rank, MPI_INFO_NULL, &node);
    if (node != MPI_COMM_NULL) {
        MPI_Comm_size(node, &g.node_ranks);
        MPI_Comm_free(&node);
    }
    rank_summary mine;
    const auto error = capture_errors([&] {
        // A rank may hold no keys (ragged shards); check_shapes would reject key_len 0, which only the whole
        // sequence must not have, so such a shard is checked as if it had one key.
        const auto qv = attend::detail::as_view(q);  // float over 16-bit k and v, or one type
        auto kv = attend::detail::as_view(k), vv = attend::detail::as_view(v);
        const bool no_keys = kv.dims[2] == 0 && vv.dims[2] == 0;
        if (no_keys) kv.dims[2] = vv.dims[2] = 1;
        attention_shape s = attend::detail::check_views(qv, kv, vv);
        if (no_keys) s.key_len = 0;
        mine.batch = s.batch;
        mine.heads = s.heads;
        mine.kv_heads = s.kv_heads;
        mine.query_len = s.query_len;
        mine.key_len = s.key_len;
        mine.head_dim = s.head_dim;
        mine.value_dim = s.value_dim;
        check_layout_and_options<attend::detail::scalar_of<Q>>(s, layout, g.rank, g.ranks, options);
        local_checks(s);
    });
    mine.failed = error ? 1 : 0;
    // The storage types by their significand bits (scalar_name's key): a rank sending another type's bytes would
    // break the ring's message sizes, and one computing in another would break its results.
    mine.storage = std::numeric_limits<attend::detail::scalar_of<Q>>::digits;
    mine.kv_storage = std::numeric_limits<attend::detail::scalar_of<K>>::digits;
    describe_options(options, layout, mine.options);
    constexpr int fields = static_cast<int>(sizeof(rank_summary) / sizeof(std::int64_t));
    std::vector<rank_summary> all(static_cast<std::size_t>(g.ranks));
    MPI_Allgather(&mine, fields, MPI_INT64_T, all.data(), fields, MPI_INT64_T, comm);

    for (int r = 0; r < g.ranks; ++r)
        if (all[static_cast<std::size_t>(r)].failed) throw_from(comm, r, error);
    const auto spell = [&](auto field) {
        std::string text;
        for (int r = 0; r < g.ranks; ++r)
            text += concat(r ? ", " : "", "rank ", r, ' ', field(all[static_cast<std::size_t>(r)]));
        return text;
    };
    const rank_summary& first = all[0];
    for (const rank_summary& s : all)
        if (s.storage != first.storage || s.kv_storage != first.kv_storage)
            throw value_error("attend.value.ring_storage",
                              concat("q and k / v must have the same storage types on every rank (the shards travel "
                                     "as their bytes): ",
                                     spell([](const rank_summary& x) {
                                         return concat("q ", attend::detail::scalar_name(static_cast<int>(x.storage)),
                                                       " k / v ",
                                                       attend::detail::scalar_name(static_cast<int>(x.kv_storage)));
                                     })));
    for (const rank_summary& s : all)
        if (s.batch != first.batch || s.heads != first.heads || s.kv_heads != first.kv_heads)
            throw shape_error(
                "attend.shape.ring_heads",
                concat("batch, heads and kv_heads must be the same on every rank: ", spell([](const rank_summary& x) {
                           return concat("[batch ", x.batch, ", heads ", x.heads, ", kv_heads ", x.kv_heads, ']');
                       })));
    for (const rank_summary& s : all)
        if (s.head_dim != first.head_dim || s.value_dim != first.value_dim)
            throw shape_error("attend.shape.ring_head_dim",
                              concat("head_dim and value_dim must be the same on every rank: ",
                                     spell([](const rank_summary& x) {
                                         return concat("head_dim ", x.head_dim, " value_dim ", x.value_dim);
                                     })));
    for (const rank_summary& s : all)
        if (!std::equal(std::begin(s.options), std::end(s.options), std::begin(first.options)))
            throw value_error("attend.value.ring_options",
                              concat("ring_options or shard layouts differ between rank 0 and rank ", &s - all.data(),
                                     " (the attention options and the shard layout must be the same on every rank)"));
    // Every rank's shard matched its entry of its layout, and the layouts are the same everywhere.
    g.queries = g.keys = layout;
    if (layout.total() == 0)
        throw shape_error("attend.shape.empty_keys",
                          concat("every key shard is empty: no query has a key to attend (",
                                 spell([](const rank_summary& x) { return concat("key_len ", x.key_len); }), ')'));
    g.batch = first.batch;
    g.heads = first.heads;
    g.kv_heads = first.kv_heads;
    g.head_dim = first.head_dim;
    g.value_dim = first.value_dim;
    g.global.batch = g.batch;
    g.global.heads = g.heads;
    g.global.kv_heads = g.kv_heads;
    g.global.query_len = g.queries.total();
    g.global.key_len = g.keys.total();
    g.global.head_dim = g.head_dim;
    g.global.value_dim = g.value_dim;
    g.global.rank = input_rank;  // masks of rank-3 calls broadcast as theirs do
    return g;
}

/// Which blocks each rank computes and how far each shard travels. needs(r, s): some block of rank r's queries
/// x shard s's keys is not empty. travel(s): the last step at which a rank needs shard s (0: only its owner, or
/// nobody); the shard is sent from step 0 to travel(s) - 1 and not beyond.
struct ring_plan {
    std::vector<char> needed;  ///< [rank * ranks + shard]
    std::vector<int> travel;   ///< [shard]
    int ranks = 1;

    bool needs(int r, int s) const { return needed[static_cast<std::size_t>(r * ranks + s)] != 0; }
    bool holds(int t, int s) const { return t <= travel[static_cast<std::size_t>(s)]; }

    template <class Bound>
    static ring_plan make(const ring_geometry& g, const Bound& mask) {
        ring_plan p;
        p.ranks = g.ranks;
        p.needed.assign(static_cast<std::size_t>(g.ranks * g.ranks), 0);
        p.travel.assign(static_cast<std::size_t>(g.ranks), 0);
        for (int r = 0; r < g.ranks; ++r)
            for (int s = 0; s < g.ranks; ++s)
                for (const shard_segment& qs : g.queries.segments(r))
                    for (const shard_segment& ks : g.keys.segments(s))
                        if (!block_is_empty(mask, g.batch, g.heads, qs.global_begin, qs.global_begin + qs.length,
                                            ks.global_begin, ks.global_begin + ks.length))
                            p.needed[static_cast<std::size_t>(r * g.ranks + s)] = 1;
        for (int s = 0; s < g.ranks; ++s)
            for (int t = 0; t < g.ranks; ++t)
                if (p.needs((s + t) % g.ranks, s)) p.travel[static_cast<std::size_t>(s)] = t;
        return p;
    }
};

/// Rows [local_begin, local_begin + length) of axis 2 of a `[batch, heads, len, dim]` buffer, copied out, or the
/// buffer itself (no copy) when the run covers it.
template <class T>
class run_of {
public:
    run_of(const T* data, std::array<index_t, 4> dims, const shard_segment& run) : source_(data), dims_(dims) {
        dims_[2] = run.length;
        if (run.local_begin == 0 && run.length == dims[2]) return;
        copy_ = const_tensor_view<T, 4>(data, dims).slice(std::array<index_t, 4>{0, 0, run.local_begin, 0}, dims_);
    }
    const_tensor_view<T, 4> operator*() const { return {copy_.size() ? copy_.data() : source_, dims_}; }

private:
    const T* source_;
    std::array<index_t, 4> dims_;
    tensor<T, 4> copy_;
};

/// Lse (`[batch, heads, len]`) rows of one run.
template <class T>
tensor<T, 3> lse_run(const T* data, std::array<index_t, 3> dims, const shard_segment& run) {
    const const_tensor_view<T, 3> whole(data, dims);
    std::array<index_t, 3> extent = dims;
    extent[2] = run.length;
    return whole.slice(std::array<index_t, 3>{0, 0, run.local_begin}, extent);
}

/// f(part row, dest row, dim) for each row of part `[batch, heads, run.length, dim]` and its row [run.local_begin
/// + i] of a `[batch, heads, len, dim]` buffer.
template <class A, class D, class F>
void for_each_run_row(const tensor<A, 4>& part, D* dest, index_t len, const shard_segment& run, F&& f) {
    const index_t batch = part.dimension(0), heads = part.dimension(1), dim = part.dimension(3);
    for (index_t b = 0; b < batch; ++b)
        for (index_t h = 0; h < heads; ++h)
            for (index_t i = 0; i < run.length; ++i)
                f(part.data() + ((b * heads + h) * run.length + i) * dim,
                  dest + ((b * heads + h) * len + run.local_begin + i) * dim, dim);
}

/// dest rows of the run += part.
template <class T>
void add_run(const tensor<T, 4>& part, T* dest, index_t len, const shard_segment& run) {
    for_each_run_row(part, dest, len, run, [](const T* from, T* to, index_t dim) {
        for (index_t d = 0; d < dim; ++d) to[d] += from[d];
    });
}

/// dest rows of the run = part, rounded once to the storage type D (a copy when D is part's type).
template <class A, class D>
void round_run(const tensor<A, 4>& part, D* dest, index_t len, const shard_segment& run) {
    for_each_run_row(part, dest, len, run,
                     [](const A* from, D* to, index_t dim) { attend::detail::narrow(from, dim, to); });
}

/// The options of one block call: the ring's, evaluated with empty rows allowed (a row empty in one block may
/// have keys in another; the ring judges empty rows on the whole sequence) and dropout at global positions.
/// ring_options::threads resolved on this rank: as given, or for 0 this rank's share of its node's logical CPUs.
inline int ring_threads(const ring_options& o, const ring_geometry& g) {
    if (o.attention.threads != 0) return o.attention.threads;  // a negative count reaches the block call's check
    return std::max(1, attend::detail::hardware_threads() / std::max(1, g.node_ranks));
}

/// The ring's options with the threads resolved on this rank.
inline ring_options run_options_of(const ring_options& o, const ring_geometry& g) {
    ring_options run = o;
    run.attention.threads = ring_threads(o, g);
    return run;
}

/// The options of one block call: position-dependent features (dropout, score_bias, score_mod) at the block's
/// global positions; empty rows allowed (the ring judges them on the whole sequence); no sinks (the ring joins
/// them once per row, not once per block).
inline sdpa_options block_options(const ring_options& o, const ring_geometry& g, const shard_segment& queries,
                                  const shard_segment& keys, bool need_lse) {
    sdpa_options s = o.attention;
    s.empty_rows = attend::empty_rows::zero;
    s.dropout.query_offset += queries.global_begin;
    s.dropout.key_offset += keys.global_begin;
    s.score_bias =
        o.attention.score_bias.block_of(queries.global_begin, keys.global_begin, g.global.query_len, g.global.key_len);
    s.score_mod = o.attention.score_mod.block_of(queries.global_begin, keys.global_begin);
    s.sinks = {};
    s.need_lse = need_lse;
    return s;
}

/// Joins the sinks into one run's rows of out `[batch, heads, run, value_dim]` (merged over the keys, unrounded)
/// and lse `[batch, heads, len]`: lse becomes log(exp(lse) + exp(sink[h])) and out shrinks by exp(old - new lse), as
/// one call with the sinks computes them. A row without keys gets lse = the sink and keeps its zero out; a padded
/// query keeps lse -inf.
template <class Acc, class Bound>
void join_sinks(const attention_sinks& sinks, const Bound& mask, tensor<Acc, 4>* out, tensor<Acc, 3>& lse,
                const shard_segment& run) {
    const index_t batch = lse.dimension(0), heads = lse.dimension(1);
    for (index_t b = 0; b < batch; ++b)
        for (index_t h = 0; h < heads; ++h)
            for (index_t i = 0; i < run.length; ++i) {
                if (mask.query_padded(b, run.global_begin + i)) continue;
                Acc& l = lse(b, h, run.local_begin + i);
                const Acc z = static_cast<Acc>(sinks[h]);
                const Acc joined = l == -std::numeric_limits<Acc>::infinity()
                                       ? z
                                       : std::max(l, z) + std::log1p(std::exp(-std::abs(l - z)));
                if (out) {
                    const Acc shrink = std::exp(l - joined);
                    Acc* row = out->data() + ((b * heads + h) * run.length + i) * out->dimension(3);
                    for (index_t d = 0; d < out->dimension(3); ++d) row[d] *= shrink;
                }
                l = joined;
            }
}

/// This rank's part of d loss / d sink[h] = -sum over its rows of p_sink D, p_sink = exp(sink[h] - lse) and
/// D = d_out . out (the sink is a score with no value), added into `sums` `[heads]` in row order; padded queries
/// (lse -inf) add nothing.
template <class Out, class DOut, class Acc, class Bound>
void sink_gradient_rows(const attention_sinks& sinks, const Bound& mask, const ring_geometry& g, const Out& out,
                        const DOut& d_out, const tensor<Acc, 3>& lse, std::vector<double>& sums) {
    const index_t len = lse.dimension(2), dim = g.value_dim;
    for (const shard_segment& run : g.queries.segments(g.rank))
        for (index_t b = 0; b < g.batch; ++b)
            for (index_t h = 0; h < g.heads; ++h)
                for (index_t i = run.local_begin; i < run.local_begin + run.length; ++i) {
                    const Acc l = lse(b, h, i);
                    if (l == -std::numeric_limits<Acc>::infinity() ||
                        mask.query_padded(b, run.global_begin + i - run.local_begin))
                        continue;
                    const index_t row = ((b * g.heads + h) * len + i) * dim;
                    Acc dot = 0;
                    for (index_t d = 0; d < dim; ++d)
                        dot += static_cast<Acc>(d_out.data()[row + d]) * static_cast<Acc>(out.data()[row + d]);
                    sums[static_cast<std::size_t>(h)] -=
                        static_cast<double>(std::exp(static_cast<Acc>(sinks[h]) - l) * dot);
                }
}

/// Sets lse to -inf on this rank's rows that have no allowed key in the whole sequence (an lse with sinks is
/// finite there), so the empty-row check of the backward sees what the forward's saw.
template <class Acc, class Bound>
void forget_keyless_rows(const Bound& mask, const ring_geometry& g, tensor<Acc, 3>& lse) {
    const index_t total = g.global.key_len;
    for (const shard_segment& run : g.queries.segments(g.rank))
        for (index_t b = 0; b < g.batch; ++b)
            for (index_t h = 0; h < g.heads; ++h)
                for (index_t i = 0; i < run.length; ++i) {
                    const index_t position = run.global_begin + i;
                    const tile_class c = mask.classify(tile{b, h, position, position + 1, 0, total});
                    bool any = c == tile_class::full;
                    for (index_t j = 0; c == tile_class::mixed && !any && j < total; ++j)
                        any = mask.allowed(b, h, position, j);
                    if (!any) lse(b, h, run.local_begin + i) = -std::numeric_limits<Acc>::infinity();
                }
}

/// Collective, the last step of every call: agrees on the first error any rank met while computing; then, under
/// empty_rows::error, on the first query of the whole sequence (in batch, head, position order) with no allowed
/// key, and throws the same mask_error attend.mask.empty_row on every rank, worded as one process words it.
template <class T, class Bound>
void finish_agreement(MPI_Comm comm, const std::optional<captured_error>& error, const ring_geometry& g,
                      const Bound& mask, const tensor<T, 3>* lse, const ring_options& o) {
    agree_on_errors(comm, error);
    if (o.attention.empty_rows != attend::empty_rows::error) return;
    const index_t total = g.global.query_len;
    std::int64_t first = std::numeric_limits<std::int64_t>::max();
    for (const shard_segment& run : g.queries.segments(g.rank))
        for (index_t b = 0; b < g.batch; ++b)
            for (index_t h = 0; h < g.heads; ++h)
                for (index_t i = 0; i < run.length; ++i) {
                    const index_t position = run.global_begin + i;
                    if ((*lse)(b, h, run.local_begin + i) == -std::numeric_limits<T>::infinity() &&
                        !mask.query_padded(b, position))
                        first = std::min<std::int64_t>(first, (b * g.heads + h) * total + position);
                }
    std::int64_t lowest = first;
    MPI_Allreduce(&first, &lowest, 1, MPI_INT64_T, MPI_MIN, comm);
    if (lowest == std::numeric_limits<std::int64_t>::max()) return;
    const index_t position = lowest % total, bh = lowest / total;
    throw mask_error("attend.mask.empty_row",
                     concat("query ", position, " of batch ", bh / g.heads, ", head ", bh % g.heads,
                            " has no allowed key, so softmax is undefined; fix the mask, mark padded "
                            "queries with query_padding, or pass empty_rows::zero"));
}

template <class X>
void require_rank4() {
    static_assert(attend::detail::tensor_traits<std::decay_t<X>>::rank == 4,
                  "attend: ring attention takes [batch, heads, len, dim] tensors, or [batch, len, dim] ones all "
                  "alike");
}

/// A rank-3 tensor `[batch, len, dim]` seen as `[batch, 1, len, dim]` (no copy).
template <class X>
auto with_heads_axis(const X& x) {
    using S = attend::detail::scalar_of<X>;
    return const_tensor_view<S, 4>(x.data(), std::array<index_t, 4>{x.dimension(0), 1, x.dimension(1), x.dimension(2)});
}

/// A `[batch, 1, len, dim]` result as `[batch, len, dim]` (and `[batch, 1, len]` as `[batch, len]`).
template <class T, int Rank>
tensor<T, Rank - 1> without_heads_axis(const tensor<T, Rank>& x) {
    std::array<index_t, Rank - 1> dims{};
    dims[0] = x.dimension(0);
    for (int a = 2; a < Rank; ++a) dims[static_cast<std::size_t>(a - 1)] = x.dimension(static_cast<std::size_t>(a));
    return x.reshape(dims);
}

template <class X>
constexpr int input_rank() {
    return attend::detail::tensor_traits<std::decay_t<X>>::rank;
}

/// The forward's storage: q, k and v of one type, or float q over Eigen::half or Eigen::bfloat16 k and v (as
/// scaled_dot_product_attention takes them); the K / V shards travel in their own type.
template <class Q, class K, class V>
void require_storage_pair() {
    require_rank4<Q>();
    using S = attend::detail::scalar_of<K>;
    static_assert(std::is_same_v<S, attend::detail::scalar_of<V>> &&
                      attend::detail::storage_pair_v<attend::detail::scalar_of<Q>, S> &&
                      !attend::detail::is_quantized_block_v<S>,
                  "attend: ring attention takes q, k and v of one scalar type (float, double, Eigen::half or "
                  "Eigen::bfloat16), or float q with Eigen::half or Eigen::bfloat16 k and v");
    (void)mpi_type<S>();
}

/// The backward's storage: q, k and v of one type, as attention_backward takes them.
template <class Q, class K, class V>
void require_one_storage() {
    require_rank4<Q>();
    static_assert(std::is_same_v<attend::detail::scalar_of<Q>, attend::detail::scalar_of<K>> &&
                      std::is_same_v<attend::detail::scalar_of<Q>, attend::detail::scalar_of<V>>,
                  "attend: ring attention backward takes q, k and v of one scalar type (float, double, Eigen::half "
                  "or Eigen::bfloat16), as attention_backward does");
    (void)mpi_type<attend::detail::scalar_of<Q>>();
}

}  // namespace detail

namespace detail {

/// ring_attention on rank-4 shards; input_rank is the caller's (3: the mask broadcasts as for rank-3 inputs).
template <class Q, class K, class V, class Mask>
ring_attention_result<attend::detail::scalar_of<Q>> ring_attention_impl(const Q& q, const K& k, const V& v,
                                                                        const Mask& mask, const shard_layout& layout,
                                                                        MPI_Comm user_comm, const ring_options& options,
                                                                        int input_rank) {
    detail::require_storage_pair<Q, K, V>();
    using T = attend::detail::scalar_of<Q>;
    using S = attend::detail::scalar_of<K>;  // the shards' storage
    using Acc = accumulator_t<T>;
    const detail::private_communicator own(user_comm);
    const MPI_Comm comm = own.get();
    const auto noop = [](const attention_shape&) {};
    const detail::ring_geometry g = detail::agree_on_geometry(q, k, v, layout, comm, options, input_rank, noop);
    const ring_options run_options = detail::run_options_of(options, g);

    ring_attention_result<T> result;
    result.statistics.threads = run_options.attention.threads;
    const index_t query_len = g.queries.shard_length(g.rank);
    const std::array<index_t, 4> q_dims{g.batch, g.heads, query_len, g.head_dim};
    const auto& query_runs = g.queries.segments(g.rank);
    std::vector<std::optional<partial_attention<Acc, 4>>> partial(query_runs.size());
    std::vector<Acc> widened_q;  // 16-bit queries in float, so every block's out stays unrounded
    std::vector<detail::run_of<Acc>> query_of_run;
    std::vector<S> current, incoming;  // K / V packed [k | v]: the shard in hand (first this rank's), the next one

    // Bind the mask to the whole sequence, plan the ring and allocate every buffer: an error here (a mask that
    // does not fit the full shape, memory) is agreed before anything is sent.
    std::optional<decltype(mask.bind(g.global))> bound;
    detail::ring_plan plan;
    const auto prepare = [&] {
        bound.emplace(mask.bind(g.global));
        plan = detail::ring_plan::make(g, *bound);
        const Acc* queries = nullptr;
        if constexpr (std::is_same_v<T, Acc>) queries = q.data();
        else {
            widened_q.resize(static_cast<std::size_t>(q.size()));
            attend::detail::widen(q.data(), q.size(), widened_q.data());
            queries = widened_q.data();
        }
        query_of_run.reserve(query_runs.size());
        for (const shard_segment& run : query_runs) query_of_run.emplace_back(queries, q_dims, run);
        current.reserve(g.largest_kv_elements());  // later resizes never allocate
        incoming.reserve(g.largest_kv_elements());
        current.resize(g.kv_elements(g.rank));
    };
    detail::agree_on_errors(comm, detail::capture_errors(prepare));
    std::copy(k.data(), k.data() + k.size(), current.begin());
    std::copy(v.data(), v.data() + v.size(), current.begin() + k.size());

    std::optional<detail::captured_error> error;
    for (int t = 0; t < g.ranks; ++t) {
        const int shard = g.shard_at(g.rank, t), arriving = g.shard_at(g.rank, t + 1);
        // A shard no rank from here on needs went no further: nothing to compute on or send, though the next
        // one may still arrive.
        const bool holding = plan.holds(t, shard);
        detail::request_set transfers;
        if (t + 1 < g.ranks && plan.holds(t + 1, arriving)) {
            incoming.resize(g.kv_elements(arriving));
            transfers.receive(incoming.data(), incoming.size(), g.previous(), detail::tag_kv, comm);
        }
        if (holding && t + 1 < g.ranks && plan.holds(t + 1, shard)) {
            transfers.send(current.data(), current.size(), g.next(), detail::tag_kv, comm);
            ++result.statistics.shards_sent;
            result.statistics.bytes_sent += static_cast<std::int64_t>(current.size() * sizeof(S));
        }
        const index_t key_len = g.keys.shard_length(shard);
        const std::array<index_t, 4> k_dims{g.batch, g.kv_heads, key_len, g.head_dim},
            v_dims{g.batch, g.kv_heads, key_len, g.value_dim};
        const S* values = current.data() + g.batch * g.kv_heads * key_len * g.head_dim;
        const auto compute = [&] {
            for (std::size_t qi = 0; holding && qi < query_runs.size(); ++qi)
                for (const shard_segment& key_run : g.keys.segments(shard)) {
                    const shard_segment& query_run = query_runs[qi];
                    if (error || detail::block_is_empty(*bound, g.batch, g.heads, query_run.global_begin,
                                                        query_run.global_begin + query_run.length, key_run.global_begin,
                                                        key_run.global_begin + key_run.length)) {
                        ++result.statistics.blocks_skipped;
                        continue;
                    }
                    ++result.statistics.blocks_computed;
                    const detail::stopwatch watch(result.statistics.compute_seconds);
                    error = detail::capture_errors([&] {
                        const detail::run_of<S> keys(current.data(), k_dims, key_run), vals(values, v_dims, key_run);
                        auto block = scaled_dot_product_attention(
                            *query_of_run[qi], *keys, *vals,
                            detail::block_of<Mask>(*bound, query_run.global_begin, key_run.global_begin),
                            detail::block_options(run_options, g, query_run, key_run, true));
                        auto& acc = partial[qi];
                        if (!acc) acc = partial_attention<Acc, 4>{std::move(block.out), std::move(block.lse)};
                        else acc = merge_partials(acc->out, acc->lse, block.out, block.lse);
                    });
                }
        };
        detail::compute_while_progressing(compute, {&transfers}, detail::step_work(g, query_len, key_len, holding));
        transfers.wait();
        if (t + 1 < g.ranks && plan.holds(t + 1, arriving)) std::swap(current, incoming);
    }

    // Assemble this rank's rows; a run no block reached has no allowed key: zero rows, lse -inf. The sinks join
    // each row once, after the merge over every key; empty rows are judged on the keys' lse alone.
    const attention_sinks& sinks = options.attention.sinks;
    tensor<Acc, 3> key_lse;
    if (!error)
        error = detail::capture_errors([&] {
            result.out.resize(g.batch, g.heads, query_len, g.value_dim);
            result.lse.resize(g.batch, g.heads, query_len);
            result.out.setZero();
            result.lse.setConstant(-std::numeric_limits<Acc>::infinity());
            for (std::size_t qi = 0; qi < query_runs.size(); ++qi) {
                if (!partial[qi]) continue;
                const shard_segment& run = query_runs[qi];
                result.lse.slice(std::array<index_t, 3>{0, 0, run.local_begin},
                                 std::array<index_t, 3>{g.batch, g.heads, run.length}) = partial[qi]->lse;
            }
            if (!sinks.empty()) key_lse = result.lse;
            for (std::size_t qi = 0; qi < query_runs.size(); ++qi) {
                const shard_segment& run = query_runs[qi];
                tensor<Acc, 4>* run_out = partial[qi] ? &partial[qi]->out : nullptr;
                if (!sinks.empty()) detail::join_sinks(sinks, *bound, run_out, result.lse, run);
                if (run_out) detail::round_run(*run_out, result.out.data(), query_len, run);
            }
        });
    detail::finish_agreement(comm, error, g, *bound, sinks.empty() ? &result.lse : &key_lse, options);
    return result;
}

}  // namespace detail

/// Ring attention forward. Every rank passes its shard: q `[batch, heads, query_shard_len, head_dim]`, k
/// `[batch, kv_heads, key_shard_len, head_dim]`, v `[batch, kv_heads, key_shard_len, value_dim]` (tensors or
/// TensorMaps, row-major), cut from the whole sequence by `layout` (take_shard(x, layout, rank)): the layout says
/// which positions each rank holds (contiguous or zigzag, lengths that may differ between ranks), the same on
/// every rank, and each rank's q, k and v hold its layout length. `mask` is written for the whole sequence, e.g.
/// causal(alignment::top_left), sliding_window(l, r), key_padding(lengths), or a dense mask broadcastable to
/// `[batch, heads, total, total]`; it must be the same on every rank. GQA as in scaled_dot_product_attention.
/// Returns this rank's rows of out and lse. Collective over the communicator (used through a private duplicate): every
/// rank must call it. Throws, on every rank alike, everything scaled_dot_product_attention throws, shape_error
/// attend.shape.ring_heads / ring_head_dim / ring_layout, value_error attend.value.ring_options and mask_error
/// attend.mask.empty_row (judged on the whole sequence), value_error attend.value.ring_storage.
/// 16-bit storage (Eigen::half, Eigen::bfloat16): the K / V shards travel in 16 bits; each block computes in float
/// (this rank's queries widened once), the partial results merge in float and out is rounded once, so it is the
/// float ring's out on the widened inputs, rounded; lse is float. Float q over 16-bit k and v (a model whose keys
/// and values are kept in 16 bits): the shards travel in 16 bits, and out and lse are the float ring's on the
/// widened keys and values, bit for bit. Every rank must pass the same types (attend.value.ring_storage).
template <class Q, class K, class V, class Mask>
auto ring_attention(const Q& q, const K& k, const V& v, const Mask& mask, const shard_layout& layout,
                    MPI_Comm user_comm, const ring_options& options = {}) {
    attend::detail::require_mask<Mask>();
    if constexpr (detail::input_rank<Q>() == 3 && detail::input_rank<K>() == 3 && detail::input_rank<V>() == 3) {
        auto r = detail::ring_attention_impl(detail::with_heads_axis(q), detail::with_heads_axis(k),
                                             detail::with_heads_axis(v), mask, layout, user_comm, options, 3);
        using T = attend::detail::scalar_of<Q>;
        return ring_attention_result<T, 3>{detail::without_heads_axis(r.out), detail::without_heads_axis(r.lse),
                                           r.statistics};
    } else {
        return detail::ring_attention_impl(q, k, v, mask, layout, user_comm, options, 4);
    }
}

/// Ring attention forward without a mask.
template <class Q, class K, class V>
auto ring_attention(const Q& q, const K& k, const V& v, const shard_layout& layout, MPI_Comm comm,
                    const ring_options& options = {}) {
    return ring_attention(q, k, v, no_mask{}, layout, comm, options);
}

namespace detail {

/// ring_attention_backward on rank-4 shards; input_rank is the caller's.
template <class Gradient, class Q, class K, class V, class Mask, class Out, class Lse, class DOut>
ring_gradients<detail::gradient_of<Gradient, attend::detail::scalar_of<Q>>> ring_attention_backward_impl(
    const Q& q, const K& k, const V& v, const Mask& mask, const Out& out, const Lse& lse, const DOut& d_out,
    const shard_layout& layout, MPI_Comm user_comm, const ring_options& options, int input_rank) {
    detail::require_one_storage<Q, K, V>();
    detail::require_rank4<Out>();
    detail::require_rank4<DOut>();
    using T = attend::detail::scalar_of<Q>;
    using Acc = accumulator_t<T>;
    using G = detail::gradient_of<Gradient, T>;
    static_assert(std::is_same_v<T, attend::detail::scalar_of<Out>> &&
                      std::is_same_v<Acc, attend::detail::scalar_of<Lse>> &&
                      std::is_same_v<T, attend::detail::scalar_of<DOut>> &&
                      attend::detail::tensor_traits<std::decay_t<Lse>>::rank == 3,
                  "attend: out and d_out have the query's scalar type, lse its accumulation type (float for "
                  "half and bfloat16) as ring_attention returns it; lse is [batch, heads, len]");
    static_assert(std::is_same_v<G, T> || (attend::detail::is_16bit_v<T> && std::is_same_v<G, float>),
                  "attend: ring_attention_backward<G> gives gradients in the inputs' type or, for 16-bit inputs, "
                  "in float");
    const auto local_checks = [&](const attention_shape& s) {
        const std::array<index_t, 4> expected{s.batch, s.heads, s.query_len, s.value_dim};
        const auto check = [&](const auto& x, const char* id, const char* what) {
            std::array<index_t, 4> got{};
            for (std::size_t a = 0; a < 4; ++a) got[a] = x.dimensions()[a];
            if (got != expected)
                throw shape_error(id, detail::concat(what, ' ', detail::format_shape(got), " != expected ",
                                                     detail::format_shape(expected)));
        };
        check(out, "attend.shape.backward_out", "out");
        check(d_out, "attend.shape.backward_d_out", "d_out");
        const std::array<index_t, 3> lse_expected{s.batch, s.heads, s.query_len},
            lse_got{lse.dimensions()[0], lse.dimensions()[1], lse.dimensions()[2]};
        if (lse_got != lse_expected)
            throw shape_error("attend.shape.backward_lse",
                              detail::concat("lse ", detail::format_shape(lse_got), " != expected ",
                                             detail::format_shape(lse_expected)));
    };
    const detail::private_communicator own(user_comm);
    const MPI_Comm comm = own.get();
    const detail::ring_geometry g = detail::agree_on_geometry(q, k, v, layout, comm, options, input_rank, local_checks);
    const ring_options run_options = detail::run_options_of(options, g);

    ring_gradients<G> result;
    result.statistics.threads = run_options.attention.threads;
    tensor<Acc, 4> dq;  // summed over the key shards in the accumulation type, rounded once at the end
    const index_t query_len = g.queries.shard_length(g.rank), own_keys = g.keys.shard_length(g.rank);
    const std::array<index_t, 4> q_dims{g.batch, g.heads, query_len, g.head_dim},
        o_dims{g.batch, g.heads, query_len, g.value_dim};
    const std::array<index_t, 3> lse_dims{g.batch, g.heads, query_len};
    const auto& query_runs = g.queries.segments(g.rank);
    struct query_rows {
        detail::run_of<T> q, out, d_out;
        tensor<Acc, 3> lse;
    };
    std::vector<query_rows> rows;
    // K / V packed [k | v] (the shard in hand, the next one), dK / dV packed [dk | dv] in the accumulation type
    // (this rank's part, the accumulator arriving, the one sent last step) and, finished, this rank's own shard's.
    std::vector<T> current, incoming;
    std::vector<Acc> accumulator, accumulator_in, accumulator_sent, own_gradient;
    const auto grad_elements = [&](int s) { return g.kv_elements(s); };  // [dk | dv] has the size of [k | v]

    // Bind the mask to the whole sequence, plan the ring and allocate every buffer: an error here is agreed
    // before anything is sent.
    std::optional<decltype(mask.bind(g.global))> bound;
    detail::ring_plan plan;
    const auto prepare = [&] {
        bound.emplace(mask.bind(g.global));
        plan = detail::ring_plan::make(g, *bound);
        rows.reserve(query_runs.size());
        for (const shard_segment& run : query_runs)
            rows.push_back(query_rows{
                detail::run_of<T>(q.data(), q_dims, run), detail::run_of<T>(out.data(), o_dims, run),
                detail::run_of<T>(d_out.data(), o_dims, run), detail::lse_run<Acc>(lse.data(), lse_dims, run)});
        dq.resize(q_dims);
        dq.setZero();
        // Later resizes never allocate.
        for (auto* buffer : {&current, &incoming}) buffer->reserve(g.largest_kv_elements());
        for (auto* buffer : {&accumulator, &accumulator_in, &accumulator_sent})
            buffer->reserve(g.largest_kv_elements());
        current.resize(g.kv_elements(g.rank));
        own_gradient.resize(grad_elements(g.rank));
    };
    detail::agree_on_errors(comm, detail::capture_errors(prepare));

    // The finished dK / dV of this rank's own shard: kept when no other rank needs the shard, otherwise received
    // from the last rank that does.
    detail::request_set home;
    const int own_travel = plan.travel[static_cast<std::size_t>(g.rank)];
    if (own_travel > 0)
        home.receive(own_gradient.data(), own_gradient.size(), (g.rank + own_travel) % g.ranks, detail::tag_home, comm);

    std::copy(k.data(), k.data() + k.size(), current.begin());
    std::copy(v.data(), v.data() + v.size(), current.begin() + k.size());
    detail::request_set gradient_sends;  // accumulators sent at step t - 1, still in flight during step t

    std::optional<detail::captured_error> error;
    for (int t = 0; t < g.ranks; ++t) {
        const int shard = g.shard_at(g.rank, t), arriving = g.shard_at(g.rank, t + 1);
        const int travel = plan.travel[static_cast<std::size_t>(shard)];
        detail::request_set transfers, accumulator_receive;
        if (t + 1 < g.ranks && plan.holds(t + 1, arriving)) {
            incoming.resize(g.kv_elements(arriving));
            transfers.receive(incoming.data(), incoming.size(), g.previous(), detail::tag_kv, comm);
        }
        if (!plan.holds(t, shard)) {  // the shard went no further; the next one may still arrive
            transfers.wait();
            if (t + 1 < g.ranks && plan.holds(t + 1, arriving)) std::swap(current, incoming);
            continue;
        }
        if (t + 1 < g.ranks && plan.holds(t + 1, shard)) {
            transfers.send(current.data(), current.size(), g.next(), detail::tag_kv, comm);
            ++result.statistics.shards_sent;
            result.statistics.bytes_sent += static_cast<std::int64_t>(current.size() * sizeof(T));
        }
        if (t > 0) {  // the accumulator of this shard, from the rank that held it one step ago
            accumulator_in.resize(grad_elements(shard));
            accumulator_receive.receive(accumulator_in.data(), accumulator_in.size(), g.previous(),
                                        detail::tag_accumulator, comm);
        }

        const index_t key_len = g.keys.shard_length(shard);
        const std::array<index_t, 4> k_dims{g.batch, g.kv_heads, key_len, g.head_dim},
            v_dims{g.batch, g.kv_heads, key_len, g.value_dim};
        const index_t k_elements = g.batch * g.kv_heads * key_len * g.head_dim;
        const T* values = current.data() + k_elements;
        accumulator.assign(grad_elements(shard), Acc(0));
        bool contributed = false;
        const auto compute = [&] {
            for (std::size_t qi = 0; qi < query_runs.size(); ++qi)
                for (const shard_segment& key_run : g.keys.segments(shard)) {
                    const shard_segment& query_run = query_runs[qi];
                    if (error || detail::block_is_empty(*bound, g.batch, g.heads, query_run.global_begin,
                                                        query_run.global_begin + query_run.length, key_run.global_begin,
                                                        key_run.global_begin + key_run.length)) {
                        ++result.statistics.blocks_skipped;
                        continue;
                    }
                    ++result.statistics.blocks_computed;
                    contributed = true;
                    const detail::stopwatch watch(result.statistics.compute_seconds);
                    error = detail::capture_errors([&] {
                        const detail::run_of<T> keys(current.data(), k_dims, key_run), vals(values, v_dims, key_run);
                        const query_rows& r = rows[qi];
                        // The block's gradients in the accumulation type: 16-bit ones are summed unrounded.
                        tensor<Acc, 4> block_dq(g.batch, g.heads, query_run.length, g.head_dim),
                            block_dk(g.batch, g.kv_heads, key_run.length, g.head_dim),
                            block_dv(g.batch, g.kv_heads, key_run.length, g.value_dim);
                        scaled_dot_product_attention_backward_into(
                            *r.q, *keys, *vals,
                            detail::block_of<Mask>(*bound, query_run.global_begin, key_run.global_begin), *r.out, r.lse,
                            *r.d_out, detail::block_options(run_options, g, query_run, key_run, false), block_dq,
                            block_dk, block_dv);
                        detail::add_run(block_dq, dq.data(), query_len, query_run);
                        detail::add_run(block_dk, accumulator.data(), key_len, key_run);
                        detail::add_run(block_dv, accumulator.data() + k_elements, key_len, key_run);
                    });
                }
        };
        detail::compute_while_progressing(compute, {&transfers, &accumulator_receive, &gradient_sends},
                                          2.5 * detail::step_work(g, query_len, key_len, true));
        // Fixed order: what the ranks before added, then this rank's part.
        accumulator_receive.wait();
        if (t > 0) {
            if (contributed)
                for (std::size_t n = 0; n < accumulator.size(); ++n)
                    accumulator[n] = accumulator_in[n] + accumulator[n];
            else std::swap(accumulator, accumulator_in);
        }
        gradient_sends.wait();  // the accumulator sent last step has arrived; its buffer is free
        if (t < travel) {
            std::swap(accumulator_sent, accumulator);
            gradient_sends.send(accumulator_sent.data(), accumulator_sent.size(), g.next(), detail::tag_accumulator,
                                comm);
            result.statistics.bytes_sent += static_cast<std::int64_t>(accumulator_sent.size() * sizeof(Acc));
        } else if (t > 0) {
            std::swap(accumulator_sent, accumulator);
            gradient_sends.send(accumulator_sent.data(), accumulator_sent.size(), shard, detail::tag_home, comm);
            result.statistics.bytes_sent += static_cast<std::int64_t>(accumulator_sent.size() * sizeof(Acc));
        } else {
            own_gradient = accumulator;
        }
        transfers.wait();
        if (t + 1 < g.ranks && plan.holds(t + 1, arriving)) std::swap(current, incoming);
    }
    gradient_sends.wait();
    home.wait();
    if (!error)
        error = detail::capture_errors([&] {
            const index_t k_elements = g.batch * g.kv_heads * own_keys * g.head_dim;
            const auto rounded = [](tensor<G, 4>& to, const Acc* from, std::array<index_t, 4> dims) {
                to.resize(dims);
                attend::detail::narrow(from, to.size(), to.data());
            };
            rounded(result.d_query, dq.data(), q_dims);
            rounded(result.d_key, own_gradient.data(), {g.batch, g.kv_heads, own_keys, g.head_dim});
            rounded(result.d_value, own_gradient.data() + k_elements, {g.batch, g.kv_heads, own_keys, g.value_dim});
        });
    // The sinks' gradient: each rank's rows summed in row order, then the ranks' sums in rank order, so every rank
    // holds the same bits. The lse the forward returned includes the sinks; the empty-row check looks at the keys.
    tensor<Acc, 3> lse_copy = const_tensor_view<Acc, 3>(lse.data(), lse_dims);
    const attention_sinks& sinks = options.attention.sinks;
    if (!sinks.empty()) {
        std::vector<double> mine(static_cast<std::size_t>(g.heads), 0.0),
            all(mine.size() * static_cast<std::size_t>(g.ranks));
        if (!error)
            error = detail::capture_errors([&] {
                detail::sink_gradient_rows(sinks, *bound, g, out, d_out, lse_copy, mine);
                detail::forget_keyless_rows(*bound, g, lse_copy);
            });
        const int heads = static_cast<int>(g.heads);  // sink logits are one per head: far below INT_MAX
        MPI_Allgather(mine.data(), heads, MPI_DOUBLE, all.data(), heads, MPI_DOUBLE, comm);
        if (!error)
            error = detail::capture_errors([&] {
                result.d_sinks.resize(g.heads);
                for (index_t h = 0; h < g.heads; ++h) {
                    double sum = 0;
                    for (int r = 0; r < g.ranks; ++r) sum += all[static_cast<std::size_t>(r * g.heads + h)];
                    result.d_sinks(h) = static_cast<G>(sum);
                }
            });
    }
    detail::finish_agreement(comm, error, g, *bound, &lse_copy, options);
    return result;
}

}  // namespace detail

/// Ring attention backward: this rank's dq, dk, dv of a loss given d_out = d loss / d out, for the shards and
/// out / lse of ring_attention (out, d_out `[batch, heads, query_shard_len, value_dim]`, lse `[batch, heads,
/// query_shard_len]`), with the same mask and options. K / V shards travel the ring again; each shard's dK / dV
/// accumulator travels behind it, each rank adding its contribution in ring order (a fixed order), and the
/// finished gradient goes straight home to the shard's owner from the last rank that needs the shard. Dropout is
/// replayed at global positions; with sinks, d_sinks is the whole sequence's (the same on every rank). Collective;
/// pass the layout of the forward. Throws like ring_attention and, for out / lse / d_out of the wrong
/// shape, shape_error attend.shape.backward_out / backward_lse / backward_d_out, on every rank alike.
/// 16-bit storage: out and d_out in it, lse the forward's float; each block's gradients are computed in float, dK /
/// dV accumulators travel and sum in float, and dq, dk, dv are rounded once at the end, so they are the float
/// ring's gradients on the widened inputs, rounded. `ring_attention_backward<float>(...)` returns them unrounded.
template <class Gradient = void, class Q, class K, class V, class Mask, class Out, class Lse, class DOut>
auto ring_attention_backward(const Q& q, const K& k, const V& v, const Mask& mask, const Out& out, const Lse& lse,
                             const DOut& d_out, const shard_layout& layout, MPI_Comm user_comm,
                             const ring_options& options = {}) {
    attend::detail::require_mask<Mask>();
    if constexpr (detail::input_rank<Q>() == 3 && detail::input_rank<K>() == 3 && detail::input_rank<V>() == 3 &&
                  detail::input_rank<Out>() == 3 && detail::input_rank<DOut>() == 3 && detail::input_rank<Lse>() == 2) {
        using L = attend::detail::scalar_of<Lse>;
        const const_tensor_view<L, 3> lse3(lse.data(), std::array<index_t, 3>{lse.dimension(0), 1, lse.dimension(1)});
        auto r = detail::ring_attention_backward_impl<Gradient>(
            detail::with_heads_axis(q), detail::with_heads_axis(k), detail::with_heads_axis(v), mask,
            detail::with_heads_axis(out), lse3, detail::with_heads_axis(d_out), layout, user_comm, options, 3);
        using G = detail::gradient_of<Gradient, attend::detail::scalar_of<Q>>;
        return ring_gradients<G, 3>{detail::without_heads_axis(r.d_query), detail::without_heads_axis(r.d_key),
                                    detail::without_heads_axis(r.d_value), std::move(r.d_sinks), r.statistics};
    } else {
        return detail::ring_attention_backward_impl<Gradient>(q, k, v, mask, out, lse, d_out, layout, user_comm,
                                                              options, 4);
    }
}
}  // namespace attend::distributed
