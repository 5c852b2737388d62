// peak_rss: L = S = 65536, H = 1, D = 64 fp32 through the tiled kernel on 2 threads, once, reporting the
// process's peak RSS (getrusage ru_maxrss) against the bytes of inputs and outputs. ru_maxrss is a high-water mark
// of the whole process, so run this case alone:
//   attend_bench --benchmark_filter=peak_rss
// Counters (MiB): rss_start (before the inputs exist), inputs_outputs (q, k, v, out, lse), peak_rss, and
// overhead = peak_rss - rss_start - inputs_outputs, which issue #4 bounds by 64 MiB.
#include <benchmark/benchmark.h>

#include <sys/resource.h>

#include "bench_common.hpp"

namespace {

using attend_bench::index;

double peak_rss_mib() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

void peak_rss(benchmark::State& state) {
    const index len = 65536, dim = 64;
    const double start = peak_rss_mib();
    const auto q = attend_bench::random_tensor<float, 4>(1, {1, 1, len, dim});
    const auto k = attend_bench::random_tensor<float, 4>(2, {1, 1, len, dim});
    const auto v = attend_bench::random_tensor<float, 4>(3, {1, 1, len, dim});
    attend::tensor<float, 4> out(1, 1, len, dim);
    attend::tensor<float, 3> lse(1, 1, len);
    out.setZero();
    lse.setZero();
    const double io = static_cast<double>((4 * len * dim + len) * static_cast<index>(sizeof(float))) / (1024.0 * 1024.0);
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.threads = 2;
    for (auto _ : state) {
        attend::scaled_dot_product_attention_into(q, k, v, attend::no_mask{}, out, o, nullptr, lse);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    const double peak = peak_rss_mib();
    state.counters["rss_start_MiB"] = start;
    state.counters["inputs_outputs_MiB"] = io;
    state.counters["peak_rss_MiB"] = peak;
    state.counters["overhead_MiB"] = peak - start - io;
    attend_bench::set_flops(state, attend_bench::attention_flops(1, 1, len, len, dim));
}

}  // namespace

BENCHMARK(peak_rss)->Iterations(1)->Unit(benchmark::kSecond)->UseRealTime();
