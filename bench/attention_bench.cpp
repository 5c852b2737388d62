// SPDX-License-Identifier: MIT
// Attention cases of attend_bench (issue #4). fp32, batch 1, 8 heads, head_dim 64 unless the name says otherwise;
// arguments are /query_len (= key_len)/threads. Every case has a `flops` rate counter (4 B H L S D, halved for
// causal, 4 B H L W D for a window of W keys) or, for decoding, a `bytes` rate counter (K + V bytes read).
//
//   reference_kernel<T>/L              the oracle kernel (single-threaded, materializes [L, S] per head)
//   tiled<T>/L/threads                 tiled kernel, no mask
//   tiled_causal/L/threads             causal(top_left)
//   tiled_window256/L/threads          sliding_window(255, 0, top_left): each query sees itself and 255 keys before it
//   tiled_softcap/L/threads            softcap 30 on the scores of tiled<float> (its cost: the ratio of the two)
//   alibi_builtin/L/threads            ALiBi as score_bias::alibi; alibi_score_mod/L/threads the same as a score_mod
//   mask_mod_window256/L/threads       tiled_window256's window as a mask_mod function with a block rule
//   packed_8x512/threads               8 sequences of 512 packed in 4096, packed_segments (skips cross tiles)
//   packed_8x512_dense_mask/threads    the same as a dense block-diagonal allowed_mask [4096, 4096]
//   tiled_tiles/query_rows/key_tile/shared_blocks  tile-size sweep at L = 2048, D = 64, 1 thread (how
//                                      default_tile_config was chosen); shared_blocks query blocks per packed tile
//   decode/threads/check_finite        L = 1, S = 8192, 32 query heads on 8 kv heads, D = 128 (GQA decoding)
//   decode_storage<KV>/threads/check_finite  the same, float queries over K and V stored as KV (a 16-bit cache);
//                                      its `bytes` counter counts KV's bytes
//   decode_short/threads/check_finite  decode's case over 1024 keys (one decode chunk)
//   decode_short_storage<KV>/threads/check_finite  the same over K and V stored as KV: from cache, what the
//                                      widening costs without the wait for memory
//   decode_q8/threads/check_finite     decode's case over an int8 cache (q8_kv_cache, ggml's q8_0 blocks); `bytes`
//                                      counts its blocks (34 bytes per 32 values)
//   decode_short_q8/threads/check_finite  decode_q8's case over 1024 keys
//   decode_q4/threads/check_finite     the same over an int4 cache (q4_kv_cache, ggml's q4_0: 18 bytes per 32)
//   call_overhead/check_finite         one query of one head over 16 keys, D = 64, 1 thread: a call's fixed cost
//   tiled<half>, tiled<bfloat16>       tiled<float>'s case with q, k, v and out in 16 bits, float accumulation
//   stream_kv/threads                  the same K and V read once, summed: the bandwidth decode is held to
//   append<Cache>                      a prefill's keys and values (8 kv heads, 2048 positions, D = 128, fp32) into
//                                      an empty kv_cache<float>, q8_kv_cache or q4_kv_cache (checks, quantization):
//                                      `bytes` counts
//                                      the fp32 input read
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <vector>

#include <Eigen/Core>

#include "bench_common.hpp"

namespace {

using attend_bench::index_t;

/// q and out in T, k and v in KV.
template <class T, class KV = T>
struct problem {
    attend::tensor<T, 4> q;
    attend::tensor<KV, 4> k, v;
    attend::tensor<T, 4> out;
    problem(index_t heads, index_t kv_heads, index_t query_len, index_t key_len, index_t dim)
        : q(attend_bench::random_tensor<T, 4>(1, {1, heads, query_len, dim})),
          k(attend_bench::random_tensor<KV, 4>(2, {1, kv_heads, key_len, dim})),
          v(attend_bench::random_tensor<KV, 4>(3, {1, kv_heads, key_len, dim})),
          out(1, heads, query_len, dim) {}
};

template <class T, class KV, class Mask>
void run_tiled(benchmark::State& state, problem<T, KV>& p, const Mask& mask, int threads, double flops,
               attend::sdpa_options o = {}) {
    o.kernel = attend::kernel::tiled;
    o.threads = threads;
    for (auto _ : state) {
        attend::scaled_dot_product_attention_into(p.q, p.k, p.v, mask, o, p.out);
        benchmark::DoNotOptimize(p.out.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_flops(state, flops);
}

template <class T>
void reference_kernel(benchmark::State& state) {
    const index_t len = state.range(0);
    problem<T> p(8, 8, len, len, 64);
    attend::sdpa_options o;
    o.kernel = attend::kernel::reference;
    for (auto _ : state) {
        attend::scaled_dot_product_attention_into(p.q, p.k, p.v, attend::no_mask{}, o, p.out);
        benchmark::DoNotOptimize(p.out.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_flops(state, attend_bench::attention_flops(1, 8, len, len, 64));
}

template <class T>
void tiled(benchmark::State& state) {
    const index_t len = state.range(0);
    problem<T> p(8, 8, len, len, 64);
    run_tiled(state, p, attend::no_mask{}, static_cast<int>(state.range(1)),
              attend_bench::attention_flops(1, 8, len, len, 64));
}

void tiled_causal(benchmark::State& state) {
    const index_t len = state.range(0);
    problem<float> p(8, 8, len, len, 64);
    run_tiled(state, p, attend::causal(attend::alignment::top_left), static_cast<int>(state.range(1)),
              attend_bench::attention_flops(1, 8, len, len, 64) / 2);
}

void tiled_window256(benchmark::State& state) {
    const index_t len = state.range(0);
    problem<float> p(8, 8, len, len, 64);
    run_tiled(state, p, attend::sliding_window(255, 0, attend::alignment::top_left), static_cast<int>(state.range(1)),
              attend_bench::attention_flops(1, 8, len, 256, 64));
}

/// Soft-capping at 30 (Gemma 2 uses 50): the same work as tiled<float> plus a tanh per score.
void tiled_softcap(benchmark::State& state) {
    const index_t len = state.range(0);
    problem<float> p(8, 8, len, len, 64);
    attend::sdpa_options o;
    o.softcap = 30.0;
    run_tiled(state, p, attend::no_mask{}, static_cast<int>(state.range(1)),
              attend_bench::attention_flops(1, 8, len, len, 64), o);
}

/// tiled_window256's window as a mask_mod function with its exact block rule: what a user's function costs over
/// the built-in rule.
void mask_mod_window256(benchmark::State& state) {
    const index_t len = state.range(0);
    problem<float> p(8, 8, len, len, 64);
    constexpr index_t left = 255;
    const auto allowed = [](index_t, index_t, index_t i, index_t j) { return j <= i && j >= i - left; };
    const auto blocks = [](const attend::tile& t) {
        if (t.key_begin > t.query_end - 1 || t.key_end - 1 < t.query_begin - left) return attend::tile_class::empty;
        if (t.key_end - 1 <= t.query_begin && t.key_begin >= t.query_end - 1 - left) return attend::tile_class::full;
        return attend::tile_class::mixed;
    };
    run_tiled(state, p, attend::mask_mod(allowed, blocks), static_cast<int>(state.range(1)),
              attend_bench::attention_flops(1, 8, len, 256, 64));
}

/// ALiBi (top-left) at L = S, built in (score_bias) or as a score_mod function: what a user's function costs.
void alibi(benchmark::State& state, bool as_function) {
    const index_t len = state.range(0);
    problem<float> p(8, 8, len, len, 64);
    const std::vector<double> slopes = attend::alibi_slopes(8);
    attend::sdpa_options o;
    if (as_function)
        o.score_mod = attend::score_mod([slopes](auto s, auto, auto h, auto i, auto j) {
            using S = decltype(s);
            return s - static_cast<S>(slopes[static_cast<std::size_t>(h)]) * static_cast<S>(std::abs(i - j));
        });
    else o.score_bias = attend::score_bias::alibi(slopes, attend::alignment::top_left);
    run_tiled(state, p, attend::no_mask{}, static_cast<int>(state.range(1)),
              attend_bench::attention_flops(1, 8, len, len, 64), o);
}
void alibi_builtin(benchmark::State& state) { alibi(state, false); }
void alibi_score_mod(benchmark::State& state) { alibi(state, true); }

constexpr index_t packed_segments_count = 8, packed_segment_len = 512;

/// Eight sequences of 512 packed into one 4096 axis, as packed_segments; flops of the work inside the segments.
void packed_8x512(benchmark::State& state) {
    const index_t len = packed_segments_count * packed_segment_len;
    problem<float> p(8, 8, len, len, 64);
    std::vector<index_t> offsets;
    for (index_t n = 0; n <= packed_segments_count; ++n) offsets.push_back(n * packed_segment_len);
    run_tiled(state, p, attend::packed_segments(attend::segment_offsets(offsets), attend::segment_offsets(offsets)),
              static_cast<int>(state.range(0)), attend_bench::attention_flops(1, 8, len, packed_segment_len, 64));
}

/// The same packing as a dense block-diagonal allowed_mask `[4096, 4096]` (what packing costs without the rule).
void packed_8x512_dense_mask(benchmark::State& state) {
    const index_t len = packed_segments_count * packed_segment_len;
    problem<float> p(8, 8, len, len, 64);
    attend::tensor<bool, 2> allowed(len, len);
    for (index_t i = 0; i < len; ++i)
        for (index_t j = 0; j < len; ++j) allowed(i, j) = i / packed_segment_len == j / packed_segment_len;
    run_tiled(state, p, attend::allowed_mask::query_key_grid(allowed), static_cast<int>(state.range(0)),
              attend_bench::attention_flops(1, 8, len, packed_segment_len, 64));
}

void tiled_tiles(benchmark::State& state) {
    const index_t len = 2048;
    problem<float> p(8, 8, len, len, 64);
    const auto qv = attend::detail::as_view(p.q), kv = attend::detail::as_view(p.k), vv = attend::detail::as_view(p.v);
    const auto s = attend::check_shapes(p.q, p.k, p.v);
    attend::sdpa_options o;
    const auto call = attend::detail::check_call(qv, kv, vv, s, attend::no_mask{}, o);
    attend::detail::tile_config tiles;
    tiles.query_rows = state.range(0);
    tiles.key_tile = state.range(1);
    tiles.shared_blocks = state.range(2);
    attend::detail::attention_outputs<float> out;
    out.out = attend::detail::as_mutable_view(p.out);
    for (auto _ : state) {
        attend::detail::tiled_attention(qv, kv, vv, s, call.mask, call.params, out, 1, tiles);
        benchmark::DoNotOptimize(p.out.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_flops(state, attend_bench::attention_flops(1, 8, len, len, 64));
}

constexpr index_t decode_heads = 32, decode_kv_heads = 8, decode_keys = 8192, decode_dim = 128;
constexpr double decode_kv_bytes = 2.0 * decode_kv_heads * decode_keys * decode_dim * sizeof(float);

/// decode's case over `keys` keys, K and V stored as KV.
template <class KV>
void decode_over(benchmark::State& state, index_t keys) {
    problem<float, KV> p(decode_heads, decode_kv_heads, 1, keys, decode_dim);
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.threads = static_cast<int>(state.range(0));
    o.check_finite = state.range(1) != 0;  // the NaN/Inf scan of q, k, v is itself one full read of K and V
    for (auto _ : state) {
        attend::scaled_dot_product_attention_into(p.q, p.k, p.v, attend::causal(attend::alignment::bottom_right), o,
                                                  p.out);
        benchmark::DoNotOptimize(p.out.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_bytes(state,
                            decode_kv_bytes * static_cast<double>(keys) / decode_keys * sizeof(KV) / sizeof(float));
    attend_bench::set_flops(state, attend_bench::attention_flops(1, decode_heads, 1, keys, decode_dim));
}

template <class KV>
void decode_storage(benchmark::State& state) {
    decode_over<KV>(state, decode_keys);
}

void decode(benchmark::State& state) { decode_over<float>(state, decode_keys); }

/// A short context: 1024 keys, one decode chunk (8 MiB of K and V, in the last-level cache of most servers).
void decode_short(benchmark::State& state) { decode_over<float>(state, 1024); }
template <class KV>
void decode_short_storage(benchmark::State& state) {
    decode_over<KV>(state, 1024);
}

/// What a call costs besides its reads and products: checks, workspaces, the runner's set-up (a small model's
/// decode pays it per layer and token).
void call_overhead(benchmark::State& state) {
    problem<float> p(1, 1, 1, 16, 64);
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.threads = 1;
    o.check_finite = state.range(0) != 0;
    for (auto _ : state) {
        attend::scaled_dot_product_attention_into(p.q, p.k, p.v, attend::no_mask{}, o, p.out);
        benchmark::DoNotOptimize(p.out.data());
        benchmark::ClobberMemory();
    }
}

/// decode's case over `keys` keys of a quantized cache.
template <class Block>
void decode_quantized(benchmark::State& state, index_t keys = decode_keys) {
    problem<float> p(decode_heads, decode_kv_heads, 1, keys, decode_dim);
    attend::quantized_kv_cache<Block> cache(
        attend::kv_cache_config{}.with_kv_heads(decode_kv_heads).with_capacity(keys).with_head_dim(decode_dim));
    cache.append(p.k, p.v);
    attend::sdpa_options o;
    o.kernel = attend::kernel::tiled;
    o.threads = static_cast<int>(state.range(0));
    o.check_finite = state.range(1) != 0;
    for (auto _ : state) {
        attend::scaled_dot_product_attention_into(p.q, cache.keys(), cache.values(),
                                                  attend::causal(attend::alignment::bottom_right), o, p.out);
        benchmark::DoNotOptimize(p.out.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_bytes(state, decode_kv_bytes * static_cast<double>(keys) / decode_keys *
                                       static_cast<double>(sizeof(Block)) / 128.0);
    attend_bench::set_flops(state, attend_bench::attention_flops(1, decode_heads, 1, keys, decode_dim));
}
void decode_q8(benchmark::State& state) { decode_quantized<attend::q8_0_block>(state); }
void decode_short_q8(benchmark::State& state) { decode_quantized<attend::q8_0_block>(state, 1024); }
void decode_q4(benchmark::State& state) { decode_quantized<attend::q4_0_block>(state); }

/// A prefill's keys and values appended to an empty cache, as a server fills one per layer: checks and copy (float)
/// or quantization (q8_0).
template <class Cache>
void append(benchmark::State& state) {
    const index_t kv_heads = 8, len = 2048, dim = 128;
    problem<float> p(kv_heads, kv_heads, 1, len, dim);
    Cache cache(attend::kv_cache_config{}.with_kv_heads(kv_heads).with_capacity(len).with_head_dim(dim));
    for (auto _ : state) {
        cache.clear();
        cache.append(p.k, p.v);
        benchmark::ClobberMemory();
    }
    attend_bench::set_bytes(state, 2.0 * kv_heads * len * dim * sizeof(float));
}

void stream_kv(benchmark::State& state) {
    problem<float> p(decode_heads, decode_kv_heads, 1, decode_keys, decode_dim);
    const int threads = static_cast<int>(state.range(0));
    const index_t parts = 64, n = p.k.size() / parts;
    std::vector<float> sums(static_cast<std::size_t>(2 * parts));
    for (auto _ : state) {
        attend::detail::parallel_for(2 * parts, threads, [&](index_t u, int) {
            const float* base = (u < parts ? p.k.data() : p.v.data()) + (u % parts) * n;
            sums[static_cast<std::size_t>(u)] = Eigen::Map<const Eigen::ArrayXf>(base, n).sum();
        });
        benchmark::DoNotOptimize(sums.data());
        benchmark::ClobberMemory();
    }
    attend_bench::set_bytes(state, decode_kv_bytes);
}

void lengths_and_threads(benchmark::internal::Benchmark* b) {
    for (int threads : {1, 2})
        for (int len : {1024, 2048, 4096}) b->Args({len, threads});
}

}  // namespace

BENCHMARK_TEMPLATE(reference_kernel, float)->Arg(1024)->Arg(2048)->Arg(4096)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(tiled, float)->Apply(lengths_and_threads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(tiled_causal)->Apply(lengths_and_threads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(reference_kernel, double)->Arg(2048)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(tiled, double)->Args({2048, 1})->Args({2048, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(tiled_window256)
    ->Args({4096, 1})
    ->Args({16384, 1})
    ->Args({16384, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(tiled, float)->Args({16384, 1})->Args({16384, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(tiled_softcap)->Args({2048, 1})->Args({2048, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(alibi_builtin)->Args({2048, 1})->Args({2048, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(alibi_score_mod)->Args({2048, 1})->Args({2048, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(mask_mod_window256)->Apply(lengths_and_threads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(packed_8x512)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(packed_8x512_dense_mask)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(tiled_tiles)
    ->ArgsProduct({{32, 64, 128, 256}, {128, 256, 512, 1024}, {1, 8}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(decode)
    ->ArgNames({"threads", "check_finite"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(decode_short)
    ->ArgNames({"threads", "check_finite"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(decode_short_storage, Eigen::bfloat16)
    ->ArgNames({"threads", "check_finite"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(call_overhead)->ArgName("check_finite")->Arg(0)->Arg(1)->Unit(benchmark::kNanosecond);
BENCHMARK(stream_kv)->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(decode_storage, Eigen::bfloat16)
    ->ArgNames({"threads", "check_finite"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(decode_storage, Eigen::half)
    ->ArgNames({"threads", "check_finite"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(decode_q8)
    ->ArgNames({"threads", "check_finite"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(decode_short_q8)
    ->ArgNames({"threads", "check_finite"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(decode_q4)
    ->ArgNames({"threads", "check_finite"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(append, attend::kv_cache<float>)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(append, attend::q8_kv_cache)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(append, attend::q4_kv_cache)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(tiled, Eigen::bfloat16)
    ->Args({2048, 1})
    ->Args({2048, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(tiled, Eigen::half)->Args({2048, 1})->Args({2048, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
