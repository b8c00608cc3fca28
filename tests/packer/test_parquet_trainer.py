"""The trainer reads a pack made from Parquet with embedded images: every row checked, every image decoded."""

from __future__ import annotations

from pathlib import Path

import pytest
from parquet_layouts import LLAVA_OV_SCHEMA, QWEN2, config, llava_ov_rows, write
from support.pack_runner import run_in_process

from packtrain.core.config import PackConfig
from packtrain.core.model_spec import model_spec

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("storage", ["original", "resized"])
def test_trainer_reads_every_sequence_of_a_parquet_pack(tmp_path: Path, storage: str) -> None:
    from packtrain.trainer.data.media import PixelSpec
    from packtrain.trainer.data.packed import PackedDataset

    data = write(tmp_path / "ov.parquet", llava_ov_rows(12), LLAVA_OV_SCHEMA, row_group_size=4)
    cfg = config([data])
    cfg["packing"]["mediaStorage"] = storage
    out = tmp_path / "pack"
    manifest = run_in_process(PackConfig.model_validate(cfg), out, workers=2)
    ds = PackedDataset(out, model_spec(QWEN2), PixelSpec.from_folder(QWEN2), units_per_micro_batch=1)
    images = tokens = 0
    for k in range(len(ds)):
        batch = ds[k]
        tokens += int(batch.inputs.input_ids.numel())
        grid = batch.inputs.image_grid_thw
        images += int(grid.shape[0]) if grid is not None else 0
    assert tokens == manifest["tokens"]
    assert images == 10  # 12 rows, every sixth text-only
