// SPDX-License-Identifier: MIT
// fma_peak<T>/threads: the core's fused multiply-add throughput as this binary's compiler flags can reach it, so
// every flop rate of attend_bench can be read as a fraction of the machine's peak. Twelve independent
// accumulators of Eigen's widest packet (AVX-512: 16 floats) per thread hide the FMA latency (4 cycles, 2 ports);
// 2 flops per lane per FMA.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include <Eigen/Core>

#include "bench_common.hpp"

namespace {

template <class T>
void fma_peak(benchmark::State& state) {
    using packet = typename Eigen::internal::packet_traits<T>::type;
    constexpr int lanes = Eigen::internal::packet_traits<T>::size;
    constexpr int chains = 12;
    constexpr std::int64_t steps = 1 << 16;
    const int threads = static_cast<int>(state.range(0));
    std::vector<T> sink(static_cast<std::size_t>(threads * lanes), T(0));
    for (auto _ : state) {
        attend::detail::parallel_for(threads, threads, [&](attend_bench::index_t worker, int) {
            const packet a = Eigen::internal::pset1<packet>(T(0.999999));
            const packet b = Eigen::internal::pset1<packet>(T(1e-7));
            packet acc[chains];  // a plain array: std::array<packet> drops the packet's vector attributes
            for (int c = 0; c < chains; ++c) acc[c] = Eigen::internal::pset1<packet>(T(c));
            for (std::int64_t s = 0; s < steps; ++s)
                for (int c = 0; c < chains; ++c) acc[c] = Eigen::internal::pmadd(acc[c], a, b);
            packet total = acc[0];
            for (int c = 1; c < chains; ++c) total = Eigen::internal::padd(total, acc[c]);
            Eigen::internal::pstoreu(sink.data() + worker * lanes, total);
        });
        benchmark::DoNotOptimize(sink.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_flops(state, 2.0 * lanes * chains * static_cast<double>(steps) * threads);
    state.counters["lanes"] = lanes;
}

}  // namespace

BENCHMARK_TEMPLATE(fma_peak, float)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(fma_peak, double)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
