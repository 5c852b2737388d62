// SPDX-License-Identifier: MIT
// main() of attend_bench and its reference cases: Eigen GEMMs in this same binary (same compiler, same flags, same
// Eigen). Read attention timings as ratios to them, never as absolute times on a shared machine. Other bench/*.cpp
// files only register benchmarks.
//
//   reference_gemm/n                  C = A B, n x n floats (2 n^3 flops)
//   gemm_attention_shape<T>/L/threads the two products of attention per head, materialized: S = Q K^T [L x L],
//                                     then O = S V [L x D], B = 1, H = 8, D = 64: exactly 4 B H L S D flops, the
//                                     work the tiled kernel does. Threads split the heads (Eigen itself is
//                                     single-threaded without OpenMP).
//   gemm_square<T>/L/threads          one square GEMM per thread-share with the same total flop count, the best case
//                                     of Eigen's GEMM (cache-blocked, no tall-skinny operand)
#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

#include <Eigen/Core>

#include "bench_common.hpp"

namespace {

using attend_bench::index_t;
template <class T>
using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// C = A * B with A, B, C n x n floats: 2 n^3 flops per iteration.
void reference_gemm(benchmark::State& state) {
    const Eigen::Index n = state.range(0);
    const Eigen::MatrixXf a = Eigen::MatrixXf::Random(n, n);
    const Eigen::MatrixXf b = Eigen::MatrixXf::Random(n, n);
    Eigen::MatrixXf c(n, n);
    for (auto _ : state) {
        c.noalias() = a * b;
        benchmark::DoNotOptimize(c.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_flops(state, 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n));
}

template <class T>
void gemm_attention_shape(benchmark::State& state) {
    const index_t len = state.range(0), heads = 8, dim = 64;
    const int threads = static_cast<int>(state.range(1));
    std::vector<matrix<T>> q, k, v, o;
    for (index_t h = 0; h < heads; ++h) {
        q.push_back(matrix<T>::Random(len, dim));
        k.push_back(matrix<T>::Random(len, dim));
        v.push_back(matrix<T>::Random(len, dim));
        o.emplace_back(len, dim);
    }
    std::vector<matrix<T>> scores(static_cast<std::size_t>(threads), matrix<T>(len, len));
    for (auto _ : state) {
        attend::detail::parallel_for(heads, threads, [&](index_t h, int worker) {
            auto& s = scores[static_cast<std::size_t>(worker)];
            const auto u = static_cast<std::size_t>(h);
            s.noalias() = q[u] * k[u].transpose();
            o[u].noalias() = s * v[u];
        });
        benchmark::DoNotOptimize(o.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_flops(state, attend_bench::attention_flops(1, heads, len, len, dim));
}

template <class T>
void gemm_square(benchmark::State& state) {
    const index_t len = state.range(0), heads = 8, dim = 64;
    const int threads = static_cast<int>(state.range(1));
    // threads GEMMs of n^3 each with 2 threads n^3 = 4 H L^2 D.
    const double total = attend_bench::attention_flops(1, heads, len, len, dim);
    const auto n = static_cast<index_t>(std::lround(std::cbrt(total / (2.0 * threads))));
    std::vector<matrix<T>> a, b, c;
    for (int t = 0; t < threads; ++t) {
        a.push_back(matrix<T>::Random(n, n));
        b.push_back(matrix<T>::Random(n, n));
        c.emplace_back(n, n);
    }
    for (auto _ : state) {
        attend::detail::parallel_for(threads, threads, [&](index_t t, int) {
            const auto u = static_cast<std::size_t>(t);
            c[u].noalias() = a[u] * b[u];
        });
        benchmark::DoNotOptimize(c.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_flops(state,
                            2.0 * static_cast<double>(threads) * static_cast<double>(n * n) * static_cast<double>(n));
}

void lengths_and_threads(benchmark::internal::Benchmark* b) {
    for (int threads : {1, 2})
        for (int len : {1024, 2048, 4096}) b->Args({len, threads});
}

}  // namespace

BENCHMARK(reference_gemm)->Arg(512)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(gemm_attention_shape, float)
    ->Apply(lengths_and_threads)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(gemm_square, float)->Apply(lengths_and_threads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(gemm_attention_shape, double)
    ->Args({2048, 1})
    ->Args({2048, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(gemm_square, double)->Args({2048, 1})->Args({2048, 2})->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
