"""Reading a large JSON array dataset: time and peak memory per reading mode.

Every convert worker reads the whole dataset file and parses only its own share; the counting pass
parses nothing. This builds a JSON array of the shared text-sft records repeated to `--mb`
megabytes and reads it, each mode in a fresh process (peak RSS is per process):

- `json.loads whole`: the file decoded at once, as the reader did before it streamed arrays
- `all`: every record parsed (one worker)
- `1 of 4`: `select` keeps every 4th position (one of four workers)
- `count`: `select` refuses all (the counting pass)
- `ijson items` / `ijson skip`: the `ijson` library (C backend) building every item, and walking
  its events to skip items, when it is installed (for comparison only)

`python tests/bench/bench_records.py [--quick] [--mb N] [--results-dir DIR]`
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import SHARED

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ["json.loads whole", "all", "1 of 4", "count", "ijson items", "ijson skip"]


def build(path: Path, megabytes: float) -> int:
    """A JSON array of the shared text-sft records, repeated (with fresh ids) to `megabytes`."""
    files = sorted((SHARED / "datasets" / "text-sft").glob("*/*.json"))
    base = [r for f in files for r in json.loads(f.read_text())]
    target, n, size = int(megabytes * 1e6), 0, 1
    with path.open("w") as f:
        f.write("[")
        while size < target:
            text = json.dumps({**base[n % len(base)], "id": f"r{n}"}, ensure_ascii=False)
            f.write(("," if n else "") + "\n" + text)
            size += len(text.encode()) + 2
            n += 1
        f.write("\n]\n")
    return n


def run_mode(mode: str, path: str) -> dict[str, float]:
    """Read `path` in this process; returns seconds, records parsed and peak RSS in MiB."""
    before = peak_rss_mib()
    t0 = time.perf_counter()
    parsed = 0
    if mode == "json.loads whole":
        parsed = sum(isinstance(r, dict) for r in json.loads(Path(path).read_bytes().decode("utf-8-sig")))
    elif mode.startswith("ijson"):
        import ijson  # type: ignore[import-not-found]

        with open(path, "rb") as f:
            if mode == "ijson items":
                parsed = sum(1 for _ in ijson.items(f, "item", use_float=True))
            else:
                depth = 0
                for event, _ in ijson.basic_parse(f, use_float=True):
                    if event in ("start_map", "start_array"):
                        depth += 1
                    elif event in ("end_map", "end_array"):
                        depth -= 1
                        parsed += depth == 1
    else:
        from packtrain.packer.sources.records import iter_records

        select = {"all": None, "1 of 4": lambda p: p % 4 == 0, "count": lambda p: False}[mode]
        parsed = sum(r.record is not None for r in iter_records([path], select=select))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "parsed": parsed, "rss_mib": peak_rss_mib(), "rss_before_mib": before}


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM; ru_maxrss would include the parent's peak from before exec)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 5 MB file")
    ap.add_argument("--mb", type=float, default=200.0, help="file size in megabytes")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.path)))
        return 0
    megabytes = 5.0 if args.quick else args.mb
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.json"
        records = build(path, megabytes)
        size_mib = path.stat().st_size / 2**20
        print(f"{path.stat().st_size / 1e6:.1f} MB JSON array, {records} records")
        print(f"{'mode':<18} {'seconds':>8} {'parsed':>8} {'peak RSS MiB':>13} {'RSS / file':>11}")
        for mode in MODES:
            cmd = [sys.executable, __file__, "--mode", mode, "--path", str(path)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                if "No module named 'ijson'" in proc.stderr:
                    continue
                print(proc.stderr, file=sys.stderr)
                return 1
            row = {"mode": mode, **json.loads(proc.stdout)}
            rows.append(row)
            print(
                f"{mode:<18} {row['seconds']:>8.2f} {row['parsed']:>8} {row['rss_mib']:>13.0f} "
                f"{row['rss_mib'] / size_mib:>11.2f}"
            )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / "bench_records.json"
    out.write_text(json.dumps({"megabytes": megabytes, "records": records, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
