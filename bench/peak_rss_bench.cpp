// SPDX-License-Identifier: MIT
// Peak memory cases, fp32, H = 1, D = 64, 2 threads, once each, reporting the process's peak RSS (getrusage
// ru_maxrss) against the bytes of inputs and outputs. ru_maxrss is a high-water mark of the whole process, so run
// each case alone:
//   attend_bench --benchmark_filter='^peak_rss/'             forward, L = S = 65536, tiled kernel
//   attend_bench --benchmark_filter='^peak_rss_backward/'   backward, L = S = 32768, from the forward's out and lse
// Counters (MiB): rss_start (before the inputs exist), inputs_outputs (forward: q, k, v, out, lse; backward: also
// d_out, dq, dk, dv), peak_rss, and overhead = peak_rss - rss_start - inputs_outputs, which issue #4 (forward) and
// issue #5 (backward) bound by 64 MiB.
#include <benchmark/benchmark.h>

#include <sys/resource.h>

#include "bench_common.hpp"

namespace {

using attend_bench::index_t;

double peak_rss_mib() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

void report(benchmark::State& state, double start, double io_bytes) {
    const double peak = peak_rss_mib(), io = io_bytes / (1024.0 * 1024.0);
    state.counters["rss_start_MiB"] = start;
    state.counters["inputs_outputs_MiB"] = io;
    state.counters["peak_rss_MiB"] = peak;
    state.counters["overhead_MiB"] = peak - start - io;
}

/// Bytes of `count` fp32 tensors [1, 1, len, dim] plus `rows` lse values.
double tensor_bytes(index_t count, index_t len, index_t dim, index_t rows) {
    return static_cast<double>((count * len * dim + rows) * static_cast<index_t>(sizeof(float)));
}

/// q, k, v `[1, 1, len, dim]` (random), out (zero) and lse `[1, 1, len]` of a single-head call.
struct single_head {
    attend::tensor<float, 4> q, k, v, out;
    attend::tensor<float, 3> lse;
    single_head(index_t len, index_t dim)
        : q(attend_bench::random_tensor<float, 4>(1, {1, 1, len, dim})),
          k(attend_bench::random_tensor<float, 4>(2, {1, 1, len, dim})),
          v(attend_bench::random_tensor<float, 4>(3, {1, 1, len, dim})),
          out(1, 1, len, dim),
          lse(1, 1, len) {
        out.setZero();
        lse.setZero();
    }
};

attend::sdpa_options tiled_on_two_threads() {
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.threads = 2;
    return o;
}

void peak_rss(benchmark::State& state) {
    const index_t len = 65536, dim = 64;
    const double start = peak_rss_mib();
    single_head x(len, dim);
    auto& [q, k, v, out, lse] = x;
    const auto o = tiled_on_two_threads();
    for (auto _ : state) {
        attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, o, out, nullptr, lse);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    report(state, start, tensor_bytes(4, len, dim, len));
    attend_bench::set_flops(state, attend_bench::attention_flops(1, 1, len, len, dim));
}

void peak_rss_backward(benchmark::State& state) {
    const index_t len = 32768, dim = 64;
    const double start = peak_rss_mib();
    single_head x(len, dim);
    auto& [q, k, v, out, lse] = x;
    const auto d_out = attend_bench::random_tensor<float, 4>(4, {1, 1, len, dim});
    attend::tensor<float, 4> dq(1, 1, len, dim), dk(1, 1, len, dim), dv(1, 1, len, dim);
    dq.setZero();
    dk.setZero();
    dv.setZero();
    const auto o = tiled_on_two_threads();
    attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, o, out, nullptr, lse);
    for (auto _ : state) {
        attend::scaled_dot_product_attention_backward_into(q, k, v, attend::no_mask{}, out, lse, d_out, o, dq, dk, dv);
        benchmark::DoNotOptimize(dq.data());
        benchmark::ClobberMemory();
    }
    report(state, start, tensor_bytes(8, len, dim, len));
    attend_bench::set_flops(state, 2.5 * attend_bench::attention_flops(1, 1, len, len, dim));
}

}  // namespace

BENCHMARK(peak_rss)->Iterations(1)->Unit(benchmark::kSecond)->UseRealTime();
BENCHMARK(peak_rss_backward)->Iterations(1)->Unit(benchmark::kSecond)->UseRealTime();
