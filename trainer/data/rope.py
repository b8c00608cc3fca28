"""Per-sub-sample multimodal RoPE (mRoPE) positions for packed sequences.

Qwen2-VL and its successors give every token three position rows (temporal,
height, width): text tokens advance all three together, vision tokens take their
grid coordinates. A packed sequence must give each sub-sample exactly the
positions `get_rope_index` computes for that sample alone, so positions restart
at 0 at every sample boundary and no sample inherits another's offset. What
differs between families (Qwen2.5-VL's temporal ids in seconds, Qwen3-VL's one
placeholder run per temporal group of a video) is read from the family registry
entry; a test checks the rule against each family's own `get_rope_index`.

A family with plain 1-D positions (InternVL: `Family.positions == "1d"`) gets one row that
restarts at 0 at every sample, vision tokens counted like text, as its language model numbers
a sample alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from packtrain.core.model_spec import ModelSpec

TEXT, IMAGE, VIDEO = 0, 1, 2
KINDS = {"image": IMAGE, "video": VIDEO}


def token_types(input_ids: np.ndarray, spec: ModelSpec) -> np.ndarray:
    types = np.zeros(len(input_ids), dtype=np.int64)
    types[input_ids == spec.token_ids.image_pad] = IMAGE
    types[input_ids == spec.token_ids.video_pad] = VIDEO
    return types


def _runs(
    media: Sequence[Mapping[str, Any]], spec: ModelSpec
) -> dict[int, list[tuple[int, int, int, float]]]:
    """Per kind, the (t, h, w, seconds per temporal step) grid of each placeholder run in order.

    With timestamped video text (Qwen3-VL) each temporal group is its own run, as that family's
    `get_rope_index` splits `video_grid_thw` into (1, h, w) rows."""
    runs: dict[int, list[tuple[int, int, int, float]]] = {IMAGE: [], VIDEO: []}
    for ref in media:
        kind = KINDS[ref["kind"]]
        t, h, w = int(ref["grid_t"]), int(ref["grid_h"]), int(ref["grid_w"])
        spg = float(ref.get("second_per_grid") or 1.0)
        if kind == VIDEO and spec.family.video_timestamps:
            runs[kind].extend([(1, h, w, spg)] * t)
        else:
            runs[kind].append((t, h, w, spg))
    return runs


def _vision_positions(
    start: int, grid: tuple[int, int, int, float], kind: int, spec: ModelSpec
) -> np.ndarray:
    m = spec.vision.merge_size
    t, h, w, spg = grid
    temporal = np.arange(t, dtype=np.int64)
    tps = spec.vision.tokens_per_second
    if kind == VIDEO and spec.family.time_scaled_rope and tps is not None:
        # Same float32 arithmetic as transformers: (arange(t) * tokens_per_second * second_per_grid).long()
        interval = np.float32(np.float32(spg) * np.float32(tps))
        temporal = (temporal.astype(np.float32) * interval).astype(np.int64)
    tt, hh, ww = np.meshgrid(temporal, np.arange(h // m) + start, np.arange(w // m) + start, indexing="ij")
    pos = np.stack([tt, hh, ww]).reshape(3, -1)
    pos[0] += start
    return pos


def _linear_positions(ids: np.ndarray, media: Sequence[Mapping[str, Any]], spec: ModelSpec) -> np.ndarray:
    """(1, L) positions 0..L-1 of one sample of a 1-D family, after its vision tokens are checked
    against its media grids (each tile or frame `(h/m)*(w/m)` tokens)."""
    m = spec.vision.merge_size
    pads = [spec.token_ids.image_pad]
    if spec.family.video_fill == "video_pad":
        pads.append(spec.token_ids.video_pad)
    tokens = int(np.isin(ids, pads).sum())
    want = sum(int(r["grid_t"]) * (int(r["grid_h"]) // m) * (int(r["grid_w"]) // m) for r in media)
    if tokens != want:
        raise ValueError(f"the sample has {tokens} vision placeholder tokens but its media grids give {want}")
    return np.arange(len(ids), dtype=np.int64)[None]


def sample_positions(
    input_ids: Sequence[int] | np.ndarray, media: Sequence[Mapping[str, Any]], spec: ModelSpec
) -> np.ndarray:
    """(3, L) mRoPE positions of one sample alone, as `get_rope_index` computes them ((1, L) for a
    1-D family).

    `media` are the sample's media refs (shard format: kind, grid_t/h/w, second_per_grid) in order.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    if spec.family.positions == "1d":
        return _linear_positions(ids, media, spec)
    m = spec.vision.merge_size
    runs = {kind: iter(grids) for kind, grids in _runs(media, spec).items()}
    parts: list[np.ndarray] = []
    current = 0
    start = 0
    for kind, group in itertools.groupby(token_types(ids, spec).tolist()):
        n = len(list(group))
        if kind == TEXT:
            parts.append(np.broadcast_to(np.arange(current, current + n, dtype=np.int64), (3, n)))
            current += n
        else:
            grid = next(runs[kind], None)
            name = "image" if kind == IMAGE else "video"
            if grid is None:
                raise ValueError(f"{name} tokens at offset {start} but no {name} grid left for them")
            t, h, w, _ = grid
            if t * (h // m) * (w // m) != n:
                raise ValueError(
                    f"{name} at offset {start} has {n} placeholder tokens but its grid "
                    f"{t}x{h}x{w} gives {t * (h // m) * (w // m)}"
                )
            parts.append(_vision_positions(current, grid, kind, spec))
            current += max(h, w) // m
        start += n
    if any(True for _ in runs[IMAGE]) or any(True for _ in runs[VIDEO]):
        raise ValueError("more media grids than media placeholder runs in the sample")
    if not parts:
        return np.zeros((3, 0), dtype=np.int64)
    return np.concatenate(parts, axis=1)


def packed_positions(
    input_ids: Sequence[int] | np.ndarray,
    seq_lens: Sequence[int],
    sample_media: Sequence[Sequence[Mapping[str, Any]]],
    spec: ModelSpec,
) -> np.ndarray:
    """(4, L) positions of a packed sequence: row 0 the 1-D text position that restarts at each
    sample (what `transformers` reads sample boundaries from), rows 1-3 each sample's own mRoPE.
    A 1-D family: (1, L), that restarting row alone."""
    ids = np.asarray(input_ids, dtype=np.int64)
    if sum(seq_lens) != len(ids):
        raise ValueError(f"seq_lens sum to {sum(seq_lens)} but the sequence has {len(ids)} tokens")
    linear = spec.family.positions == "1d"
    rows = np.empty((1 if linear else 4, len(ids)), dtype=np.int64)
    offset = 0
    for n, media in zip(seq_lens, sample_media, strict=True):
        rows[0, offset : offset + n] = np.arange(n)
        own = sample_positions(ids[offset : offset + n], media, spec)
        if not linear:
            rows[1:, offset : offset + n] = own
        offset += n
    return rows
