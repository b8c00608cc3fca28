"""The three stages of a pack: convert (many workers), plan (one), materialize (many).

Every stage reads and writes only the output folder, publishes its results with
atomic renames and ends by writing a small "done" record, so a re-run of a
finished stage is a no-op and a killed worker leaves nothing that looks whole.
Results do not depend on the number of workers: samples are ordered by their
global position in the input before planning.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import PackConfig
from .media import MediaLimits, MediaRoots
from .media_store import media_blob
from .plan import lower_bound, plan_bins
from .records import ConfigError, iter_records
from .shard_format import FORMAT_VERSION, IGNORE_INDEX
from .shards import (
    MANIFEST,
    REJECTS,
    atomic_write,
    atomic_write_json,
    atomic_writer,
    canonical_json,
    read_table,
    remove_stale_temps,
    sha256_file,
    shard_paths,
    temp_path,
    write_shard,
    write_table,
)
from .tokenize import Reject, SampleTokenizer, TokenizedSample, truncate_sample

WORK = "work"
CONFIG_CLAIM = "config.json"
DUPLICATE_IDS = "duplicate_ids"  # manifest counts key: samples whose id an earlier sample already used
PART_BATCH_TOKENS = 1 << 20
Progress = Callable[[int], None]

PART_MEDIA = pa.struct(
    [
        ("kind", pa.string()),
        ("path", pa.string()),
        ("key", pa.string()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("grid_t", pa.int32()),
        ("grid_h", pa.int32()),
        ("grid_w", pa.int32()),
        ("frames", pa.list_(pa.int32())),
        ("second_per_grid", pa.float32()),
    ]
)
PART_SCHEMA = pa.schema(
    [
        ("position", pa.int64()),  # global position of the record over all input files
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("index", pa.int64()),
        ("length", pa.int32()),
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("media", pa.list_(PART_MEDIA)),
    ]
)
PLAN_SCHEMA = pa.schema(
    [
        ("shard", pa.int32()),
        ("parts", pa.list_(pa.int32())),
        ("rows", pa.list_(pa.int32())),
    ]
)


def _part_name(index: int, count: int) -> str:
    return f"{index:05d}-of-{count:05d}"


def _work(out: Path) -> Path:
    return out / WORK


def check_output_config(cfg: PackConfig, out: Path, record: bool = False) -> None:
    """Refuse to mix two configs in one output folder (a re-run with the same config is fine).

    `record` claims a free folder for `cfg`: convert does it once its slice has converted, so a
    config error (a wrong model or path, `overlong: error`) does not lock the folder to the bad config.
    """
    path = _work(out) / CONFIG_CLAIM
    want = {"config_hash": cfg.config_hash(), "config": cfg.dump()}
    if not path.is_file():
        if not record:
            return
        _create_once(path, canonical_json(want))
    existing = json.loads(path.read_text())
    if existing.get("config_hash") != want["config_hash"]:
        raise ConfigError(
            f"{out} already holds a pack made with a different configuration "
            f"(hash {existing.get('config_hash', '?')[:12]}… vs {want['config_hash'][:12]}…). "
            "Use a new output folder, or delete this one to re-pack."
        )


def _create_once(path: Path, data: bytes) -> None:
    """Publish `path` atomically unless it exists: of workers racing to create it, exactly one wins
    (a hard link fails on an existing name, where a rename would replace it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path, "new")
    atomic_write(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links: a rename (last writer wins) is the best left
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _media_row(m: Any) -> dict[str, Any]:
    return {
        "kind": m.kind,
        "path": str(m.path),
        "key": m.key,
        "height": m.height,
        "width": m.width,
        "grid_t": m.grid_t,
        "grid_h": m.grid_h,
        "grid_w": m.grid_w,
        "frames": list(m.frames),
        "second_per_grid": float(m.second_per_grid),
    }


REJECT_DETAIL_CHARS = 500
"""Longest reject detail kept: a dataset's paths and messages are untrusted and may be huge."""


def _reject_row(r: Reject, position: int) -> dict[str, Any]:
    detail = r.detail if len(r.detail) <= REJECT_DETAIL_CHARS else r.detail[: REJECT_DETAIL_CHARS - 1] + "…"
    return {
        "position": position,
        "source": r.source,
        "index": r.index,
        "id": r.sample_id,
        "reason": r.reason,
        "detail": detail,
    }


def _apply_overlong(
    cfg: PackConfig, sample: TokenizedSample, position: int
) -> TokenizedSample | Reject:
    max_length = cfg.packing.max_length
    if len(sample.input_ids) <= max_length:
        return sample
    policy = cfg.packing.overlong
    detail = f"{len(sample.input_ids)} tokens > maxLength {max_length}"
    if policy == "error":
        raise ConfigError(
            f"sample {sample.sample_id} ({sample.source} #{sample.index}) has {detail}; "
            "raise packing.maxLength or set packing.overlong to drop or truncate"
        )
    if policy == "truncate":
        cut = truncate_sample(sample, max_length)
        if cut is not None:
            return cut
        detail += "; cannot truncate without cutting a vision-token run or losing all labels"
    return Reject(sample.source, sample.index, sample.sample_id, "overlong", detail)


def convert(
    cfg: PackConfig, out: Path, index: int, count: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Tokenize and measure every `count`-th input record starting at `index`."""
    if not 0 <= index < count:
        raise ConfigError(f"convert index {index} is outside 0..{count - 1}")
    work = _work(out)
    name = _part_name(index, count)
    summary_path = work / "convert" / f"summary-{name}.json"
    check_output_config(cfg, out)
    _sweep(work / "convert", lambda final: f"-{name}." in final)
    _sweep(work, lambda _: False)
    if summary_path.is_file():
        return json.loads(summary_path.read_text())

    tokenizer = SampleTokenizer(cfg.source, cfg.model, cfg.packing)
    # Converted rows go to Arrow record batches every PART_BATCH_TOKENS tokens: Python int lists cost
    # ~80 bytes a token (Arrow: 8), and one batch's list offsets are int32 (2^31 tokens at most).
    batches: list[pa.RecordBatch] = []
    rows: list[dict[str, Any]] = []
    pending_tokens = converted = tokens = 0
    rejected = seen = 0
    mine: Callable[[int], bool] = lambda position: position % count == index  # noqa: E731
    # Rejects stream to their file (a worker may reject millions: a missing media folder).
    with atomic_writer(work / "convert" / f"rejects-{name}.jsonl") as reject_file:
        for position, raw in enumerate(iter_records(cfg.source.paths, select=mine)):
            if not mine(position):
                continue  # another worker's record, yielded unparsed
            seen += 1
            result = tokenizer(raw)
            if isinstance(result, TokenizedSample):
                result = _apply_overlong(cfg, result, position)
            if isinstance(result, Reject):
                row = _reject_row(result, position)
                reject_file.write((json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n").encode())
                rejected += 1
            else:
                rows.append(
                    {
                        "position": position,
                        "sample_id": result.sample_id,
                        "source": result.source,
                        "index": result.index,
                        "length": len(result.input_ids),
                        "input_ids": result.input_ids,
                        "labels": result.labels,
                        "media": [_media_row(m) for m in result.media],
                    }
                )
                pending_tokens += len(result.input_ids)
                if pending_tokens >= PART_BATCH_TOKENS:
                    batches.append(pa.RecordBatch.from_pylist(rows, schema=PART_SCHEMA))
                    converted += len(rows)
                    tokens += pending_tokens
                    rows, pending_tokens = [], 0
            if progress is not None and seen % 64 == 0:
                progress(64)
        if progress is not None and seen % 64:
            progress(seen % 64)
        # Claim the folder only now, before publishing anything: a config that fails (bad model
        # or paths, `overlong: error`) leaves it free for the corrected config.
        check_output_config(cfg, out, record=True)

    if rows:
        batches.append(pa.RecordBatch.from_pylist(rows, schema=PART_SCHEMA))
        converted += len(rows)
        tokens += pending_tokens
    write_table(work / "convert" / f"part-{name}.arrow", pa.Table.from_batches(batches, schema=PART_SCHEMA))
    summary = {
        "stage": "convert",
        "index": index,
        "count": count,
        "samples": seen,
        "converted": converted,
        "rejected": rejected,
        "tokens": tokens,
    }
    atomic_write_json(summary_path, summary)
    return summary


_SHARD_NAME = re.compile(r"^(\d{5})\.")
_SUMMARY = re.compile(r"summary-(\d{5})-of-(\d{5})\.json$")


def _convert_parts(out: Path) -> int:
    """Number of convert workers, checking that every part finished."""
    found: dict[int, set[int]] = {}
    for p in sorted((_work(out) / "convert").glob("summary-*.json")):
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


def _input_fingerprints(cfg: PackConfig) -> list[dict[str, Any]]:
    from .records import expand_paths, source_names

    files = expand_paths(cfg.source.paths)
    return [
        {"name": name, "path": str(p), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p, name in zip(files, source_names(files), strict=True)
    ]


def plan(cfg: PackConfig, out: Path) -> dict[str, Any]:
    """Assign every converted sample to a packed sequence and sequences to shards."""
    work = _work(out)
    summary_path = work / "plan.json"
    check_output_config(cfg, out)
    _sweep(work, lambda final: final in ("plan.json", "plan.arrow"))  # plan runs as one process
    _sweep(out, lambda final: final == REJECTS)
    if summary_path.is_file():
        return json.loads(summary_path.read_text())["summary"]

    count = _convert_parts(out)
    positions, parts, rows, lengths, ids = [], [], [], [], []
    converted_total = 0
    for i in range(count):
        name = _part_name(i, count)
        table = read_table(work / "convert" / f"part-{name}.arrow")
        ids.append(table.column("sample_id"))
        pos = table.column("position").to_numpy()
        positions.append(pos)
        parts.append(np.full(len(pos), i, dtype=np.int32))
        rows.append(np.arange(len(pos), dtype=np.int32))
        lengths.append(table.column("length").to_numpy().astype(np.int64))
        converted_total += len(pos)

    position = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    order = np.argsort(position, kind="stable")
    part_of = (np.concatenate(parts) if parts else np.zeros(0, np.int32))[order]
    row_of = (np.concatenate(rows) if rows else np.zeros(0, np.int32))[order]
    length = (np.concatenate(lengths) if lengths else np.zeros(0, np.int64))[order]

    p = cfg.packing
    if len(length):
        order, offsets = plan_bins(length, p.max_length, algorithm=p.algorithm, seed=p.seed,
                                   partial_threshold=p.partial_threshold)
    else:
        order, offsets = np.zeros(0, np.int64), np.zeros(1, np.int64)
    sequences = len(offsets) - 1
    offsets32 = pa.array(offsets, pa.int32())
    plan_table = pa.table(
        {
            "shard": pa.array(np.arange(sequences) // p.sequences_per_shard, pa.int32()),
            "parts": pa.ListArray.from_arrays(offsets32, pa.array(part_of[order], pa.int32())),
            "rows": pa.ListArray.from_arrays(offsets32, pa.array(row_of[order], pa.int32())),
        },
        schema=PLAN_SCHEMA,
    )
    write_table(work / "plan.arrow", plan_table)

    # Each worker's rejects are in position order: merge them, streaming, into input order.
    reasons: Counter[str] = Counter()
    with contextlib.ExitStack() as stack, atomic_writer(out / REJECTS) as f:
        files = [stack.enter_context((work / "convert" / f"rejects-{_part_name(i, count)}.jsonl").open("rb"))
                 for i in range(count)]
        streams = ((json.loads(line) for line in fh if line.strip()) for fh in files)
        reject_ids: list[str] = []
        for r in heapq.merge(*streams, key=lambda r: r["position"]):
            reasons[r["reason"]] += 1
            if isinstance(r.get("id"), str):
                reject_ids.append(r["id"])
            keep = {k: r[k] for k in ("source", "index", "id", "reason", "detail")}
            f.write((json.dumps(keep, ensure_ascii=False) + "\n").encode())
    rejected = sum(reasons.values())
    duplicates, examples = count_duplicate_ids([*ids, pa.array(reject_ids, pa.string())])
    if duplicates:
        print(
            f"packtrain pack plan: warning: {duplicates} samples reuse an earlier sample's id "
            f"(e.g. {examples}); `unpack --sample ID` and per-sample reports cannot tell them apart. "
            "Give every record a unique `id`.",
            file=sys.stderr,
        )
    tokens = int(length.sum())
    shards = -(-sequences // p.sequences_per_shard)
    summary = {
        "stage": "plan",
        "samples": converted_total + rejected,
        "packed": converted_total,
        "rejected": rejected,
        "rejectedByReason": dict(sorted(reasons.items())),
        "duplicateIds": duplicates,
        "sequences": sequences,
        "shards": shards,
        "tokens": tokens,
        "lowerBound": lower_bound(length, p.max_length) if len(length) else 0,
        "fillRatio": round(tokens / (sequences * p.max_length), 6) if sequences else 0.0,
        # Fraction of fixed-length sequences saved versus one sample per sequence.
        "paddingSaved": round(1 - sequences / converted_total, 6) if converted_total else 0.0,
    }
    atomic_write_json(
        summary_path,
        {"summary": summary, "convert_workers": count, "inputs": _input_fingerprints(cfg),
         "rejects_sha256": sha256_file(out / REJECTS)},
    )
    return summary


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


def _sweep(folder: Path, owned: Callable[[str], bool]) -> None:
    """Remove temp files a killed run of this stage left in `folder` (rule: `shards.remove_stale_temps`)."""
    remove_stale_temps(folder, owned, short_write=lambda final: final in (MANIFEST, CONFIG_CLAIM))


def _load_plan(out: Path) -> tuple[dict[str, Any], pa.Table]:
    work = _work(out)
    if not (work / "plan.json").is_file():
        raise ConfigError(f"no plan in {out}: run `packtrain pack plan` before materialize")
    return json.loads((work / "plan.json").read_text()), read_table(work / "plan.arrow")


def _build_shard(
    cfg: PackConfig, plan_table: pa.Table, shard_rows: list[int], part_tables: dict[int, pa.Table]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    sequences: list[dict[str, Any]] = []
    blobs: dict[str, dict[str, Any]] = {}
    limits, roots = MediaLimits.of(cfg.source), MediaRoots(cfg.source).all_roots()
    for r in shard_rows:
        entry = plan_table.slice(r, 1).to_pylist()[0]
        seq: dict[str, Any] = {
            "input_ids": [], "labels": [], "seq_lens": [], "sample_ids": [],
            "sources": [], "indices": [], "media": [],
        }
        for sub, (part, row) in enumerate(zip(entry["parts"], entry["rows"], strict=True)):
            sample = part_tables[part].slice(row, 1).to_pylist()[0]
            seq["input_ids"].extend(sample["input_ids"])
            seq["labels"].extend(sample["labels"])
            seq["seq_lens"].append(sample["length"])
            seq["sample_ids"].append(sample["sample_id"])
            seq["sources"].append(sample["source"])
            seq["indices"].append(sample["index"])
            for m in sample["media"]:
                seq["media"].append({k: v for k, v in m.items() if k != "path"} | {"sample": sub})
                if m["key"] not in blobs:
                    blobs[m["key"]] = media_blob(m, cfg.packing.media_storage, limits, roots)
        sequences.append(seq)
    return sequences, [blobs[k] for k in sorted(blobs)]


def materialize(
    cfg: PackConfig, out: Path, index: int, count: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Write every `count`-th shard starting at `index`; the worker that completes the set writes the manifest."""
    if not 0 <= index < count:
        raise ConfigError(f"materialize index {index} is outside 0..{count - 1}")
    check_output_config(cfg, out)
    plan_info, plan_table = _load_plan(out)
    work = _work(out)
    n_shards = plan_info["summary"]["shards"]

    def owned(final: str) -> bool:  # this worker's shards: NNNNN.arrow, NNNNN.media.arrow, NNNNN.json
        m = _SHARD_NAME.match(final)
        return m is not None and int(m[1]) % count == index

    _sweep(out / "shards", owned)
    _sweep(work / "shards", owned)
    _sweep(out, lambda _: False)
    shard_col = plan_table.column("shard").to_numpy() if plan_table.num_rows else np.zeros(0, np.int32)
    mine = [s for s in range(n_shards) if s % count == index]
    part_tables: dict[int, pa.Table] = {}
    written = 0
    for s in mine:
        done = work / "shards" / f"{s:05d}.json"
        if done.is_file() and _shard_intact(out, json.loads(done.read_text())):
            continue
        shard_rows = np.nonzero(shard_col == s)[0].tolist()
        for r in shard_rows:
            for part in plan_table.column("parts")[r].as_py():
                if part not in part_tables:
                    name = _part_name(part, plan_info["convert_workers"])
                    part_tables[part] = read_table(work / "convert" / f"part-{name}.arrow")
        sequences, media = _build_shard(cfg, plan_table, shard_rows, part_tables)
        entry = write_shard(out, s, sequences, media)
        atomic_write_json(done, entry)
        written += 1
        if progress is not None:
            progress(1)
    manifest = finalize(cfg, out)
    return {
        "stage": "materialize",
        "index": index,
        "count": count,
        "shards": len(mine),
        "written": written,
        "manifest": manifest is not None,
        "manifestSha256": sha256_file(out / MANIFEST) if manifest is not None else None,
    }


def _shard_intact(out: Path, entry: dict[str, Any]) -> bool:
    seq_rel, media_rel = shard_paths(entry["index"])
    return all(
        (out / rel).is_file() and sha256_file(out / rel) == want
        for rel, want in ((seq_rel, entry["sha256"]), (media_rel, entry["media_sha256"]))
    )


def finalize(cfg: PackConfig, out: Path) -> dict[str, Any] | None:
    """Write manifest.json once every shard is done; None while some are missing.

    Several workers may get here at once: the content is deterministic and the
    write atomic, so whichever rename lands last leaves the same bytes.
    """
    plan_info, _ = _load_plan(out)
    summary = plan_info["summary"]
    entries = []
    for s in range(summary["shards"]):
        done = _work(out) / "shards" / f"{s:05d}.json"
        if not done.is_file():
            return None
        entries.append(json.loads(done.read_text()))
    p = cfg.packing
    manifest = {
        "format": "packtrain-pack",
        "format_version": FORMAT_VERSION,
        "family": cfg.model.family,
        "config": cfg.dump(),
        "config_hash": cfg.config_hash(),
        "inputs": plan_info["inputs"],
        "counts": {
            "input": summary["samples"],
            "packed": summary["packed"],
            "rejected": summary["rejected"],
            "rejected_by_reason": summary["rejectedByReason"],
            DUPLICATE_IDS: summary.get("duplicateIds", 0),
        },
        "tokens": summary["tokens"],
        "label_tokens": sum(_label_tokens(out, e) for e in entries),
        "sequences": summary["sequences"],
        "lower_bound": summary["lowerBound"],
        "max_length": p.max_length,
        "algorithm": p.algorithm,
        "fill_ratio": summary["fillRatio"],
        "padding_saved": summary["paddingSaved"],
        "rejects": {"file": REJECTS, "sha256": plan_info["rejects_sha256"]},
        "shards": entries,
    }
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def _label_tokens(out: Path, entry: dict[str, Any]) -> int:
    labels = read_table(out / entry["file"]).column("labels").combine_chunks().flatten()
    return int(pc.sum(pc.not_equal(labels, IGNORE_INDEX).cast(pa.int64())).as_py() or 0)


def run_in_process(cfg: PackConfig, out: Path, workers: int = 1) -> dict[str, Any]:
    """Every stage in this process, worker slice by worker slice; returns the manifest.

    The same slicing as parallel pods, without processes: for tests and debugging.
    """
    for i in range(workers):
        convert(cfg, out, i, workers)
    plan(cfg, out)
    for i in range(workers):
        materialize(cfg, out, i, workers)
    return json.loads((out / MANIFEST).read_text())
