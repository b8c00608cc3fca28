"""Convert scaling with workers: the convert stage at 1 and N worker processes on the same data.

Each worker tokenizes every N-th record independently (no shared state but the
input files), so wall time should fall ~linearly with workers up to the core
count. Worker processes run as `packtrain pack convert --index i --count N`,
the same command Kubernetes pods run. Prints speedup and efficiency (speedup /
workers) and writes tests/bench/results/bench_convert_scaling.json. Run it on
an otherwise idle machine: on a loaded one the ratio measures the load.

    python tests/bench/bench_convert_scaling.py [--quick] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import MODELS
from support.synth import generate_dataset

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = MODELS / "qwen2-vl"


def convert_wall_seconds(data: Path, out: Path, workers: int) -> float:
    """Wall time of the convert stage with `workers` processes started at once."""
    exe = Path(sys.executable).parent / "packtrain"
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                str(exe),
                "pack",
                "convert",
                "--input",
                str(data),
                "--model",
                str(MODEL),
                "--max-length",
                "8192",
                "-o",
                str(out),
                "--index",
                str(i),
                "--count",
                str(workers),
            ],
            stdout=subprocess.DEVNULL,
            env=env,
        )
        for i in range(workers)
    ]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"convert worker failed with exit {p.returncode}")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument(
        "--repeats", type=int, default=3, help="best wall time of this many runs per worker count"
    )
    args = ap.parse_args(argv)
    n = min(args.samples, 200) if args.quick else args.samples
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = generate_dataset(Path(tmp) / "data", n, seed=0, image_frac=0.4, video_frac=0.0)
        base = None
        for w in args.workers:
            wall = min(
                convert_wall_seconds(data, Path(tmp) / f"out{w}-{r}", w)
                for r in range(1 if args.quick else args.repeats)
            )
            base = base or wall * args.workers[0]
            speedup = base / wall
            rows.append(
                {"workers": w, "samples": n, "wall_s": wall, "speedup": speedup, "efficiency": speedup / w}
            )
    print(f"{'workers':>8}{'samples':>9}{'speedup':>9}{'efficiency':>12}")
    for r in rows:
        print(f"{r['workers']:>8}{r['samples']:>9}{r['speedup']:>9.2f}{r['efficiency']:>12.2f}")
    RESULTS.mkdir(exist_ok=True)
    name = "bench_convert_scaling.quick.json" if args.quick else "bench_convert_scaling.json"
    (RESULTS / name).write_text(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
