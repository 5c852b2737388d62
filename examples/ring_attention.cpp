// SPDX-License-Identifier: MIT
// Ring attention over MPI: a causal sequence of 16 tokens sharded zig-zag over the ranks, each rank holding its
// shard of q, k and v; K / V shards travel the ring and every rank gets the rows of the single-process result
// for its queries, forward and backward. Run with: mpirun -np 2 ring_attention (rank 0 prints).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include <mpi.h>

#include <attend/attend.hpp>
#include <attend/distributed/ring.hpp>

namespace ad = attend::distributed;
using idx = attend::index_t;

/// A deterministic [1, 2, 16, 4] tensor, the same on every rank.
attend::tensor<double, 4> make(double phase) {
    attend::tensor<double, 4> t(1, 2, 16, 4);
    for (idx h = 0; h < 2; ++h)
        for (idx i = 0; i < 16; ++i)
            for (idx d = 0; d < 4; ++d) t(0, h, i, d) = std::sin(phase + 0.7 * double(i) + 1.3 * double(d) + double(h));
    return t;
}

template <int R>
double max_difference(const attend::tensor<double, R>& a, const attend::tensor<double, R>& b) {
    double m = 0;
    for (idx n = 0; n < a.size(); ++n) m = std::max(m, std::abs(a.data()[n] - b.data()[n]));
    return m;
}

int main(int argc, char** argv) {
    int provided = 0;  // the ring computes on a worker thread while this one calls MPI
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    int rank = 0, ranks = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);

    const auto q = make(0.0), k = make(1.0), v = make(2.0), d_out = make(3.0);
    const auto causal = attend::causal(attend::alignment::top_left);
    // Zig-zag: 2 * ranks chunks, rank r holds chunks r and 2 * ranks - 1 - r, so causal work is even.
    const ad::shard_layout layout(ad::sharding::zigzag,
                                  ad::shard_layout::balanced_lengths(ad::sharding::zigzag, 16, ranks));
    ad::ring_options options;
    const auto shard = [&](const auto& x) { return ad::take_shard(x, layout, rank); };

    const auto ring = ad::ring_attention(shard(q), shard(k), shard(v), causal, layout, MPI_COMM_WORLD, options);
    const auto grads = ad::ring_attention_backward(shard(q), shard(k), shard(v), causal, ring.out, ring.lse,
                                                   shard(d_out), layout, MPI_COMM_WORLD, options);

    // The same attention in one process, to compare this rank's rows with.
    attend::sdpa_options one;
    one.need_lse = true;
    const auto whole = attend::scaled_dot_product_attention(q, k, v, causal, one);
    const auto whole_grads =
        attend::scaled_dot_product_attention_backward(q, k, v, causal, whole.out, whole.lse, d_out, one);
    double mine = std::max({max_difference(ring.out, shard(whole.out)),
                            max_difference(ring.lse, ad::take_shard(whole.lse, layout, rank, ad::sequence_axis{2})),
                            max_difference(grads.d_query, shard(whole_grads.d_query)),
                            max_difference(grads.d_key, shard(whole_grads.d_key)),
                            max_difference(grads.d_value, shard(whole_grads.d_value))});
    double worst = 0;
    MPI_Reduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

    if (rank == 0) {
        std::printf("%d ranks, 16 tokens, causal, zig-zag shards:\n", ranks);
        for (int r = 0; r < ranks; ++r) {
            std::int64_t pairs = 0;  // causal work: query p sees keys 0 .. p
            std::printf("  rank %d holds positions", r);
            for (const auto& s : layout.segments(r)) {
                std::printf(" %lld-%lld", static_cast<long long>(s.global_begin),
                            static_cast<long long>(s.global_begin + s.length - 1));
                for (idx i = 0; i < s.length; ++i) pairs += s.global_begin + i + 1;
            }
            std::printf(", %lld (query, key) pairs\n", static_cast<long long>(pairs));
        }
        // Rank 0 holds the last chunk, so it has query 15, which sees every key.
        std::printf("out of query 15, head 0:");
        const idx local = layout.segments(0).back().local_begin + layout.segments(0).back().length - 1;
        for (idx d = 0; d < 4; ++d) std::printf(" %.4f", ring.out(0, 0, local, d));
        std::printf("\nout, lse, dq, dk, dv equal single-process attention within 1e-12: %s\n",
                    worst <= 1e-12 ? "yes" : "NO");
    }
    MPI_Finalize();
    return 0;
}
