#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""Times PyTorch's CPU attention on the shapes of attend_bench, for side-by-side ratios in bench/README.md.

Run with a python3 that has torch: PyTorch 2.x (the public F.scaled_dot_product_attention, CPU flash attention
for float32; bench/peers/ installs it into a virtual environment) or Debian's torch 1.13:

    python3 bench/compare_pytorch.py --json /tmp/pytorch.json

PyTorch 1.13 has no public scaled_dot_product_attention (it arrived in 2.0); it has the private
torch.nn.functional._scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, need_attn_weights, is_causal),
which on CPU runs the math path (materialized softmax(q k^T * scale) v with a bmm). Both that entry point ("sdpa")
and the explicit math expression ("math") are timed; the script prints which entry point was found. Timing: best
of `--repeats` runs after a warm-up, each run timed with time.perf_counter around one call, fp32 unless noted,
torch.set_num_threads(1 or 2), inference mode. A case whose first call takes over 5 s is timed by that call alone.

Backward ("backward/L"): autograd through the math path, the only differentiable attention of 1.13 on CPU:
out = softmax(q k^T * scale) v with q, k, v requiring grad, timed around out.backward(d_out) (the forward runs
outside the timed region, as attend_bench's backward cases get out and lse from setup). Its `gflops` counts
2.5 x the forward's 4 B H L S D, the convention of attend_bench's backward cases.

Debian's torch 1.13 links the reference (netlib) libblas.so.3 unless another BLAS is installed as the alternative
(`update-alternatives --display libblas.so.3-x86_64-linux-gnu`), so its matmuls, and with them its attention,
run at well under 1 GFLOP/s: the script prints the BLAS it finds so that the ratios are read with that in mind.
"""

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

# PyTorch >= 2.0: the public entry point (CPU flash attention for float32); 1.13: the private one, which also
# returns the weights.
PUBLIC_SDPA = getattr(F, "scaled_dot_product_attention", None)
SDPA = PUBLIC_SDPA or getattr(F, "_scaled_dot_product_attention", None)
SDPA_NAME = ("torch.nn.functional.scaled_dot_product_attention" if PUBLIC_SDPA
             else "torch.nn.functional._scaled_dot_product_attention")


TIME_MATH = True


def blas():
    import os
    for path in ("/etc/alternatives/libblas.so.3-x86_64-linux-gnu",):
        if os.path.exists(path):
            return os.path.realpath(path)
    return torch.__config__.show().split("BLAS_INFO=")[-1].split(",")[0]


def flops(b, h, l, s, d, causal=False):
    f = 4.0 * b * h * l * s * d
    return f / 2 if causal else f


def best_time(fn, repeats):
    t0 = time.perf_counter()
    fn()  # warm-up (allocator, thread pool)
    first = time.perf_counter() - t0
    if first > 5.0:  # a call of seconds needs no warm-up; timing it again would take minutes
        return first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def case(name, b, h, l, s, d, threads, dtype=torch.float32, causal=False, kv_heads=None, repeats=5):
    torch.set_num_threads(threads)
    kv_heads = kv_heads or h
    g = torch.Generator().manual_seed(0)
    q = torch.rand(b, h, l, d, generator=g, dtype=dtype) * 2 - 1
    k = torch.rand(b, kv_heads, s, d, generator=g, dtype=dtype) * 2 - 1
    v = torch.rand(b, kv_heads, s, d, generator=g, dtype=dtype) * 2 - 1
    if kv_heads != h:  # 1.13 has no GQA: repeat the kv heads, as users of 1.13 had to
        k = k.repeat_interleave(h // kv_heads, dim=1)
        v = v.repeat_interleave(h // kv_heads, dim=1)
    scale = 1.0 / math.sqrt(d)
    mask = torch.ones(l, s, dtype=torch.bool).tril() if causal else None

    def math_path():
        scores = (q @ k.transpose(-2, -1)) * scale
        if causal:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    def sdpa_path():
        if PUBLIC_SDPA:
            return PUBLIC_SDPA(q, k, v, is_causal=causal)
        return SDPA(q, k, v, None, 0.0, False, causal)

    results = []
    with torch.inference_mode():
        paths = [("math", math_path)] if TIME_MATH or SDPA is None else []
        if SDPA is not None:
            paths.insert(0, ("sdpa", sdpa_path))
        for path, fn in paths:
            t = best_time(fn, repeats)
            results.append({"name": name, "path": path, "batch": b, "heads": h, "kv_heads": kv_heads,
                            "query_len": l, "key_len": s, "head_dim": d, "threads": threads,
                            "blas": blas(), "dtype": str(dtype).replace("torch.", ""), "causal": causal, "seconds": t,
                            "gflops": flops(b, h, l, s, d, causal) / t / 1e9,
                            "kv_gbytes_per_s": 2 * b * kv_heads * s * d * q.element_size() / t / 1e9})
            print(f"{name:28s} {path:5s} threads {threads}  {t * 1e3:10.3f} ms  "
                  f"{results[-1]['gflops']:7.2f} GFLOP/s", flush=True)
    return results


def backward_case(name, b, h, l, s, d, threads, repeats=3):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.rand(b, h, n, d, generator=g) * 2 - 1 for n in (l, s, s, l))
    scale = 1.0 / math.sqrt(d)
    times = []
    for _ in range(repeats + 1):  # the first run is the warm-up
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = torch.softmax((qq @ kk.transpose(-2, -1)) * scale, dim=-1) @ vv
        t0 = time.perf_counter()
        out.backward(d_out)
        times.append(time.perf_counter() - t0)
        if times[0] > 5.0:  # seconds per call: one timed call is enough
            break
    t = min(times[1:]) if len(times) > 1 else times[0]
    result = {"name": name, "path": "autograd_math", "batch": b, "heads": h, "kv_heads": h, "query_len": l,
              "key_len": s, "head_dim": d, "threads": threads, "blas": blas(), "dtype": "float32", "causal": False,
              "seconds": t, "gflops": 2.5 * flops(b, h, l, s, d) / t / 1e9}
    print(f"{name:28s} autograd threads {threads}  {t * 1e3:10.3f} ms  {result['gflops']:7.2f} GFLOP/s", flush=True)
    return [result]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-math", action="store_true", help="time the sdpa entry point only")
    parser.add_argument("--backward-lengths", type=int, nargs="*", default=[1024, 2048],
                        help="L = S of the autograd backward cases (none: skip them)")
    parser.add_argument("--forward", action=argparse.BooleanOptionalAction, default=True,
                        help="time the forward cases (--no-forward: backward only)")
    args = parser.parse_args()
    global TIME_MATH
    TIME_MATH = not args.no_math
    print(f"torch {torch.__version__}; entry point: "
          f"{SDPA_NAME if SDPA else 'none (math path only)'}; "
          f"BLAS: {blas()}")
    out = []
    for threads in args.threads:
        for length in args.backward_lengths:
            out += backward_case(f"backward/{length}", 1, 8, length, length, 64, threads)
        if not args.forward:
            continue
        for length in args.lengths:
            out += case(f"noncausal/{length}", 1, 8, length, length, 64, threads, repeats=args.repeats)
            out += case(f"causal/{length}", 1, 8, length, length, 64, threads, causal=True, repeats=args.repeats)
        out += case("double/2048", 1, 8, 2048, 2048, 64, threads, dtype=torch.float64, repeats=args.repeats)
        out += case("decode", 1, 32, 1, 8192, 128, threads, kv_heads=8, repeats=20)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__,
                       "entry_point": SDPA_NAME if SDPA else None,
                       "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
