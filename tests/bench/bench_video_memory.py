"""Peak memory of a trainer data worker decoding a "video bomb": a tiny MP4 of huge, identical frames.

A 17.5 KB H.264 file of 120 black 2048x2048 frames packs fine (its tokens are counted at the
resized size), but a decoder that keeps every sampled frame at source size and then stacks them
holds 2 x 120 x 12.6 MB. Each measurement runs in a fresh process and reports its peak RSS and
how much the peak grew over the decode (imports and the file itself excluded). The peak is the
kernel's VmHWM, reset before the decode: `ru_maxrss` would carry over the peak of the process
that forked the child (Linux keeps it across exec), hiding a decode smaller than, say, pytest.

    python tests/bench/bench_video_memory.py [--frames 120] [--side 2048]

`--mode stacked` measures the old path (decode every frame at full size, stack, then resize),
`--mode streamed` the trainer's `media_pixels` (each frame resized as it is decoded).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20


def video_bomb(frames: int = 120, side: int = 2048) -> bytes:
    """`frames` black side x side frames at 30 fps, H.264 at the lowest quality: a few KB."""
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "51", "preset": "ultrafast"}
        black = av.VideoFrame.from_ndarray(np.zeros((side, side, 3), np.uint8), format="rgb24")
        for _ in range(frames):
            for packet in stream.encode(black):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _ref(frames: int) -> dict:
    """A media ref as the packer writes it: every frame sampled, resized to 4 x 4 merged patches."""
    side = 4 * 28
    return {
        "kind": "video",
        "key": "bomb",
        "height": side,
        "width": side,
        "frames": list(range(frames)),
        "grid_t": (frames + 1) // 2,
        "grid_h": side // 14,
        "grid_w": side // 14,
        "second_per_grid": 1.0,
    }


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(mode: str, path: str) -> None:
    from packtrain.trainer.data.media import (
        PixelSpec,
        decode_video_frames,
        media_pixels,
        video_pixels_from_frames,
    )

    data = Path(path).read_bytes()
    ref, spec = _ref(int(sys.argv[-1])), PixelSpec()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    if mode == "stacked":
        pixels = video_pixels_from_frames(
            decode_video_frames(data, ref["frames"]), ref["height"], ref["width"], spec
        )
    else:
        pixels = media_pixels({"kind": "video", "encoding": "original", "data": data}, ref, spec)
    after = _status_kib("VmHWM")
    print(json.dumps({"growth_kib": after - before, "peak_kib": after, "patches": list(pixels.shape)}))


def measure(path: Path, mode: str, frames: int) -> dict:
    """Run one decode in a fresh interpreter; returns its peak RSS and growth over the decode (KiB)."""
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path), str(frames)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=120)
    ap.add_argument("--side", type=int, default=2048)
    ap.add_argument("--mode", choices=["stacked", "streamed", "both"], default="both")
    ap.add_argument("--out", default="/tmp/video-bomb.mp4")
    args = ap.parse_args(argv)
    path = Path(args.out)
    path.write_bytes(video_bomb(args.frames, args.side))
    print(f"{path}: {path.stat().st_size} bytes, {args.frames} frames of {args.side}x{args.side}")
    for mode in ("stacked", "streamed") if args.mode == "both" else (args.mode,):
        r = measure(path, mode, args.frames)
        print(
            f"{mode:9s} peak RSS {r['peak_kib'] / 1024:8.0f} MiB, growth over the decode "
            f"{r['growth_kib'] / 1024:8.0f} MiB, patches {r['patches']}"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
