"""What a shard stores for each media file: original bytes, or pixels already at the counted size.

Original bytes keep shards small and exact (the trainer re-applies the same
resize rule). `resized` moves decode and resize work off the GPU nodes: images
become PNGs of exactly height x width, videos the sampled frames as PNGs.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from PIL import Image

from .records import ConfigError
from .vision import upright


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def resize_rgb(img: Image.Image, height: int, width: int) -> Image.Image:
    """RGB at exactly (height, width), bicubic like the Qwen2-VL image processor."""
    img = upright(img)
    if img.mode != "RGB":
        img = img.convert("RGBA").convert("RGB") if img.mode in ("P", "LA", "PA") else img.convert("RGB")
    if img.size != (width, height):
        img = img.resize((width, height), Image.Resampling.BICUBIC)
    return img


def video_frames(path: Path, indices: list[int]) -> list[Image.Image]:
    """Decode the frames at `indices` (decode order) with PyAV."""
    import av

    wanted = set(indices)
    frames: dict[int, Image.Image] = {}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                frames[i] = frame.to_image()
            if len(frames) == len(wanted):
                break
    missing = wanted - frames.keys()
    if missing:
        raise ValueError(f"{path}: frames {sorted(missing)[:5]} could not be decoded")
    return [frames[i] for i in indices]


def _checked_bytes(path: Path, key: str, keep: bool = True) -> bytes:
    """The file's bytes (b"" when not `keep`: then the file is only hashed, streaming).

    Refuses a file that changed or vanished since convert measured it: its token count
    and grid came from the bytes that `key` hashes.
    """
    try:
        if keep:
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
        else:
            data = b""
            with path.open("rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise ConfigError(
            f"media file {path} was readable at convert time but not now ({exc}); restore it, "
            "or re-pack into a new output folder"
        ) from exc
    if digest != key:
        raise ConfigError(
            f"media file {path} changed since the convert stage measured it (sha256 differs); its "
            "vision-token count would be wrong. Restore it, or re-pack into a new output folder"
        )
    return data


def media_blob(ref: dict[str, Any], storage: str) -> dict[str, Any]:
    """The MEDIA_SCHEMA row for one media reference of a converted sample."""
    path = Path(ref["path"])
    data = _checked_bytes(path, ref["key"], keep=storage == "original" or ref["kind"] == "image")
    if storage == "original":
        return {"key": ref["key"], "kind": ref["kind"], "encoding": "original",
                "data": data, "frames": []}
    h, w = ref["height"], ref["width"]
    if ref["kind"] == "image":
        with Image.open(io.BytesIO(data)) as img:
            return {"key": ref["key"], "kind": "image", "encoding": "resized",
                    "data": _png(resize_rgb(img, h, w)), "frames": []}
    frames = [_png(resize_rgb(f, h, w)) for f in video_frames(path, list(ref["frames"]))]
    return {"key": ref["key"], "kind": "video", "encoding": "resized", "data": b"", "frames": frames}
