"""The packer's numpy resize is torchvision's antialiased bicubic uint8 kernel, bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from packtrain.core.pixels import _numpy_resize, _torchvision_resize

pytest.importorskip("torchvision")

SIZES = [(1, 1), (3, 5), (27, 29), (28, 28), (99, 201), (360, 640), (767, 1023), (48, 3000)]
TARGETS = [(28, 28), (56, 84), (84, 56), (168, 308), (224, 420), (756, 1008), (32, 2048), (1540, 2072)]


@pytest.mark.parametrize(("source", "target"), list(itertools.product(SIZES, TARGETS)))
def test_numpy_resize_equals_torchvision(source: tuple[int, int], target: tuple[int, int]) -> None:
    rng = np.random.default_rng(source[0] * 7919 + target[1])
    pixels = rng.integers(0, 256, (*source, 3), dtype=np.uint8)
    ours = _numpy_resize(pixels, *target)
    ref = _torchvision_resize(pixels, *target)
    assert ours.shape == (*target, 3) and np.array_equal(ours, ref), (
        f"{int((ours != ref).sum())} values differ, at most by "
        f"{int(np.abs(ours.astype(int) - ref.astype(int)).max())}"
    )


def test_frame_stacks_resize_frame_by_frame() -> None:
    frames = np.random.default_rng(1).integers(0, 256, (5, 47, 83, 3), dtype=np.uint8)
    ours = _numpy_resize(frames, 64, 96)
    assert np.array_equal(ours, _torchvision_resize(frames, 64, 96))
    assert np.array_equal(ours[3], _numpy_resize(frames[3], 64, 96))
