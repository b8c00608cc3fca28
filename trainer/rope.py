"""Per-sub-sample multimodal RoPE (mRoPE) positions for packed sequences.

Qwen2-VL gives every token three position rows (temporal, height, width): text
tokens advance all three together, vision tokens take their grid coordinates.
A packed sequence must give each sub-sample exactly the positions
`get_rope_index` computes for that sample alone, so positions restart at 0 at
every sample boundary and no sample inherits another's offset. The rule below
mirrors `transformers`' `Qwen2VLModel.get_rope_index` /
`Qwen2_5_VLModel.get_rope_index` (a test checks it against both).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2


@dataclass(frozen=True)
class FamilyInfo:
    """The model-family constants the collator and pixel path need (read from config.json)."""

    name: str
    image_token_id: int = 151655
    video_token_id: int = 151656
    spatial_merge_size: int = 2
    patch_size: int = 14
    temporal_patch_size: int = 2
    tokens_per_second: float | None = None  # Qwen2.5-VL: temporal position units per second of video

    @property
    def time_scaled(self) -> bool:
        return self.tokens_per_second is not None


def family_info(family: str | FamilyInfo) -> FamilyInfo:
    """Defaults of a named family (the released configs' values), or the given info unchanged."""
    if isinstance(family, FamilyInfo):
        return family
    if family == "qwen2-vl":
        return FamilyInfo("qwen2-vl")
    if family == "qwen2.5-vl":
        return FamilyInfo("qwen2.5-vl", tokens_per_second=2.0)
    raise ValueError(f"unknown model family {family!r}; expected qwen2-vl or qwen2.5-vl")


def family_from_config(config: Any) -> FamilyInfo:
    """FamilyInfo from a `transformers` Qwen2-VL / Qwen2.5-VL config object."""
    vision = config.vision_config
    name = {"qwen2_vl": "qwen2-vl", "qwen2_5_vl": "qwen2.5-vl"}.get(config.model_type)
    if name is None:
        raise ValueError(f"model_type {config.model_type!r} is not a supported family (qwen2_vl, qwen2_5_vl)")
    tps = getattr(vision, "tokens_per_second", None) if name == "qwen2.5-vl" else None
    return FamilyInfo(
        name=name,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        spatial_merge_size=vision.spatial_merge_size,
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        tokens_per_second=None if tps is None else float(tps),
    )


@dataclass(frozen=True)
class Grid:
    """A media item's patch grid (before the spatial merge) and, for video, seconds per temporal step."""

    t: int
    h: int
    w: int
    second_per_grid: float = 1.0

    def llm_tokens(self, merge: int) -> int:
        return self.t * (self.h // merge) * (self.w // merge)


def token_types(input_ids: np.ndarray, fam: FamilyInfo) -> np.ndarray:
    types = np.zeros(len(input_ids), dtype=np.int64)
    types[input_ids == fam.image_token_id] = IMAGE
    types[input_ids == fam.video_token_id] = VIDEO
    return types


def _vision_positions(start: int, grid: Grid, kind: int, fam: FamilyInfo) -> np.ndarray:
    m = fam.spatial_merge_size
    gt, gh, gw = grid.t, grid.h // m, grid.w // m
    temporal = np.arange(gt, dtype=np.int64)
    if kind == VIDEO and fam.time_scaled:
        # Same float32 arithmetic as transformers: (arange(t) * tokens_per_second * second_per_grid).long()
        interval = np.float32(np.float32(grid.second_per_grid) * np.float32(fam.tokens_per_second))
        temporal = (temporal.astype(np.float32) * interval).astype(np.int64)
    tt, hh, ww = np.meshgrid(temporal, np.arange(gh) + start, np.arange(gw) + start, indexing="ij")
    pos = np.stack([tt, hh, ww]).reshape(3, -1)
    pos[0] += start
    return pos


def sample_positions(
    input_ids: Sequence[int] | np.ndarray,
    image_grids: Sequence[Grid],
    video_grids: Sequence[Grid],
    fam: FamilyInfo,
) -> np.ndarray:
    """(3, L) mRoPE positions of one sample alone, as `get_rope_index` computes them."""
    ids = np.asarray(input_ids, dtype=np.int64)
    grids = {IMAGE: iter(image_grids), VIDEO: iter(video_grids)}
    parts: list[np.ndarray] = []
    current = 0
    start = 0
    for kind, group in itertools.groupby(token_types(ids, fam).tolist()):
        n = len(list(group))
        if kind == TEXT:
            parts.append(np.broadcast_to(np.arange(current, current + n, dtype=np.int64), (3, n)))
            current += n
        else:
            grid = next(grids[kind], None)
            name = "image" if kind == IMAGE else "video"
            if grid is None:
                raise ValueError(f"{name} tokens at offset {start} but no {name} grid left for them")
            if grid.llm_tokens(fam.spatial_merge_size) != n:
                raise ValueError(
                    f"{name} at offset {start} has {n} placeholder tokens but its grid "
                    f"{grid.t}x{grid.h}x{grid.w} gives {grid.llm_tokens(fam.spatial_merge_size)}"
                )
            parts.append(_vision_positions(current, grid, kind, fam))
            current += max(grid.h, grid.w) // fam.spatial_merge_size
        start += n
    if any(True for _ in grids[IMAGE]) or any(True for _ in grids[VIDEO]):
        raise ValueError("more media grids than media placeholder runs in the sample")
    if not parts:
        return np.zeros((3, 0), dtype=np.int64)
    return np.concatenate(parts, axis=1)


def packed_positions(
    input_ids: Sequence[int] | np.ndarray,
    seq_lens: Sequence[int],
    sample_grids: Sequence[tuple[Sequence[Grid], Sequence[Grid]]],
    fam: FamilyInfo,
) -> np.ndarray:
    """(4, L) positions of a packed sequence: row 0 the 1-D text position that restarts at each
    sample (what `transformers` reads sample boundaries from), rows 1-3 each sample's own mRoPE."""
    ids = np.asarray(input_ids, dtype=np.int64)
    if sum(seq_lens) != len(ids):
        raise ValueError(f"seq_lens sum to {sum(seq_lens)} but the sequence has {len(ids)} tokens")
    rows = np.empty((4, len(ids)), dtype=np.int64)
    offset = 0
    for n, (images, videos) in zip(seq_lens, sample_grids, strict=True):
        rows[0, offset : offset + n] = np.arange(n)
        rows[1:, offset : offset + n] = sample_positions(ids[offset : offset + n], images, videos, fam)
        offset += n
    return rows
