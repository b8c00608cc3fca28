"""Cost of the one pixel pipeline's resize: the packer's numpy port of torchvision's kernel, against
PIL's bicubic (what `mediaStorage: resized` used before; fast, but up to 16 levels off the
processor's pixels) and torchvision itself (the reference, what the trainer calls). One thread.

    python tests/bench/bench_pixels.py [--quick] [--repeat 3] [--results-dir DIR]

Prints a table and writes `bench_pixels.json`; exits 1 if the numpy port is not equal to
torchvision on every case (speed is reported, not judged).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
# (source height, width) -> (counted height, width): a phone photo, a video frame, a small upscale.
CASES = [
    ((3000, 4000), (868, 1148)),
    ((1080, 1920), (728, 1288)),
    ((480, 640), (476, 644)),
    ((29, 27), (56, 56)),
]
QUICK = CASES[2:]


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    import torch
    from PIL import Image

    from packtrain.core.pixels import _numpy_resize, _torchvision_resize

    torch.set_num_threads(1)
    rows = []
    for (h, w), (th, tw) in QUICK if args.quick else CASES:
        pixels = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
        ref = _torchvision_resize(pixels, th, tw)
        ours = _numpy_resize(pixels, th, tw)
        pil = np.asarray(Image.fromarray(pixels).resize((tw, th), Image.Resampling.BICUBIC))
        rows.append(
            {
                "source": f"{w}x{h}",
                "target": f"{tw}x{th}",
                "numpy_ms": 1000 * _best(lambda: _numpy_resize(pixels, th, tw), args.repeat),  # noqa: B023
                "pil_ms": 1000
                * _best(
                    lambda: Image.fromarray(pixels).resize((tw, th), Image.Resampling.BICUBIC),  # noqa: B023
                    args.repeat,
                ),
                "torchvision_ms": 1000 * _best(lambda: _torchvision_resize(pixels, th, tw), args.repeat),  # noqa: B023
                "numpy_equal": bool(np.array_equal(ours, ref)),
                "pil_max_diff": int(np.abs(pil.astype(int) - ref.astype(int)).max()),
            }
        )
    print(
        f"{'source':>10} {'target':>10} {'numpy ms':>9} {'PIL ms':>7} {'torchvision ms':>14} "
        f"{'numpy == tv':>11} {'PIL max diff':>12}"
    )
    for r in rows:
        print(
            f"{r['source']:>10} {r['target']:>10} {r['numpy_ms']:9.1f} {r['pil_ms']:7.1f} "
            f"{r['torchvision_ms']:14.1f} {str(r['numpy_equal']):>11} {r['pil_max_diff']:12d}"
        )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    meta = {"threads": 1, "repeat": args.repeat, "baseline": "PIL bicubic (previous resized-mode resize)"}
    (args.results_dir / "bench_pixels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0 if all(r["numpy_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
