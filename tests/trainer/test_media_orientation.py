"""The trainer's pixels for EXIF-rotated images equal the HF processor's, at the size the packer counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.paths import MODELS
from transformers import AutoImageProcessor

from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample
from packtrain.trainer.data.media import PixelSpec, image_pixels

MODEL = MODELS / "qwen2-vl"
ORIENTATION = 0x0112


def _rotated_jpeg(path: Path, orientation: int) -> Path:
    rng = np.random.default_rng(orientation)
    # A smooth gradient plus noise: any transpose/rotation error changes most pixels.
    y, x = np.mgrid[0:90, 0:150]
    arr = np.stack([x * 1.5, y * 2.5, (x + y) % 256], -1) + rng.integers(0, 20, (90, 150, 3))
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(path, quality=95, exif=exif.tobytes())
    return path


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_rotated_image_pixels_match_processor(tmp_path: Path, orientation: int) -> None:
    path = _rotated_jpeg(tmp_path / f"o{orientation}.jpg", orientation)
    tok = SampleTokenizer(SourceConfig(paths=[str(path)]), ModelConfig(path=str(MODEL)), PackingConfig())
    record = {
        "messages": [{"role": "user", "content": "<image>what?"}, {"role": "assistant", "content": "x"}],
        "images": [path.name],
    }
    sample = tok(RawRecord(source=tmp_path / "d.json", index=0, record=record, error=None))
    assert isinstance(sample, TokenizedSample), sample
    (item,) = sample.media
    if orientation in (6, 8):
        assert (item.height, item.width) != (84, 140) and item.height > item.width

    hf = AutoImageProcessor.from_pretrained(MODEL)(images=[str(path)], return_tensors="pt")
    assert hf["image_grid_thw"][0].tolist() == [item.grid_t, item.grid_h, item.grid_w]
    ours = image_pixels(path.read_bytes(), item.height, item.width, PixelSpec.from_folder(MODEL))
    torch.testing.assert_close(ours, hf["pixel_values"], atol=2e-2, rtol=0)
