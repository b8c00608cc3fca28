"""Sharded checkpoints across world sizes and strategies, and the streamed Hugging Face export.

One checkpoint's life (`reshard_job.py`): 2 FSDP ranks train and save; 1 process resumes, re-saves
and trains on; 4 FSDP ranks resume that; 2 DDP ranks resume again. Every re-save equals what it
loaded, and the state after the chain equals one process's straight run of the same steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import reshard_job
import torch
from conftest import job_spec, write_job
from safetensors.torch import load_file
from torchrun_job import free_port, torchrun_two_processes
from transformers import AutoModelForImageTextToText

from packtrain.core.errors import ConfigError
from packtrain.core.sft_config import load_train_config
from packtrain.trainer.data.sampler import Layout, plan_epoch, position_state, resume_position
from packtrain.trainer.distributed import DistEnv
from packtrain.trainer.loop import train
from packtrain.trainer.state import checkpoint, export

JOB = Path(reshard_job.__file__)
SHARD = 4_000_000  # bytes: the tiny model's 39 MB embedding alone in a shard, the rest around it


def _torchrun(world: int, *args: str) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", str(world), "--master-port", str(free_port()), str(JOB), *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def _step(root: Path, n: int) -> Path:
    return root / "checkpoints" / f"step-{n:08d}"


def _assert_same(a: Path, b: Path) -> None:
    """Two checkpoints hold the same model and AdamW state, bit for bit."""
    (model_a, optim_a), (model_b, optim_b) = checkpoint.saved_state(a), checkpoint.saved_state(b)
    assert model_a.keys() == model_b.keys()
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a), a
    assert optim_a["state"].keys() == optim_b["state"].keys()
    for name, state in optim_a["state"].items():
        assert all(torch.equal(v, optim_b["state"][name][k]) for k, v in state.items()), name
    groups = [json.dumps(o["param_groups"], sort_keys=True) for o in (optim_a, optim_b)]
    assert groups[0] == groups[1]  # as JSON: betas are a tuple or a list


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The resharded chain (2 → 1 → 4 → 2 DDP ranks) and one process's straight run of its 4 steps."""
    root, ref = tmp_path_factory.mktemp("chain"), tmp_path_factory.mktemp("straight")
    _torchrun(2, "--root", str(root), "--steps", "2", "--save", "2", "--export", str(root / "export-2"),
              "--shard-bytes", str(SHARD))  # fmt: skip
    one = ["--root", str(root), "--load", "2", "--resave", "20", "--steps", "1", "--save", "3"]
    reshard_job.run(reshard_job.parse(one), DistEnv())
    _torchrun(4, "--root", str(root), "--load", "3", "--resave", "30", "--steps", "1", "--save", "4")
    _torchrun(2, "--root", str(root), "--strategy", "ddp", "--load", "4", "--resave", "40")
    straight = ["--root", str(ref), "--steps", "2", "--save", "2", "--export", str(ref / "export-1"),
                "--shard-bytes", str(SHARD)]  # fmt: skip
    reshard_job.run(reshard_job.parse(straight), DistEnv())
    reshard_job.run(
        reshard_job.parse(["--root", str(ref), "--load", "2", "--steps", "2", "--save", "4"]), DistEnv()
    )
    return root, ref


def test_a_checkpoint_resumes_at_any_world_size_and_strategy(chain):
    root, ref = chain
    _assert_same(_step(root, 2), _step(root, 20))  # 2 FSDP ranks → 1 process
    _assert_same(_step(root, 3), _step(root, 30))  # 1 process → 4 FSDP ranks
    _assert_same(_step(root, 4), _step(root, 40))  # 4 FSDP ranks → 2 DDP ranks
    # Training on after each resharded resume is the straight run (elementwise AdamW on shards).
    _assert_same(_step(root, 4), _step(ref, 4))
    assert sorted(p.name for p in _step(root, 2).glob("tensors-*.bin")) == [
        "tensors-00000.bin",
        "tensors-00001.bin",
    ]
    assert len(list(_step(root, 3).glob("*.bin"))) == 1 and len(list(_step(root, 4).glob("*.bin"))) == 4
    model, optim = checkpoint.saved_state(_step(root, 4))
    assert not any(k.startswith(reshard_job.FROZEN) for k in model)  # frozen: rebuilt, not saved
    # The vision tower never had a gradient: no AdamW state, through every reshard.
    assert optim["state"] and not any(".visual." in k for k in optim["state"])


def test_ranks_without_a_saved_rng_state_get_a_seeded_fresh_one(chain):
    """4 ranks resuming a 1-process checkpoint: rank 0 continues the saved stream, ranks 1-3 (none
    saved) start from `fresh_rng_seed(seed, step, rank)`: distinct, and the same on every rerun."""
    root, _ = chain
    draws = [json.loads((root / f"rng-3-4-{r}.json").read_text()) for r in range(4)]
    torch.set_rng_state(checkpoint.read_rng(checkpoint.read_saved(_step(root, 3)), 0)["torch"])
    assert draws[0] == torch.rand(2).tolist()
    for rank in (1, 2, 3):
        torch.manual_seed(checkpoint.fresh_rng_seed(0, 3, rank))
        assert draws[rank] == torch.rand(2).tolist()
    assert len({tuple(d) for d in draws}) == 4


def test_export_is_sharded_loadable_and_the_same_from_one_or_two_ranks(chain):
    root, ref = chain
    two, one = root / "export-2", ref / "export-1"
    index = json.loads((two / export.INDEX).read_text())
    assert index == json.loads((one / export.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(p.name for p in two.glob("model-*.safetensors"))
    assert all((two / f).stat().st_size <= SHARD or len(load_file(two / f)) == 1 for f in files)
    for name in files:
        a, b = load_file(two / name), load_file(one / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert (two / "preprocessor_config.json").is_file() and (two / "generation_config.json").is_file()
    loaded = AutoModelForImageTextToText.from_pretrained(two)
    trained, _ = checkpoint.saved_state(_step(root, 2))
    init = reshard_job.build("fsdp", DistEnv())[0].state_dict()  # the frozen patch embedding: as built
    for name, value in loaded.state_dict().items():
        want = trained.get("hf." + name, init.get("hf." + name))
        assert want is not None and torch.equal(value, want), name


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded export, from the shards its index names."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(json.loads((folder / export.INDEX).read_text())["weight_map"].values())):
        out |= load_file(folder / name)
    return out


def test_a_bf16_export_is_the_fp32_one_cast_whatever_the_ranks(chain):
    root, ref = chain
    two, one = root / "export-2-bf16", ref / "export-1"
    assert json.loads((two / "config.json").read_text())["dtype"] == "bfloat16"
    got, fp32 = _weights(two), _weights(one)
    cast = {k: v.to(torch.bfloat16) for k, v in fp32.items()}
    assert got.keys() == cast.keys()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], cast[k]) for k in got)


def test_checkpoints_of_the_former_formats_are_refused_unread(chain, tmp_path):
    """A folder of a former format (model.pt + optimizer.pt gathered on rank 0, or DCP's pickled
    .metadata, with trainer.pt) cannot be read without unpickling: refused, saying what to do, by the
    newest-checkpoint scan as by a load (the planted pickles of test_hostile_checkpoints prove that
    none is read)."""
    root, _ = chain
    model_sd, optim_sd = checkpoint.saved_state(_step(root, 2))
    legacy = _step(tmp_path, 2)
    legacy.mkdir(parents=True)
    torch.save(model_sd, legacy / "model.pt")
    torch.save(optim_sd, legacy / "optimizer.pt")
    torch.save({"step": 2, "data": {"seed": 0}}, legacy / "trainer.pt")
    model, _, optimizer, scheduler = reshard_job.build("fsdp", DistEnv())
    for refuse in (
        lambda: checkpoint.latest(tmp_path),
        lambda: checkpoint.load(legacy, model, optimizer, scheduler, DistEnv()),
    ):
        with pytest.raises(
            ConfigError, match=r"cannot be read safely \(trainer.pt, model.pt, optimizer.pt: pickles"
        ):
            refuse()


def test_a_folder_in_neither_format_is_refused_with_what_to_do(tmp_path):
    folder = _step(tmp_path, 2)
    folder.mkdir(parents=True)
    model, _, optimizer, scheduler = reshard_job.build("fsdp", DistEnv())
    with pytest.raises(ConfigError, match=r"trainer.json is missing .*; delete \S*step-00000002 "):
        checkpoint.load(folder, model, optimizer, scheduler, DistEnv())


# -- the data position under another layout ------------------------------------------------------

COSTS = [(i * 7919) % 97 + 1 for i in range(96)]


def _layout(world: int, accum: int = 1, micro: int = 1) -> Layout:
    return Layout(seed=3, world_size=world, units_per_micro_batch=micro, grad_accum=accum, mode="packed",
                  num_units=len(COSTS))  # fmt: skip


def _trained(layout: Layout, epoch: int, steps: int) -> set[int]:
    plan = plan_epoch(COSTS, layout.world_size, layout.units_per_rank, layout.seed, epoch)
    return {u for step in plan[:steps] for group in step for u in group}


def test_the_same_global_batch_on_other_ranks_resumes_mid_epoch_exactly():
    """2 ranks x gradAccum 2 → 4 ranks x 1 or 1 x 4: each step keeps its units, so the position is
    the same step of the same epoch, whatever step it is."""
    old = _layout(2, accum=2)
    for steps in (3, 5, 11):
        saved = position_state(old, _at(1, 2 * steps))
        for new in (_layout(4), _layout(1, accum=4), _layout(1, micro=2, accum=2)):
            moved = checkpoint.resharded_data_state(saved, new, COSTS)
            pos = resume_position(new, moved)
            assert pos.epoch == 1 and pos.next == steps * new.grad_accum
            assert _trained(new, 1, steps) == _trained(old, 1, steps)


def test_another_global_batch_resumes_at_epoch_boundaries_and_refuses_between():
    old, new = _layout(2), _layout(1)
    at_boundary = position_state(old, _at(2, 0))
    assert resume_position(new, checkpoint.resharded_data_state(at_boundary, new, COSTS)) == _at(2, 0)
    # 8 steps of 2 ranks are one whole balancing window: the same units as 16 steps of 1 rank.
    window = position_state(old, _at(0, 8))
    assert resume_position(new, checkpoint.resharded_data_state(window, new, COSTS)) == _at(0, 16)
    mid = position_state(old, _at(0, 5))
    with pytest.raises(ConfigError, match="train some twice") as refused:
        checkpoint.resharded_data_state(mid, _layout(4), COSTS)
    assert "training.gradAccum" not in str(refused.value)  # 2 units per step cannot be spread over 4
    with pytest.raises(ConfigError, match=r"training.gradAccum 2 keeps the global batch of 2"):
        checkpoint.resharded_data_state(mid, new, COSTS)
    # Another seed is not another layout: sampler refuses it as before.
    other_seed = {**mid, "seed": 4}
    assert checkpoint.resharded_data_state(other_seed, new, COSTS) is other_seed


def _at(epoch: int, index: int):
    from packtrain.trainer.data.sampler import Position

    return Position(epoch, index)


def test_a_run_moves_to_other_ranks_keeping_its_global_batch(pack_dir, tmp_path):
    """2 FSDP ranks x gradAccum 1 train 2 steps; one process with gradAccum 2 (the same global batch)
    resumes their checkpoint and finishes: the same steps, data position and loss as one process
    throughout (the checkpoint's settings may differ in gradAccum: the position is remapped)."""
    # Still warming up at step 4: the schedule does not depend on maxSteps, which differs below.
    straight = job_spec(pack_dir, tmp_path / "straight", maxSteps=4, gradAccum=2, checkpointEvery=2, warmup=8)
    reference = train(load_train_config(write_job(tmp_path / "a.yaml", straight)), log=lambda _: None)
    moved = job_spec(pack_dir, tmp_path / "moved", maxSteps=2, strategy="fsdp", saveFinal=False, warmup=8)
    proc = torchrun_two_processes(write_job(tmp_path / "b.yaml", moved))
    assert proc.returncode == 0, proc.stderr[-3000:]
    moved["spec"]["training"].update(maxSteps=4, gradAccum=2, checkpointEvery=2, saveFinal=True)
    resumed = train(load_train_config(write_job(tmp_path / "c.yaml", moved)), log=lambda _: None)
    assert resumed["resumed_from"].endswith("step-00000002") and resumed["steps_this_run"] == 2
    assert resumed["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-5)
    data = [checkpoint.read_saved(_step(tmp_path / r, 4)).state["data"] for r in ("straight", "moved")]
    assert data[0] == data[1]
    a, b = (
        load_file(tmp_path / "straight" / "final" / "model.safetensors"),
        load_file(tmp_path / "moved" / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=1e-4, atol=1e-5, msg=name)
