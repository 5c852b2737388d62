// SPDX-License-Identifier: MIT
// Backward cases of attend_bench (attend/backward.hpp): fp32, batch 1, 8 heads, head_dim 64, no mask;
// arguments are /query_len (= key_len)/threads. The `flops` rate counter counts 2.5 x the forward's 4 B H L S D:
// the five GEMMs of the backward (S = Q K^T, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q). Read it as a
// ratio to gemm_square<float>/L/threads in bench_main.cpp (Eigen sgemm, same binary, same thread count).
//
//   backward/L/threads          tiled backward (kernel::automatic), out and lse from one forward pass in setup
//   backward_causal/L/threads   causal(top_left): half the flops, counted as such
//   backward<bfloat16>/L/threads  backward's case with bf16 q, k, v, out and d_out (float lse), bf16 gradients
#include <benchmark/benchmark.h>

#include "bench_common.hpp"

namespace {

using attend_bench::index_t;

template <class T, class Mask>
void run_backward(benchmark::State& state, const Mask& mask, double flops_fraction) {
    const index_t len = state.range(0), heads = 8, dim = 64;
    const auto q = attend_bench::random_tensor<T, 4>(1, {1, heads, len, dim});
    const auto k = attend_bench::random_tensor<T, 4>(2, {1, heads, len, dim});
    const auto v = attend_bench::random_tensor<T, 4>(3, {1, heads, len, dim});
    const auto d_out = attend_bench::random_tensor<T, 4>(4, {1, heads, len, dim});
    attend::sdpa_options o;
    o.threads = static_cast<int>(state.range(1));
    o.need_lse = true;
    const auto forward = attend::scaled_dot_product_attention(q, k, v, mask, o);
    attend::tensor<T, 4> dq(q.dimensions()), dk(k.dimensions()), dv(v.dimensions());
    for (auto _ : state) {
        attend::scaled_dot_product_attention_backward_into(q, k, v, mask, forward.out, forward.lse, d_out, o, dq, dk,
                                                           dv);
        benchmark::DoNotOptimize(dq.data());
        benchmark::DoNotOptimize(dk.data());
        benchmark::DoNotOptimize(dv.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_flops(state, 2.5 * flops_fraction * attend_bench::attention_flops(1, heads, len, len, dim));
}

template <class T = float>
void backward(benchmark::State& state) {
    run_backward<T>(state, attend::no_mask{}, 1.0);
}

void backward_causal(benchmark::State& state) {
    run_backward<float>(state, attend::causal(attend::alignment::top_left), 0.5);
}

void lengths_and_threads(benchmark::internal::Benchmark* b) {
    for (int threads : {1, 2})
        for (int len : {1024, 2048}) b->Args({len, threads});
}

}  // namespace

BENCHMARK(backward)->Apply(lengths_and_threads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(backward, Eigen::bfloat16)
    ->Args({2048, 1})
    ->Args({2048, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(backward_causal)->Args({2048, 1})->Args({2048, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
