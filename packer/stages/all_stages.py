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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtrain.packer.binpack import lower_bound, plan_bins
from packtrain.packer.core.config import PackConfig
from packtrain.packer.core.contract import (
    ConvertSummary,
    ErrorReport,
    MaterializeSummary,
    PackCounts,
    PlanSummary,
    RejectReason,
    pack_outcome_error,
)
from packtrain.packer.core.errors import ConfigError, MediaError
from packtrain.packer.core.pack.schema import FORMAT_VERSION, IGNORE_INDEX, MEDIA_REF, SEQUENCE_SCHEMA
from packtrain.packer.core.pack.shards import (
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
from packtrain.packer.media.access import EMBEDDED_DIR, MediaLimits, MediaRoots
from packtrain.packer.media.store import media_blob
from packtrain.packer.sources.mixture import repeat, source_counts, weigher
from packtrain.packer.sources.raw import SKIPPED
from packtrain.packer.sources.records import iter_records, source_files
from packtrain.packer.tokenize import Reject, SampleTokenizer, TokenizedSample

WORK = "work"
CONFIG_CLAIM = "config.json"
REFUSED = "refused.json"  # under work/: why a finished pack got no manifest, and its final counts
DUPLICATE_IDS = "duplicate_ids"  # manifest counts key: samples whose id an earlier sample already used
SHARD_REJECTS = (
    "rejects"  # a shard's done record: the samples materialize dropped (media that does not decode)
)
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


class PackRefused(ConfigError):
    """Every shard is written, but the final counts make the pack useless (NoSamples,
    TooManyRejected): finalize publishes no manifest, so nothing can train on it.

    `report`: the ErrorReport (reason, error); `manifest`: what the manifest would have been (its
    counts and stats, for the operator and `pack run`); `summary`: the materialize worker's summary,
    with the final counts in `pack`, when materialize raised it.
    """

    def __init__(
        self, report: ErrorReport, manifest: dict[str, Any], summary: MaterializeSummary | None = None
    ):
        super().__init__(report["error"])
        self.report, self.manifest, self.summary = report, manifest, summary

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a worker process, re-raised in `pack run`
        return type(self), (self.report, self.manifest, self.summary)


def refusal(out: Path) -> dict[str, Any] | None:
    """The refusal finalize recorded in `out` (REFUSED: the report and the would-be manifest), or None."""
    path = _work(out) / REFUSED
    return json.loads(path.read_text()) if path.is_file() else None


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
    cfg: PackConfig, tokenizer: SampleTokenizer, sample: TokenizedSample, position: int
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
        cut = tokenizer.truncate(sample, max_length)
        if cut is not None:
            return cut
        detail += "; cannot truncate without cutting a vision-token run or losing all labels"
    return Reject(sample.source, sample.index, sample.sample_id, RejectReason.OVERLONG, detail)


def sample_tokenizer(cfg: PackConfig, out: Path) -> SampleTokenizer:
    """The tokenizer and processor a convert worker of `out` uses; load it once and hand it to every
    worker slice (`convert(tokenizer=...)`, forked workers) instead of each slice re-reading it."""
    return SampleTokenizer(cfg.source, cfg.model, cfg.packing, embedded_dir=_work(out) / EMBEDDED_DIR)


def convert(
    cfg: PackConfig,
    out: Path,
    index: int,
    count: int,
    progress: Progress | None = None,
    tokenizer: SampleTokenizer | None = None,
) -> ConvertSummary:
    """Tokenize and measure every `count`-th input record starting at `index`.

    `tokenizer`: one `sample_tokenizer(cfg, out)` already loaded (default: load it here).
    """
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

    tokenizer = tokenizer or sample_tokenizer(cfg, out)
    # Converted rows go to the part file as Arrow record batches every PART_BATCH_TOKENS tokens: Python
    # int lists cost ~80 bytes a token, and one batch's list offsets are int32 (2^31 tokens at most).
    # Streamed, a worker holds one batch, whatever the size of its slice.
    rows: list[dict[str, Any]] = []
    pending_tokens = converted = tokens = 0
    rejected = seen = 0
    # A unit is one JSON record or one Parquet row group (`records.iter_records`).
    mine: Callable[[int], bool] = lambda unit: unit % count == index  # noqa: E731
    records = iter_records(cfg.source.paths, select=mine, weigh=weigher(cfg.source, cfg.packing.seed))
    first: TokenizedSample | Reject | None = None  # a record's result, reused for its mixture repeats
    # Rejects stream to their file (a worker may reject millions: a missing media folder).
    with (
        atomic_writer(work / "convert" / f"rejects-{name}.jsonl") as reject_file,
        atomic_writer(work / "convert" / f"part-{name}.arrow") as part_file,
        pa.ipc.new_file(pa.PythonFile(part_file, mode="w"), PART_SCHEMA) as part,
    ):
        for position, raw in enumerate(records):
            if raw.reason == SKIPPED:
                continue  # another worker's record, yielded unparsed
            seen += 1
            if raw.copy == 0 or first is None:
                first = tokenizer(raw)
            result = repeat(first, raw.copy)
            if isinstance(result, TokenizedSample):
                result = _apply_overlong(cfg, tokenizer, result, position)
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
                    part.write_batch(pa.RecordBatch.from_pylist(rows, schema=PART_SCHEMA))
                    converted += len(rows)
                    tokens += pending_tokens
                    rows, pending_tokens = [], 0
            if progress is not None and seen % 64 == 0:
                progress(64)
        if progress is not None and seen % 64:
            progress(seen % 64)
        if rows:
            part.write_batch(pa.RecordBatch.from_pylist(rows, schema=PART_SCHEMA))
            converted += len(rows)
            tokens += pending_tokens
        # Claim the folder only now, before publishing anything (the part and rejects files appear
        # when this block ends): a config that fails (bad model or paths, `overlong: error`) leaves
        # it free for the corrected config.
        check_output_config(cfg, out, record=True)

    summary: ConvertSummary = {
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


SMALL_PACK_SHARDS = 16
"""A pack too small to fill this many shards of `sequencesPerShard` gets this many smaller shards
(of at least MIN_SHARD_SEQUENCES), so materialize spreads over up to 16 workers even for a pack that
one full shard would hold."""
MIN_SHARD_SEQUENCES = 4


def shard_size(sequences: int, sequences_per_shard: int) -> int:
    """Sequences per shard: `sequences_per_shard`, smaller for a small pack (see SMALL_PACK_SHARDS).

    A function of the pack alone, never of the worker count: the same inputs and config give the
    same shards whatever the number of workers.
    """
    return max(1, min(sequences_per_shard, max(MIN_SHARD_SEQUENCES, -(-sequences // SMALL_PACK_SHARDS))))


def plan(cfg: PackConfig, out: Path) -> PlanSummary:
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
    packed_by_file: Counter[str] = Counter()  # per source file name, for the per-source counts
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
        packed_by_file.update(
            {v["values"]: v["counts"] for v in pc.value_counts(table.column("source")).to_pylist()}
        )

    position = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    order = np.argsort(position, kind="stable")
    part_of = (np.concatenate(parts) if parts else np.zeros(0, np.int32))[order]
    row_of = (np.concatenate(rows) if rows else np.zeros(0, np.int32))[order]
    length = (np.concatenate(lengths) if lengths else np.zeros(0, np.int64))[order]

    p = cfg.packing
    if len(length):
        order, offsets = plan_bins(
            length, p.max_length, algorithm=p.algorithm, seed=p.seed, partial_threshold=p.partial_threshold
        )
    else:
        order, offsets = np.zeros(0, np.int64), np.zeros(1, np.int64)
    sequences = len(offsets) - 1
    per_shard = shard_size(sequences, p.sequences_per_shard)
    offsets32 = pa.array(offsets, pa.int32())
    plan_table = pa.table(
        {
            "shard": pa.array(np.arange(sequences) // per_shard, pa.int32()),
            "parts": pa.ListArray.from_arrays(offsets32, pa.array(part_of[order], pa.int32())),
            "rows": pa.ListArray.from_arrays(offsets32, pa.array(row_of[order], pa.int32())),
        },
        schema=PLAN_SCHEMA,
    )
    write_table(work / "plan.arrow", plan_table)

    reasons: Counter[str] = Counter()
    rejected_by_file: Counter[str] = Counter()
    reject_ids: list[str] = []
    with _rejects_in_order(work, count) as rejects, atomic_writer(out / REJECTS) as f:
        for r in rejects:
            reasons[r["reason"]] += 1
            rejected_by_file[r["source"]] += 1
            if isinstance(r.get("id"), str):
                reject_ids.append(r["id"])
            f.write(_reject_line(r))
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
    shards = -(-sequences // per_shard)
    fill_ratio, padding_saved = _fill(tokens, sequences, converted_total, p.max_length)
    summary: PlanSummary = {
        "stage": "plan",
        "samples": converted_total + rejected,
        "packed": converted_total,
        "rejected": rejected,
        "rejected_by_reason": dict(sorted(reasons.items())),
        "duplicate_ids": duplicates,
        "sequences": sequences,
        "shards": shards,
        "tokens": tokens,
        "lower_bound": lower_bound(length, p.max_length) if len(length) else 0,
        "fill_ratio": fill_ratio,
        "padding_saved": padding_saved,
        "sources": source_counts(
            source_files(cfg.source.paths), cfg.source.mixture, packed_by_file, rejected_by_file
        ),
    }
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


@contextlib.contextmanager
def _rejects_in_order(
    work: Path, count: int, late: Sequence[dict[str, Any]] = ()
) -> Iterator[Iterator[dict[str, Any]]]:
    """Every reject in input order: each convert worker's file (already in position order) and
    materialize's `late` rejects, merged streaming. Global positions make the order independent of
    the number of workers."""
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context((work / "convert" / f"rejects-{_part_name(i, count)}.jsonl").open("rb"))
            for i in range(count)
        ]
        streams = [(json.loads(line) for line in fh if line.strip()) for fh in files]
        yield heapq.merge(*streams, sorted(late, key=lambda r: r["position"]), key=lambda r: r["position"])


def _reject_line(r: dict[str, Any]) -> bytes:
    """One `rejects.jsonl` line: the reject without its position (an internal ordering key)."""
    keep = {k: r[k] for k in ("source", "index", "id", "reason", "detail")}
    return (json.dumps(keep, ensure_ascii=False) + "\n").encode()


def _fill(tokens: int, sequences: int, packed: int, max_length: int) -> tuple[float, float]:
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


def _sweep(folder: Path, owned: Callable[[str], bool]) -> None:
    """Remove temp files a killed run of this stage left in `folder` (rule: `shards.remove_stale_temps`)."""
    remove_stale_temps(folder, owned, short_write=lambda final: final in (MANIFEST, CONFIG_CLAIM))


def _load_plan(out: Path) -> tuple[dict[str, Any], pa.Table]:
    work = _work(out)
    if not (work / "plan.json").is_file():
        raise ConfigError(f"no plan in {out}: run `packtrain pack plan` before materialize")
    return json.loads((work / "plan.json").read_text()), read_table(work / "plan.arrow")


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


def _shard_media(
    cfg: PackConfig, flat_media: pa.StructArray, embedded: Path | None
) -> tuple[dict[str, dict[str, Any]], dict[str, MediaError]]:
    """Each media key's MEDIA_SCHEMA row, made once per shard, and the keys whose video does not decode."""
    blobs: dict[str, dict[str, Any]] = {}
    bad: dict[str, MediaError] = {}
    limits, roots = MediaLimits.of(cfg.source), MediaRoots(cfg.source).all_roots()
    if embedded is not None:  # media convert took from the dataset files, kept by sha256
        roots |= {os.path.realpath(embedded)}
    for i, key in enumerate(flat_media.field("key").to_pylist()):
        if key not in blobs and key not in bad:
            try:
                blobs[key] = media_blob(flat_media[i].as_py(), cfg.packing.media_storage, limits, roots)
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
        _reject_row(Reject(r["source"], r["index"], r["sample_id"], err.reason, err.detail), r["position"])
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


def materialize(
    cfg: PackConfig, out: Path, index: int, count: int, progress: Progress | None = None
) -> MaterializeSummary:
    """Write every `count`-th shard starting at `index`; the worker that completes the set writes the manifest.

    Every sampled video frame is decoded here (convert counted from headers): a sample whose video
    does not decode is dropped from its sequence and rejected (`corrupt_media`), not a failed pack.
    """
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
    written = 0
    for s in mine:
        done = work / "shards" / f"{s:05d}.json"
        if done.is_file() and _shard_intact(out, json.loads(done.read_text())):
            continue
        rows = np.nonzero(shard_col == s)[0]  # a shard's rows are consecutive (plan: sequence // size)
        plan_rows = plan_table.slice(int(rows[0]), len(rows)) if len(rows) else plan_table.slice(0, 0)
        # Mapped per shard and unmapped after it: a map kept for the whole stage keeps every page a
        # shard touched resident, so a worker's RSS grew with the pack (2.3 GiB at 100k samples).
        part_tables = {
            part: read_table(
                work / "convert" / f"part-{_part_name(part, plan_info['convert_workers'])}.arrow"
            )
            for part in np.unique(plan_rows.column("parts").combine_chunks().flatten().to_numpy()).tolist()
        }
        sequences, media, rejects = _build_shard(cfg, plan_rows, part_tables, work / EMBEDDED_DIR)
        del part_tables
        entry = write_shard(out, s, sequences, media)
        # The shard's rejects travel in its done record, published with it in one rename: a re-run
        # rewrites both, and `finalize` reads each shard's once, so nothing is counted twice.
        atomic_write_json(done, {**entry, SHARD_REJECTS: rejects})
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
        summary.update(manifest=True, manifest_sha256=sha256_file(out / MANIFEST), pack=pack_counts(manifest))
    return summary


def _shard_intact(out: Path, entry: dict[str, Any]) -> bool:
    seq_rel, media_rel = shard_paths(entry["index"])
    return all(
        (out / rel).is_file() and sha256_file(out / rel) == want
        for rel, want in ((seq_rel, entry["sha256"]), (media_rel, entry["media_sha256"]))
    )


def finalize(cfg: PackConfig, out: Path) -> dict[str, Any] | None:
    """Write manifest.json once every shard is done; None while some are missing.

    Plan's counts, less the samples materialize rejected (their rejects merged into rejects.jsonl
    in input order); sequences, tokens, lower bound and fill are those of the shards written.
    Several workers may get here at once: the content is deterministic and the
    write atomic, so whichever rename lands last leaves the same bytes.

    Counts that make the pack useless (`pack_outcome_error`: nothing packed, more rejected than
    packing.maxRejectedFraction) publish no manifest: the refusal and the would-be manifest go to
    work/REFUSED and PackRefused is raised, the same on every re-run (the counts are deterministic).
    """
    plan_info, _ = _load_plan(out)
    summary = plan_info["summary"]
    entries: list[dict[str, Any]] = []
    late: list[dict[str, Any]] = []  # materialize's rejects
    for s in range(summary["shards"]):
        done = _work(out) / "shards" / f"{s:05d}.json"
        if not done.is_file():
            return None
        entry = json.loads(done.read_text())
        late.extend(entry.pop(SHARD_REJECTS, []))
        entries.append(entry)
    p = cfg.packing
    rejects_sha256 = plan_info["rejects_sha256"]
    reasons = Counter(summary["rejected_by_reason"])
    sources = json.loads(json.dumps(summary.get("sources", {})))
    if late:
        with (
            _rejects_in_order(_work(out), plan_info["convert_workers"], late) as rejects,
            atomic_writer(out / REJECTS) as f,
        ):
            for r in rejects:
                f.write(_reject_line(r))
        rejects_sha256 = sha256_file(out / REJECTS)
        reasons.update(r["reason"] for r in late)
        entry_of = {i["name"]: i.get("entry", "") for i in plan_info["inputs"]}
        for r in late:
            counts = sources.get(entry_of.get(r["source"], ""))
            if counts is not None:
                counts["packed"] -= 1
                counts["rejected"] += 1
    totals = np.array([_shard_totals(out, e) for e in entries], dtype=np.int64).reshape(-1, 2)
    tokens, label_tokens = (int(x) for x in totals.sum(axis=0))
    packed = summary["packed"] - len(late)
    sequences = sum(int(e["rows"]) for e in entries)
    fill_ratio, padding_saved = _fill(tokens, sequences, packed, p.max_length)
    manifest = {
        "format": "packtrain-pack",
        "format_version": FORMAT_VERSION,
        "family": cfg.model.family,
        "config": cfg.dump(),
        "config_hash": cfg.config_hash(),
        "inputs": plan_info["inputs"],
        "counts": {
            "input": summary["samples"],
            "packed": packed,
            "rejected": summary["rejected"] + len(late),
            "rejected_by_reason": dict(sorted(reasons.items())),
            DUPLICATE_IDS: summary.get("duplicate_ids", 0),
            "sources": sources,  # per source.paths entry: input = packed + rejected
        },
        "tokens": tokens,
        "label_tokens": label_tokens,
        "sequences": sequences,
        "lower_bound": lower_bound(totals[:, 0], p.max_length),
        "max_length": p.max_length,
        "algorithm": p.algorithm,
        "fill_ratio": fill_ratio,
        "padding_saved": padding_saved,
        "rejects": {"file": REJECTS, "sha256": rejects_sha256},
        "shards": entries,
    }
    counts = manifest["counts"]
    problem = pack_outcome_error(
        counts["input"], counts["packed"], counts["rejected_by_reason"], p.max_rejected_fraction
    )
    if problem is not None:
        report: ErrorReport = {**problem, "stage": "materialize"}
        atomic_write_json(_work(out) / REFUSED, {"report": report, "manifest": manifest})
        (out / MANIFEST).unlink(missing_ok=True)
        raise PackRefused(report, manifest)
    (_work(out) / REFUSED).unlink(missing_ok=True)
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def pack_counts(manifest: dict[str, Any]) -> PackCounts:
    """The finished pack's counts from its manifest, under the stage summaries' keys."""
    c = manifest["counts"]
    return {
        "samples": c["input"],
        "packed": c["packed"],
        "rejected": c["rejected"],
        "rejected_by_reason": c["rejected_by_reason"],
        "sequences": manifest["sequences"],
        "tokens": manifest["tokens"],
        "lower_bound": manifest["lower_bound"],
        "fill_ratio": manifest["fill_ratio"],
        "padding_saved": manifest["padding_saved"],
    }


def _shard_totals(out: Path, entry: dict[str, Any]) -> tuple[int, int]:
    """A written shard's tokens and label tokens (its columns memory-mapped, summed without copying rows)."""
    table = read_table(out / entry["file"])
    tokens = int(pc.sum(table.column("seq_lens").combine_chunks().flatten()).as_py() or 0)
    labels = table.column("labels").combine_chunks().flatten()
    return tokens, int(pc.sum(pc.not_equal(labels, IGNORE_INDEX).cast(pa.int64())).as_py() or 0)
