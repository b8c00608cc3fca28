"""Small, deterministic media files for packer tests: odd sizes, modes, EXIF orientation, broken files."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

ORIENTATION = 0x0112


def image(
    path: Path, width: int, height: int, mode: str = "RGB", exif_orientation: int | None = None
) -> Path:
    """A solid-colour image (cheap to encode at any size); the format follows the extension."""
    colour: int | tuple[int, ...]
    colour = {
        "RGB": (200, 30, 90),
        "RGBA": (10, 200, 30, 128),
        "CMYK": (0, 120, 200, 10),
        "P": 3,
        "L": 77,
    }.get(mode, 1000)
    img = Image.new(mode, (width, height), colour)
    kwargs = {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[ORIENTATION] = exif_orientation
        kwargs["exif"] = exif.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(
        path, format="JPEG" if path.suffix.lower() in (".jpg", ".jpeg") and mode != "P" else None, **kwargs
    )
    return path


def png_named_jpg(path: Path, width: int, height: int) -> Path:
    """PNG content under a .jpg name: the bytes decide the type."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), (1, 2, 3)).save(path, format="PNG")
    return path


def random_bytes(path: Path, size: int = 4096, seed: int = 0) -> Path:
    """Noise that no decoder accepts, whatever the extension says."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


def truncated_copy(src: Path, dst: Path, keep: float = 0.5) -> Path:
    """The first `keep` fraction of a file, like an interrupted download."""
    data = src.read_bytes()
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data[: int(len(data) * keep)])
    return dst


def noisy_jpeg(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """A JPEG with real entropy-coded data (solid colours compress to almost nothing)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG", quality=90)
    return path


def video(path: Path, frames: int, fps: int = 10, width: int = 64, height: int = 48) -> Path:
    """An H.264 (mp4) or MPEG-4 (other containers) clip of moving gradients, `frames` frames long."""
    path.parent.mkdir(parents=True, exist_ok=True)
    codec = "libx264" if path.suffix == ".mp4" else "mpeg4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        ramp = np.linspace(0, 255, width, dtype=np.uint8)[None, :, None]
        for i in range(frames):
            rgb = np.broadcast_to((ramp.astype(np.int64) + i * 7) % 256, (height, width, 3)).astype(np.uint8)
            for packet in stream.encode(
                av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            ):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def video_bomb(path: Path, frames: int = 120, size: int = 2048, fps: int = 2) -> Path:
    """A tiny H.264 file that decodes to `frames` full frames of size x size (identical, so it compresses to
    a few KB); at 2 fps every frame is sampled."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(fps), options={"preset": "ultrafast"})
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((size, size, 3), dtype=np.uint8), format="rgb24")
        for _ in range(frames):
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def nested_tools(depth: int) -> str:
    """A `tools` JSON value nested `depth` lists deep (parses, then overflows recursive serializers)."""
    return "[" * depth + "]" * depth
