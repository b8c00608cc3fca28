"""A million samples through `pack run`, with 1 and 2 workers, and the planner at 10^8 lengths.

Generates a synthetic `messages` dataset with `support.synth` (its heavy-tailed text-length
mix with long documents, 30% of samples with 1-3 images of varied sizes, 2% with a video; media
drawn from a pool of files, so a million samples fit on a disk), then runs
`packtrain pack run --workers W` for each W as its own process and reports per stage (load,
convert, plan, materialize) the wall seconds and each process's peak RSS, the output size and
sequences against the lower bound. The first worker count is the baseline of the speedup column.
Then plans 10^8 synthetic lengths (`bench_planner.py --huge`, its own process) for time and peak
memory, only when enough memory is free. The load average is printed beside every timing: on a
shared machine a timing measures the load as much as the code.

    python tests/bench/bench_scale.py [--samples 1000000] [--workers 1 2] [--planner-n 100000000]

Everything is written under a temporary folder (or --work-dir); the JSON goes to
tests/bench/results/bench_scale.json (bench_scale.small.json below 10^6 samples).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import MODELS
from support.synth import generate_dataset

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODEL = MODELS / "qwen2-vl"
IMAGE_FRAC, VIDEO_FRAC = 0.30, 0.02
PLANNER_MIN_FREE_GIB = 12.0
PLANNER_LIMIT_GIB = 24.0


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def available_gib() -> float:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def dataset(work: Path, samples: int, media_pool: int, seed: int) -> tuple[Path, float, bool]:
    """The synthetic dataset (reused when `work` already holds one made with the same arguments)."""
    folder = work / f"data-{samples}-{media_pool}-{seed}"
    done = folder / "done.json"
    if done.is_file():
        return folder / "data.jsonl", json.loads(done.read_text())["seconds"], True
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    path = generate_dataset(
        folder, samples, seed=seed, image_frac=IMAGE_FRAC, video_frac=VIDEO_FRAC, media_pool=media_pool
    )
    seconds = time.perf_counter() - start
    done.write_text(json.dumps({"seconds": seconds}))
    return path, seconds, False


def pack_run(data: Path, out: Path, workers: int, max_length: int) -> dict[str, Any]:
    """One `packtrain pack run` process: its summary line (with per-stage timings) and wall time."""
    exe = Path(sys.executable).parent / "packtrain"
    cmd = [
        str(exe),
        "pack",
        "run",
        "--input",
        str(data),
        "--model",
        str(MODEL),
        "--max-length",
        str(max_length),
        "-o",
        str(out),
        "--workers",
        str(workers),
        "--no-progress",
    ]
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    load_before = load_average()
    cpu_before = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    cpu = _children_cpu() - cpu_before
    if proc.returncode != 0:
        raise RuntimeError(f"pack run --workers {workers} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    work_bytes = folder_bytes(out / "work")
    return {
        "workers": workers,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "stages": summary["timings"]["stages"],
        "main_peak_rss_mib": summary["timings"]["peak_rss_mib"],
        "samples": summary["samples"],
        "packed": summary["packed"],
        "rejected": summary["rejected"],
        "tokens": summary["tokens"],
        "sequences": summary["sequences"],
        "lower_bound": summary["lower_bound"],
        "sequences_over_lb": round(summary["sequences"] / summary["lower_bound"], 6)
        if summary["lower_bound"]
        else 1.0,
        "output_bytes": folder_bytes(out) - work_bytes,
        "work_bytes": work_bytes,
    }


def _children_cpu() -> float:
    """User + system CPU seconds of every finished child process (the pack run and its workers)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def overhead(work: Path, workers: list[int], max_length: int) -> list[dict[str, Any]]:
    """Fixed cost of `pack run`: 10 samples, each worker count (wall and CPU of all its processes)."""
    data, _, _ = dataset(work, 10, 4, 1)
    rows = []
    for w in workers:
        out = work / f"overhead-w{w}"
        shutil.rmtree(out, ignore_errors=True)
        run = pack_run(data, out, w, max_length)
        shutil.rmtree(out)
        rows.append(
            {k: run[k] for k in ("workers", "wall_s", "cpu_s", "load_average_before", "load_average_after")}
        )
    return rows


def planner(n: int, max_length: int, tmp: Path) -> dict[str, Any]:
    """`bench_planner.py --huge` in its own process (its peak RSS is the planner's alone)."""
    free = available_gib()
    if free < PLANNER_MIN_FREE_GIB:
        return {"n": n, "skipped": f"only {free:.1f} GiB available, {PLANNER_MIN_FREE_GIB} needed"}
    load_before = load_average()
    cmd = [
        sys.executable,
        str(HERE / "bench_planner.py"),
        "--huge",
        "--huge-n",
        str(n),
        "--max-length",
        str(max_length),
        "--results-dir",
        str(tmp),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1):  # 1: a target missed, reported in the result
        raise RuntimeError(f"bench_planner --huge failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads((tmp / "bench_planner_huge.json").read_text())["result"]
    return result | {
        "available_gib_before": round(free, 1),
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }


def stage_cell(run: dict[str, Any], stage: str) -> str:
    """`wall s / CPU s (anonymous RSS MiB per worker)`: anonymous memory is what a worker holds;
    its peak RSS (in the JSON) also counts mapped pages the kernel can drop."""
    s = run["stages"].get(stage, {})
    anon = s.get("worker_peak_anon_rss_mib") or (
        [s["peak_anon_rss_mib"]] if s.get("peak_anon_rss_mib") else []
    )
    cell = f"{s.get('seconds', 0):.0f}/{s.get('cpu_s', 0):.0f}"
    return cell + (f" ({'/'.join(f'{r:.0f}' for r in anon if r is not None)})" if anon else "")


def print_table(runs: list[dict[str, Any]], data: dict[str, Any]) -> None:
    print(
        f"\n{data['samples']:,} samples ({data['jsonl_bytes'] / 2**30:.2f} GiB JSONL, "
        f"{data['media_files']} media files, generated in {data['seconds']:.0f} s)"
    )
    stages = ["load", "convert", "plan", "materialize"]
    head = f"{'workers':>7} {'wall s':>8} {'CPU s':>8} {'speedup':>7} " + " ".join(
        f"{s + ' wall/CPU s (anon MiB)':>26}" for s in stages
    )
    print(head + f" {'main MiB':>9} {'out GiB':>8} {'seq/LB':>9} {'load avg':>11}")
    base = runs[0]["wall_s"] * runs[0]["workers"] if runs else 0
    for r in runs:
        cells = " ".join(f"{stage_cell(r, s):>26}" for s in stages)
        speed = base / r["wall_s"] / runs[0]["workers"] if r["wall_s"] else 0
        print(
            f"{str(r['workers']) + ('*' if r.get('earlier') else ''):>7} {r['wall_s']:>8.1f} "
            f"{r['cpu_s']:>8.1f} {speed:>7.2f} {cells} {r['main_peak_rss_mib']:>9.0f} "
            f"{r['output_bytes'] / 2**30:>8.2f} {r['sequences_over_lb']:>9.5f} "
            f"{r['load_average_before']:>5.1f}/{r['load_average_after']:<5.1f}"
        )
    if any(r.get("earlier") for r in runs):
        print(
            "* measured by an earlier invocation (--previous), under its own load: compare the load averages "
            "and CPU seconds before reading the speedup"
        )
    if runs:
        r = runs[0]
        print(
            f"({r['packed']:,} packed, {r['rejected']:,} rejected, {r['tokens']:,} tokens, "
            f"{r['sequences']:,} sequences, lower bound {r['lower_bound']:,}; load avg before/after each run)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--media-pool", type=int, default=2000, help="distinct image and video files (each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--planner-n", type=int, default=10**8, help="lengths for the planner run (0: skip it)")
    ap.add_argument(
        "--work-dir", type=Path, help="keep the dataset here and reuse it (default: a temp folder)"
    )
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument(
        "--previous",
        type=Path,
        help="a results JSON of an earlier run on the same dataset: its runs join this run's table "
        "(a million samples per worker count is hours on a small machine)",
    )
    args = ap.parse_args(argv)
    previous = json.loads(args.previous.read_text()) if args.previous else None
    if previous is not None and (
        previous["dataset"]["samples"],
        previous["meta"]["media_pool"],
        previous["meta"]["max_length"],
    ) != (args.samples, args.media_pool, args.max_length):
        print(f"{args.previous} was measured on another dataset or max length", file=sys.stderr)
        return 2
    if not MODEL.is_dir():
        print(f"the shared model folder {MODEL} is missing", file=sys.stderr)
        return 2
    meta = {
        "cpus": os.cpu_count(),
        "load_average_at_start": load_average(),
        "available_gib_at_start": round(available_gib(), 1),
        "max_length": args.max_length,
        "image_frac": IMAGE_FRAC,
        "video_frac": VIDEO_FRAC,
        "media_pool": args.media_pool,
    }
    print(
        f"cpus {meta['cpus']}, load average {meta['load_average_at_start']}, "
        f"{meta['available_gib_at_start']} GiB available"
    )
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp_name:
        tmp = Path(tmp_name)
        work = args.work_dir or tmp
        work.mkdir(parents=True, exist_ok=True)
        data_path, gen_s, reused = dataset(work, args.samples, args.media_pool, args.seed)
        media = sum(1 for _ in (data_path.parent / "images").iterdir()) + sum(
            1 for _ in (data_path.parent / "videos").iterdir()
        )
        data = {
            "samples": args.samples,
            "seconds": gen_s,
            "reused": reused,
            "jsonl_bytes": data_path.stat().st_size,
            "media_files": media,
            "media_bytes": folder_bytes(data_path.parent) - data_path.stat().st_size,
        }
        print(f"dataset: {data_path} ({'reused' if reused else f'generated in {gen_s:.0f} s'})")
        fixed = overhead(tmp, args.workers, args.max_length)
        for row in fixed:
            print(
                f"pack run on 10 samples, {row['workers']} worker(s): {row['wall_s']:.2f} s wall, "
                f"{row['cpu_s']:.2f} s CPU (all processes); load avg {row['load_average_before']}"
            )
        runs = []
        for w in args.workers:
            out = tmp / f"pack-w{w}"
            runs.append(pack_run(data_path, out, w, args.max_length))
            print(f"workers {w}: {runs[-1]['wall_s']:.1f} s, stages {runs[-1]['stages']}", flush=True)
            shutil.rmtree(out)  # one output on disk at a time
        if previous is not None:
            runs = sorted(
                runs + [r | {"earlier": True} for r in previous["runs"] if r["workers"] not in args.workers],
                key=lambda r: r["workers"],
            )
        print_table(runs, data)
        plan = planner(args.planner_n, args.max_length, tmp) if args.planner_n else None
        if plan is None and previous is not None and previous.get("planner"):
            plan = previous["planner"] | {"earlier": True}
    if plan is not None:
        if "skipped" in plan:
            print(f"planner at {plan['n']:,} lengths skipped: {plan['skipped']}")
        else:
            print(
                f"planner{' (earlier invocation)' if plan.get('earlier') else ''}: "
                f"{plan['n']:,} lengths in {plan['plan_seconds']:.1f} s ({plan['rate']:,.0f}/s), "
                f"peak RSS {plan['peak_rss_gib_after_plan']:.2f} GiB (limit {PLANNER_LIMIT_GIB:.0f}), "
                f"{plan['sequences_over_lb']:.5f} x lower bound, valid {plan['valid']}; "
                f"load avg {plan['load_average_before']}/{plan['load_average_after']}"
            )
    consistent = all(
        r["samples"] == args.samples and r["packed"] + r["rejected"] == r["samples"] for r in runs
    )
    same = len({(r["sequences"], r["tokens"]) for r in runs}) <= 1
    args.results_dir.mkdir(parents=True, exist_ok=True)
    name = "bench_scale.json" if args.samples >= 1_000_000 else "bench_scale.small.json"
    (args.results_dir / name).write_text(
        json.dumps(
            {
                "meta": meta,
                "dataset": data,
                "overhead_10_samples": fixed,
                "runs": runs,
                "planner": plan,
                "counts_add_up": consistent,
                "same_pack_any_workers": same,
            },
            indent=1,
        )
    )
    print(f"wrote {args.results_dir / name}")
    planner_ok = (
        plan is None
        or "skipped" in plan
        or (plan["valid"] and plan["peak_rss_gib_after_plan"] < PLANNER_LIMIT_GIB)
    )
    return 0 if consistent and same and planner_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
