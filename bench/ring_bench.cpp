// SPDX-License-Identifier: MIT
// attend_ring_bench: ring attention (distributed/ring.hpp) under mpirun. Not a Google Benchmark binary: its
// timings are collective (every rank runs the call, the slowest rank's time counts), so it times with
// MPI_Wtime around barriers and prints one line per case on rank 0.
//
//   overlap  (2 ranks): ring_attention without a mask, fp32 or bf16 shards (the last argument: fp32, bf16 or
//            both), threads = 1 per rank, versus the same compute alone
//            (each rank runs the N block attentions and N - 1 lse merges of the ring on its own K / V, no MPI).
//            overlap efficiency = compute-alone time / ring time (1.0: the transfers hide entirely). Also the
//            time of one K / V shard exchange alone (ping-pong), from which the link rate is derived.
//   balance  (any ranks, 4 in docs/scaling.md): causal work per rank, as (query, key) pairs the mask allows in
//            the blocks each rank computes, contiguous vs zigzag; deterministic. Plus each rank's compute time in
//            the causal ring call (ring_statistics::compute_seconds; informational, noisy on a shared machine).
//
//   mpirun -np 2 attend_ring_bench overlap [tokens_per_rank=4096] [head_dim=64] [heads=4] [repeats=3] [fp32]
//   mpirun -np 4 attend_ring_bench balance [tokens_per_rank=2048] [head_dim=64] [heads=2]

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <mpi.h>

#include <attend/attend.hpp>
#include <attend/distributed/ring.hpp>

#include "bench_common.hpp"

namespace {

namespace ad = attend::distributed;
using attend::index_t;

/// q, k or v `[b, h, l, d]`, uniform in [-1, 1) (bench_common.hpp's generator), rounded to T.
template <class T = float>
attend::tensor<T, 4> random_tensor(std::uint64_t seed, index_t b, index_t h, index_t l, index_t d) {
    return attend_bench::random_tensor<float, 4>(seed, {b, h, l, d}).template cast<T>();
}

/// Seconds of f on the slowest rank (barrier, f, max over ranks).
template <class F>
double collective_seconds(F&& f) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    f();
    double mine = MPI_Wtime() - start, slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return slowest;
}

index_t argument(int argc, char** argv, int at, index_t fallback) {
    return argc > at ? static_cast<index_t>(std::atoll(argv[at])) : fallback;
}

/// The overlap case in storage type T: the ring's K / V shards travel in T; its blocks compute with float
/// queries (16-bit ones widened once, as the ring does) and merge in float.
template <class T>
void overlap(index_t tokens, index_t dim, index_t heads, index_t repeats, int rank, int ranks, const char* name) {
    const auto q = random_tensor<T>(1 + static_cast<std::uint64_t>(rank), 1, heads, tokens, dim);
    const auto k = random_tensor<T>(100 + static_cast<std::uint64_t>(rank), 1, heads, tokens, dim);
    const auto v = random_tensor<T>(200 + static_cast<std::uint64_t>(rank), 1, heads, tokens, dim);
    const attend::tensor<attend::accumulator_t<T>, 4> q_wide = q.template cast<attend::accumulator_t<T>>();
    const ad::shard_layout layout(ad::sharding::contiguous,
                                  std::vector<index_t>(static_cast<std::size_t>(ranks), tokens));
    ad::ring_options ro;
    ro.attention.threads = 1;  // one rank per core
    attend::sdpa_options so;
    so.threads = 1;
    so.need_lse = true;
    const auto ring_call = [&] { ad::ring_attention(q, k, v, layout, MPI_COMM_WORLD, ro); };
    const auto compute_alone = [&] {  // the ring's blocks and merges on this rank, K / V never moving
        auto acc = attend::scaled_dot_product_attention(q_wide, k, v, so);
        for (int t = 1; t < ranks; ++t) {
            const auto block = attend::scaled_dot_product_attention(q_wide, k, v, so);
            auto merged = attend::merge_partials(acc.out, acc.lse, block.out, block.lse);
            acc.out = std::move(merged.out);
            acc.lse = std::move(merged.lse);
        }
    };
    // One K / V shard there and back between ranks 0 and 1: what one ring step moves, alone.
    std::vector<T> shard(static_cast<std::size_t>(2 * k.size())), back(shard.size());
    const int shard_bytes = static_cast<int>(shard.size() * sizeof(T));
    const auto exchange = [&] {
        const int peer = rank ^ 1;
        if (peer >= ranks) return;
        MPI_Sendrecv(shard.data(), shard_bytes, MPI_BYTE, peer, 1, back.data(), shard_bytes, MPI_BYTE, peer, 1,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    };
    ring_call();  // warm up: first-touch pages, MPI connections
    double best_ring = 1e300, best_alone = 1e300, best_exchange = 1e300;
    for (index_t n = 0; n < repeats; ++n) {
        best_ring = std::min(best_ring, collective_seconds(ring_call));
        best_alone = std::min(best_alone, collective_seconds(compute_alone));
        best_exchange = std::min(best_exchange, collective_seconds(exchange));
    }
    const double bytes = static_cast<double>(shard_bytes);
    const double flops_per_step = 4.0 * static_cast<double>(heads * tokens * tokens * dim);
    if (rank == 0)
        std::printf(
            "overlap ranks=%d tokens_per_rank=%lld head_dim=%lld heads=%lld %s: ring %.4f s, compute "
            "alone %.4f s, overlap efficiency %.3f (ring / alone %.3f); per step %.1f MiB sent, %.2f GFLOP, "
            "%.1f GFLOP/s per rank; shard exchange alone %.4f s = %.2f GB/s per direction\n",
            ranks, static_cast<long long>(tokens), static_cast<long long>(dim), static_cast<long long>(heads), name,
            best_ring, best_alone, best_alone / best_ring, best_ring / best_alone, bytes / (1 << 20),
            flops_per_step * 1e-9, flops_per_step * ranks * 1e-9 / best_alone, best_exchange,
            bytes / best_exchange * 1e-9);
}

void overlap(int argc, char** argv, int rank, int ranks) {
    const index_t tokens = argument(argc, argv, 2, 4096), dim = argument(argc, argv, 3, 64),
                  heads = argument(argc, argv, 4, 4), repeats = argument(argc, argv, 5, 3);
    const std::string storage = argc > 6 ? argv[6] : "fp32";
    if (storage == "fp32" || storage == "both") overlap<float>(tokens, dim, heads, repeats, rank, ranks, "fp32");
    if (storage == "bf16" || storage == "both")
        overlap<Eigen::bfloat16>(tokens, dim, heads, repeats, rank, ranks, "bf16");
}

void balance(int argc, char** argv, int rank, int ranks) {
    const index_t tokens = argument(argc, argv, 2, 2048), dim = argument(argc, argv, 3, 64),
                  heads = argument(argc, argv, 4, 2);
    const index_t total = tokens * ranks;
    for (ad::sharding kind : {ad::sharding::contiguous, ad::sharding::zigzag}) {
        const ad::shard_layout layout(kind, ad::shard_layout::balanced_lengths(kind, total, ranks));
        // Causal work: query p sees keys 0 .. p, in whichever block they fall.
        std::vector<double> pairs(static_cast<std::size_t>(ranks), 0);
        for (int r = 0; r < ranks; ++r)
            for (const auto& s : layout.segments(r))
                for (index_t i = 0; i < s.length; ++i)
                    pairs[static_cast<std::size_t>(r)] += double(s.global_begin + i + 1);
        double mean = 0;
        for (double p : pairs) mean += p / ranks;
        const auto full_q = random_tensor(7, 1, heads, total, dim);
        const auto q = ad::take_shard(full_q, layout, rank);
        ad::ring_options o;
        MPI_Barrier(MPI_COMM_WORLD);
        double seconds =
            ad::ring_attention(q, q, q, attend::causal(attend::alignment::top_left), layout, MPI_COMM_WORLD, o)
                .statistics.compute_seconds;
        std::vector<double> times(static_cast<std::size_t>(ranks));
        MPI_Gather(&seconds, 1, MPI_DOUBLE, times.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
        if (rank != 0) continue;
        std::printf("balance %s ranks=%d total=%lld causal: (query, key) pairs per rank / mean:",
                    kind == ad::sharding::zigzag ? "zigzag" : "contiguous", ranks, static_cast<long long>(total));
        double worst = 0;
        for (double p : pairs) {
            std::printf(" %.4f", p / mean);
            worst = std::max(worst, std::abs(p / mean - 1));
        }
        std::printf(" (max deviation %.2f %%); compute seconds per rank:", 100 * worst);
        for (double t : times) std::printf(" %.3f", t);
        std::printf("\n");
    }
}

}  // namespace

int main(int argc, char** argv) {
    int provided = 0;  // the ring computes on a worker thread while this one calls MPI
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    int rank = 0, ranks = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "overlap") overlap(argc, argv, rank, ranks);
    else if (mode == "balance") balance(argc, argv, rank, ranks);
    else if (rank == 0) std::fprintf(stderr, "usage: mpirun -np N attend_ring_bench overlap|balance [sizes...]\n");
    MPI_Finalize();
    return mode == "overlap" || mode == "balance" ? 0 : 2;
}
