// SPDX-License-Identifier: MIT
#pragma once
// Helpers shared by the bench/*.cpp files of attend_bench.

#include <benchmark/benchmark.h>

#include <cstdint>

#include <attend/attend.hpp>

namespace attend_bench {

using attend::index_t;

/// A tensor of the given dims with values uniform in [-1, 1) (splitmix64, the same everywhere).
template <class T, int Rank>
attend::tensor<T, Rank> random_tensor(std::uint64_t seed, const std::array<index_t, Rank>& dims) {
    attend::tensor<T, Rank> t(dims);
    std::uint64_t s = seed;
    for (index_t n = 0; n < t.size(); ++n) {
        std::uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        z ^= z >> 31;
        const double x = static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0;
        t.data()[n] = static_cast<T>(static_cast<attend::accumulator_t<T>>(x));  // 16-bit types convert from float
    }
    return t;
}

/// Multiply-adds of attention counted as flops: 2 L S D for q k^T plus 2 L S Dv for P v, per (batch, head).
inline double attention_flops(index_t batch, index_t heads, index_t query_len, index_t key_len, index_t dim) {
    return 4.0 * static_cast<double>(batch * heads) * static_cast<double>(query_len) * static_cast<double>(key_len) *
           static_cast<double>(dim);
}

/// Reports `flops` per iteration as a rate counter (Google Benchmark prints it as flops/s, e.g. 95.1G/s).
inline void set_flops(benchmark::State& state, double flops_per_iteration) {
    state.counters["flops"] =
        benchmark::Counter(flops_per_iteration * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

/// Reports `bytes` per iteration as a rate counter.
inline void set_bytes(benchmark::State& state, double bytes_per_iteration) {
    state.counters["bytes"] =
        benchmark::Counter(bytes_per_iteration * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

}  // namespace attend_bench
