"""Parquet input: convert rate beside the same samples as JSONL, and memory while reading a large file.

1. Convert: synthetic samples (`support.synth`, 30% with images) as JSONL with
   image files (the baseline) and as a Parquet file with the images embedded as
   `{bytes, path}` structs, the layout `datasets` writes. One convert worker each, CPU
   time of this process, best of interleaved rounds; the tokenizer load is left out
   (it is the same for both). Rate = samples per CPU second.
2. Memory: a Parquet file of large embedded blobs read with `iter_records` (row group by
   row group, 64 rows at a time) in a child process, its peak RSS beside a child that
   reads the same file whole with `pyarrow.parquet.read_table` (what the reader avoids).

    python tests/bench/bench_parquet.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from packtrain.core.config import PackConfig
from packtrain.packer.stages.convert import convert

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import MODELS
from support.synth import generate_dataset

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = MODELS / "qwen2-vl"
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
SCHEMA = pa.schema(
    [
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("images", pa.list_(IMAGE)),
    ]
)

# Peak RSS from VmHWM: ru_maxrss would carry the parent's peak over fork and exec.
_READ_CHILD = """
import re, sys
from pathlib import Path
mode, path = sys.argv[1], sys.argv[2]
if mode == "stream":
    from packtrain.packer.sources.records import iter_records
    n = sum(1 for r in iter_records([path]) if r.record is not None)
else:
    import pyarrow.parquet as pq
    n = pq.read_table(path).num_rows
print(n, re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))
"""


def _parquet_twin(jsonl: Path, out: Path, row_group: int) -> Path:
    rows = []
    for line in jsonl.read_text().splitlines():
        rec = json.loads(line)
        images = [
            {"bytes": (jsonl.parent / p).read_bytes(), "path": Path(p).name} for p in rec.get("images", [])
        ]
        rows.append({"messages": rec["messages"], "images": images})
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), out, row_group_size=row_group)
    return out


def _big_file(path: Path, mib: int, group: int = 128) -> Path:
    """`mib` rows of one 1 MiB blob each, written a row group at a time (this process stays small)."""
    with pq.ParquetWriter(path, SCHEMA, compression="none") as writer:
        for start in range(0, mib, group):
            n = min(group, mib - start)
            writer.write_table(
                pa.table(
                    {
                        "messages": pa.array([[{"role": "user", "content": "x"}]] * n, SCHEMA.field(0).type),
                        "images": pa.array(
                            [[{"bytes": os.urandom(1 << 20), "path": None}] for _ in range(n)],
                            pa.list_(IMAGE),
                        ),
                    }
                ),
                row_group_size=group,
            )
    return path


def _convert_seconds(data: Path, work: Path) -> tuple[float, dict[str, Any]]:
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(data)]},
            "model": {"path": str(MODEL), "maxPixels": 401_408},
            "packing": {"maxLength": 8192},
        }
    )
    shutil.rmtree(work, ignore_errors=True)
    from packtrain.packer.tokenize import SampleTokenizer

    SampleTokenizer(cfg.source, cfg.model, cfg.packing)  # warm caches; the timed run loads it again
    load0 = time.process_time()
    SampleTokenizer(cfg.source, cfg.model, cfg.packing)
    load = time.process_time() - load0
    start = time.process_time()
    summary = convert(cfg, work, 0, 1)
    return time.process_time() - start - load, dict(summary)


def _peak_rss(mode: str, path: Path) -> tuple[int, float]:
    done = subprocess.run(
        [sys.executable, "-c", _READ_CHILD, mode, str(path)], capture_output=True, text=True, check=True
    )
    n, kib = done.stdout.split()
    return int(n), int(kib) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big-mib", type=int, default=1024, help="size of the large Parquet file")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.rounds, args.big_mib = 200, 1, 64
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        jsonl = generate_dataset(
            tmp / "synth", args.samples, seed=0, image_frac=0.3, video_frac=0.0, media_pool=64
        )
        parquet = _parquet_twin(jsonl, tmp / "synth.parquet", row_group=256)
        best: dict[str, float] = {}
        summaries: dict[str, dict[str, Any]] = {}
        for _ in range(args.rounds):
            for name, data in (("jsonl", jsonl), ("parquet", parquet)):
                seconds, summaries[name] = _convert_seconds(data, tmp / f"out-{name}")
                best[name] = min(best.get(name, seconds), seconds)
        assert summaries["jsonl"]["tokens"] == summaries["parquet"]["tokens"], summaries

        big = _big_file(tmp / "big.parquet", args.big_mib)
        streamed = _peak_rss("stream", big)
        whole = _peak_rss("whole", big)

    rate = {k: args.samples / v for k, v in best.items()}
    result = {
        "meta": {"samples": args.samples, "image_frac": 0.3, "rounds": args.rounds, "row_group_rows": 256},
        "convert": {
            k: {"cpu_seconds": round(best[k], 3), "samples_per_cpu_second": round(rate[k], 1)} for k in best
        },
        "parquet_vs_jsonl": round(rate["parquet"] / rate["jsonl"], 3),
        "read_large_file": {
            "file_mib": args.big_mib,
            "rows": streamed[0],
            "iter_records_peak_rss_gib": round(streamed[1], 3),
            "read_table_peak_rss_gib": round(whole[1], 3),
        },
    }
    print(f"{'input':10} {'CPU s':>8} {'samples/CPU s':>14}")
    for k in ("jsonl", "parquet"):
        print(f"{k:10} {best[k]:8.2f} {rate[k]:14.1f}")
    print(f"Parquet / JSONL convert rate: {result['parquet_vs_jsonl']:.3f}")
    print(f"reading a {args.big_mib} MiB Parquet file ({streamed[0]} rows of 1 MiB, row groups of 128):")
    print(
        f"  iter_records peak RSS {streamed[1]:.3f} GiB; pyarrow read_table (whole file) {whole[1]:.3f} GiB"
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    name = "bench_parquet.quick.json" if args.quick else "bench_parquet.json"
    (args.results_dir / name).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
