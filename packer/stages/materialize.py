"""Materialize (many workers): write the shards the plan assigned, then the manifest.

Worker `index` of `count` writes every `count`-th shard. Every sampled video frame is decoded
here (convert counted from headers): a sample whose video does not decode is dropped from its
sequence and rejected (`corrupt_media`), not a failed pack. The worker that completes the set
runs `finalize`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtrain.core.config import PackConfig
from packtrain.core.contract import MaterializeSummary
from packtrain.core.errors import ConfigError, MediaError
from packtrain.core.model_spec import vision_spec
from packtrain.core.pack.schema import MEDIA_REF, SEQUENCE_SCHEMA
from packtrain.core.pack.shards import (
    MANIFEST,
    atomic_write_json,
    read_table,
    sha256_file,
    shard_paths,
    write_shard,
)
from packtrain.packer.media.access import EMBEDDED_DIR, MediaLimits, MediaRoots
from packtrain.packer.media.store import media_blob
from packtrain.packer.stages.finalize import finalize, pack_counts
from packtrain.packer.stages.workdir import (
    PART_SCHEMA,
    SHARD_REJECTS,
    PackRefused,
    Progress,
    check_output_config,
    load_plan,
    part_name,
    reject_row,
    sweep,
    work_dir,
)
from packtrain.packer.tokenize import Reject

_SHARD_NAME = re.compile(r"^(\d{5})\.")


def materialize(
    cfg: PackConfig, out: Path, index: int, count: int, progress: Progress | None = None
) -> MaterializeSummary:
    """Write every `count`-th shard starting at `index`; the worker that completes the set writes
    the manifest (see the module docstring for the samples dropped here)."""
    if not 0 <= index < count:
        raise ConfigError(f"materialize index {index} is outside 0..{count - 1}")
    check_output_config(cfg, out)
    plan_info, plan_table = load_plan(out)
    work = work_dir(out)

    def owned(final: str) -> bool:  # this worker's shards: NNNNN.arrow, NNNNN.media.arrow, NNNNN.json
        m = _SHARD_NAME.match(final)
        return m is not None and int(m[1]) % count == index

    sweep(out / "shards", owned)
    sweep(work / "shards", owned)
    sweep(out, lambda _: False)
    shard_col = plan_table.column("shard").to_numpy() if plan_table.num_rows else np.zeros(0, np.int32)
    mine = [s for s in range(plan_info["summary"]["shards"]) if s % count == index]
    written = 0
    for s in mine:
        done = work / "shards" / f"{s:05d}.json"
        if done.is_file() and _shard_intact(out, json.loads(done.read_text())):
            continue
        rows = np.nonzero(shard_col == s)[0]  # a shard's rows are consecutive (plan: sequence // size)
        plan_rows = plan_table.slice(int(rows[0]), len(rows)) if len(rows) else plan_table.slice(0, 0)
        _write_one_shard(cfg, out, s, plan_rows, plan_info["convert_workers"])
        written += 1
        if progress is not None:
            progress(1)
    rejected = sum(
        len(json.loads((work / "shards" / f"{s:05d}.json").read_text()).get(SHARD_REJECTS, [])) for s in mine
    )
    summary: MaterializeSummary = {
        "stage": "materialize",
        "index": index,
        "count": count,
        "shards": len(mine),
        "written": written,
        "rejected": rejected,
        "manifest": False,
        "manifest_sha256": None,
        "pack": None,
    }
    try:
        manifest = finalize(cfg, out)
    except PackRefused as exc:  # the final counts still go to the operator, beside the reason
        raise PackRefused(exc.report, exc.manifest, {**summary, "pack": pack_counts(exc.manifest)}) from None
    if manifest is not None:
        summary["manifest"] = True
        summary["manifest_sha256"] = sha256_file(out / MANIFEST)
        summary["pack"] = pack_counts(manifest)
    return summary


def _write_one_shard(cfg: PackConfig, out: Path, s: int, plan_rows: pa.Table, convert_workers: int) -> None:
    """Shard `s` from its plan rows: its files, then its done record (with the samples it dropped)."""
    work = work_dir(out)
    # Mapped per shard and unmapped after it: a map kept for the whole stage keeps every page a
    # shard touched resident, so a worker's RSS grew with the pack (2.3 GiB at 100k samples).
    part_tables = {
        part: read_table(work / "convert" / f"part-{part_name(part, convert_workers)}.arrow")
        for part in np.unique(plan_rows.column("parts").combine_chunks().flatten().to_numpy()).tolist()
    }
    sequences, media, rejects = _build_shard(cfg, plan_rows, part_tables, work / EMBEDDED_DIR)
    del part_tables
    entry = write_shard(out, s, sequences, media)
    # The shard's rejects travel in its done record, published with it in one rename: a re-run
    # rewrites both, and `finalize` reads each shard's once, so nothing is counted twice.
    atomic_write_json(work / "shards" / f"{s:05d}.json", {**entry, SHARD_REJECTS: rejects})


def _lists(offsets: np.ndarray, values: pa.Array) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def _build_shard(
    cfg: PackConfig,
    plan_rows: pa.Table,
    part_tables: dict[int, pa.Table],
    embedded: Path | None = None,
) -> tuple[pa.Table, list[dict[str, Any]], list[dict[str, Any]]]:
    """One shard's sequences (SEQUENCE_SCHEMA), its media rows and the samples it rejected.

    Built column-wise: the sub-samples are taken from the convert parts and regrouped by offsets, so
    no token becomes a Python object. A sample whose video does not decode (convert counted it from
    the headers) is dropped from its sequence and returned as a reject row: its sequence gets
    shorter (a sample is never split), a sequence left empty is dropped.
    """
    samples, seq_off = _take_samples(plan_rows, part_tables)
    blobs, bad = _shard_media(cfg, samples.column("media").combine_chunks().flatten(), embedded)
    rejects: list[dict[str, Any]] = []
    if bad:
        samples, seq_off, rejects = _drop_undecodable(samples, seq_off, bad)
    n = samples.num_rows
    length = samples.column("length").combine_chunks()
    token_off = np.concatenate([[0], np.cumsum(length.to_numpy(), dtype=np.int64)])[seq_off]
    if token_off[-1] >= 2**31:
        raise ConfigError("a shard holds 2^31 tokens or more; lower packing.sequencesPerShard")
    media = samples.column("media").combine_chunks()
    per_sample = pc.list_value_length(media).to_numpy(zero_copy_only=False).astype(np.int64)
    flat_media = media.flatten()
    media_of = np.repeat(np.arange(n), per_sample)  # the sub-sample of each media item
    seq_of = np.repeat(np.arange(len(seq_off) - 1), np.diff(seq_off))
    children = dict(zip([f.name for f in flat_media.type], flat_media.flatten(), strict=True))
    refs = pa.StructArray.from_arrays(
        [
            pa.array(media_of - seq_off[seq_of[media_of]], pa.int32()),
            *(children[f.name] for f in MEDIA_REF if f.name != "sample"),
        ],
        fields=list(MEDIA_REF),
    )
    table = pa.Table.from_arrays(
        [
            _lists(token_off, samples.column("input_ids").combine_chunks().flatten()),
            _lists(token_off, samples.column("labels").combine_chunks().flatten()),
            _lists(seq_off, length),
            _lists(seq_off, samples.column("sample_id").combine_chunks()),
            _lists(seq_off, samples.column("source").combine_chunks()),
            _lists(seq_off, samples.column("index").combine_chunks()),
            _lists(np.concatenate([[0], np.cumsum(per_sample)])[seq_off], refs),
        ],
        schema=SEQUENCE_SCHEMA,
    )
    used = set(children["key"].to_pylist())  # a dropped sample's other media may be used by no one
    return table, [blobs[k] for k in sorted(blobs) if k in used], rejects


def _take_samples(plan_rows: pa.Table, part_tables: dict[int, pa.Table]) -> tuple[pa.Table, np.ndarray]:
    """The shard's sub-samples (PART_SCHEMA rows, in plan order) and each sequence's offsets into them."""
    parts_col = plan_rows.column("parts").combine_chunks()
    rows_col = plan_rows.column("rows").combine_chunks()
    seq_off = parts_col.offsets.to_numpy() - parts_col.offsets[0].as_py()  # sub-samples per sequence
    flat_parts = parts_col.flatten().to_numpy()
    flat_rows = rows_col.flatten().to_numpy()
    # Taken record batch by record batch: a Table.take over a many-chunk column may first concatenate
    # every chunk, i.e. copy a whole convert part into memory for each shard.
    pieces: list[pa.RecordBatch] = []
    where: list[np.ndarray] = []
    for part in np.unique(flat_parts):
        at = np.nonzero(flat_parts == part)[0]
        batches = part_tables[int(part)].to_batches()
        starts = np.cumsum([0] + [b.num_rows for b in batches])
        batch_of = np.searchsorted(starts, flat_rows[at], side="right") - 1
        for b in np.unique(batch_of):
            sel = at[batch_of == b]
            pieces.append(batches[int(b)].take(pa.array(flat_rows[sel] - starts[b])))
            where.append(sel)
    samples = pa.Table.from_batches(pieces, schema=PART_SCHEMA).combine_chunks()
    if pieces:
        samples = samples.take(pa.array(np.argsort(np.concatenate(where), kind="stable")))
    return samples, seq_off


def _shard_media(
    cfg: PackConfig, flat_media: pa.StructArray, embedded: Path | None
) -> tuple[dict[str, dict[str, Any]], dict[str, MediaError]]:
    """Each media key's MEDIA_SCHEMA row, made once per shard, and the keys whose video does not decode."""
    blobs: dict[str, dict[str, Any]] = {}
    bad: dict[str, MediaError] = {}
    limits, roots = MediaLimits.of(cfg.source), MediaRoots(cfg.source).all_roots()
    tile = vision_spec(Path(cfg.model.path), cfg.model).tile_size
    if embedded is not None:  # media convert took from the dataset files, kept by sha256
        roots |= {os.path.realpath(embedded)}
    for i, key in enumerate(flat_media.field("key").to_pylist()):
        if key not in blobs and key not in bad:
            try:
                ref = flat_media[i].as_py()
                blobs[key] = media_blob(
                    ref, cfg.packing.media_storage, limits, roots, alpha=cfg.model.alpha, tile_size=tile
                )
            except MediaError as exc:
                bad[key] = exc
    return blobs, bad


def _drop_undecodable(
    samples: pa.Table, seq_off: np.ndarray, bad: dict[str, MediaError]
) -> tuple[pa.Table, np.ndarray, list[dict[str, Any]]]:
    """The samples using none of the `bad` media, their sequences' new offsets (emptied sequences
    gone), and a reject row (in position order) for each sample dropped."""
    media = samples.column("media").combine_chunks()
    per_sample = pc.list_value_length(media).to_numpy(zero_copy_only=False).astype(np.int64)
    keys = media.flatten().field("key").to_pylist()
    media_of = np.repeat(np.arange(samples.num_rows), per_sample)
    broken = np.zeros(samples.num_rows, dtype=bool)
    broken[media_of[np.array([k in bad for k in keys], dtype=bool)]] = True
    first_bad: dict[int, MediaError] = {}
    for sample, key in zip(media_of.tolist(), keys, strict=True):
        if key in bad:
            first_bad.setdefault(sample, bad[key])
    dropped = (
        samples.filter(pa.array(broken)).select(["position", "source", "index", "sample_id"]).to_pylist()
    )
    rejects = [
        reject_row(Reject(r["source"], r["index"], r["sample_id"], err.reason, err.detail), r["position"])
        for r, err in zip(dropped, (first_bad[i] for i in np.flatnonzero(broken).tolist()), strict=True)
    ]
    kept = np.bincount(
        np.repeat(np.arange(len(seq_off) - 1), np.diff(seq_off))[~broken], minlength=len(seq_off) - 1
    )
    kept = kept[kept > 0]
    return (
        samples.filter(pa.array(~broken)),
        np.concatenate([[0], np.cumsum(kept)]).astype(np.int64),
        sorted(rejects, key=lambda r: r["position"]),
    )


def _shard_intact(out: Path, entry: dict[str, Any]) -> bool:
    seq_rel, media_rel = shard_paths(entry["index"])
    return all(
        (out / rel).is_file() and sha256_file(out / rel) == want
        for rel, want in ((seq_rel, entry["sha256"]), (media_rel, entry["media_sha256"]))
    )
