"""What the pods tell the operator: summary keys and metric names, typed once.

The packer's stage summaries, the trainer's summary and its Prometheus metrics
travel from pods to the operator as termination messages and `/metrics` text.
Both sides import the names from here, so a key renamed on one side fails the
type checker and the tests on the other instead of silently dropping a stat.
One spelling throughout: snake_case, the manifest's. This module imports nothing
of ours (the operator, the packer and the trainer may all depend on it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final, Literal, NotRequired, TypedDict

# The pack stages pods run, in order (finalize runs inside the last materialize worker).
PackStage = Literal["convert", "plan", "materialize"]
PACK_STAGES: Final[tuple[PackStage, ...]] = ("convert", "plan", "materialize")

# Termination messages


def parse_summary(message: str | None) -> dict[str, Any] | None:
    """The JSON object of a summary line (a stage's termination message, the trainer's last line), or
    None for anything else (a traceback, a log line): the operator and `packtrain run` read it alike."""
    if not message:
        return None
    text = message.strip()
    if not text.startswith("{"):
        return None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


class ConvertSummary(TypedDict):
    """One convert worker's slice."""

    stage: str
    index: int
    count: int
    samples: int
    converted: int
    rejected: int
    tokens: int
    # Worker 0 only: the model's config.json as the memory planner reads it (`model_size.planning_config`),
    # None when model.path holds no readable config.json.
    model_sizes: NotRequired[dict[str, Any] | None]


class SourceCounts(TypedDict):
    """One `source.paths` entry's samples: records in its files, taken by the mixture (`input`), their
    fate."""

    records: int
    input: int
    packed: int
    rejected: int


class PlanSummary(TypedDict):
    """The whole pack's counts as plan knows them, before materialize decodes the videos.

    A sample whose video does not decode is found by materialize and rejected there, so the
    finished pack (its manifest, `PackCounts`) may pack fewer samples in fewer, shorter sequences.
    """

    stage: str
    samples: int
    packed: int
    rejected: int
    rejected_by_reason: dict[str, int]
    duplicate_ids: int
    sequences: int
    shards: int
    tokens: int
    lower_bound: int
    fill_ratio: float
    padding_saved: float
    sources: dict[str, SourceCounts]


class PackCounts(TypedDict):
    """A finished pack's counts, as its manifest has them: plan's less the samples materialize rejected
    (a video whose frames do not decode), and the sequences, tokens and fill of the shards written."""

    samples: int
    packed: int
    rejected: int
    rejected_by_reason: dict[str, int]
    sequences: int
    tokens: int
    lower_bound: int
    fill_ratio: float
    padding_saved: float


class MaterializeSummary(TypedDict):
    """One materialize worker's shards; the worker that completes the set writes the manifest.

    `rejected`: samples dropped from this worker's shards (media that does not decode); `pack`: the
    final counts, from the worker that completed the set: it wrote the manifest, or it refused the pack
    (NoSamples, TooManyRejected) and its error report carries them; else None.
    """

    stage: str
    index: int
    count: int
    shards: int
    written: int
    rejected: int
    manifest: bool
    manifest_sha256: str | None
    pack: PackCounts | None


class ErrorReport(TypedDict):
    """What a failing stage or trainer writes instead of a summary (on every non-zero exit).

    `reason` is a CamelCase word the operator uses as the condition reason when set
    (e.g. `NoSamples`); `error` is the short message a user reads.
    """

    error: str
    stage: NotRequired[str]
    reason: NotRequired[str]
    exit_code: NotRequired[int]  # the trainer's own exit code (torchrun reports 1 for any failed rank)


class TrainSummary(TypedDict):
    """The trainer's one-line result: its last stdout line and its termination message.

    The operator reads `steps`, `final_loss`, `eval_loss` and `tokens_per_second` into the SFTJob's
    status. Totals and rates leave out the first step of a run (warm-up) unless it is the only one;
    token and sample totals are summed over ranks, and timed by the slowest rank.
    """

    steps: int  # optimizer steps done, this run and the ones it resumed from
    steps_this_run: int
    tokens: int  # token slots processed, padding included
    effective_tokens: int  # non-padding tokens
    tokens_per_second: float
    effective_tokens_per_second: float
    samples_per_second: float
    padding_ratio: float
    final_loss: float | None  # None when no step ran or the loss is not finite (NaN is not JSON)
    eval_loss: float | None  # the last evaluation's token-mean loss; None without an evaluation set
    eval_units: int
    steps_per_epoch: int | None
    epochs: float | None
    model_flops_per_effective_token: float | None
    mfu: float | None  # None when the device's peak is unknown (CPU)
    mode: str  # training.mode
    attention: str  # the attention backend chosen
    world_size: int
    attention_imbalance_max: float  # the epoch plan's max/mean attention cost over ranks
    resumed_from: str | None  # the checkpoint folder this run resumed from
    final_model: str | None  # the exported model's folder
    init: str  # what the model started from: "pretrained from DIR" or "random" (model.init)
    peak_memory_bytes: NotRequired[int]  # CUDA only
    gpu_sm_utilization_mean: NotRequired[float]  # with NVML readings only


class RejectReason(StrEnum):
    """Why a sample was rejected: the `reason` of a `rejects.jsonl` line and a key of the manifest's
    `rejected_by_reason`. One member per code (a StrEnum, so the JSON carries the plain string);
    `REJECT_REASONS` below describes each, `docs/rejects.md` is generated from it (`packtrain docs`),
    and the README's table lists them."""

    BAD_JSON = "bad_json"
    BAD_UTF8 = "bad_utf8"
    RECORD_TOO_LARGE = "record_too_large"
    BAD_PARQUET = "bad_parquet"
    MALFORMED_RECORD = "malformed_record"
    EMPTY_CONVERSATION = "empty_conversation"
    PLACEHOLDER_MISMATCH = "placeholder_mismatch"
    RESERVED_TOKEN = "reserved_token"
    REMOTE_MEDIA = "remote_media"
    MEDIA_OUTSIDE_ROOT = "media_outside_root"
    HARD_LINKED_MEDIA = "hard_linked_media"
    MISSING_MEDIA = "missing_media"
    CORRUPT_MEDIA = "corrupt_media"
    MEDIA_TYPE_MISMATCH = "media_type_mismatch"
    UNSUPPORTED_MEDIA = "unsupported_media"
    MEDIA_TOO_LARGE = "media_too_large"
    VIDEO_TOO_LARGE = "video_too_large"
    ASPECT_RATIO = "aspect_ratio"
    TEMPLATE_ERROR = "template_error"
    OVERLONG = "overlong"
    UNSPLITTABLE_TEXT = "unsplittable_text"
    INTERNAL_ERROR = "internal_error"


# The reader's limits a record must stay within (`sources/raw.py`, `sources/records.py` and
# `sources/parquet.py` enforce them); defined here because the reject descriptions name them.
MAX_NESTING_DEPTH = 64
"""Deepest nesting of objects and arrays a record may have; deeper is a `bad_json` reject.

Found by counting brackets before anything is parsed, so neither `json.loads` nor a later stage
(chat templates render `tools`) recurses towards Python's limit; real records nest ~10 deep."""

MAX_RECORD_BYTES = 64 << 20
"""Largest record read, in bytes of its JSON text (one JSONL line, one item of a JSON array).

A larger one is a `record_too_large` reject, counted but never decoded or parsed, and never held
in memory whole: a line is read in bounded pieces, an array item scanned chunk by chunk. Real
samples are far smaller (media are files, not inline), so this only stops a hostile record from
taking a worker's memory."""

MAX_RECORD_VALUES = 1 << 20
"""Most JSON values (containers and their elements) a record may hold, JSON held in its string
fields included; more is a `record_too_large` reject.

Counted on the text before it is parsed: a parsed value costs some 60-100 bytes, so 64 MiB of `{},`
would take a worker 1.6 GiB. A real sample holds a few hundred."""

MAX_UNSPLIT_CHARS = 1 << 20
"""Longest run of text the tokenizer must take whole (one pre-token: letters, spaces or symbols with
no break between them) in a long text, which is otherwise tokenized piece by piece; longer is an
`unsplittable_text` reject. Tokenizing such a run costs up to ~270 bytes a character; real text
breaks every few dozen characters."""

REJECT_REASONS: dict[RejectReason, str] = {
    RejectReason.BAD_JSON: "a line or array item is not valid JSON, or it (or JSON held in one of its string "
    f"fields: tools, a function call, its arguments) nests deeper than {MAX_NESTING_DEPTH} levels; where a "
    "JSON array itself breaks, the rest of the file is one reject",
    RejectReason.BAD_UTF8: "a line or array item is not valid UTF-8, or has a lone surrogate escape",
    RejectReason.RECORD_TOO_LARGE: f"one record's JSON text is over {MAX_RECORD_BYTES >> 20} MiB "
    f"(contract.MAX_RECORD_BYTES) or holds over {MAX_RECORD_VALUES} JSON values (its string fields' JSON "
    "included), or a Parquet row decodes to more than 2 GiB (from the footer or its dictionaries); "
    "counted, not parsed",
    RejectReason.BAD_PARQUET: "a Parquet file's footer, a row group or a row does not decode (a file that "
    "cannot be opened is one reject, a row group that fails one reject per row it declares)",
    RejectReason.MALFORMED_RECORD: "the record is not a conversation this packer can read (see detail)",
    RejectReason.EMPTY_CONVERSATION: "no turns, or nothing to train on",
    RejectReason.PLACEHOLDER_MISMATCH: "image/video placeholders in the text and the listed media do not "
    "pair up",
    RejectReason.RESERVED_TOKEN: "a text field the chat template renders (content, reasoning, function "
    "calls, tool results, the system prompt, tool definitions) contains a turn or vision control token of "
    "the model, or reasoning a thinking template renders contains a think tag (it would end the block "
    "that wraps the reasoning early)",
    RejectReason.REMOTE_MEDIA: "a media reference is a URL (http://, s3://, file://, data: ...); only local "
    "files are read",
    RejectReason.MEDIA_OUTSIDE_ROOT: "a media path resolves (symlinks followed) outside the folders the job "
    "names: source.mediaRoot, the dataset files' folders, source.mediaPathMap targets; whether it exists is "
    "not told",
    RejectReason.HARD_LINKED_MEDIA: "a media file has more than one hard link (its other names may lie "
    "outside the media folders) and source.allowHardLinks is off",
    RejectReason.MISSING_MEDIA: "a media file inside the media folders does not exist or cannot be read",
    RejectReason.CORRUPT_MEDIA: "a media file does not decode, or is not an allowed image format or video "
    "container (truncated, too few frames, text named as a video); a video whose sampled frames do not "
    "decode is found by materialize",
    RejectReason.MEDIA_TYPE_MISMATCH: "a video used as an image, or an image used as a video",
    RejectReason.UNSUPPORTED_MEDIA: "audio, a video for a family whose model takes none "
    "(llava-onevision-1.5), or a media path that is not a regular file (folder, FIFO, device)",
    RejectReason.MEDIA_TOO_LARGE: "a media file over source.maxImageBytes / source.maxVideoBytes, an "
    "image over source.maxImageSourcePixels, one whose metadata (EXIF, ICC, XMP, text) is over 1 MiB, "
    "or an mp4/mov whose sample tables declare over 1,000,000 samples or whose edit lists declare over "
    "1,000 entries",
    RejectReason.VIDEO_TOO_LARGE: "a video whose decoded work (source pixels x sampled frames) is over "
    "source.maxVideoSourcePixels",
    RejectReason.ASPECT_RATIO: "an image or video more than 200 times wider than tall (or taller than wide)",
    RejectReason.TEMPLATE_ERROR: "the chat template failed on this record",
    RejectReason.OVERLONG: "longer than packing.maxLength (set by the convert stage; a long text is "
    "tokenized piece by piece and only until it is over, and with packing.overlong drop a text too long "
    "to fit is not tokenized at all)",
    RejectReason.UNSPLITTABLE_TEXT: f"a long text holds a run of over {MAX_UNSPLIT_CHARS} characters the "
    "tokenizer cannot split (letters, spaces or symbols with no break); not tokenized",
    RejectReason.INTERNAL_ERROR: "handling the record raised an unexpected error (detail: its type and "
    "message); the worker goes on",
}
"""What each reject reason means (the README's table is checked against it); one entry per member."""


# What to change for the most common reject reasons (`docs/rejects.md` lists them beside every reason).
REJECT_FIXES: dict[str, str] = {
    "media_outside_root": "media lie outside the media roots: set source.mediaRoot to the folder holding "
    "them, or map their prefix with source.mediaPathMap",
    "missing_media": "media files are not where the records say: fix the paths, source.mediaRoot or "
    "source.mediaPathMap",
    "remote_media": "URLs are never fetched: download the media and point the records at the files",
    "overlong": "samples longer than packing.maxLength: raise it, or set packing.overlong: truncate (a long "
    "video: lower model.maxFrames, model.fps or model.videoMaxPixels; each reject says to what)",
    "placeholder_mismatch": "image/video placeholders and media lists disagree in the records",
}


def reject_fixes(top: list[tuple[str, int]]) -> str:
    """What to change for the top reject reasons, for those that have a known fix ("" for none)."""
    return "; ".join(REJECT_FIXES[r] for r, _ in top if r in REJECT_FIXES)


# Reasons a pack fails although every stage ran (plan reports them, the operator shows them).
NO_SAMPLES: Final = "NoSamples"
TOO_MANY_REJECTED: Final = "TooManyRejected"


def pack_outcome_error(
    samples: int,
    packed: int,
    rejected_by_reason: Mapping[str, int],
    max_rejected_fraction: float | None,
) -> ErrorReport | None:
    """Why a pack's counts make it useless: nothing packed, or more rejected than allowed.

    The top reasons are named so the user knows what to fix in the dataset or the config.
    """
    rejected = sum(rejected_by_reason.values())
    top = sorted(rejected_by_reason.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    reasons = ", ".join(f"{reason} {count}" for reason, count in top) or "none recorded"
    fix = f"Fix: {fixes}. " if (fixes := reject_fixes(top)) else ""
    if packed == 0:
        return {
            "stage": "plan",
            "reason": NO_SAMPLES,
            "error": f"no sample was packed: {samples} read, {rejected} rejected (top reasons: {reasons}); "
            "see rejects.jsonl in the pack folder",
        }
    if max_rejected_fraction is not None and samples and rejected / samples > max_rejected_fraction:
        return {
            "stage": "plan",
            "reason": TOO_MANY_REJECTED,
            "error": f"{rejected} of {samples} samples rejected ({rejected / samples:.1%}), over "
            f"packing.maxRejectedFraction {max_rejected_fraction:g} (top reasons: {reasons}); "
            f"see rejects.jsonl in the pack folder. {fix}Or raise packing.maxRejectedFraction to train on "
            "what is left.",
        }
    return None


# The trainer's rank-0 gauges the operator scrapes for live progress.

TRAIN_METRIC_PREFIX: Final = "packtrain_train_"


def train_metric(name: str) -> str:
    """The full Prometheus name of a trainer gauge (`step` -> `packtrain_train_step`)."""
    return f"{TRAIN_METRIC_PREFIX}{name}"


TRAIN_STEP: Final = train_metric("step")
# How long the last step waited for data: what a stuck data loader shows (named in stall messages too).
TRAIN_DATA_WAIT: Final = train_metric("data_wait_seconds")
TRAIN_LOSS: Final = train_metric("loss")
TRAIN_EVAL_LOSS: Final = train_metric("eval_loss")
TRAIN_TOKENS_PER_SECOND: Final = train_metric("tokens_per_second")
TRAIN_EFFECTIVE_TOKENS_PER_SECOND: Final = train_metric("effective_tokens_per_second")
TRAIN_PADDING_RATIO: Final = train_metric("padding_ratio")
TRAIN_SAMPLES_PER_SECOND: Final = train_metric("samples_per_second")
TRAIN_STEP_SECONDS: Final = train_metric("step_seconds")
TRAIN_LEARNING_RATE: Final = train_metric("learning_rate")
TRAIN_ATTENTION_IMBALANCE: Final = train_metric("attention_imbalance")
TRAIN_MFU: Final = train_metric("mfu")
TRAIN_INFO: Final = train_metric("info")  # the run's choices as labels, value 1
# The GPU gauges of the trainer's ranks keep the `packtrain_gpu_` names dashboards read.
TRAIN_GPU_SM_UTILIZATION: Final = "packtrain_gpu_sm_utilization_percent"
TRAIN_GPU_MEMORY_USED: Final = "packtrain_gpu_memory_used_bytes"
TRAIN_GPU_MEMORY_TOTAL: Final = "packtrain_gpu_memory_total_bytes"
