"""Convert (many workers): tokenize and measure a slice of the input records.

Worker `index` of `count` takes every `count`-th unit of work (a JSON record, a Parquet row
group) and writes its samples to a part file and its rejects to a rejects file, both keyed
by the record's global position, so plan's result does not depend on the worker count.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from packtrain.core.config import PackConfig
from packtrain.core.contract import ConvertSummary, RejectReason
from packtrain.core.errors import ConfigError
from packtrain.core.model_size import planning_config, read_config
from packtrain.core.pack.shards import atomic_write_json, atomic_writer
from packtrain.core.vision import VisionSpec, shorter_video
from packtrain.packer.media.access import EMBEDDED_DIR, MediaItem
from packtrain.packer.sources.mixture import repeat, weigher
from packtrain.packer.sources.raw import SKIPPED
from packtrain.packer.sources.records import iter_records
from packtrain.packer.stages.workdir import (
    PART_SCHEMA,
    Progress,
    check_output_config,
    part_name,
    reject_row,
    sweep,
    work_dir,
)
from packtrain.packer.tokenize import Reject, SampleTokenizer, TokenizedSample

PART_BATCH_TOKENS = 1 << 20
"""Tokens per record batch of a part file (see `_PartBatches`)."""
PROGRESS_EVERY = 64  # records between progress callbacks


def sample_tokenizer(cfg: PackConfig, out: Path) -> SampleTokenizer:
    """The tokenizer and processor a convert worker of `out` uses; load it once and hand it to every
    worker slice (`convert(tokenizer=...)`, forked workers) instead of each slice re-reading it."""
    return SampleTokenizer(cfg.source, cfg.model, cfg.packing, embedded_dir=work_dir(out) / EMBEDDED_DIR)


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
    work = work_dir(out)
    name = part_name(index, count)
    summary_path = work / "convert" / f"summary-{name}.json"
    check_output_config(cfg, out)
    sweep(work / "convert", lambda final: f"-{name}." in final)
    sweep(work, lambda _: False)
    if summary_path.is_file():
        return json.loads(summary_path.read_text())

    tokenizer = tokenizer or sample_tokenizer(cfg, out)
    seen, converted, rejected, tokens = _convert_slice(cfg, out, index, count, tokenizer, progress)
    summary: ConvertSummary = {
        "stage": "convert",
        "index": index,
        "count": count,
        "samples": seen,
        "converted": converted,
        "rejected": rejected,
        "tokens": tokens,
    }
    if index == 0:  # once per pack: what the operator plans an SFTJob's GPU memory with
        summary["model_sizes"] = _planning_config(cfg.model.path)
    atomic_write_json(summary_path, summary)
    return summary


def _planning_config(folder: str) -> dict[str, Any] | None:
    """model.path's config.json, trimmed to what the memory planner reads; None without one."""
    try:
        return planning_config(read_config(folder))
    except ConfigError:
        return None


def _convert_slice(
    cfg: PackConfig,
    out: Path,
    index: int,
    count: int,
    tokenizer: SampleTokenizer,
    progress: Progress | None,
) -> tuple[int, int, int, int]:
    """Write the slice's part and rejects files; its samples seen, converted, rejected and tokens."""
    work = work_dir(out)
    name = part_name(index, count)
    # A unit is one JSON record or one Parquet row group (`records.iter_records`).
    mine: Callable[[int], bool] = lambda unit: unit % count == index  # noqa: E731
    records = iter_records(cfg.source.paths, select=mine, weigh=weigher(cfg.source, cfg.packing.seed))
    first: TokenizedSample | Reject | None = None  # a record's result, reused for its mixture repeats
    seen = rejected = 0
    # Rejects stream to their file (a worker may reject millions: a missing media folder).
    with (
        atomic_writer(work / "convert" / f"rejects-{name}.jsonl") as reject_file,
        atomic_writer(work / "convert" / f"part-{name}.arrow") as part_file,
        pa.ipc.new_file(pa.PythonFile(part_file, mode="w"), PART_SCHEMA) as part,
    ):
        batches = _PartBatches(part)
        for position, raw in enumerate(records):
            if raw.reason == SKIPPED:
                continue  # another worker's record, yielded unparsed
            seen += 1
            if raw.copy == 0 or first is None:
                first = tokenizer(raw)
            result = repeat(first, raw.copy)
            if isinstance(result, TokenizedSample):
                result = _apply_overlong(cfg, tokenizer, result)
            if isinstance(result, Reject):
                _write_reject(reject_file, result, position)
                rejected += 1
            else:
                batches.add(result, position)
            if progress is not None and seen % PROGRESS_EVERY == 0:
                progress(PROGRESS_EVERY)
        if progress is not None and seen % PROGRESS_EVERY:
            progress(seen % PROGRESS_EVERY)
        batches.flush()
        # Claim the folder only now, before publishing anything (the part and rejects files appear
        # when this block ends): a config that fails (bad model or paths, `overlong: error`) leaves
        # it free for the corrected config.
        check_output_config(cfg, out, record=True)
    return seen, batches.converted, rejected, batches.tokens


class _PartBatches:
    """Converted rows, written to the part file as Arrow record batches every PART_BATCH_TOKENS tokens.

    Python int lists cost ~80 bytes a token, and one batch's list offsets are int32 (2^31 tokens at
    most): streamed, a worker holds one batch, whatever the size of its slice.
    """

    def __init__(self, part: pa.ipc.RecordBatchFileWriter) -> None:
        self.part = part
        self.rows: list[dict[str, Any]] = []
        self.pending_tokens = self.converted = self.tokens = 0

    def add(self, sample: TokenizedSample, position: int) -> None:
        self.rows.append(
            {
                "position": position,
                "sample_id": sample.sample_id,
                "source": sample.source,
                "index": sample.index,
                "length": len(sample.input_ids),
                "input_ids": sample.input_ids,
                "labels": sample.labels,
                "media": [_media_row(m) for m in sample.media],
            }
        )
        self.pending_tokens += len(sample.input_ids)
        if self.pending_tokens >= PART_BATCH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.part.write_batch(pa.RecordBatch.from_pylist(self.rows, schema=PART_SCHEMA))
            self.converted += len(self.rows)
            self.tokens += self.pending_tokens
            self.rows, self.pending_tokens = [], 0


def _write_reject(reject_file: BinaryIO, result: Reject, position: int) -> None:
    row = reject_row(result, position)
    reject_file.write((json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n").encode())


def _media_row(m: MediaItem) -> dict[str, Any]:
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


def _apply_overlong(
    cfg: PackConfig, tokenizer: SampleTokenizer, sample: TokenizedSample
) -> TokenizedSample | Reject:
    """`packing.overlong` applied to a sample over `packing.maxLength`: an error, a cut, or a reject."""
    max_length = cfg.packing.max_length
    if len(sample.input_ids) <= max_length:
        return sample
    policy = cfg.packing.overlong
    if sample.complete:
        hint = video_hint(sample, max_length, tokenizer.model.vision)
        detail = f"{len(sample.input_ids)} tokens > maxLength {max_length}"
    else:  # tokenized only until it was over (`long_text`): its length and its media are not all known
        hint = ""
        detail = f"at least {len(sample.input_ids)} tokens > maxLength {max_length} (tokenized only that far)"
    if policy == "error":
        raise ConfigError(
            f"sample {sample.sample_id} ({sample.source} #{sample.index}) has {detail}{hint}; "
            "raise packing.maxLength or set packing.overlong to drop or truncate"
        )
    if policy == "truncate":
        cut = tokenizer.truncate(sample, max_length)
        if cut is not None:
            return cut
        detail += "; cannot truncate without cutting a vision-token run or losing all labels"
    return Reject(sample.source, sample.index, sample.sample_id, RejectReason.OVERLONG, detail + hint)


def video_hint(sample: TokenizedSample, max_length: int, spec: VisionSpec) -> str:
    """What shortens an overlong sample's largest video enough to fit, as each `model.*` setting
    would count it (with the packer's own counting rules), or "" for a sample without one."""
    videos = [(m, m.source) for m in sample.media if m.kind == "video" and m.source is not None]
    if not videos:
        return ""
    video, info = max(videos, key=lambda pair: pair[0].num_tokens)
    # The rest of the sample as it is: a bound, since Qwen3-VL's timestamps shrink with the frames too.
    budget = max_length - (len(sample.input_ids) - video.num_tokens)
    head = f"; its video {video.path.name} is {video.num_tokens} of them ({len(video.frames)} frames)"
    if budget <= 0:
        return f"{head}, and the rest alone is over maxLength"
    options = shorter_video(info, spec, budget)
    if not options:
        return (
            f"{head}; no single model.maxFrames, model.fps or model.videoMaxPixels brings it within {budget}"
        )
    said = [
        f"model.{key} {value} ({tokens} video tokens"
        + (f"; with model.minFrames {value}" if key == "maxFrames" and value < spec.min_frames else "")
        + ")"
        for key, (value, tokens) in options.items()
    ]
    return f"{head}; to fit its {budget} tokens, set {', or '.join(said)}"
