"""Planner speed: lengths planned per second, bfd against the baselines, one core.

The packer plans the whole dataset in one process before writing shards, so
planning must stay a small part of a pack even at 10^8 samples. Lengths come
from the synthetic heavy-tailed mix; the swift baseline (the `binpacking`
library, as ms-swift calls it) is timed on a prefix of the same lengths when n
is larger than `--baseline-max` and its rate extrapolated, which is fair because
it works in fixed chunks of 1000 and so scales linearly (the table says which
rates are extrapolated). `--huge` plans 10^8 lengths with the lean CSR variant
(`plan_bins`) and reports peak RSS.

Targets: bfd >= 1M lengths/s from 10^6 lengths up, and >= 10x swift at every
size. Prints a table,
writes tests/bench/results/bench_planner.json (bench_planner_huge.json for
--huge), exits 1 when a target is missed.

    python tests/bench/bench_planner.py [--quick] [--sizes N ...] [--huge]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, whatever numpy was built with

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from packtrain.packer.binpack import ALGORITHMS, lower_bound, plan_bins

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.synth import synthetic_lengths

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_RATE = 1_000_000
TARGET_SPEEDUP = 10.0
RATE_TARGET_FROM = 10**6


def peak_rss_gib() -> float:
    """Peak resident set of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def time_plan(lengths: np.ndarray, max_length: int, algorithm: str, repeats: int) -> tuple[float, int]:
    """Best wall time of `repeats` runs, and the number of sequences."""
    best = float("inf")
    bins = 0
    for _ in range(repeats):
        start = time.perf_counter()
        _, offsets = plan_bins(lengths, max_length, algorithm)
        best = min(best, time.perf_counter() - start)
        bins = int(offsets.size - 1)
    return best, bins


def bench(sizes: list[int], max_length: int, baseline_max: int) -> list[dict[str, Any]]:
    lengths_all = synthetic_lengths(max(sizes), seed=0, max_length=max_length)
    timed: dict[tuple[str, int], tuple[float, int]] = {}  # a prefix is timed once, whatever rows reuse it
    rows = []
    for n in sizes:
        lengths = lengths_all[:n]
        row: dict[str, Any] = {
            "n": n,
            "max_length": max_length,
            "lower_bound": lower_bound(lengths, max_length),
        }
        for algorithm in ALGORITHMS:
            measured = n if algorithm == "bfd" else min(n, baseline_max)
            if (algorithm, measured) not in timed:
                repeats = 3 if measured <= 10**6 else 1
                timed[algorithm, measured] = time_plan(lengths[:measured], max_length, algorithm, repeats)
            seconds, bins = timed[algorithm, measured]
            row[algorithm] = {
                "measured_on": measured,
                "seconds": seconds,
                "rate": measured / seconds,
                "sequences": bins if measured == n else None,
            }
        row["speedup_vs_swift"] = row["bfd"]["rate"] / row["swift"]["rate"]
        # The rate target is for 10^6 samples and up: below that, fixed per-length work shows.
        fast_enough = n < RATE_TARGET_FROM or row["bfd"]["rate"] >= TARGET_RATE
        row["target_met"] = fast_enough and row["speedup_vs_swift"] >= TARGET_SPEEDUP
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"Planner speed, one core (max_length {rows[0]['max_length']}; rates in lengths/s)")
    headers = [
        "n",
        "bfd rate",
        *(f"{a} rate" for a in ALGORITHMS if a != "bfd"),
        "bfd / swift",
        "bfd seqs / LB",
    ]
    for header in (*headers, "target"):
        table.add_column(header, justify="right")
    prefixes = set()
    for row in rows:
        rates = []
        for algorithm in ALGORITHMS[1:]:
            cell = row[algorithm]
            extrapolated = cell["measured_on"] != row["n"]
            if extrapolated:
                prefixes.add(cell["measured_on"])
            rates.append(f"{cell['rate']:,.0f}{' *' if extrapolated else ''}")
        table.add_row(
            f"{row['n']:,}",
            f"{row['bfd']['rate']:,.0f}",
            *rates,
            f"{row['speedup_vs_swift']:,.0f}x",
            f"{row['bfd']['sequences'] / row['lower_bound']:.5f}",
            "ok" if row["target_met"] else "MISSED",
        )
    Console(width=None if sys.stdout.isatty() else 150).print(table)
    if prefixes:
        print(
            f"* timed on the first {', '.join(f'{p:,}' for p in sorted(prefixes))} lengths and the rate "
            "extrapolated: the baselines work in chunks of 1000, so their time is linear in n"
        )


def huge(n: int, max_length: int) -> dict[str, Any]:
    """10^8 lengths through the lean variant: time, rate and peak memory."""
    start = time.perf_counter()
    lengths = synthetic_lengths(n, seed=0, max_length=max_length)
    generate_s = time.perf_counter() - start
    rss_lengths = peak_rss_gib()
    start, cpu_start = time.perf_counter(), time.process_time()
    order, offsets = plan_bins(lengths, max_length)
    plan_s, plan_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    rss_plan = peak_rss_gib()
    loads = np.add.reduceat(lengths[order], offsets[:-1]) if n else np.zeros(0)
    valid = bool(offsets[-1] == n and (loads.max(initial=0) <= max_length))
    bound = lower_bound(lengths, max_length)
    return {
        "n": n,
        "max_length": max_length,
        "generate_seconds": generate_s,
        "plan_seconds": plan_s,
        "plan_cpu_seconds": plan_cpu_s,
        "rate": n / plan_s,
        "sequences": int(offsets.size - 1),
        "lower_bound": bound,
        "sequences_over_lb": (offsets.size - 1) / bound if bound else 1.0,
        "peak_rss_gib_after_lengths": rss_lengths,
        "peak_rss_gib_after_plan": rss_plan,
        "valid": valid,
        "target_met": valid and n / plan_s >= TARGET_RATE and rss_plan < 24,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--sizes", type=int, nargs="+", help="default 10^5 10^6 10^7 (--quick: 10^4 10^5)")
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--baseline-max", type=int, default=200_000, help="largest n the baselines run on")
    parser.add_argument("--huge", action="store_true", help="only the 10^8 lean-variant run, with peak RSS")
    parser.add_argument("--huge-n", type=int, default=10**8)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m_at_start": os.getloadavg()[0],
    }

    if args.huge:
        result = huge(args.huge_n, args.max_length)
        print(
            f"{result['n']:,} lengths (max_length {result['max_length']}): "
            f"planned in {result['plan_seconds']:.1f} s "
            f"wall ({result['plan_cpu_seconds']:.1f} s CPU) = {result['rate']:,.0f} lengths/s; "
            f"{result['sequences']:,} sequences, "
            f"{result['sequences_over_lb']:.5f} x lower bound; valid: {result['valid']}"
        )
        print(
            f"peak RSS: {result['peak_rss_gib_after_lengths']:.2f} GiB after generating the lengths, "
            f"{result['peak_rss_gib_after_plan']:.2f} GiB after planning (limit 24 GiB)"
        )
        out = args.results_dir / "bench_planner_huge.json"
        out.write_text(json.dumps({"meta": meta, "result": result}, indent=1))
        print(f"wrote {out}")
        return 0 if result["target_met"] else 1

    sizes = args.sizes or ([10**4, 10**5] if args.quick else [10**5, 10**6, 10**7])
    rows = bench(sizes, args.max_length, args.baseline_max)
    print_table(rows)
    missed = [row["n"] for row in rows if not row["target_met"]]
    print(
        f"targets: bfd >= {TARGET_RATE:,} lengths/s (n >= {RATE_TARGET_FROM:,}) "
        f"and >= {TARGET_SPEEDUP:.0f}x swift:",
        "all met" if not missed else f"MISSED at n = {missed}",
    )
    out = args.results_dir / "bench_planner.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
