# SPDX-License-Identifier: MIT
"""Times attend next to ONNX Runtime and PyTorch 2.x attention on CPU, in one process and one sitting.

Run with the interpreter of the environment that bench/peers/setup makes:

    "${ATTEND_PEERS_VENV:-$HOME/.cache/attend-peers-venv}/bin/python" bench/peers/compare.py \
        --attend-bench build/bench/bench/attend_bench [--quick] [--filter REGEX] [--json out.json] [--verify]

Implementations (all take q, k, v already in their preferred layout; layout changes are not timed):
  attend        attend_bench's `prefill<float>/...` and `decode/...` cases (scaled_dot_product_attention_into),
                run as a subprocess per case; the median of its repetitions
  ort-mha       ONNX Runtime com.microsoft MultiHeadAttention, q/k/v [B, S, N*H] (BSNH), causal = unidirectional=1
  ort-attn23    ONNX Runtime opset-23 Attention, q/k/v [B, N, S, H] (BNSH), is_causal; GQA by kv heads < q heads
  ort-gqa       ONNX Runtime com.microsoft GroupQueryAttention (decode): the new token's k/v plus past_key/past_value
                [B, kv_heads, max_seq, H], seqlens_k = total - 1; present_* bound to the past buffers (no copy)
  torch-sdpa    torch.nn.functional.scaled_dot_product_attention, [B, N, S, H], is_causal, enable_gqa for decode;
                restricted to the CPU flash kernel, the default dispatch if flash rejects the case (noted)
  torch-sdpa-fold  decode only: the same call with q reshaped to [B, kv_heads, group, H], the 4 query heads of a kv
                head as 4 query rows (no enable_gqa; exact for L = 1), much faster than enable_gqa on CPU
  torch-flex    packed only: FlexAttention under torch.compile with a document mask_mod and its block mask, which
                skips the blocks between segments (PyTorch's own way to attend within packed sequences); softcap
                only: FlexAttention with the score_mod c tanh(s / c)
Soft-capped cases: L = S = 2048, D = 64, fp32, c tanh(s / c) with c = 30 on the scaled scores (Gemma 2). attend runs
`tiled_softcap`; ort-attn23 takes its `softcap` attribute; torch-flex a score_mod (SDPA has no soft-capping).
Packed cases: 8 sequences of 512 in one axis of 4096. attend runs `packed_8x512` (packed_segments, which skips the
tiles between segments) and `packed_8x512_dense_mask` (the same as a dense block-diagonal allowed_mask); the
dense peers take that block-diagonal mask as it is, dense: ort-mha an additive attention_bias [1, 1, 4096, 4096] of
0 and -inf, ort-attn23 and torch-sdpa a Boolean attn_mask [4096, 4096] (true = attend).
Every ONNX Runtime case is a one-node model run through IO binding (inputs and outputs bound once), with
intra_op_num_threads = threads and inter_op_num_threads = 1; torch runs under torch.set_num_threads(threads).
Each peer timing: warm-up calls, then the median of single calls, at least --min-runs and --min-time seconds.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

ONNX_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
NUMPY_TYPES = {"fp32": np.float32, "fp16": np.float16}
TORCH_TYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Which peer runs which kind of case.
PEERS = {"ort-mha": ("prefill", "packed"), "ort-attn23": ("prefill", "decode", "packed", "softcap"),
         "ort-gqa": ("decode",), "torch-sdpa": ("prefill", "decode", "packed"), "torch-sdpa-fold": ("decode",),
         "torch-flex": ("packed", "softcap")}


class Unsupported(Exception):
    """The peer rejects this case (operator, dtype or attribute); the message says why."""


@dataclass(frozen=True)
class Case:
    kind: str  # "prefill", "decode" or "packed"
    dtype: str
    query_len: int
    key_len: int
    dim: int
    threads: int
    causal: bool = False
    heads: int = 8
    kv_heads: int = 8
    segments: int = 0  # packed: sequences of key_len / segments each, attending only within themselves
    softcap: float = 0.0  # softcap: c of c tanh(s / c) on the scaled scores

    @property
    def name(self):
        if self.kind == "packed":
            return f"packed/{self.dtype}/{self.segments}x{self.key_len // self.segments}/D{self.dim}/t{self.threads}"
        if self.kind == "decode":
            return f"decode/{self.dtype}/S{self.key_len}/D{self.dim}/H{self.heads}-{self.kv_heads}/t{self.threads}"
        if self.kind == "softcap":
            return f"softcap/{self.dtype}/L{self.query_len}/D{self.dim}/c{self.softcap:g}/t{self.threads}"
        mask = "causal" if self.causal else "full"
        return f"prefill/{self.dtype}/L{self.query_len}/D{self.dim}/{mask}/t{self.threads}"

    @property
    def group(self):
        if self.kind == "packed":
            return f"packed {self.dtype}, block-diagonal"
        if self.kind == "decode":
            return f"decode {self.dtype}"
        if self.kind == "softcap":
            return f"prefill {self.dtype} non-causal, soft-capped"
        return f"prefill {self.dtype} {'causal' if self.causal else 'non-causal'}"


def prefill(dtype, length, dim, threads, causal):
    return Case("prefill", dtype, length, length, dim, threads, causal)


def decode(dtype, threads):
    return Case("decode", dtype, 1, 8192, 128, threads, heads=32, kv_heads=8)


def packed(threads):
    return Case("packed", "fp32", 4096, 4096, 64, threads, segments=8)


def softcapped(threads):
    return Case("softcap", "fp32", 2048, 2048, 64, threads, softcap=30.0)


def all_cases(quick):
    if quick:
        return [prefill("fp32", 1024, 64, t, c) for c in (False, True) for t in (1, 2)] + [
            decode("fp32", 1), prefill("fp16", 1024, 64, 1, False), prefill("bf16", 1024, 64, 1, False),
            decode("bf16", 1)]
    cases = [prefill("fp32", n, d, t, c) for c in (False, True) for n in (256, 1024, 2048, 4096) for d in (64, 128)
             for t in (1, 2)]
    cases += [decode("fp32", t) for t in (1, 2)]
    for dtype in ("fp16", "bf16"):
        cases += [prefill(dtype, 2048, 64, t, c) for c in (False, True) for t in (1, 2)]
        cases += [decode(dtype, t) for t in (1, 2)]
    return cases + [packed(t) for t in (1, 2)] + [softcapped(t) for t in (1, 2)]


def make_inputs(case, seed=0):
    """q [B, N, L, H], k and v [B, KV, S, H], float32 uniform in [-1, 1)."""
    rng = np.random.default_rng(seed)
    heads_and_lengths = ((case.heads, case.query_len), (case.kv_heads, case.key_len), (case.kv_heads, case.key_len))
    return tuple(rng.uniform(-1, 1, (1, n, s, case.dim)).astype(np.float32) for n, s in heads_and_lengths)


def allowed_blocks(case):
    """The packed case's block-diagonal mask [L, S], true where a query and a key are in the same sequence."""
    segment = np.arange(case.key_len) // (case.key_len // case.segments)
    return segment[:, None] == segment[None, :]


def reference(q, k, v, causal, segments=0, softcap=0.0):
    """Attention in float64 numpy, bottom-right aligned causal mask (top-left when L = S); with segments, each of
    that many equal parts of the sequence on its own (the packed cases' block-diagonal mask); with softcap c, the
    scaled scores s become c tanh(s / c) before the mask."""
    if segments:
        n = q.shape[2] // segments
        return np.concatenate([reference(q[:, :, i:i + n], k[:, :, i:i + n], v[:, :, i:i + n], causal)
                               for i in range(0, q.shape[2], n)], axis=2)
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


# ---------------------------------------------------------------- ONNX Runtime

def ort_session(node, inputs, outputs, threads, opset=None):
    opsets = [helper.make_opsetid("", opset or 21), helper.make_opsetid("com.microsoft", 1)]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = helper.find_min_ir_version_for(opsets[:1])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # NOT_IMPLEMENTED (no kernel for the type), INVALID_GRAPH (attribute), ...
        raise Unsupported(first_line(e)) from None


def ort_runner(session, feeds, outputs, shared=()):
    """Binds numpy feeds and preallocated numpy outputs once; `shared` maps output names to input names."""
    binding, keep = session.io_binding(), {}
    for name, array in feeds.items():
        keep[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))
        binding.bind_ortvalue_input(name, keep[name])
    for name, array in outputs.items():
        value = keep[dict(shared)[name]] if name in dict(shared) else ort.OrtValue.ortvalue_from_numpy(array)
        keep["out:" + name] = value
        binding.bind_ortvalue_output(name, value)
    return (lambda: session.run_with_iobinding(binding)), (lambda: keep["out:" + next(iter(outputs))].numpy())


def tensor_info(name, dtype, shape):
    return helper.make_tensor_value_info(name, ONNX_TYPES[dtype], list(shape))


def numpy_of(x, dtype):
    if dtype not in NUMPY_TYPES:
        raise Unsupported(f"{dtype} has no numpy type to feed ONNX Runtime")
    return x.astype(NUMPY_TYPES[dtype])


def ort_mha(case, q, k, v):
    bsnh = lambda x: x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)
    q3, k3, v3 = (bsnh(x) for x in (q, k, v))
    names = ["query", "key", "value"] + (["", "", "attention_bias"] if case.segments else [])
    node = helper.make_node("MultiHeadAttention", names, ["output"], domain="com.microsoft",
                            num_heads=case.heads, unidirectional=int(case.causal))
    ins = [tensor_info(n, case.dtype, x.shape) for n, x in (("query", q3), ("key", k3), ("value", v3))]
    feeds = {"query": numpy_of(q3, case.dtype), "key": numpy_of(k3, case.dtype), "value": numpy_of(v3, case.dtype)}
    if case.segments:  # additive: 0 where allowed, -inf elsewhere
        bias = np.where(allowed_blocks(case), 0.0, -np.inf)[None, None]
        ins.append(tensor_info("attention_bias", case.dtype, bias.shape))
        feeds["attention_bias"] = numpy_of(bias, case.dtype)
    session = ort_session(node, ins, [tensor_info("output", case.dtype, q3.shape)], case.threads)
    run, fetch = ort_runner(session, feeds, {"output": np.empty(q3.shape, feeds["query"].dtype)})
    B, N, L, H = q.shape
    return run, lambda: fetch().reshape(B, L, N, H).transpose(0, 2, 1, 3)


def ort_attention23(case, q, k, v):
    extra = {"softcap": case.softcap} if case.softcap else {}
    node = helper.make_node("Attention", ["Q", "K", "V"] + (["attn_mask"] if case.segments else []), ["Y"],
                            is_causal=int(case.causal), **extra)
    ins = [tensor_info(n, case.dtype, x.shape) for n, x in (("Q", q), ("K", k), ("V", v))]
    feeds = {n: numpy_of(x, case.dtype) for n, x in (("Q", q), ("K", k), ("V", v))}
    if case.segments:  # Boolean: true = attend
        ins.append(helper.make_tensor_value_info("attn_mask", TensorProto.BOOL, [case.query_len, case.key_len]))
        feeds["attn_mask"] = allowed_blocks(case)
    session = ort_session(node, ins, [tensor_info("Y", case.dtype, q.shape)], case.threads, opset=23)
    return ort_runner(session, feeds, {"Y": np.empty(q.shape, feeds["Q"].dtype)})


def ort_gqa(case, q, k, v):
    """Decoding: the last key/value position is the new token, the others are the cache."""
    B, N, L, H = q.shape
    KV, S = k.shape[1], k.shape[2]
    last = lambda x: x[:, :, S - L:].transpose(0, 2, 1, 3).reshape(B, L, KV * H)
    past_k, past_v = k.copy(), v.copy()  # [B, KV, max_seq = S, H], positions >= S - L are overwritten
    node = helper.make_node("GroupQueryAttention",
                            ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
                            ["output", "present_key", "present_value"], domain="com.microsoft",
                            num_heads=N, kv_num_heads=KV)
    ins = [tensor_info("query", case.dtype, (B, L, N * H)), tensor_info("key", case.dtype, (B, L, KV * H)),
           tensor_info("value", case.dtype, (B, L, KV * H)), tensor_info("past_key", case.dtype, k.shape),
           tensor_info("past_value", case.dtype, v.shape),
           helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
           helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outs = [tensor_info("output", case.dtype, (B, L, N * H)), tensor_info("present_key", case.dtype, k.shape),
            tensor_info("present_value", case.dtype, v.shape)]
    session = ort_session(node, ins, outs, case.threads)
    feeds = {"query": numpy_of(q.transpose(0, 2, 1, 3).reshape(B, L, N * H), case.dtype),
             "key": numpy_of(last(k), case.dtype), "value": numpy_of(last(v), case.dtype),
             "past_key": numpy_of(past_k, case.dtype), "past_value": numpy_of(past_v, case.dtype),
             "seqlens_k": np.full(B, S - 1, np.int32), "total_sequence_length": np.array(S, np.int32)}
    run, fetch = ort_runner(session, feeds, {"output": np.empty((B, L, N * H), feeds["query"].dtype),
                                             "present_key": None, "present_value": None},
                            shared=(("present_key", "past_key"), ("present_value", "past_value")))
    return run, lambda: fetch().reshape(B, L, N, H).transpose(0, 2, 1, 3)


# ---------------------------------------------------------------- PyTorch

TORCH_NOTES = {}


def torch_sdpa(case, q, k, v, fold=False):
    """fold: the query heads of one kv head become rows of one query, q [B, KV, group * L, H]: no enable_gqa,
    exact when the L queries see the same keys (decoding, L = 1)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.set_num_threads(case.threads)
    B, N, L, H = q.shape
    if fold:
        q = q.reshape(B, k.shape[1], -1, H)
    qt, kt, vt = (torch.from_numpy(x).to(TORCH_TYPES[case.dtype]) for x in (q, k, v))
    kwargs = {"is_causal": case.causal and not fold}
    if case.segments:  # Boolean: true = attend
        kwargs["attn_mask"] = torch.from_numpy(allowed_blocks(case))
    if qt.shape[1] != kt.shape[1]:
        kwargs["enable_gqa"] = True
    result = {}

    def call():
        with torch.inference_mode():
            result["out"] = F.scaled_dot_product_attention(qt, kt, vt, **kwargs)

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            call()

    try:
        flash()
        TORCH_NOTES[case.name] = "flash"
        run = flash
    except TypeError:  # no enable_gqa (torch < 2.5): expand the kv heads
        group = case.heads // case.kv_heads
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
        del kwargs["enable_gqa"]
        flash()
        TORCH_NOTES[case.name] = "flash, kv heads expanded by repeat_interleave (no enable_gqa)"
        run = flash
    except RuntimeError as e:
        try:
            call()
        except RuntimeError as e2:
            raise Unsupported(first_line(e2)) from None
        TORCH_NOTES[case.name] = f"default dispatch (flash rejected: {first_line(e)})"
        run = call
    return run, lambda: result["out"].float().numpy().reshape(B, N, L, H)


def torch_flex(case, q, k, v):
    """FlexAttention, compiled: packed, with a document mask_mod whose block mask skips the blocks between
    sequences; softcap, with the score_mod c tanh(s / c) and no mask."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise Unsupported(first_line(e)) from None
    torch.set_num_threads(case.threads)
    qt, kt, vt = (torch.from_numpy(x).to(TORCH_TYPES[case.dtype]) for x in (q, k, v))
    try:
        # A fresh compile per case: recompiling after another shape turns on dynamic shapes, which FlexAttention's
        # score_mod then fails under ("when making fake tensor call").
        torch._dynamo.reset()
        kwargs = {}
        if case.segments:
            n = case.key_len // case.segments
            kwargs["block_mask"] = create_block_mask(lambda b, h, i, j: i // n == j // n, B=None, H=None,
                                                     Q_LEN=case.query_len, KV_LEN=case.key_len, device="cpu")
        if case.softcap:
            c = case.softcap
            kwargs["score_mod"] = lambda score, b, h, i, j: c * torch.tanh(score / c)
        compiled = torch.compile(flex_attention)
        result = {}

        def run():
            with torch.inference_mode():
                result["out"] = compiled(qt, kt, vt, **kwargs)

        run()  # compiles
    except Exception as e:  # no C++ toolchain for inductor, an unsupported configuration, ...
        raise Unsupported(first_line(e)) from None
    return run, lambda: result["out"].float().numpy()


BUILDERS = {"ort-mha": ort_mha, "ort-attn23": ort_attention23, "ort-gqa": ort_gqa, "torch-sdpa": torch_sdpa,
            "torch-sdpa-fold": lambda case, q, k, v: torch_sdpa(case, q, k, v, fold=True), "torch-flex": torch_flex}


# ---------------------------------------------------------------- timing

def first_line(error):
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


def median_time(fn, min_runs, min_time):
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first < 0.5:  # a second warm-up call unless one call is long
        fn()
    times = timed_calls(fn, min_runs, min_time)
    return float(np.median(times)), len(times)


def timed_calls(fn, runs, min_time):
    """The times of at least `runs` calls of fn and at least `min_time` seconds of calls, no warm-up."""
    times, begin = [], time.perf_counter()
    while len(times) < runs or time.perf_counter() - begin < min_time:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def peers_of(case):
    """The peers that run this kind of case."""
    return [p for p, kinds in PEERS.items() if case.kind in kinds]


def check_key(peer, case):
    """What the numerical check (verify) reports a peer's result under: the kind, mask and type it checked."""
    return peer, case.kind, case.causal, case.dtype


ATTEND_TYPES = {"fp32": "float", "fp16": "Eigen::half", "bf16": "Eigen::bfloat16"}


def attend_name(case, check_finite=False, dense=False):
    """attend_bench's case: 16-bit prefill stores q, k, v and out in 16 bits; 16-bit decode keeps the query in float
    over a 16-bit K and V (attend's decoding call: float activations, a 16-bit kv_cache); a packed case is
    packed_segments, or with `dense` the same as a dense block-diagonal allowed_mask."""
    if case.kind == "packed":
        return f"packed_8x512{'_dense_mask' if dense else ''}/{case.threads}/"
    if case.kind == "softcap":  # attend_bench's soft-capped case is c = 30 at L = S = 2048, D = 64
        return f"tiled_softcap/{case.query_len}/{case.threads}/"
    if case.kind == "decode":
        prefix = "decode" if case.dtype == "fp32" else f"decode_storage<{ATTEND_TYPES[case.dtype]}>"
        return f"{prefix}/threads:{case.threads}/check_finite:{int(check_finite)}/"
    return (f"prefill<{ATTEND_TYPES[case.dtype]}>/L:{case.query_len}/D:{case.dim}/threads:{case.threads}/"
            f"causal:{int(case.causal)}/")


def gbench_cases(binary, name, *flags):
    """attend_bench's JSON entries for the cases whose names start with `name`, run with `flags`."""
    cmd = [binary, "--benchmark_filter=^" + re.escape(name), "--benchmark_format=json", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    cases = json.loads(out)["benchmarks"]
    if not cases:
        raise RuntimeError(f"attend_bench has no case matching {name!r} (is the binary from this branch?)")
    return cases


def seconds(entry):
    """A Google Benchmark JSON entry's real time in seconds."""
    return entry["real_time"] * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[entry["time_unit"]]


def attend_time(binary, name, min_runs, min_time):
    """Median over min_runs Google Benchmark repetitions of at least min_time / min_runs seconds each."""
    for b in gbench_cases(binary, name, f"--benchmark_repetitions={min_runs}",
                          f"--benchmark_min_time={max(min_time / min_runs, 0.05):g}",
                          "--benchmark_min_warmup_time=0.1", "--benchmark_report_aggregates_only=true"):
        if b.get("aggregate_name") == "median":
            return seconds(b), b.get("repetitions", min_runs)
    raise RuntimeError(f"attend_bench gave no median for {name!r}")


def gbench_once(binary, name, min_time):
    """The JSON entry of one Google Benchmark repetition of the case `name`."""
    return gbench_cases(binary, name, f"--benchmark_min_time={min_time:g}", "--benchmark_min_warmup_time=0.1")[0]


def flop_count(case):
    """The multiply-adds of Q K^T and P V over the allowed (query, key) pairs, 2 flops each, for prefill (B = 1):
    4 H D times L S, or causal (bottom-right aligned) L (S - L) + L (L + 1) / 2, the fewest an exact kernel does."""
    if case.kind != "prefill":
        return None
    L, S = case.query_len, case.key_len
    pairs = L * (S - L) + L * (L + 1) / 2 if case.causal else L * S
    return 4.0 * case.heads * case.dim * pairs


def run_case_paired(case, args):
    """--rounds: each round times attend, this binary's FMA probe at the case's thread count and every peer once,
    in an order rotated from round to round, so that a host whose speed drifts slows all of them alike; the ratios
    are taken within each round (attend / peer, and each one's fraction of that round's probe) and their medians
    and quartiles reported."""
    q, k, v = make_inputs(case)
    runners = {}
    for peer in peers_of(case):
        if not args.correct.get(check_key(peer, case), True):
            continue
        try:
            run, _ = BUILDERS[peer](case, q, k, v)
            run()
            runners[peer] = run
        except Exception:  # an unsupported or failing peer is left out of the pairing; the plain mode reports it
            pass
    # attend as its users call it: a decode with check_finite on (the default options), as the decode target says
    mine, flops = attend_name(case, check_finite=case.kind == "decode"), flop_count(case)
    steps = {"attend": lambda: seconds(gbench_once(args.attend_bench, mine, args.min_time))}
    if flops:
        probe = f"fma_peak<float>/{case.threads}/"
        steps["fma peak"] = lambda: gbench_once(args.attend_bench, probe, 0.3)["flops"]
    steps.update({peer: (lambda run=run: float(np.median(timed_calls(run, args.min_runs, args.min_time))))
                  for peer, run in runners.items()})
    names, rounds = list(steps), []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        rounds.append({name: steps[name]() for name in order})

    def spread(values):
        return [float(x) for x in np.percentile(values, [50, 25, 75])]
    result = {"rounds": rounds, "attend / peer": {}, "fraction of fma peak": {}}
    for peer in runners:
        result["attend / peer"][peer] = spread([x["attend"] / x[peer] for x in rounds])
    if runners:
        # The target's ratio: attend against the peer of the lowest median time (not the fastest peer of each
        # round: the least of several noisy times is biased low).
        best = min(runners, key=lambda p: float(np.median([x[p] for x in rounds])))
        result["best peer"] = best
        result["attend / best peer"] = result["attend / peer"][best]
    if flops:
        for name in ["attend"] + list(runners):
            result["fraction of fma peak"][name] = spread([flops / x[name] / x["fma peak"] for x in rounds])
    return result


def paired_markdown(cases, results, rounds):
    peers = list(dict.fromkeys(p for c in cases for p in results[c.name]["attend / peer"]))
    out = [f"attend / peer time per round, median (quartiles) of {rounds} rounds; fraction of the FMA probe's "
           "rate in the same round (prefill: 4 B H D flops per allowed query and key)", "",
           "| case | attend / best peer | " + " | ".join(f"attend / {p}" for p in peers) + " | attend / FMA peak | " +
           " | ".join(f"{p} / FMA peak" for p in peers) + " |", "|---" * (3 + 2 * len(peers)) + "|"]

    def show(x):
        return f"{x[0]:.3f} ({x[1]:.3f} to {x[2]:.3f})" if x else "-"
    for c in cases:
        r = results[c.name]
        fractions = r["fraction of fma peak"]
        best = f"{show(r['attend / best peer'])}, {r['best peer']}" if "best peer" in r else "-"
        out.append(f"| {c.name} | {best} | " +
                   " | ".join(show(r["attend / peer"].get(p)) for p in peers) + " | " +
                   " | ".join(show(fractions.get(p)) for p in ["attend"] + peers) + " |")
    return "\n".join(out)


def run_case(case, args):
    results = {}
    if args.attend_bench:
        variants = [("attend", False, False)] + ([("attend check_finite", True, False)] if case.kind == "decode" else
                                                 [("attend dense mask", False, True)] if case.kind == "packed" else [])
        for label, check, dense in variants:
            label += " (fp32 q)" if case.kind == "decode" and case.dtype != "fp32" else ""
            try:
                t, n = attend_time(args.attend_bench, attend_name(case, check, dense), args.min_runs, args.min_time)
                results[label] = {"seconds": t, "runs": n}
            except (subprocess.CalledProcessError, RuntimeError) as e:
                results[label] = {"error": first_line(e)}
    q, k, v = make_inputs(case)
    for peer in peers_of(case):
        if not args.correct.get(check_key(peer, case), True):
            results[peer] = {"error": "skipped: wrong result in the numerical check"}
            continue
        try:
            run, _ = BUILDERS[peer](case, q, k, v)
            t, n = median_time(run, args.min_runs, args.min_time)
            results[peer] = {"seconds": t, "runs": n}
            if peer.startswith("torch"):
                results[peer]["kernel"] = TORCH_NOTES.get(case.name)
        except Unsupported as e:
            results[peer] = {"unsupported": str(e)}
        except Exception as e:  # a peer that fails at run time is reported, never stops the sitting
            results[peer] = {"error": first_line(e)}
    return results


# ---------------------------------------------------------------- numerical check

def verify(print_report=True):
    """Small cases against the float64 numpy reference; returns {(peer, kind, causal, dtype): passed}."""
    shapes = [("prefill", 48, 48, False, 4, 4, 0), ("prefill", 48, 48, True, 4, 4, 0), ("decode", 1, 40, False, 8, 2, 0),
              ("packed", 48, 48, False, 4, 4, 3), ("softcap", 48, 48, False, 4, 4, 0)]
    tolerance = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 5e-2}
    passed, lines = {}, []
    for dtype, tol in tolerance.items():
        for kind, L, S, causal, heads, kv_heads, segments in shapes:
            if kind == "packed" and dtype != "fp32":  # packed cases are timed in fp32 only
                continue
            if kind == "softcap" and dtype != "fp32":  # soft-capped cases are timed in fp32 only
                continue
            # c = 0.5 here, so that the cap changes the small test's scores (|s| < 4) by a lot
            case = Case(kind, dtype, L, S, 16, 1, causal, heads, kv_heads, segments, 0.5 if kind == "softcap" else 0.0)
            q, k, v = make_inputs(case, seed=1)
            want = reference(q, k, v, case.causal, segments, case.softcap)
            for peer in peers_of(case):
                try:
                    run, fetch = BUILDERS[peer](case, q, k, v)
                    run()
                    err = float(np.abs(fetch() - want).max())
                    passed[check_key(peer, case)] = ok = err < tol
                    result = f"{'PASS' if ok else 'FAIL'}  max |diff| = {err:.2e} (tolerance {tol:g})"
                except Unsupported as e:
                    result = f"n/a   {e}"
                lines.append(f"{peer:15s} {case.name:34s} {result}")
    if print_report:
        print("Numerical check against a float64 numpy reference:\n")
        print("\n".join("    " + line for line in lines) + "\n")
    return passed


# ---------------------------------------------------------------- report

def cell(result, unit):
    if result is None:
        return "-"
    if "seconds" in result:
        value = result["seconds"] / unit
        return f"{value:.0f}" if value >= 100 else f"{value:.3g}"
    return "unsupported" if "unsupported" in result else "error"


def markdown(cases, results, loads):
    out, notes = [], {}
    for group in dict.fromkeys(c.group for c in cases):
        members = [c for c in cases if c.group == group]
        impls = list(dict.fromkeys(i for c in members for i in results[c.name]))
        unit, unit_name = (1e-6, "µs") if members[0].kind == "decode" else (1e-3, "ms")
        shape = {"decode": "B = 1, H = 32 q / 8 kv heads, L = 1", "packed": "B = 1, H = 8, 8 x 512 in L = S = 4096"}.get(
            members[0].kind, "B = 1, H = 8, L = S")
        out += [f"### {group} ({shape}), median {unit_name}", "",
                f"load average at start / end: {loads[group][0]:.2f} / {loads[group][1]:.2f}", "",
                "| case | " + " | ".join(impls) + " | best peer | attend / best peer |",
                "|---" * (len(impls) + 3) + "|"]
        for c in members:
            r = results[c.name]
            peers = {i: x["seconds"] for i, x in r.items() if not i.startswith("attend") and "seconds" in x}
            mine = next((x.get("seconds") for i, x in r.items() if i.startswith("attend")), None)
            best = min(peers, key=peers.get) if peers else None
            ratio = f"{mine / peers[best]:.2f}" if best and mine else "-"
            label = f"S {c.key_len} D {c.dim}" if c.kind == "decode" else f"L {c.query_len} D {c.dim}"
            out.append(f"| {label} t{c.threads} | " + " | ".join(cell(r.get(i), unit) for i in impls) +
                       f" | {best or '-'} | {ratio} |")
            for i, x in r.items():
                message = x.get("unsupported") or x.get("error") or (
                    x.get("kernel") if x.get("kernel") not in (None, "flash") else None)
                if message:
                    notes.setdefault(f"{i}, {c.dtype}: {message}", []).append(c.name)
        out.append("")
    if notes:
        out += ["Notes:", ""] + [f"* {n} ({len(names)} case{'s' if len(names) > 1 else ''})"
                                 for n, names in notes.items()] + [""]
    out.append(f"load average at start / end of the sitting: {loads['all'][0]:.2f} / {loads['all'][1]:.2f}")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attend-bench", metavar="PATH", help="attend_bench binary (omit to time the peers only)")
    p.add_argument("--quick", action="store_true", help="a few small cases")
    p.add_argument("--filter", metavar="REGEX", help="cases whose name matches, e.g. 'prefill/fp32/L2048/.*/t1'")
    p.add_argument("--json", metavar="FILE", help="write every timing and the environment here")
    p.add_argument("--verify", action="store_true",
                   help="print the numerical check of the peer models and exit (it also runs, silently, before timing)")
    p.add_argument("--min-runs", type=int, default=5, help="timed calls (attend: repetitions) per measurement")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per measurement")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    p.add_argument("--rounds", type=int, default=0,
                   help="paired mode (with --attend-bench): this many rounds per case, each timing attend, the FMA "
                        "probe and every peer once; reports per-round ratios (--min-runs calls and --min-time "
                        "seconds per peer timing, --min-time for attend's)")
    args = p.parse_args()
    if args.rounds and not args.attend_bench:
        p.error("--rounds needs --attend-bench")

    cases = [c for c in all_cases(args.quick) if not args.filter or re.search(args.filter, c.name)]
    if args.list:
        print("\n".join(c.name for c in cases))
        return
    torch.set_num_interop_threads(1)
    env = {"torch": torch.__version__, "onnxruntime": ort.__version__, "onnx": onnx.__version__,
           "numpy": np.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    print("# attend vs ONNX Runtime and PyTorch, CPU\n")
    print(", ".join(f"{k} {v}" for k, v in env.items()) + "\n")
    args.correct = verify(print_report=args.verify)
    if args.verify:
        return
    if not all(args.correct.values()):
        print("Some peer models failed the numerical check; their cases are skipped (see --verify).\n")

    results, loads = {}, {"all": [os.getloadavg()[0]]}
    run = run_case_paired if args.rounds else run_case
    for case in cases:
        loads.setdefault(case.group, [os.getloadavg()[0]])
        print(f"  {case.name} ...", file=sys.stderr, flush=True)
        results[case.name] = run(case, args)
        loads[case.group][1:] = [os.getloadavg()[0]]
    loads["all"].append(os.getloadavg()[0])
    if args.rounds:
        print(paired_markdown(cases, results, args.rounds))
        print(f"\nload average at start / end of the sitting: {loads['all'][0]:.2f} / {loads['all'][1]:.2f}")
    elif cases:
        print(markdown(cases, results, loads))
    if args.json:
        doc = {"environment": env, "load_average": loads}
        if args.rounds:
            doc["rounds"], key = args.rounds, "paired"
        else:
            doc["verify"], key = {"/".join(map(str, k)): v for k, v in args.correct.items()}, "results"
        doc["cases"] = [dict(asdict(c), name=c.name, **{key: results[c.name]}) for c in cases]
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
