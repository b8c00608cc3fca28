"""Configuration models of the packer.

These pydantic models are the single source of truth for a pack: the CLI reads
them from YAML, the operator embeds them in the `PackJob` CRD (camelCase keys,
as Kubernetes users expect), and the manifest records them with a hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator
from pydantic.alias_generators import to_camel

from packtrain.core.families import FAMILY_NAMES
from packtrain.core.spec_file import load_spec_section


class CamelModel(BaseModel):
    """Base: camelCase in YAML/JSON (Kubernetes style), snake_case in Python; unknown keys are errors."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The camelCase dict, as written in manifests and CRs."""
        return self.model_dump(mode="json", by_alias=True)


Format = Literal["auto", "sharegpt", "messages", "typed"]
FamilyName = Literal[FAMILY_NAMES]  # type: ignore[valid-type]  # the registry's entries, one source
Algorithm = Literal["bfd", "next_fit", "swift", "knapsack"]
OverlongPolicy = Literal["drop", "truncate", "error"]
LabelMode = Literal["all_assistant", "last_assistant", "all"]
MediaStorage = Literal["original", "resized"]
Alpha = Literal["white", "drop"]


class FieldMap(CamelModel):
    """Column and role names of the input records, replacing any interactive mapping step."""

    conversations: str = Field("conversations", description="ShareGPT turn-list column.")
    messages: str = Field("messages", description="role/content turn-list column.")
    role_key: str = Field("from", description="ShareGPT key holding a turn's role.")
    content_key: str = Field("value", description="ShareGPT key holding a turn's text.")
    reasoning_key: str = Field(
        "reasoning_content",
        description="Key of an assistant turn (either layout) holding its reasoning, passed to the chat "
        "template as `reasoning_content`; templates that read it (Qwen3.5) render it in a <think> block.",
    )
    images: str = Field("images", description="Column listing a record's image files.")
    videos: str = Field("videos", description="Column listing a record's video files.")
    audios: str = Field(
        "audios", description="Column listing a record's audio files (rejected: not supported)."
    )
    system: str = Field("system", description="Column holding a system prompt.")
    tools: str = Field("tools", description="Column holding tool definitions.")
    id: str = Field("id", description="Column holding a record's id (rejects and unpack name samples by it).")
    user_roles: list[str] = Field(
        default_factory=lambda: ["human", "user"], description="Roles read as the user."
    )
    assistant_roles: list[str] = Field(
        default_factory=lambda: ["gpt", "assistant"], description="Roles read as the assistant (trained on)."
    )
    system_roles: list[str] = Field(
        default_factory=lambda: ["system"], description="Roles read as the system."
    )
    function_call_roles: list[str] = Field(
        default_factory=lambda: ["function_call"], description="Roles read as the assistant calling a tool."
    )
    observation_roles: list[str] = Field(
        default_factory=lambda: ["observation", "tool"], description="Roles read as a tool's answer."
    )
    image_placeholder: str = Field(
        "<image>", min_length=1, max_length=64, description="Marks where an image goes in a turn's text."
    )
    video_placeholder: str = Field(
        "<video>", min_length=1, max_length=64, description="Marks where a video goes in a turn's text."
    )


MAX_MIXTURE_WEIGHT = 1000.0
MAX_MIXTURE_SAMPLES = 10**12


class MixtureEntry(CamelModel):
    """How much of one `source.paths` entry a pack takes (the seed is `packing.seed`)."""

    path: str = Field(..., min_length=1, description="An entry of source.paths, exactly as written there.")
    weight: float | None = Field(
        None,
        gt=0,
        le=MAX_MIXTURE_WEIGHT,
        description="Take round(weight x records): below 1 a sample without replacement, above 1 every "
        "record floor(weight) times plus a sample without replacement for the rest (default 1).",
    )
    max_samples: int | None = Field(
        None, ge=0, le=MAX_MIXTURE_SAMPLES, description="Take at most this many (after weight), a sample."
    )

    @model_validator(mode="after")
    def _something_set(self) -> MixtureEntry:
        if self.weight is None and self.max_samples is None:
            raise ValueError(f"source.mixture entry {self.path!r}: give weight or maxSamples")
        return self


class SourceConfig(CamelModel):
    """Where the dataset is and how to read it."""

    paths: list[str] = Field(
        ...,
        min_length=1,
        description="Files or globs: JSON arrays or JSONL, or Parquet (names ending .parquet).",
    )
    format: Format = Field("auto", description="Record format; auto detects per record.")
    field_map: FieldMap = Field(default_factory=FieldMap)
    media_root: str | None = Field(
        None, description="Folder relative media paths resolve against; default: each dataset file's folder."
    )
    media_path_map: dict[str, str] = Field(
        default_factory=dict,
        description="Prefix rewrites applied to media paths before resolving (first match wins), for data "
        "written for another layout, e.g. {'data/mllm_demo_data/': 'mllm_demo_data/'} or "
        "{'/mnt/old/': '/data/'}. "
        "Each target is also a folder media may come from (a target ending inside a file name: its folder).",
    )
    max_image_bytes: int = Field(
        64 * 2**20,
        ge=1,
        le=2**31 - 1,
        description="Largest image file read, in bytes (default 64 MiB), enforced while reading; larger "
        "files are rejected as media_too_large.",
    )
    max_video_bytes: int = Field(
        2**30,
        ge=1,
        le=2**31 - 1,
        description="Largest video file read, in bytes (default 1 GiB; a shard row holds under 2 GiB), "
        "enforced while reading; larger files are rejected as media_too_large.",
    )
    max_image_source_pixels: int = Field(
        89_478_485,
        ge=1,
        le=178_956_970,
        description="Most pixels (width x height, read from the header before decoding) of a source image "
        "(default 89478485, Pillow's decompression-bomb threshold; at most twice that); larger images are "
        "rejected as media_too_large.",
    )
    max_video_source_pixels: int = Field(
        2**28,
        ge=1,
        le=2**34,
        description="Most decoded work of one video: source width x height x sampled frames, read from the "
        "container before decoding (default 2^28, e.g. 128 full-HD frames or 768 frames of 590x590); "
        "larger videos are rejected as video_too_large.",
    )
    allow_hard_links: bool = Field(
        False,
        description="Read dataset and media files that have more than one hard link. Off by default: a "
        "path check cannot see where a hard link's other names are, so one may be a second name of a "
        "file outside the folders the job names; such media are rejected as hard_linked_media and such "
        "dataset files stop the job. Turn on for data deduplicated with hard links.",
    )
    mixture: list[MixtureEntry] = Field(
        default_factory=list,
        max_length=1024,
        description="Weights or caps per source.paths entry (a source), drawn from packing.seed; entries not "
        "listed are taken whole, once. Counts per source are in the manifest (counts.sources).",
    )

    @model_validator(mode="after")
    def _mixture_names_paths(self) -> SourceConfig:
        seen: set[str] = set()
        for m in self.mixture:
            if m.path not in self.paths:
                raise ValueError(
                    f"source.mixture names {m.path!r}, which is not an entry of source.paths; "
                    "write the entry exactly as source.paths does"
                )
            if m.path in seen:
                raise ValueError(f"source.mixture names {m.path!r} twice")
            seen.add(m.path)
        return self


# Ceilings of the numbers a (possibly untrusted) config may ask for; each bounds a worker's memory.
# Pixels: the largest of the released processors' own maxima: Qwen2-VL / Qwen2.5-VL allow 16384
# patches of 28x28 per image or frame; Qwen3-VL's video bound (all sampled frames together) is
# 24576 patches of 32x32.
MAX_PIXELS_CEILING = 24576 * 32 * 32
# Frames: the processors' own frame cap (FPS_MAX_FRAMES).
MAX_FRAMES_CEILING = 768
# Tokens per packed sequence: far beyond any context these models train with.
MAX_LENGTH_CEILING = 262144
SEQUENCES_PER_SHARD_CEILING = 16384
DEFAULT_MAX_REJECTED_FRACTION = 0.05
"""packing.maxRejectedFraction's default: a pack that loses more than 5% of its samples is refused."""


def _ordered(low: str, high: str) -> JsonValue:
    """A CEL rule `low <= high` for two optional fields, with the message pydantic gives too."""
    return {
        "rule": f"!has(self.{low}) || !has(self.{high}) || self.{low} <= self.{high}",
        "message": f"{low} must not exceed {high}",
        "fieldPath": f".{low}",
    }


MAX_TILES_CEILING = 64  # tiles of one image: 64 x 256 = 16,384 vision tokens
_PIXEL_ORDER = (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels"))


class ModelConfig(CamelModel):
    """Model family and its processor settings: these decide the exact vision-token counts."""

    model_config = CamelModel.model_config | ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                *[_ordered(to_camel(lo), to_camel(hi)) for lo, hi in _PIXEL_ORDER],
                _ordered("minFrames", "maxFrames"),
                _ordered("minTiles", "maxTiles"),
            ]
        }
    )

    family: FamilyName | None = Field(
        None,
        description="The model family (its chat template, vision tokens, rope); default: the one "
        "model.path's config.json names (its model_type), qwen2-vl for a folder without config.json.",
    )
    path: str = Field(..., description="Folder with tokenizer, chat template and preprocessor config.")
    chat_template: str | None = Field(None, description="Path to a Jinja template overriding the folder's.")
    min_pixels: int | None = Field(
        None, ge=1, le=MAX_PIXELS_CEILING, description="Default: the folder's preprocessor config."
    )
    max_pixels: int | None = Field(
        None, ge=1, le=MAX_PIXELS_CEILING, description="Default: the folder's preprocessor config."
    )
    video_min_pixels: int | None = Field(
        None,
        ge=1,
        le=MAX_PIXELS_CEILING,
        description="Pixels per video frame, at least. Default: the folder's video processor config, "
        "else the family's, else minPixels.",
    )
    video_max_pixels: int | None = Field(
        None,
        ge=1,
        le=MAX_PIXELS_CEILING,
        description="Pixels per video frame, at most. Default: the folder's video processor config, "
        "else the family's, else maxPixels.",
    )
    fps: float | None = Field(
        None,
        gt=0,
        description="Video frame sampling rate. Default: the folder's video processor config, else 2.",
    )
    min_frames: int | None = Field(
        None, ge=1, description="Default: the folder's video processor config, else 4."
    )
    max_frames: int | None = Field(
        None,
        ge=1,
        le=MAX_FRAMES_CEILING,
        description="Default: the folder's video processor config, else 768.",
    )
    min_tiles: int | None = Field(
        None,
        ge=1,
        le=MAX_TILES_CEILING,
        description="Tiled families (internvl): fewest 448x448 tiles an image is cut into. Default: the "
        "folder's image processor config (min_patches), else 1.",
    )
    max_tiles: int | None = Field(
        None,
        ge=1,
        le=MAX_TILES_CEILING,
        description="Tiled families (internvl): most tiles an image is cut into (a thumbnail of the whole "
        "image follows them when there are two or more; 256 vision tokens each). Default: the folder's "
        "image processor config (max_patches), else 12.",
    )
    cap_pixels_per_frame: bool = Field(
        True,
        description="Qwen3-VL videos: cap each frame's pixels as the reference implementation "
        "(qwen-vl-utils) "
        "does, transformers' cap_pixels_per_frame=True; false spends videoMaxPixels on however few frames "
        "are sampled. Other families bound pixels per frame already.",
    )
    alpha: Alpha = Field(
        "white",
        description="Transparent images (an alpha band, or a palette or colour-key transparency entry): "
        "white composites them onto white, as transformers' in-memory convert_to_rgb does (qwen-vl-utils "
        "and vLLM composite RGBA images onto white too); drop discards the transparency, as PIL's "
        "convert('RGB') and transformers' decode of a file path do. Recorded in the pack's manifest, whose "
        "value the trainer decodes with (packs made before this field: drop). Token counts do not depend "
        "on it.",
    )

    @model_validator(mode="after")
    def _frames_order(self) -> ModelConfig:
        if self.min_frames is not None and self.max_frames is not None and self.min_frames > self.max_frames:
            raise ValueError(f"minFrames ({self.min_frames}) must not exceed maxFrames ({self.max_frames})")
        if self.min_tiles is not None and self.max_tiles is not None and self.min_tiles > self.max_tiles:
            raise ValueError(f"minTiles ({self.min_tiles}) must not exceed maxTiles ({self.max_tiles})")
        for low, high in _PIXEL_ORDER:
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"{to_camel(low)} ({lo}) must not exceed {to_camel(high)} ({hi})")
        return self


class PackingConfig(CamelModel):
    """How samples become fixed-length sequences."""

    max_length: int = Field(4096, ge=16, le=MAX_LENGTH_CEILING, description="Tokens per packed sequence.")
    algorithm: Algorithm = Field(
        "bfd", description="bfd (default), or a baseline: next_fit, swift, knapsack."
    )
    overlong: OverlongPolicy = Field(
        "drop", description="Samples longer than maxLength: drop, truncate, error."
    )
    partial_threshold: int | None = Field(
        None, ge=1, description="Samples at least this long get a sequence of their own."
    )
    seed: int = Field(
        0, description="Seed of every random choice (packing order, mixtures): same seed, same pack."
    )
    label_mode: LabelMode = Field("all_assistant", description="Which turns are trained on.")
    label_newline_after_turn_end: bool = Field(
        False,
        description="Also train the newline after each assistant turn's end token (<|im_end|>), as ms-swift "
        "4.6 does; by default the newline belongs to the next prompt and is not trained.",
    )
    sequences_per_shard: int = Field(
        1024,
        ge=1,
        le=SEQUENCES_PER_SHARD_CEILING,
        description="Packed sequences per shard file, at most: a shard holds at most 2^24 token slots "
        "(128 sequences of maxLength 131072), and a small pack gets 16 smaller shards.",
    )
    media_storage: MediaStorage = Field(
        "original",
        description="original bytes, or pre-resized images / sampled frames (less decode on GPUs).",
    )
    max_rejected_fraction: float | None = Field(
        DEFAULT_MAX_REJECTED_FRACTION,
        ge=0,
        le=1,
        description=f"Fail the pack when more than this share of the samples is rejected (default "
        f"{DEFAULT_MAX_REJECTED_FRACTION:g}, so lost data stops the job before any GPU is spent; null: no "
        "limit; a pack with no packed sample always fails).",
    )


class PackConfig(CamelModel):
    """A whole pack job as the packer sees it (the `PackJob` spec minus cluster-only fields)."""

    source: SourceConfig
    model: ModelConfig
    packing: PackingConfig = Field(default_factory=PackingConfig)

    def config_hash(self) -> str:
        """sha256 over the canonical JSON: same config, same hash."""
        blob = json.dumps(self.dump(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


# PackJob spec keys only a cluster reads (where and how the stages run): `pack … -c` sets them aside.
PACK_CLUSTER_KEYS = frozenset({"output", "workers", "volumes", "queueName"})


def load_pack_config(path: str | Path) -> PackConfig:
    """Read a `PackJob` manifest or spec (the first PackJob of a multi-document YAML)."""
    return load_spec_section(path, "PackJob", PackConfig, PACK_CLUSTER_KEYS)
