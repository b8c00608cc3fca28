"""Shard format choice: Arrow IPC (memory-mapped) vs Parquet, by size and read speed.

The trainer reads packed sequences in a seeded random order, one row at a
time, from many dataloader workers; so random-row latency matters most, then
size on the shared volume. Prints a table of ratios against Arrow IPC and
writes JSON to tests/bench/results/bench_shard_format.json.

    python tests/bench/bench_shard_format.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packtrain.core.pack.schema import SEQUENCE_SCHEMA
from packtrain.core.pack.shards import read_table, table_bytes

RESULTS = Path(__file__).resolve().parent / "results"


def make_rows(n: int, max_length: int, seed: int) -> list[dict]:
    """Realistic packed rows: token ids from a 150k vocab with long vision-pad runs, -100 labels."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        lens = []
        left = max_length
        while left > 64:
            ln = int(min(left, max(16, rng.lognormal(6.0, 0.8))))
            lens.append(ln)
            left -= ln
        ids = rng.integers(0, 151_000, sum(lens)).astype(np.int32)
        ids[: sum(lens) // 3] = 151_655  # an image-pad run: compresses well, as real data does
        labels = np.where(rng.random(len(ids)) < 0.4, ids, -100).astype(np.int32)
        rows.append(
            {
                "input_ids": ids.tolist(),
                "labels": labels.tolist(),
                "seq_lens": lens,
                "sample_ids": [f"s{i}" for i in range(len(lens))],
                "sources": ["d.jsonl"] * len(lens),
                "indices": list(range(len(lens))),
                "media": [],
            }
        )
    return rows


def bench(n: int, max_length: int, reads: int) -> list[dict]:
    table = pa.Table.from_pylist(make_rows(n, max_length, 0), schema=SEQUENCE_SCHEMA)
    order = random.Random(0).sample(range(n), min(reads, n))
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        ipc = Path(tmp) / "s.arrow"
        t0 = time.perf_counter()
        ipc.write_bytes(table_bytes(table))
        w_ipc = time.perf_counter() - t0
        t0 = time.perf_counter()
        t = read_table(ipc)
        for i in order:
            t.slice(i, 1).to_pylist()
        r_ipc = time.perf_counter() - t0
        out.append(
            {"format": "arrow-ipc (mmap)", "bytes": ipc.stat().st_size, "write_s": w_ipc, "read_s": r_ipc}
        )
        for codec in ("snappy", "zstd"):
            p = Path(tmp) / f"s.{codec}.parquet"
            t0 = time.perf_counter()
            pq.write_table(table, p, compression=codec, row_group_size=64)
            w = time.perf_counter() - t0
            t0 = time.perf_counter()
            f = pq.ParquetFile(p)
            cache: dict[int, pa.Table] = {}
            for i in order:  # row groups cached like a reader would
                g = i // 64
                if g not in cache:
                    cache = {g: f.read_row_group(g)}
                cache[g].slice(i % 64, 1).to_pylist()
            r = time.perf_counter() - t0
            out.append(
                {
                    "format": f"parquet ({codec}, 64-row groups)",
                    "bytes": p.stat().st_size,
                    "write_s": w,
                    "read_s": r,
                }
            )
    base = out[0]
    for row in out:
        row["size_vs_ipc"] = row["bytes"] / base["bytes"]
        row["read_time_vs_ipc"] = row["read_s"] / base["read_s"]
        row["write_time_vs_ipc"] = row["write_s"] / base["write_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    n, reads = (64, 64) if args.quick else (1024, 1024)
    rows = bench(n, 4096, reads)
    print(f"{'format':<34}{'size/ipc':>10}{'random read time/ipc':>22}{'write time/ipc':>16}")
    for r in rows:
        print(
            f"{r['format']:<34}{r['size_vs_ipc']:>10.3f}{r['read_time_vs_ipc']:>22.2f}{r['write_time_vs_ipc']:>16.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_shard_format.json").write_text(json.dumps({"sequences": n, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
