"""What every packed row must satisfy before anything trains on it.

The trainer trusts a pack's rows: an id outside the vocabulary indexes past the
embedding (a device-side assert on CUDA), a label that is not the input id at
its position trains on text that is not there, and a sub-sample without a
label token (all −100) trains on nothing and reports a loss of 0. The packer
never writes such rows, so finding one means the pack was damaged or edited.
`row_problem` is the cheap check the trainer runs on every row it reads;
`pack verify` runs it and `grid_problem` (vision-token runs against the media
grids) over the whole pack. numpy only: no torch in the packer.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from packtrain.core.config import MAX_FRAMES_CEILING, MAX_PIXELS_CEILING
from packtrain.core.families import FAMILIES
from packtrain.core.model_folder import read_json
from packtrain.core.pack.schema import IGNORE_INDEX
from packtrain.core.pack.shards import ShardReader
from packtrain.core.pixels import IMAGE_FORMATS


@dataclass(frozen=True)
class ModelFacts:
    """The few numbers of a model folder that rows are checked against (None: not known)."""

    vocab_size: int | None
    image_pad_id: int | None
    video_pad_id: int | None
    merge_size: int = 2
    video_groups: bool = False  # a video is one pad run per temporal group (Qwen3-VL timestamps)
    # A video is one image-context run per frame (InternVL: `Frame{n}: <img>…</img>`); no video pad id.
    video_frames_as_images: bool = False


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_facts(folder: str | Path) -> tuple[ModelFacts, str | None]:
    """Vocabulary size and vision pad ids from `config.json` (no tokenizer, no torch), merge size from
    `preprocessor_config.json`; with a note saying what could not be read, else None."""
    folder = Path(folder)
    try:
        config = read_json(folder / "config.json")
    except (OSError, ValueError) as exc:
        return ModelFacts(None, None, None), (
            f"model folder {folder} has no readable config.json ({exc}): token ids are not checked "
            "against the vocabulary, nor vision tokens against the media grids"
        )
    text = config.get("text_config")
    if not isinstance(text, dict):
        text = {}
    vocab = _int(config.get("vocab_size")) or _int(text.get("vocab_size"))
    merge = 2
    try:
        pre = read_json(folder / "preprocessor_config.json")
        merge = _int(pre.get("merge_size")) or merge
    except (OSError, ValueError, AttributeError):
        pass
    family = [f for f in FAMILIES.values() if f.model_type == config.get("model_type")]
    groups = any(f.video_timestamps for f in family)
    frames = any(f.video_fill == "image_pad" for f in family)
    facts = ModelFacts(
        vocab,
        _int(config.get("image_token_id")),
        None if frames else _int(config.get("video_token_id")),
        merge,
        groups,
        frames,
    )
    note = (
        None if vocab else f"{folder}/config.json names no vocab_size: token ids are not checked against it"
    )
    return facts, note


def stored_config_hash(config: Any) -> str:
    """The hash `PackConfig.config_hash` gave the config as the manifest stores it (its dump).

    Hashing the stored dict rather than a re-validated model keeps a pack made before a field was
    added to the configuration verifiable; `test_pack_integrity` holds the two rules equal.
    """
    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def row_problem(
    input_ids: np.ndarray, labels: np.ndarray, seq_lens: np.ndarray, vocab_size: int | None
) -> str | None:
    """The first broken invariant of one packed row, in words; None when the row is sound. Vectorized."""
    n = len(input_ids)
    if len(labels) != n:
        return f"{len(labels)} labels for {n} tokens"
    if len(seq_lens) == 0 or int(seq_lens.min()) < 1 or int(seq_lens.sum()) != n:
        return (
            f"seq_lens {seq_lens.tolist()[:8]} do not split its {n} tokens into samples of at least 1 token"
        )
    if n == 0:
        return "no tokens"
    low = int(input_ids.min())
    if low < 0:
        return f"token id {low} at position {int(np.argmin(input_ids))} is negative"
    if vocab_size is not None and int(input_ids.max()) >= vocab_size:
        pos = int(np.argmax(input_ids >= vocab_size))
        return (
            f"token id {int(input_ids[pos])} at position {pos} is outside the vocabulary (size {vocab_size})"
        )
    trained = labels != IGNORE_INDEX
    wrong = trained & (labels != input_ids)
    if wrong.any():
        pos = int(np.argmax(wrong))
        return (
            f"label {int(labels[pos])} at position {pos} is neither {IGNORE_INDEX} nor the input id "
            f"{int(input_ids[pos])} there"
        )
    starts = np.concatenate(([0], np.cumsum(seq_lens)[:-1]))
    per_sample = np.add.reduceat(trained.astype(np.int64), starts)
    if (per_sample == 0).any():
        k = int(np.argmax(per_sample == 0))
        return f"sub-sample {k} has no label token: it trains on nothing"
    return None


def grid_problem(
    input_ids: np.ndarray, seq_lens: Sequence[int], media: Sequence[dict[str, Any]], facts: ModelFacts
) -> str | None:
    """Each sub-sample's vision-token runs, in order, against its media refs: one run of
    grid_t·grid_h·grid_w / merge² pad tokens per image or video; one per temporal group of a
    timestamped video, one image-context run per frame of a tiled family's video."""
    frames = facts.video_frames_as_images
    if facts.image_pad_id is None or (facts.video_pad_id is None and not frames):
        return None
    pads = {facts.image_pad_id: "image"}
    if facts.video_pad_id is not None and not frames:
        pads[facts.video_pad_id] = "video"
    m2 = facts.merge_size**2
    offset = 0
    for k, n in enumerate(seq_lens):
        ids = input_ids[offset : offset + n]
        offset += n
        mark = np.where(np.isin(ids, list(pads)), ids, -1)  # a run ends where the pad id changes
        starts = np.flatnonzero((mark != -1) & (mark != np.concatenate(([-1], mark[:-1]))))
        ends = np.flatnonzero((mark != -1) & (mark != np.concatenate((mark[1:], [-1])))) + 1
        runs = [(pads[int(ids[a])], int(b - a)) for a, b in zip(starts, ends, strict=True)]
        want = []
        for ref in (r for r in media if r["sample"] == k):
            grid = [int(ref[g]) for g in ("grid_t", "grid_h", "grid_w")]
            if min(grid) < 1 or grid[1] % facts.merge_size or grid[2] % facts.merge_size:
                return f"sub-sample {k}: media grid {grid} is not a whole number of merged patches"
            if ref["kind"] == "video" and frames:
                want += [("image", grid[1] * grid[2] // m2)] * grid[0]
            elif ref["kind"] == "video" and facts.video_groups:
                want += [("video", grid[1] * grid[2] // m2)] * grid[0]
            else:
                want.append((ref["kind"], grid[0] * grid[1] * grid[2] // m2))
        if runs != want:
            return (
                f"sub-sample {k}: vision-token runs {runs[:4]} do not match its media grids {want[:4]} "
                f"(merge size {facts.merge_size})"
            )
    stray = [r["sample"] for r in media if not 0 <= r["sample"] < len(seq_lens)]
    if stray:
        return f"media refer to sub-sample {stray[0]}, but the row has {len(seq_lens)}"
    return None


def ref_problem(
    ref: dict[str, Any],
    image_pixels: int = MAX_PIXELS_CEILING,
    video_pixels: int = MAX_PIXELS_CEILING,
    patch_size: int | None = None,
    temporal_patch_size: int | None = None,
    tile_size: int | None = None,
) -> str | None:
    """A media ref against the pack's pixel caps, before anything is decoded or allocated for it: the
    resized size (per image or frame) at most `image_pixels` / `video_pixels`, at most
    MAX_FRAMES_CEILING frames, and, when the patch sizes are given, a grid that is that size (a tiled
    family's: `tile_size` squares, a thumbnail after two or more, one tile per video frame)."""
    kind, h, w = ref["kind"], int(ref["height"]), int(ref["width"])
    grid = [int(ref[g]) for g in ("grid_t", "grid_h", "grid_w")]
    frames = list(ref["frames"] or ())
    cap = image_pixels if kind == "image" else video_pixels
    if kind not in ("image", "video"):
        return f"media kind {kind!r} is neither image nor video"
    if h < 1 or w < 1 or h * w > cap:
        return f"{kind} resized to {w}x{h}, outside the pack's pixel cap ({cap} per {kind} or frame)"
    if len(frames) > MAX_FRAMES_CEILING or (kind == "video") != bool(frames):
        return f"{kind} with {len(frames)} sampled frames (a video has 1 to {MAX_FRAMES_CEILING}, images 0)"
    if tile_size is not None and patch_size is not None:
        return _tile_problem(kind, h, w, grid, len(frames), tile_size, patch_size)
    if patch_size is not None and (grid[1] * patch_size, grid[2] * patch_size) != (h, w):
        return f"media grid {grid} is not its resized size {w}x{h} in patches of {patch_size}"
    if temporal_patch_size is not None:
        want_t = 1 if kind == "image" else -(-len(frames) // temporal_patch_size)
        if grid[0] != want_t:
            return f"media grid {grid}: grid_t should be {want_t} for {len(frames)} sampled frames"
    return None


def _tile_problem(
    kind: str, h: int, w: int, grid: list[int], frames: int, tile: int, patch_size: int
) -> str | None:
    """A tiled family's ref: a canvas of whole tiles (a video frame: one tile), each tile a full
    patch grid, and as many tiles in grid_t as the canvas holds (plus its thumbnail)."""
    if (grid[1] * patch_size, grid[2] * patch_size) != (tile, tile):
        return f"media grid {grid} is not one {tile}x{tile} tile in patches of {patch_size}"
    if h % tile or w % tile or (kind == "video" and (h, w) != (tile, tile)):
        return f"{kind} resized to {w}x{h}, which is not a canvas of whole {tile}x{tile} tiles"
    tiles = (h // tile) * (w // tile)
    want_t = frames if kind == "video" else tiles + (tiles > 1)
    if grid[0] != want_t:
        return f"media grid {grid}: grid_t should be {want_t} for a {w}x{h} {kind} ({frames} frames)"
    return None


@dataclass
class Scan:
    """What a pass over every row found: problems, and the totals the manifest must agree with."""

    problems: list[str]
    seen: Counter[tuple[str, int]]
    tokens: int = 0
    label_tokens: int = 0
    packed: int = 0
    sample_ids: list[str] = field(default_factory=list)


def _png_size(data: bytes, formats: tuple[str, ...] = ("PNG",)) -> tuple[int, int] | None:
    """(width, height) from an image header, without decoding pixels; None if it is not an image of
    `formats` (resized media are PNG; the trainer decodes nothing outside IMAGE_FORMATS)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=formats) as img:
            return img.size
    except Exception:  # any decoder error on edited bytes is simply "not the image the ref says"
        return None


def blob_problem(blob: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """A media blob against the ref that uses it: original bytes must hash to their key (convert
    measured those bytes); resized pixels must already be the ref's size, frame for frame (the
    trainer decodes them as they are, so an edited PNG could otherwise be any size: a pixel bomb)."""
    key = blob["key"]
    if blob["encoding"] == "original":
        if hashlib.sha256(blob["data"]).hexdigest() != key:
            return f"media {key[:12]}…: its bytes do not hash to its key"
        if blob["kind"] == "image" and _png_size(blob["data"], IMAGE_FORMATS) is None:
            return f"media {key[:12]}…: not an image of an allowed format ({', '.join(IMAGE_FORMATS)})"
        return None
    want = (ref["width"], ref["height"])
    if blob["kind"] == "image" and blob["frames"]:
        return _tiles_problem(key, list(blob["frames"]), ref)
    images = [blob["data"]] if blob["kind"] == "image" else list(blob["frames"])
    if blob["kind"] == "video" and len(images) != len(ref["frames"]):
        return f"media {key[:12]}…: {len(images)} resized frames for {len(ref['frames'])} sampled"
    for data in images:
        if (got := _png_size(data)) != want:
            return f"media {key[:12]}…: resized image is {got}, the ref says {want}"
    return None


def _tiles_problem(key: str, frames: list[bytes], ref: dict[str, Any]) -> str | None:
    """A tiled family's resized image: the canvas at the ref's size, then a square thumbnail whose
    side tiles the canvas when grid_t counts one (tiles + 1)."""
    w, h, grid_t = int(ref["width"]), int(ref["height"]), int(ref["grid_t"])
    if len(frames) > 2 or _png_size(frames[0]) != (w, h):
        return f"media {key[:12]}…: resized tiles are not a {w}x{h} canvas and at most a thumbnail"
    if len(frames) == 2:
        side = (_png_size(frames[1]) or (0, 1))[0]
        if _png_size(frames[1]) != (side, side) or side < 1 or h % side or w % side:
            return f"media {key[:12]}…: its thumbnail is not a square tile of the {w}x{h} canvas"
        if (h // side) * (w // side) + 1 != grid_t:
            return f"media {key[:12]}…: {grid_t} tiles in its grid, the canvas and thumbnail hold others"
    return None


def _lists(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (offsets, flat values) numpy arrays: rows are slices, nothing is copied per row."""
    col = table.column(name).combine_chunks()
    return col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False)


def scan_rows(reader: ShardReader, facts: ModelFacts, max_length: int, limit: int = 50) -> Scan:
    """Every row of every shard against `row_problem`, `grid_problem`, `max_length` and its shard's media
    table; each problem names the shard file and row (at most `limit` are listed)."""
    out = Scan([], Counter())
    for s, entry in enumerate(reader.manifest["shards"]):
        table = reader.table(s)
        keys = set(reader.media_table(s).column("key").to_pylist())
        ids_off, ids = _lists(table, "input_ids")
        lab_off, labels = _lists(table, "labels")
        len_off, lens = _lists(table, "seq_lens")
        media = table.column("media").to_pylist()
        sources, indices = table.column("sources").to_pylist(), table.column("indices").to_pylist()
        out.sample_ids.extend(x for row in table.column("sample_ids").to_pylist() for x in row)
        for r in range(table.num_rows):
            row_ids = ids[ids_off[r] : ids_off[r + 1]]
            row_labels = labels[lab_off[r] : lab_off[r + 1]]
            row_lens = lens[len_off[r] : len_off[r + 1]]
            out.tokens += len(row_ids)
            out.label_tokens += int((row_labels != IGNORE_INDEX).sum())
            out.packed += len(row_lens)
            out.seen.update(zip(sources[r], indices[r], strict=False))
            problem = row_problem(row_ids, row_labels, row_lens, facts.vocab_size)
            if problem is None and len(row_ids) > max_length:
                problem = f"{len(row_ids)} tokens > max_length {max_length}"
            if problem is None:
                problem = next((p for ref in media[r] if (p := ref_problem(ref))), None)
            if problem is None:
                problem = grid_problem(row_ids, row_lens.tolist(), media[r], facts)
            if problem is None and (lost := [m["key"] for m in media[r] if m["key"] not in keys]):
                problem = f"media {lost[0][:12]}… is not in {entry['media_file']}"
            if problem is not None and len(out.problems) < limit:
                out.problems.append(f"{entry['file']} row {r}: {problem}")
        refs = {m["key"]: m for row in media for m in row}
        blobs = reader.media_table(s)
        for b in range(blobs.num_rows):  # one blob in memory at a time: media tables are memory-mapped
            blob = blobs.slice(b, 1).to_pylist()[0]
            ref = refs.get(blob["key"])
            problem = blob_problem(blob, ref) if ref is not None else None
            if problem is not None and len(out.problems) < limit:
                out.problems.append(f"{entry['media_file']}: {problem}")
    return out
