#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""Turns attend_bench JSON (run with --benchmark_repetitions), compare_pytorch.py JSON and bench/peers/compare.py
JSON into the tables of bench/README.md and the data + plot of bench/gflops.png.

    /usr/bin/python3 bench/summarize.py attend.json [more-attend.json ...] [pytorch.json] [peers.json] \
        [--plot bench/gflops.png] [--machine "Zen 5, 2 vCPUs"]

(a file whose name contains "pytorch" is read as compare_pytorch.py output, a file holding "cases" as compare.py
output; later attend files replace the cases they contain). The plot takes compare.py's output: its attend, ONNX
Runtime and PyTorch lines all come from that one sitting, the same-binary sgemm and FMA peak from attend_bench's.

Every figure is the best (shortest real time) of the repetitions: on a shared machine the other processes only
ever make a run slower, so the best run is the closest to what the code does. Single-thread cases also show the
CPU-time rate (thread CPU time, immune to time slicing by other processes) in brackets.
"""

import json
import statistics
import subprocess
import sys


def load_bench(paths):
    """Later files replace earlier ones case by case (a re-run of some cases after a change)."""
    runs = {}
    for path in paths:
        fresh = {}
        with open(path) as f:
            for b in json.load(f)["benchmarks"]:
                if b.get("run_type") != "iteration":
                    continue
                fresh.setdefault(b["run_name"], []).append(b)
        runs.update(fresh)
    best = {}
    for name, rs in runs.items():
        r = min(rs, key=lambda x: x["real_time"])
        scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[r["time_unit"]]
        best[name.replace("/real_time", "")] = {
            "real": r["real_time"] * scale,
            "cpu": min(x["cpu_time"] for x in rs) * scale,
            "flops": r.get("flops"),
            "bytes": r.get("bytes"),
            "n": len(rs),
            "real_time_rate": name.endswith("/real_time"),
            "median_real": statistics.median(x["real_time"] for x in rs) * scale,
            "median_flops": statistics.median(x.get("flops") or 0 for x in rs),
        }
    return best


def gf(x):
    return f"{x / 1e9:.1f}" if x else "-"


def main():
    args = sys.argv[1:]
    plot = None
    if "--plot" in args:
        i = args.index("--plot")
        plot = args[i + 1]
        del args[i:i + 2]
    machine = "machine not named"
    if "--machine" in args:
        i = args.index("--machine")
        machine = args[i + 1]
        del args[i:i + 2]
    torch_json = [a for a in args if "pytorch" in a]
    peers_json = []
    for a in args:
        if a not in torch_json:
            with open(a) as f:
                doc = json.load(f)
            if "rounds" in doc:
                sys.exit(f"{a} is a `compare.py --rounds` sitting, whose table compare.py prints itself; "
                         "summarize.py reads the plain mode's --json")
            if "cases" in doc:
                peers_json.append(a)
    if plot and not peers_json:
        sys.exit("--plot draws one sitting of bench/peers/compare.py: give its --json output too")
    b = load_bench([a for a in args if a not in torch_json and a not in peers_json])
    peers_env, peer_cases = {}, []
    if peers_json:
        with open(peers_json[0]) as f:
            doc = json.load(f)
            peers_env = doc.get("environment", {})
            peer_cases = doc["cases"]
    torch = {}
    if torch_json:
        with open(torch_json[0]) as f:
            doc = json.load(f)
            for r in doc["results"]:
                torch[(r["name"], r["path"], r["threads"])] = r

    def rate(name, key="flops"):
        return b[name][key] if name in b else None

    def ratio(x, y):
        return f"{x / y:.2f}" if x and y else "-"

    def work(name):
        # flops per call = rate * the time the rate was computed from
        return b[name]["flops"] * (b[name]["real"] if b[name]["real_time_rate"] else b[name]["cpu"])

    lines = []
    lines.append("| L = S | threads | tiled GFLOP/s | sgemm (attention shape) | tiled / sgemm | sgemm (square) | "
                 "tiled / square | causal time / non-causal | PyTorch SDPA GFLOP/s | tiled / PyTorch |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for threads in (1, 2):
        for length in (1024, 2048, 4096):
            t = f"tiled<float>/{length}/{threads}"
            g = f"gemm_attention_shape<float>/{length}/{threads}"
            sq = f"gemm_square<float>/{length}/{threads}"
            c = f"tiled_causal/{length}/{threads}"
            if t not in b:
                continue
            tr = rate(t)
            cpu = f" [{gf(work(t) / b[t]['cpu'])}]" if threads == 1 else ""
            gcpu = f" [{gf(work(g) / b[g]['cpu'])}]" if threads == 1 and g in b else ""
            py = torch.get((f"noncausal/{length}", "sdpa", threads))
            causal = f"{b[c]['real'] / b[t]['real']:.3f}" + (
                f" [{b[c]['cpu'] / b[t]['cpu']:.3f}]" if threads == 1 else "")
            lines.append(
                f"| {length} | {threads} | {gf(tr)}{cpu} | {gf(rate(g))}{gcpu} | "
                f"{ratio(tr, rate(g))} | {gf(rate(sq))} | {ratio(tr, rate(sq))} | "
                f"{causal} | "
                f"{py['gflops']:.2f} | {tr / 1e9 / py['gflops']:.2f}x |" if py else
                f"| {length} | {threads} | {gf(tr)}{cpu} | {gf(rate(g))}{gcpu} | "
                f"{ratio(tr, rate(g))} | {gf(rate(sq))} | {ratio(tr, rate(sq))} | "
                f"{b[c]['real'] / b[t]['real']:.3f} | not measured | - |")
    print("\n".join(lines))
    print()
    print("| case | figure |")
    print("|---|---|")
    for length in (2048, 4096):
        one, two = f"tiled<float>/{length}/1", f"tiled<float>/{length}/2"
        if one in b and two in b:
            print(f"| 2 threads vs 1, non-causal L = {length} | {b[one]['real'] / b[two]['real']:.2f}x |")
        one, two = f"tiled_causal/{length}/1", f"tiled_causal/{length}/2"
        if one in b and two in b:
            print(f"| 2 threads vs 1, causal L = {length} | {b[one]['real'] / b[two]['real']:.2f}x |")
    for threads in (1, 2):
        d, g = f"tiled<double>/2048/{threads}", f"gemm_attention_shape<double>/2048/{threads}"
        sq = f"gemm_square<double>/2048/{threads}"
        if d in b and g in b and sq in b and threads == 1:
            print(f"| double L = 2048, 1 thread, by CPU time: tiled / dgemm (attention shape), / dgemm (square) | "
                  f"{b[g]['cpu'] / b[d]['cpu']:.2f}, {(work(d) / b[d]['cpu']) / (work(sq) / b[sq]['cpu']):.2f} |")
        if d in b and g in b:
            print(f"| double L = 2048, {threads} thread(s): tiled / dgemm (attention shape), / dgemm (square) | "
                  f"{gf(rate(d))} / {gf(rate(g))} GFLOP/s = {ratio(rate(d), rate(g))}; "
                  f"{ratio(rate(d), rate(sq))} of {gf(rate(sq))} |")
    for threads in (1, 2):
        w, f_ = f"tiled_window256/16384/{threads}", f"tiled<float>/16384/{threads}"
        if w in b and f_ in b:
            cpu = f" [{b[f_]['cpu'] / b[w]['cpu']:.1f}x by CPU time]" if threads == 1 else ""
            print(f"| window 256 vs full at L = 16384, {threads} thread(s) | {b[f_]['real'] / b[w]['real']:.1f}x "
                  f"faster{cpu} ({b[w]['real'] * 1e3:.0f} ms vs {b[f_]['real'] * 1e3:.0f} ms) |")
    for threads in (1, 2):
        s = f"stream_kv/{threads}"
        for check in (0, 1):
            d = f"decode/threads:{threads}/check_finite:{check}"
            if d in b and s in b:
                if threads == 1:
                    print(f"| decode 1 thread, check_finite {'on' if check else 'off'}, by CPU time | "
                          f"{b[s]['cpu'] / b[d]['cpu']:.2f} of the streaming read |")
                print(f"| decode {threads} thread(s), check_finite {'on' if check else 'off'}: K+V bandwidth vs "
                      f"streaming read | {rate(d, 'bytes') / 1e9:.1f} / {rate(s, 'bytes') / 1e9:.1f} GB/s = "
                      f"{rate(d, 'bytes') / rate(s, 'bytes'):.2f} |")
    if "peak_rss" in b:
        print("| peak RSS, L = S = 65536, H = 1 | see the peak_rss run |")

    print_bounds(b, peer_cases)

    if plot:
        plot_peers(plot, b, peer_cases, peers_env, machine)


def print_bounds(b, peer_cases):
    """What the speed targets ask of the core, in fractions of the in-binary FMA peak (fma_peak<float>, the median
    of its runs): for each non-causal prefill of compare.py's sitting (its medians; 4 H L S D flops), attend's
    rate, the best peer's and the rate that 0.87 x the best peer's time would need; and the time the q8_0 decode's
    vector multiplies take at that peak against a third of the fp32 decode's (medians of attend_bench's runs).
    Unlike the tables above, medians: the targets are read from medians."""
    peak = {t: b[f"fma_peak<float>/{t}"]["median_flops"] for t in (1, 2) if f"fma_peak<float>/{t}" in b}
    if not peak:
        return
    rows = []
    for c in peer_cases:
        r = c["results"]
        # fp32, and fp16, which widens to float where the core has no fp16 arithmetic; bf16 runs on bf16 pairs.
        if (c["kind"] != "prefill" or c["causal"] or c.get("segments") or c["dtype"] not in ("fp32", "fp16")
                or "seconds" not in r.get("attend", {})):
            continue
        peers = [(v["seconds"], k) for k, v in r.items() if k != "attend" and "seconds" in v]
        if not peers or c["threads"] not in peak:
            continue
        best, who = min(peers)
        flops = 4.0 * c["heads"] * c["query_len"] * c["key_len"] * c["dim"]
        p = peak[c["threads"]]
        rows.append(f"| {c['dtype']} L {c['query_len']} D {c['dim']} t{c['threads']} | {flops / r['attend']['seconds'] / p:.2f} "
                    f"| {flops / best / p:.2f} ({who}) | {flops / (0.87 * best) / p:.2f} |")
    if rows:
        print()
        print("| non-causal prefill | attend / FMA peak | best peer / FMA peak | 0.87 x the best peer's time needs |")
        print("|---|---|---|---|")
        print("\n".join(rows))
    # The q8_0 decode case: S = 8192 keys, 8 kv heads of 4 query heads, D = 128. Per key and kv head, K and V each
    # take D / 16 packets, each widened and multiplied by its block's scale, then one multiply-add per query row.
    keys, kv_heads, packets, rows_per_head = 8192, 8, 128 // 16, 4
    ops = keys * kv_heads * 2 * packets * (rows_per_head + 1)
    rows = []
    for t in (1, 2):
        q8, fp32 = f"decode_q8/threads:{t}/check_finite:1", f"decode/threads:{t}/check_finite:1"
        if t in peak and q8 in b and fp32 in b:
            floor = ops * 32 / peak[t]  # a packet's multiply-add: 16 lanes x 2 flops
            rows.append(f"| {t} | {floor * 1e6:.0f} | {b[q8]['median_real'] * 1e6:.0f} | "
                        f"{b[fp32]['median_real'] * 1e6:.0f} | {b[fp32]['median_real'] / 3 * 1e6:.0f} |")
    if rows:
        print()
        print(f"| q8_0 decode, threads | its {ops / 1e6:.2f} M vector multiplies at the FMA peak, us | attend, us | "
              "fp32 decode, us | 3 x faster than fp32 needs, us |")
        print("|---|---|---|---|---|")
        print("\n".join(rows))


def plot_peers(plot, b, peer_cases, env, machine):
    """gflops.png from one compare.py sitting (attend, ONNX Runtime MultiHeadAttention, PyTorch SDPA: wall clock,
    fp32 non-causal, D = 64) with the same-binary sgemm of the attention's shape and the FMA peak."""
    data = plot.rsplit(".", 1)[0] + ".dat"
    peers = {c["name"]: c["results"] for c in peer_cases}
    peak = b.get("fma_peak<float>/1", {}).get("flops")
    with open(data, "w") as f:
        f.write("# L attend1 attend2 ort-mha1 ort-mha2 torch-sdpa1 torch-sdpa2 sgemm1 sgemm2 fma-peak1 (GFLOP/s, "
                "wall clock)\n")
        for length in (1024, 2048, 4096):
            flops = 4.0 * 8 * length * length * 64
            row = [length]
            for impl in ("attend", "ort-mha", "torch-sdpa"):
                for threads in (1, 2):
                    r = peers.get(f"prefill/fp32/L{length}/D64/full/t{threads}", {}).get(impl, {})
                    row.append(f"{flops / r['seconds'] / 1e9:.3f}" if "seconds" in r else "NaN")
            for threads in (1, 2):
                g = b.get(f"gemm_attention_shape<float>/{length}/{threads}")
                row.append(f"{g['flops'] / 1e9:.3f}" if g else "NaN")
            row.append(f"{peak / 1e9:.3f}" if peak else "NaN")
            f.write(" ".join(str(x) for x in row) + "\n")
    ort_version = "ONNX Runtime " + env.get("onnxruntime", "")
    torch_version = "PyTorch " + env.get("torch", "").split("+")[0]
    script = f"""
set terminal pngcairo size 1100,560 font ',11'
set output '{plot}'
set title "attention fp32, non-causal, B = 1, H = 8, D = 64 ({machine})\\nwall clock, one sitting; GFLOP/s = 4 B H L S D / time"
set xlabel 'sequence length L = S'
set ylabel 'GFLOP/s'
set logscale x 2
set yrange [0:*]
set xtics (1024, 2048, 4096)
set xrange [900:4600]
set key outside right center box font ',9'
set grid
plot '{data}' using 1:2 with linespoints lw 2 pt 7 lc rgb '#c0392b' title 'attend, 1 thread', \\
     '' using 1:3 with linespoints lw 2 pt 5 lc rgb '#c0392b' dt 2 title 'attend, 2 threads', \\
     '' using 1:4 with linespoints lw 2 pt 7 lc rgb '#2471a3' title '{ort_version} MHA, 1 thread', \\
     '' using 1:5 with linespoints lw 2 pt 5 lc rgb '#2471a3' dt 2 title '{ort_version} MHA, 2 threads', \\
     '' using 1:6 with linespoints lw 2 pt 7 lc rgb '#7d3c98' title '{torch_version} SDPA, 1 thread', \\
     '' using 1:7 with linespoints lw 2 pt 5 lc rgb '#7d3c98' dt 2 title '{torch_version} SDPA, 2 threads', \\
     '' using 1:8 with lines lc rgb '#7f8c8d' title 'Eigen sgemm (attention shape), 1 thread', \\
     '' using 1:10 with lines lc rgb '#000000' dt 3 title 'FMA peak, 1 thread (in-binary probe)'
"""
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


if __name__ == "__main__":
    main()
