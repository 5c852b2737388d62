// SPDX-License-Identifier: MIT
// Serving cases of attend_bench (issue #13): one decoding step of 16 sequences of different lengths (512 to 8192,
// evenly spaced), 32 query heads on 8 kv heads, head_dim 128, fp32 queries, check_finite off. The paged and the
// contiguous case of one storage type read the same K and V bytes and report them as the `bytes` rate counter;
// their ratio is the cost of the paging.
//
//   paged_decode<S>/block_size/interleaved/threads
//                                      paged_attention over a paged_kv_cache<S> (S float, or q8_0_block: an int8
//                                      pool) holding the 16 sequences, appended one after another (interleaved 0:
//                                      each sequence's blocks follow each other in the pool) or one block of each
//                                      in turn (1: as sequences that grow together during serving, no two blocks
//                                      of a sequence adjacent)
//   contiguous_decode/threads          the same sequences, each in its own contiguous tensors, one
//                                      scaled_dot_product_attention call per sequence (what a kv_cache per
//                                      sequence gives)
//   contiguous_decode_q8/threads       the same over a q8_kv_cache per sequence
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

#include <attend/paged_attention.hpp>
#include <attend/q8_cache.hpp>

#include "bench_common.hpp"

namespace {

using attend_bench::index_t;

constexpr index_t serving_sequences = 16, serving_heads = 32, serving_kv_heads = 8, serving_dim = 128;

index_t serving_length(index_t n) { return 512 + n * (8192 - 512) / (serving_sequences - 1); }

/// The 16 sequences' keys and values, each `[1, kv_heads, length, dim]`, and one query per sequence.
struct serving_problem {
    std::vector<attend::tensor<float, 4>> keys, values;
    attend::tensor<float, 4> q = attend_bench::random_tensor<float, 4>(7, {serving_sequences, serving_heads, 1,
                                                                           serving_dim});  // [sequences, heads, 1, dim]
    double bytes = 0;

    serving_problem() {
        for (index_t n = 0; n < serving_sequences; ++n) {
            const auto seed = static_cast<std::uint64_t>(2 * n);
            keys.push_back(
                attend_bench::random_tensor<float, 4>(seed, {1, serving_kv_heads, serving_length(n), serving_dim}));
            values.push_back(
                attend_bench::random_tensor<float, 4>(seed + 1, {1, serving_kv_heads, serving_length(n), serving_dim}));
            bytes += 2.0 * static_cast<double>(keys.back().size()) * sizeof(float);
        }
    }
};

attend::sdpa_options decode_options(int threads) {
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.threads = threads;
    o.check_finite = false;
    o.need_lse = false;
    return o;
}

/// The bytes one step reads of K and V stored as S: q8_0 holds 32 values in 34 bytes.
template <class S>
double stored_bytes(const serving_problem& p) {
    return std::is_same_v<S, attend::q8_0_block> ? p.bytes / sizeof(float) * 34.0 / 32.0 : p.bytes;
}

template <class S>
void paged_decode(benchmark::State& state) {
    const serving_problem p;
    const index_t block_size = state.range(0);
    index_t blocks = 0;
    for (index_t n = 0; n < serving_sequences; ++n) blocks += (serving_length(n) + block_size - 1) / block_size;
    attend::paged_cache_config c;
    c.kv_heads = serving_kv_heads;
    c.head_dim = serving_dim;
    c.block_size = block_size;
    c.blocks = blocks;
    c.max_sequences = serving_sequences;
    attend::paged_kv_cache<S> cache(c);
    std::vector<index_t> ids, ones(static_cast<std::size_t>(serving_sequences), 1);
    for (index_t n = 0; n < serving_sequences; ++n) ids.push_back(cache.add_sequence());
    const bool interleaved = state.range(1) != 0;
    const index_t step = interleaved ? block_size : serving_length(serving_sequences - 1);
    for (index_t at = 0; at < serving_length(serving_sequences - 1); at += step)
        for (index_t n = 0; n < serving_sequences; ++n) {
            const auto& k = p.keys[static_cast<std::size_t>(n)];
            const auto& v = p.values[static_cast<std::size_t>(n)];
            const index_t rows = std::min(step, k.dimension(2) - at);
            if (rows <= 0) continue;
            const std::array<index_t, 4> from{0, 0, at, 0}, size{1, serving_kv_heads, rows, serving_dim};
            cache.append(ids[static_cast<std::size_t>(n)], attend::tensor<float, 4>(k.slice(from, size)),
                         attend::tensor<float, 4>(v.slice(from, size)));
        }
    const auto o = decode_options(static_cast<int>(state.range(2)));
    for (auto _ : state) {
        const auto r = attend::paged_attention(p.q, cache, ids, ones, o);
        benchmark::DoNotOptimize(r.out.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_bytes(state, stored_bytes<S>(p));
}

/// The 16 queries `[1, heads, 1, dim]` and outputs of the contiguous cases.
struct per_sequence_queries {
    std::vector<attend::tensor<float, 4>> queries, outs;
    explicit per_sequence_queries(const serving_problem& p) {
        for (index_t n = 0; n < serving_sequences; ++n) {
            attend::tensor<float, 4> q(1, serving_heads, 1, serving_dim);
            for (index_t h = 0; h < serving_heads; ++h)
                for (index_t d = 0; d < serving_dim; ++d) q(0, h, 0, d) = p.q(n, h, 0, d);
            queries.push_back(q);
            outs.emplace_back(1, serving_heads, 1, serving_dim);
        }
    }
};

void contiguous_decode(benchmark::State& state) {
    const serving_problem p;
    per_sequence_queries s(p);
    const auto o = decode_options(static_cast<int>(state.range(0)));
    for (auto _ : state) {
        for (std::size_t n = 0; n < s.queries.size(); ++n)
            attend::scaled_dot_product_attention_into(s.queries[n], p.keys[n], p.values[n],
                                                      attend::causal(attend::alignment::bottom_right), o, s.outs[n]);
        benchmark::DoNotOptimize(s.outs.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_bytes(state, p.bytes);
}

void contiguous_decode_q8(benchmark::State& state) {
    const serving_problem p;
    per_sequence_queries s(p);
    std::vector<attend::q8_kv_cache> caches;
    for (index_t n = 0; n < serving_sequences; ++n) {
        caches.emplace_back(attend::kv_cache_config{}
                                .with_kv_heads(serving_kv_heads)
                                .with_capacity(serving_length(n))
                                .with_head_dim(serving_dim));
        caches.back().append(p.keys[static_cast<std::size_t>(n)], p.values[static_cast<std::size_t>(n)]);
    }
    const auto o = decode_options(static_cast<int>(state.range(0)));
    for (auto _ : state) {
        for (std::size_t n = 0; n < caches.size(); ++n)
            attend::scaled_dot_product_attention_into(s.queries[n], caches[n].keys(), caches[n].values(),
                                                      attend::causal(attend::alignment::bottom_right), o, s.outs[n]);
        benchmark::DoNotOptimize(s.outs.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_bytes(state, stored_bytes<attend::q8_0_block>(p));
}

}  // namespace

BENCHMARK_TEMPLATE(paged_decode, float)
    ->ArgNames({"block_size", "interleaved", "threads"})
    ->ArgsProduct({{16, 64, 256}, {0, 1}, {1, 2}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(paged_decode, attend::q8_0_block)
    ->ArgNames({"block_size", "interleaved", "threads"})
    ->ArgsProduct({{16, 64, 256}, {0, 1}, {1, 2}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(contiguous_decode)->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(contiguous_decode_q8)->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond)->UseRealTime();
