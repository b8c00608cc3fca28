"""Plan (one process): assign every converted sample to a packed sequence and sequences to shards.

Samples are ordered by their global position in the input before the bin packing, so the
plan does not depend on the number of convert workers. Plan also merges the workers'
rejects into `rejects.jsonl`, in input order.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtrain.core.config import PackConfig, PackingConfig
from packtrain.core.contract import PlanSummary
from packtrain.core.errors import ConfigError
from packtrain.core.pack.shards import (
    REJECTS,
    atomic_write_json,
    atomic_writer,
    read_table,
    sha256_file,
    write_table,
)
from packtrain.packer.binpack import lower_bound, plan_bins
from packtrain.packer.sources.mixture import source_counts
from packtrain.packer.sources.records import source_files
from packtrain.packer.stages.workdir import (
    PLAN_SCHEMA,
    check_output_config,
    part_name,
    reject_line,
    rejects_in_order,
    sweep,
    work_dir,
)

SMALL_PACK_SHARDS = 16
"""A pack too small to fill this many shards of `sequencesPerShard` gets this many smaller shards
(of at least MIN_SHARD_SEQUENCES), so materialize spreads over up to 16 workers even for a pack that
one full shard would hold."""
MIN_SHARD_SEQUENCES = 4
SHARD_TOKENS = 1 << 24
"""Most token slots (sequences x maxLength) in one shard. Materialize builds a shard in memory, at about
5x its token and label bytes (measured: 1.2 GiB for 256 sequences of 122k tokens), so shards are cut
by tokens, not only by `sequencesPerShard`: 1024 sequences of 16384 tokens, 128 of 131072 (about
0.65 GiB a worker), where 1024 such rows would need about 5 GiB."""

_SUMMARY = re.compile(r"summary-(\d{5})-of-(\d{5})\.json$")


def shard_size(sequences: int, sequences_per_shard: int, max_length: int = 1) -> int:
    """Sequences per shard: `sequences_per_shard`, fewer when that many rows of `max_length` tokens are
    over SHARD_TOKENS, and fewer again for a small pack (see SMALL_PACK_SHARDS).

    A function of the pack alone, never of the worker count: the same inputs and config give the
    same shards whatever the number of workers.
    """
    per_shard = min(sequences_per_shard, max(1, SHARD_TOKENS // max_length))
    return max(1, min(per_shard, max(MIN_SHARD_SEQUENCES, -(-sequences // SMALL_PACK_SHARDS))))


def plan(cfg: PackConfig, out: Path) -> PlanSummary:
    """Assign every converted sample to a packed sequence and sequences to shards."""
    work = work_dir(out)
    summary_path = work / "plan.json"
    check_output_config(cfg, out)
    sweep(work, lambda final: final in ("plan.json", "plan.arrow"))  # plan runs as one process
    sweep(out, lambda final: final == REJECTS)
    if summary_path.is_file():
        return json.loads(summary_path.read_text())["summary"]

    count = _convert_parts(out)
    converted = _read_parts(work, count)
    sequences, per_shard = _write_plan_table(work, converted, cfg.packing)
    rejects = _merge_rejects(work, out, count)
    duplicates = _warn_duplicate_ids([*converted.ids, pa.array(rejects.ids, pa.string())])
    summary = _summary(cfg, converted, rejects, duplicates, sequences, -(-sequences // per_shard))
    atomic_write_json(
        summary_path,
        {
            "summary": summary,
            "convert_workers": count,
            "inputs": _input_fingerprints(cfg),
            "rejects_sha256": sha256_file(out / REJECTS),
        },
    )
    return summary


@dataclass
class _Converted:
    """Every converted sample, in input order: its convert part, its row there and its length."""

    part_of: np.ndarray
    row_of: np.ndarray
    length: np.ndarray
    ids: list[pa.ChunkedArray]
    packed_by_file: Counter[str]  # per source file name, for the per-source counts


@dataclass
class _Rejects:
    """What plan counts of the convert workers' rejects."""

    reasons: Counter[str] = field(default_factory=Counter)
    by_file: Counter[str] = field(default_factory=Counter)
    ids: list[str] = field(default_factory=list)


def _convert_parts(out: Path) -> int:
    """Number of convert workers, checking that every part finished."""
    found: dict[int, set[int]] = {}
    for p in sorted((work_dir(out) / "convert").glob("summary-*.json")):
        m = _SUMMARY.search(p.name)
        if m:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    complete = [n for n, idx in found.items() if idx == set(range(n))]
    if not complete:
        detail = {n: sorted(set(range(n)) - idx) for n, idx in found.items()}
        raise ConfigError(
            f"convert has not finished in {out}: missing parts {detail or '(none started)'}. "
            "Run `packtrain pack convert` for every index first."
        )
    return max(complete)


def _read_parts(work: Path, count: int) -> _Converted:
    """The `count` convert parts' samples, ordered by global position (the worker count drops out)."""
    positions, parts, rows, lengths, ids = [], [], [], [], []
    packed_by_file: Counter[str] = Counter()
    for i in range(count):
        table = read_table(work / "convert" / f"part-{part_name(i, count)}.arrow")
        ids.append(table.column("sample_id"))
        pos = table.column("position").to_numpy()
        positions.append(pos)
        parts.append(np.full(len(pos), i, dtype=np.int32))
        rows.append(np.arange(len(pos), dtype=np.int32))
        lengths.append(table.column("length").to_numpy().astype(np.int64))
        packed_by_file.update(
            {v["values"]: v["counts"] for v in pc.value_counts(table.column("source")).to_pylist()}
        )
    position = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    order = np.argsort(position, kind="stable")
    return _Converted(
        part_of=(np.concatenate(parts) if parts else np.zeros(0, np.int32))[order],
        row_of=(np.concatenate(rows) if rows else np.zeros(0, np.int32))[order],
        length=(np.concatenate(lengths) if lengths else np.zeros(0, np.int64))[order],
        ids=ids,
        packed_by_file=packed_by_file,
    )


def _write_plan_table(work: Path, converted: _Converted, p: PackingConfig) -> tuple[int, int]:
    """Bin-pack the samples and write plan.arrow (PLAN_SCHEMA); the sequences and sequences per shard."""
    length = converted.length
    if len(length):
        order, offsets = plan_bins(
            length, p.max_length, algorithm=p.algorithm, seed=p.seed, partial_threshold=p.partial_threshold
        )
    else:
        order, offsets = np.zeros(0, np.int64), np.zeros(1, np.int64)
    sequences = len(offsets) - 1
    per_shard = shard_size(sequences, p.sequences_per_shard, p.max_length)
    offsets32 = pa.array(offsets, pa.int32())
    plan_table = pa.table(
        {
            "shard": pa.array(np.arange(sequences) // per_shard, pa.int32()),
            "parts": pa.ListArray.from_arrays(offsets32, pa.array(converted.part_of[order], pa.int32())),
            "rows": pa.ListArray.from_arrays(offsets32, pa.array(converted.row_of[order], pa.int32())),
        },
        schema=PLAN_SCHEMA,
    )
    write_table(work / "plan.arrow", plan_table)
    return sequences, per_shard


def _merge_rejects(work: Path, out: Path, count: int) -> _Rejects:
    """Write rejects.jsonl from the convert workers' rejects, in input order, counting them."""
    found = _Rejects()
    with rejects_in_order(work, count) as rejects, atomic_writer(out / REJECTS) as f:
        for r in rejects:
            found.reasons[r["reason"]] += 1
            found.by_file[r["source"]] += 1
            if isinstance(r.get("id"), str):
                found.ids.append(r["id"])
            f.write(reject_line(r))
    return found


def _warn_duplicate_ids(ids: list[pa.Array | pa.ChunkedArray]) -> int:
    """How many samples reuse an earlier sample's id, warned about on stderr when any do."""
    duplicates, examples = count_duplicate_ids(ids)
    if duplicates:
        print(
            f"packtrain pack plan: warning: {duplicates} samples reuse an earlier sample's id "
            f"(e.g. {examples}); `unpack --sample ID` and per-sample reports cannot tell them apart. "
            "Give every record a unique `id`.",
            file=sys.stderr,
        )
    return duplicates


def _summary(
    cfg: PackConfig, converted: _Converted, rejects: _Rejects, duplicates: int, sequences: int, shards: int
) -> PlanSummary:
    p = cfg.packing
    length = converted.length
    packed = len(length)
    rejected = sum(rejects.reasons.values())
    tokens = int(length.sum())
    fill_ratio, padding_saved = fill(tokens, sequences, packed, p.max_length)
    return {
        "stage": "plan",
        "samples": packed + rejected,
        "packed": packed,
        "rejected": rejected,
        "rejected_by_reason": dict(sorted(rejects.reasons.items())),
        "duplicate_ids": duplicates,
        "sequences": sequences,
        "shards": shards,
        "tokens": tokens,
        "lower_bound": lower_bound(length, p.max_length) if len(length) else 0,
        "fill_ratio": fill_ratio,
        "padding_saved": padding_saved,
        "sources": source_counts(
            source_files(cfg.source.paths), cfg.source.mixture, converted.packed_by_file, rejects.by_file
        ),
    }


def _input_fingerprints(cfg: PackConfig) -> list[dict[str, Any]]:
    return [
        {
            "name": f.name,
            "path": str(f.path),
            "entry": f.entry,
            "bytes": f.path.stat().st_size,
            "sha256": sha256_file(f.path),
        }
        for f in source_files(cfg.source.paths)
    ]


def fill(tokens: int, sequences: int, packed: int, max_length: int) -> tuple[float, float]:
    """`fill_ratio` (real tokens / sequence capacity) and `padding_saved` (share of sequences saved
    versus one sample per sequence)."""
    return (
        round(tokens / (sequences * max_length), 6) if sequences else 0.0,
        round(1 - sequences / packed, 6) if packed else 0.0,
    )


def count_duplicate_ids(chunks: list[pa.Array | pa.ChunkedArray]) -> tuple[int, list[str]]:
    """How many sample ids repeat an earlier one (packed and rejected samples alike), and a few of them."""
    all_ids = pa.chunked_array(
        [c for chunk in chunks for c in (chunk.chunks if isinstance(chunk, pa.ChunkedArray) else [chunk])],
        pa.string(),
    ).drop_null()
    counts = pc.value_counts(all_ids)
    repeated = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    extra = int(pc.sum(repeated.field("counts")).as_py() or 0) - len(repeated)
    return extra, repeated.field("values").to_pylist()[:3]
