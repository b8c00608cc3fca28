"""Pixel decoding: media blobs → the exact patch tensors the Hugging Face processor produces.

The packer counted vision tokens from a resized size and, for video, a set of
sampled frame indices; both are stored in each media ref. Here the trainer
decodes to *that* size and *those* frames, so the token count always matches,
then repeats the steps of the `transformers` Qwen2-VL / Qwen3-VL image and video
processors. Decoding and resizing are `packtrain.core.pixels`, the one pixel
pipeline the packer's `mediaStorage: resized` also uses (upright RGB, transparency
handled by the pack's `model.alpha`, torchvision's antialiased bicubic resize of
uint8 pixels); then fused
rescale+normalize in float32 and patchify grouped by the merge windows. A tiled family
(InternVL) gets whole tiles instead (`tile_pixels`). Runs in dataloader workers.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchvision.transforms.v2 import functional as tvF

from packtrain.core.config import Alpha
from packtrain.core.families import CLIP_MEAN, CLIP_STD
from packtrain.core.model_spec import ModelSpec, model_spec
from packtrain.core.mp4_index import check_mp4_index
from packtrain.core.pixels import SNIFF_BYTES, decode_rgb, image_rgb, resize_uint8, sniff_container
from packtrain.core.vision import VisionSpec


@dataclass(frozen=True)
class PixelSpec:
    """Normalization and patch geometry (defaults: Qwen2-VL's; see `from_vision`), and the
    transparency rule of the pack being decoded.

    `alpha` is the pack's, not the model's: `PackedDataset` replaces it with its manifest's value
    (`pixels.pack_alpha`), so the default here never decides how a pack's originals decode.
    """

    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    alpha: Alpha = "white"
    tile_size: int | None = None  # a tiled family (InternVL): whole square tiles, not patches

    @classmethod
    def from_model(cls, spec: ModelSpec) -> PixelSpec:
        """`from_vision`, refusing a tiled family whose folder gave no tile size (the packer counted
        tiles of the folder's size, so the trainer cuts the same ones)."""
        if spec.family.vision_input == "tiles" and not spec.vision.tile_size:
            raise ValueError(f"{spec.family.name} takes tiles but {spec.folder} gives no tile size")
        return cls.from_vision(spec.vision)

    @classmethod
    def from_vision(cls, vision: VisionSpec) -> PixelSpec:
        """The settings the packer counted with (family registry entry + the folder's processor configs)."""
        return cls(
            image_mean=tuple(vision.image_mean),
            image_std=tuple(vision.image_std),
            rescale_factor=float(vision.rescale_factor),
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.merge_size,
            tile_size=vision.tile_size or None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> PixelSpec:
        return cls.from_model(model_spec(folder))

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


def _normalize(frames: torch.Tensor, spec: PixelSpec) -> torch.Tensor:
    # Fused rescale + normalize, with the same float32 constants as the HF backend.
    mean = torch.tensor(spec.image_mean) * (1.0 / spec.rescale_factor)
    std = torch.tensor(spec.image_std) * (1.0 / spec.rescale_factor)
    return tvF.normalize(frames.to(torch.float32), mean.tolist(), std.tolist())


def patchify_image(image: torch.Tensor, spec: PixelSpec) -> torch.Tensor:
    """(C, H, W) normalized → (grid_h*grid_w, C*tp*p*p), the frame repeated over the temporal patch."""
    c, height, width = image.shape
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = height // p, width // p
    patches = image.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    patches = patches.unsqueeze(5).expand(-1, -1, -1, -1, -1, tp, -1, -1)
    return patches.reshape(gh * gw, c * tp * p * p)


def patchify_video(video: torch.Tensor, spec: PixelSpec) -> torch.Tensor:
    """(T, C, H, W) normalized → (grid_t*grid_h*grid_w, C*tp*p*p); the last frame pads T to the
    temporal patch."""
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    if pad := -video.shape[0] % tp:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    t, c, height, width = video.shape
    gt, gh, gw = t // tp, height // p, width // p
    patches = video.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * tp * p * p)


def image_pixels(data: bytes, height: int, width: int, spec: PixelSpec) -> torch.Tensor:
    """Encoded image bytes → patches at exactly height x width."""
    rgb = image_rgb(data, height, width, spec.alpha)
    frame = torch.from_numpy(np.require(rgb, requirements=["C", "W"])).permute(2, 0, 1)
    return patchify_image(_normalize(frame, spec), spec)


def decode_video_frames(
    data: bytes, indices: Sequence[int], size: tuple[int, int] | None = None
) -> np.ndarray:
    """Decode the given frame indices (decode order, as the packer counted them) → (T, H, W, 3) uint8.

    With `size` = (height, width) each wanted frame is resized as soon as it is decoded, the same
    resize `video_pixels_from_frames` applies to the stack, so memory holds one source-size frame at
    a time: a small file of many huge frames cannot make a data worker hold them all.
    """
    wanted = sorted(set(indices))
    if not wanted:
        raise ValueError("a video media ref has no sampled frame indices")
    demuxer = sniff_container(data[:SNIFF_BYTES])
    if demuxer is None:  # FFmpeg is never left to guess (its text, playlist and concat demuxers)
        raise ValueError(
            "video bytes are not in an allowed container; re-pack, or run `packtrain pack verify`"
        )
    if demuxer == "mp4":  # FFmpeg builds the whole sample index on open: bound it first
        check_mp4_index(data)
    import av  # PyAV only where a video is decoded: importing the trainer does not need it

    want = set(wanted)
    got: dict[int, np.ndarray] = {}
    with av.open(io.BytesIO(data), mode="r", format=demuxer) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in want:
                rgb = frame.to_ndarray(format="rgb24")
                got[i] = rgb if size is None else resize_uint8(rgb, *size)
            if i >= wanted[-1]:
                break
    missing = [i for i in wanted if i not in got]
    if missing:
        raise ValueError(f"video has no frames {missing[:5]} (decoded {len(got)} of {len(wanted)} wanted)")
    return np.stack([got[i] for i in indices])


def video_pixels_from_frames(frames: np.ndarray, height: int, width: int, spec: PixelSpec) -> torch.Tensor:
    """(T, H, W, 3) uint8 frames → patches at exactly height x width."""
    video = torch.from_numpy(np.require(resize_uint8(frames, height, width), requirements=["C", "W"]))
    video = video.permute(0, 3, 1, 2)
    return patchify_video(_normalize(video, spec), spec)


def _tiles_of_image(blob: dict[str, Any], height: int, width: int, n: int, spec: PixelSpec) -> np.ndarray:
    """An image's (n, tile, tile, 3) uint8 tiles: the canvas (height x width) cut row-major, then the
    thumbnail (the whole image at tile x tile) when `n` counts one more tile than the canvas holds.

    As GotOcr2ImageProcessor with `crop_to_patches` does: it resizes the uint8 image with torchvision's
    antialiased bicubic (the one `resize_uint8` is) to the canvas and, for the thumbnail, the original
    to one tile; both from the *original* image, never the thumbnail from the canvas."""
    tile = int(spec.tile_size or 0)
    rows, cols = height // tile, width // tile
    if rows < 1 or cols < 1 or rows * tile != height or cols * tile != width:
        raise ValueError(f"image canvas {height}x{width} is not whole {tile}-pixel tiles")
    if n not in (rows * cols, rows * cols + 1):
        raise ValueError(f"the pack counted {n} tiles for a {rows}x{cols} canvas")
    if blob["encoding"] == "resized":  # [canvas PNG, thumbnail PNG]: RGB PNGs, no alpha
        frames = [decode_rgb(png, spec.alpha) for png in blob["frames"]]
        if len(frames) != 1 + (n > rows * cols):
            raise ValueError(f"a resized tiled image has {len(frames)} frames for {n} tiles")
        canvas = resize_uint8(frames[0], height, width)
        thumbnail = [resize_uint8(f, tile, tile) for f in frames[1:]]
    else:
        rgb = decode_rgb(blob["data"], spec.alpha)
        canvas = resize_uint8(rgb, height, width)
        thumbnail = [resize_uint8(rgb, tile, tile)] if n > rows * cols else []
    tiles = canvas.reshape(rows, tile, cols, tile, 3).transpose(0, 2, 1, 3, 4).reshape(-1, tile, tile, 3)
    return np.concatenate([tiles, np.stack(thumbnail)]) if thumbnail else tiles


def tile_pixels(blob: dict[str, Any], ref: dict[str, Any], spec: PixelSpec) -> torch.Tensor:
    """A tiled family's media → (grid_t, 3, tile, tile) normalized tiles, in the model's order.

    A video frame is one tile: each sampled frame resized to tile x tile and normalized like an image
    (the image processor's mean and std, as the family was trained, not its video processor config's
    smaller CLIP-normalized frames, whose patch grid the pixel shuffle cannot take)."""
    tile, n = int(spec.tile_size or 0), int(ref["grid_t"])
    if ref["kind"] == "image":
        tiles = _tiles_of_image(blob, int(ref["height"]), int(ref["width"]), n, spec)
    elif ref["kind"] == "video":
        if blob["encoding"] == "resized":
            tiles = np.stack(
                [resize_uint8(decode_rgb(png, spec.alpha), tile, tile) for png in blob["frames"]]
            )
        else:
            tiles = decode_video_frames(blob["data"], ref["frames"], (tile, tile))
    else:
        raise ValueError(f"unknown media kind {ref['kind']!r}")
    if tiles.shape[0] != n:
        raise ValueError(f"media {ref['key'][:12]}: decoded {tiles.shape[0]} tiles but the pack counted {n}")
    frames = torch.from_numpy(np.require(tiles, requirements=["C", "W"])).permute(0, 3, 1, 2)
    return _normalize(frames, spec)


def media_pixels(blob: dict[str, Any], ref: dict[str, Any], spec: PixelSpec) -> torch.Tensor:
    """A MEDIA_SCHEMA blob + its MEDIA_REF → patch tensor (tiles for a tiled family), checked against
    the ref's grid."""
    if spec.tile_size is not None:
        return tile_pixels(blob, ref, spec)
    height, width = int(ref["height"]), int(ref["width"])
    if ref["kind"] == "image":
        pixels = image_pixels(blob["data"], height, width, spec)
    elif ref["kind"] == "video":
        if blob["encoding"] == "resized":
            frames = [decode_rgb(png, spec.alpha) for png in blob["frames"]]  # RGB PNGs: no alpha
            pixels = video_pixels_from_frames(np.stack(frames), height, width, spec)
        else:
            pixels = video_pixels_from_frames(
                decode_video_frames(blob["data"], ref["frames"], (height, width)), height, width, spec
            )
    else:
        raise ValueError(f"unknown media kind {ref['kind']!r}")
    want = int(ref["grid_t"]) * int(ref["grid_h"]) * int(ref["grid_w"])
    if pixels.shape[0] != want:
        raise ValueError(
            f"media {ref['key'][:12]}: decoded {pixels.shape[0]} patches but the pack counted {want} "
            f"(grid {ref['grid_t']}x{ref['grid_h']}x{ref['grid_w']})"
        )
    return pixels
