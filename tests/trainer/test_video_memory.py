"""Video frames are resized as they are decoded: a data worker's memory is bounded by the target size,
and the pixels are exactly those of resizing the whole stack (the path the HF comparisons cover)."""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from support import malloc

from packtrain.trainer.data.media import (
    PixelSpec,
    decode_video_frames,
    media_pixels,
    video_pixels_from_frames,
)

# Measures the memory of processes it starts: they run with glibc's default malloc settings.
pytestmark = pytest.mark.measures_memory

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_video_memory.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_video_memory", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _noise_video(frames: int, height: int, width: int) -> bytes:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        stream.options = {"qp": "0"}
        for _ in range(frames):
            img = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def test_streamed_resize_gives_the_pixels_of_the_stacked_resize() -> None:
    data = _noise_video(9, 300, 420)
    frames = [0, 2, 2, 5, 8]  # a repeated index, as a short video's sampling can give
    spec = PixelSpec()
    for height, width in ((112, 168), (280, 420), (336, 476)):  # down, same, up
        stacked = video_pixels_from_frames(decode_video_frames(data, frames), height, width, spec)
        ref = {
            "kind": "video",
            "key": "noise",
            "height": height,
            "width": width,
            "frames": frames,
            "grid_t": 3,
            "grid_h": height // 14,
            "grid_w": width // 14,
        }
        streamed = media_pixels({"kind": "video", "encoding": "original", "data": data}, ref, spec)
        assert torch.equal(stacked, streamed)
        small = decode_video_frames(data, frames, (height, width))
        assert small.shape == (len(frames), height, width, 3) and small.dtype == np.uint8


def test_a_video_bomb_costs_a_worker_little_memory(tmp_path: Path) -> None:
    bench = _bench()
    path = tmp_path / "bomb.mp4"
    path.write_bytes(bench.video_bomb(frames=40, side=2048))
    assert path.stat().st_size < 20_000
    result = bench.measure(path, "streamed", 40)
    # Keeping the 40 source frames costs 40 x 12 MiB twice over; one frame at a time, a few.
    assert result["growth_kib"] < 200 * 1024, result
    assert result["patches"] == [20 * 8 * 8, 1176]


def test_this_module_s_processes_allocate_as_glibc_does_by_default() -> None:
    """The module is marked `measures_memory`: the suite's malloc settings are not in its environment."""
    assert not set(malloc.SETTINGS) & set(os.environ)
