"""Qwen3-VL through the trainer on a real pack: the packer's rows give each sub-sample the positions
the model's own `get_rope_index` gives it alone (a video's temporal groups are separate placeholder
runs between timestamp text), a tiny random model trains end to end, and what differs from the
registry entry in a config override is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import vlm_fixtures as fx
from conftest import job_spec, make_pack, write_job
from test_equivalence import _double_batch
from transformers import AutoModelForImageTextToText
from vlm_fixtures import FOLDER, TINY, spec

from packtrain.core.errors import ConfigError
from packtrain.core.pack.shards import ShardReader
from packtrain.core.sft_config import load_train_config
from packtrain.trainer.data.packed import collate_packed, collate_padded, split_row
from packtrain.trainer.data.rope import sample_positions
from packtrain.trainer.loop import train
from packtrain.trainer.model.build import VLMForTraining, build_model, checked_spec, load_config
from packtrain.trainer.model.loss import per_sample_sums

FAMILY = "qwen3-vl"


@pytest.fixture(scope="module")
def qwen3_pack(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> Path:
    return make_pack(tmp_path_factory.mktemp("pack") / FAMILY, family=FAMILY)


def test_every_packed_sample_gets_the_positions_of_get_rope_index(qwen3_pack):
    model = build_model(FOLDER[FAMILY], init="random", overrides=TINY[FAMILY])
    ids_of = spec(FAMILY).token_ids
    reader = ShardReader(qwen3_pack)
    checked = videos = 0
    for seq in range(len(reader.seq_lens())):
        row = reader.sequence(seq)
        offset = 0
        for k, n in enumerate(row["seq_lens"]):
            ids = np.asarray(row["input_ids"][offset : offset + n], dtype=np.int64)
            offset += n
            media = [m for m in row["media"] if m["sample"] == k]
            if not media:
                continue
            grids = {
                f"{kind}_grid_thw": torch.tensor(
                    [[m["grid_t"], m["grid_h"], m["grid_w"]] for m in media if m["kind"] == kind]
                )
                for kind in ("image", "video")
                if any(m["kind"] == kind for m in media)
            }
            types = torch.from_numpy((ids == ids_of.image_pad) * 1 + (ids == ids_of.video_pad) * 2)[None]
            want = model.model.get_rope_index(torch.from_numpy(ids)[None], types, **grids)[0][:, 0].numpy()
            np.testing.assert_array_equal(sample_positions(ids, media, spec(FAMILY)), want)
            checked += 1
            videos += "video_grid_thw" in grids and int(grids["video_grid_thw"][:, 0].max()) > 1
    assert checked >= 9 and videos >= 1  # every demo media sample; a video of several temporal groups


def test_a_tiny_qwen3_vl_trains_on_the_pack_and_exports(qwen3_pack, tmp_path):
    job = write_job(
        tmp_path / "job.yaml",
        job_spec(qwen3_pack, tmp_path / "run", family=FAMILY, microBatchSequences=2, maxSteps=2),
    )
    summary = train(load_train_config(job), log=lambda _: None)
    assert summary["steps"] == 2 and 0 < summary["final_loss"] < 20
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "run" / "final")
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"


def test_text_only_batch_still_reaches_every_vision_parameter(qwen3_pack):
    """Under DDP/FSDP a rank with a text-only batch still runs the tower (a zero term), DeepStack
    mergers included, so every rank reduces the same parameters."""
    model = build_model(FOLDER[FAMILY], init="random", overrides=TINY[FAMILY])
    reader = ShardReader(qwen3_pack)
    text_row = next(r for r in map(reader.sequence, range(len(reader.seq_lens()))) if not r["media"])
    out = VLMForTraining(model, "sdpa", always_run_vision=True)(
        collate_packed([text_row], spec(FAMILY)).inputs
    )
    out["loss_sum"].backward()
    visual = dict(model.model.visual.named_parameters())
    assert any(name.startswith("deepstack_merger_list") for name in visual)
    assert all(p.grad is not None for p in visual.values())


def test_padded_baseline_gives_each_sample_its_packed_loss(shared_dir):
    """The padded baseline (one sample per row, B > 1) places DeepStack features row by row; each
    sample's loss equals the packed one (fp64)."""
    model = build_model(FOLDER[FAMILY], init="random", overrides=TINY[FAMILY], dtype=torch.float64, seed=4)
    core = VLMForTraining(model, "sdpa")
    row = fx.packed_row(fx.demo_samples(FAMILY), FAMILY)
    sums = []
    with torch.no_grad():
        for batch in (collate_packed([row], spec(FAMILY)), collate_padded(split_row(row), spec(FAMILY))):
            out = core(_double_batch(batch).inputs)
            sums.append(per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, 4))
    torch.testing.assert_close(sums[1], sums[0], rtol=1e-10, atol=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vision_config": {"patch_size": 14}}, "vision_config.patch_size is 14"),
        ({"image_token_id": 151654}, "image_token_id is 151654"),
    ],
)
def test_overrides_that_disagree_with_the_folder_are_refused(overrides, message, shared_dir):
    config = load_config(FOLDER[FAMILY], overrides)
    with pytest.raises(ConfigError, match=message):
        checked_spec(FOLDER[FAMILY], config)


def test_a_family_that_is_not_the_folder_is_refused(shared_dir):
    with pytest.raises(ConfigError, match="model.family is qwen2-vl but .*qwen3_vl"):
        checked_spec(FOLDER[FAMILY], load_config(FOLDER[FAMILY]), "qwen2-vl")


def test_lora_in_the_vision_tower_reaches_the_deepstack_mergers(shared_dir):
    from packtrain.core.sft_config import LoraSpec
    from packtrain.trainer.model import lora

    model = build_model(FOLDER[FAMILY], init="random", overrides=TINY[FAMILY])
    lora.apply(model, LoraSpec(vision=True, targetModules=["linear_fc1", "linear_fc2"]), FOLDER[FAMILY])
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert any(".deepstack_merger_list." in n for n in adapted)
    assert any(".visual.merger." in n for n in adapted)
