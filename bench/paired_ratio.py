#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The ratio of two attend_bench cases from runs made in pairs, for machines whose speed drifts between runs.

Runs case A and case B back to back (in alternating order, ABBA...), each in a process of its own, `pairs` times, and
prints the median and quartiles of the per-pair ratio time(B) / time(A). Two runs next to each other share the
machine's state of the moment, so the ratio of a pair is steadier than the ratio of two medians taken minutes apart.

    bench/paired_ratio.py build/bench/bench/attend_bench 'packed_8x512/2/real_time' 'tiled<float>/4096/2/real_time' 10

With --binaries, one case in two builds (an old and a new commit), the ratio time(new) / time(old):

    bench/paired_ratio.py --binaries OLD_ATTEND_BENCH NEW_ATTEND_BENCH 'decode/threads:1/check_finite:1/real_time' 7
"""
import json
import statistics
import subprocess
import sys


def run(binary, name, min_time):
    out = subprocess.run([binary, f"--benchmark_filter=^{name}$", f"--benchmark_min_time={min_time}",
                          "--benchmark_format=json"], capture_output=True, text=True, check=True).stdout
    cases = json.loads(out)["benchmarks"]
    if len(cases) != 1:
        sys.exit(f"'{name}' matches {len(cases)} cases, not one")
    return cases[0]["real_time"]


def main():
    args = sys.argv[1:]
    binaries = bool(args) and args[0] == "--binaries"
    if binaries:
        args = args[1:]
    if len(args) not in (4, 5):
        sys.exit("usage: paired_ratio.py ATTEND_BENCH CASE_A CASE_B PAIRS [MIN_TIME_SECONDS=0.25]\n"
                 "       paired_ratio.py --binaries OLD_ATTEND_BENCH NEW_ATTEND_BENCH CASE PAIRS [MIN_TIME_SECONDS]")
    if binaries:  # (binary, case) of A and B
        a, b = (args[0], args[2]), (args[1], args[2])
    else:
        a, b = (args[0], args[1]), (args[0], args[2])
    pairs = int(args[3])
    min_time = args[4] if len(args) == 5 else "0.25"
    ratios = []
    for i in range(pairs):
        if i % 2 == 0:
            ta = run(*a, min_time)
            tb = run(*b, min_time)
        else:
            tb = run(*b, min_time)
            ta = run(*a, min_time)
        ratios.append(tb / ta)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    label = f"{b[0]} / {a[0]}, {a[1]}" if binaries else f"{b[1]} / {a[1]}"
    print(f"{label}: median {statistics.median(ratios):.3f}, quartiles {q[0]:.3f} to {q[2]:.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f} ({pairs} pairs)")


if __name__ == "__main__":
    main()
