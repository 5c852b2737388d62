// SPDX-License-Identifier: MIT
// Prefill cases timed next to ONNX Runtime and PyTorch by bench/peers/compare.py (decode reuses `decode` of
// attention_bench.cpp). fp32, batch 1, 8 heads (q, k and v), query_len = key_len = L, head_dim D, through the public
// scaled_dot_product_attention_into with the default (tiled) kernel. check_finite is off: the peers do not scan their
// inputs either (the scan is O(L D) against O(L^2 D) of attention, so it hardly matters here).
//
//   prefill<float>/L:L/D:D/threads:T/causal:C   C = 1: causal(top_left); flops 4 H L^2 D, halved for causal
//   prefill<Eigen::half>/..., prefill<Eigen::bfloat16>/...   the same with q, k, v and out in 16 bits (L = 2048,
//                                                D = 64), float accumulation
#include <benchmark/benchmark.h>

#include "bench_common.hpp"

namespace {

using attend_bench::index_t;

template <class T>
void prefill(benchmark::State& state) {
    const index_t len = state.range(0), dim = state.range(1), heads = 8;
    const bool causal = state.range(3) != 0;
    const auto q = attend_bench::random_tensor<T, 4>(1, {1, heads, len, dim});
    const auto k = attend_bench::random_tensor<T, 4>(2, {1, heads, len, dim});
    const auto v = attend_bench::random_tensor<T, 4>(3, {1, heads, len, dim});
    attend::tensor<T, 4> out(1, heads, len, dim);
    attend::sdpa_options o;
    o.threads = static_cast<int>(state.range(2));
    o.check_finite = false;
    for (auto _ : state) {
        if (causal)
            attend::scaled_dot_product_attention_into(q, k, v, attend::causal(attend::alignment::top_left), o, out);
        else attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, o, out);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_flops(state, attend_bench::attention_flops(1, heads, len, len, dim) / (causal ? 2 : 1));
}

}  // namespace

BENCHMARK_TEMPLATE(prefill, float)
    ->ArgNames({"L", "D", "threads", "causal"})
    ->ArgsProduct({{256, 1024, 2048, 4096}, {64, 128}, {1, 2}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(prefill, Eigen::half)
    ->ArgNames({"L", "D", "threads", "causal"})
    ->ArgsProduct({{2048}, {64}, {1, 2}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(prefill, Eigen::bfloat16)
    ->ArgNames({"L", "D", "threads", "causal"})
    ->ArgsProduct({{2048}, {64}, {1, 2}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
