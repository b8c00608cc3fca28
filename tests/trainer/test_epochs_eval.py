"""Epochs instead of maxSteps, and the evaluation loss (a held-out share or a separate pack)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import vlm_fixtures as fx
from conftest import job_spec, write_job
from pydantic import ValidationError
from safetensors.torch import load_file
from support.paths import SHARED

from packtrain.core.config import PackConfig
from packtrain.core.sft_config import DEFAULT_MAX_STEPS, SFTSpecCore, TrainingSpec, load_train_config
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan
from packtrain.trainer.data.media import PixelSpec
from packtrain.trainer.data.packed import EvalDataset, PackedDataset, collate_packed, eval_dataset
from packtrain.trainer.data.sampler import Layout, carve_eval, eval_micro_batches, plan_epoch, total_steps
from packtrain.trainer.evaluate import due, evaluate
from packtrain.trainer.loop import batches, train
from packtrain.trainer.model.build import VLMForTraining, build_model
from packtrain.trainer.state.checkpoint import read_saved

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> Path:
    """27 short packed text sequences (40 chats of the shared text set, 128 tokens a row): whole
    epochs of a tiny model in seconds."""
    out = tmp_path_factory.mktemp("tiny")
    chats = json.loads(
        (SHARED / "datasets" / "text-sft" / "fastchat" / "dummy_conversation.json").read_text()
    )
    (out / "chats.json").write_text(json.dumps(chats[:40]))
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(out / "chats.json")]},
            "model": {"family": "qwen2-vl", "path": str(fx.FOLDER["qwen2-vl"])},
            "packing": {"maxLength": 128, "sequencesPerShard": 16},
        }
    )
    convert(cfg, out / "pack", 0, 1)
    plan(cfg, out / "pack")
    materialize(cfg, out / "pack", 0, 1)
    return out / "pack"


# -- configuration ---------------------------------------------------------------------------------


def test_max_steps_and_epochs_are_exclusive_and_the_default_stays_100():
    assert TrainingSpec().fixed_steps() == DEFAULT_MAX_STEPS == 100
    assert TrainingSpec(max_steps=7).fixed_steps() == 7
    assert TrainingSpec(epochs=2).fixed_steps() is None
    with pytest.raises(ValidationError, match="at most one of `maxSteps` or `epochs`"):
        TrainingSpec.model_validate({"maxSteps": 10, "epochs": 1})
    with pytest.raises(
        ValidationError, match="at most one of `evalPath`, `evalPackJobRef` or `evalFraction`"
    ):
        SFTSpecCore.model_validate(
            {"data": {"path": "p", "evalPath": "e", "evalFraction": 0.1}, "model": {"path": "m"}}
        )
    with pytest.raises(ValidationError):
        SFTSpecCore.model_validate({"data": {"path": "p", "evalFraction": 0.9}, "model": {"path": "m"}})
    quickstart = load_train_config(REPO / "examples" / "quickstart.yaml")
    assert quickstart.training.fixed_steps() == 6 and quickstart.data.eval_fraction == 0


@pytest.mark.parametrize(
    ("units", "world", "micro", "accum", "per_epoch"),
    [
        (72, 1, 1, 1, 72),
        (72, 2, 1, 4, 9),
        (72, 4, 2, 2, 4),
        (100, 8, 3, 1, 4),
        (54, 1, 9, 2, 3),
        (16, 8, 2, 1, 1),
    ],
)
def test_epochs_become_steps_over_the_global_batch(units, world, micro, accum, per_epoch):
    layout = Layout(0, world, micro, accum, "packed", units)
    assert layout.steps_per_epoch == per_epoch == len(plan_epoch([1] * units, world, micro * accum, 0, 0))
    assert total_steps(None, 3, layout, 100) == 3 * per_epoch
    assert total_steps(5, None, layout, 100) == 5 and total_steps(None, None, layout, 100) == 100


def test_evaluation_is_due_every_n_steps_and_after_the_last():
    assert [s for s in range(1, 8) if due(s, 7, 3)] == [3, 6, 7]
    assert [s for s in range(1, 8) if due(s, 7, 0)] == [7]


# -- the held-out share ------------------------------------------------------------------------------


def test_eval_fraction_is_seeded_disjoint_and_never_trained(pack_dir):
    train_seqs, held = carve_eval(72, 0.25, seed=3)
    assert (train_seqs, held) == carve_eval(72, 0.25, seed=3)  # the same on every rank and rerun
    assert held != carve_eval(72, 0.25, seed=4)[1]
    assert (
        len(held) == 18 and not set(train_seqs) & set(held) and sorted(train_seqs + held) == list(range(72))
    )
    assert carve_eval(72, 0.0, seed=3) == (list(range(72)), [])
    assert len(carve_eval(3, 0.01, seed=0)[1]) == 1  # at least one sequence
    with pytest.raises(ValueError, match="holds out all"):
        carve_eval(1, 0.5, seed=0)

    ds = PackedDataset(
        pack_dir,
        fx.spec("qwen2-vl"),
        units_per_micro_batch=9,
        grad_accum=2,
        verify_checksums=False,
        eval_fraction=0.25,
        seed=3,
    )
    assert ds.eval_sequences == held and {seq for seq, _ in ds.units} == set(train_seqs)
    ev = eval_dataset(
        ds,
        SFTSpecCore.model_validate(
            {"data": {"path": str(pack_dir), "evalFraction": 0.25}, "model": {"path": "m"}}
        ).data,
    )
    assert isinstance(ev, EvalDataset) and sorted(seq for seq, _ in ev.units) == held
    trained = {s for b in ds.micro_batches() for s in b}
    assert {ds.units[u][0] for u in trained}.isdisjoint(held)


@pytest.mark.parametrize(
    ("units", "world", "micro"), [(18, 1, 4), (18, 2, 4), (7, 4, 1), (5, 3, 2), (4, 4, 3)]
)
def test_every_eval_unit_counts_once_and_ranks_run_as_many_forwards(units, world, micro):
    shares = [eval_micro_batches(units, world, r, micro) for r in range(world)]
    counted = [u for mbs, n in shares for mb in mbs[:n] for u in mb]
    assert sorted(counted) == list(range(units))
    assert len({len(mbs) for mbs, _ in shares}) == 1
    with pytest.raises(ValueError, match="evaluation set holds"):
        eval_micro_batches(world - 1, world, 0, micro)


def test_one_epoch_trains_each_unit_exactly_once(pack_dir):
    ds = PackedDataset(
        pack_dir,
        fx.spec("qwen2-vl"),
        PixelSpec.from_folder(fx.FOLDER["qwen2-vl"]),
        units_per_micro_batch=9,
        grad_accum=2,
        verify_checksums=False,
        eval_fraction=0.25,
    )
    stream, seen = batches(ds, 0, 2, False), []
    for _ in range(ds.steps_per_epoch() * ds.grad_accum):
        batch = next(stream)
        ds.mark_consumed(batch)
        seen.extend(batch.info.sample_ids)
    trained = [sid for seq, _ in ds.units for sid in ds.reader.sequence(seq)["sample_ids"]]
    assert sorted(seen) == sorted(trained) and len(set(seen)) == len(seen)
    assert ds.position == (1, 0)


# -- the loss ----------------------------------------------------------------------------------------


def test_eval_loss_is_the_token_mean_over_the_eval_set(pack_dir):
    hf = build_model(fx.FOLDER["qwen2-vl"], init="random", overrides=fx.TINY["qwen2-vl"], seed=1)
    model = VLMForTraining(hf, "sdpa")
    spec = PixelSpec.from_folder(fx.FOLDER["qwen2-vl"])
    held = [0, 5, 11, 30, 47, 70]  # text, images and video; micro-batches of 4 and 2 sequences
    ev = EvalDataset(
        pack_dir, fx.spec("qwen2-vl"), spec, sequences=held, units_per_micro_batch=4, verify_checksums=False
    )
    # By hand: every sequence alone, all logits at once (no chunking), Σ token losses / Σ label tokens.
    alone = VLMForTraining(hf, "sdpa", loss_chunk_tokens=0).eval()
    sums, counts, means = 0.0, 0, []
    with torch.no_grad():
        for seq in held:
            batch = collate_packed([ev._decoded_row(seq, {})], fx.spec("qwen2-vl"))
            loss = float(alone(batch.inputs)["loss_sum"])
            sums, counts = sums + loss, counts + batch.info.num_label_tokens
            means.append(loss / batch.info.num_label_tokens)
    rng = torch.get_rng_state()
    got = evaluate(model, ev, torch.device("cpu"), torch.float32)
    assert model.training  # handed back in training mode ...
    assert torch.equal(rng, torch.get_rng_state())  # ... and the training run's RNG untouched
    assert got == pytest.approx(sums / counts, rel=1e-6)
    assert sum(means) / len(means) != pytest.approx(sums / counts, rel=1e-5)  # a mean of means fails


def test_epochs_report_steps_and_eval_loss_and_resume_exactly_across_an_epoch(tiny_pack, tmp_path):
    """27 sequences, 7 held out: 20 = 2 steps of 5 x 2 per epoch; two epochs, interrupted after
    step 1 and resumed across the epoch boundary."""
    spec = job_spec(
        tiny_pack,
        tmp_path / "straight",
        microBatchSequences=5,
        gradAccum=2,
        epochs=2,
        evalEvery=2,
        checkpointEvery=1,
        keepCheckpoints=5,
    )
    del spec["spec"]["training"]["maxSteps"]
    spec["spec"]["data"]["evalFraction"] = 0.25
    lines: list[str] = []
    straight = train(load_train_config(write_job(tmp_path / "a.yaml", spec)), log=lines.append)
    start, steps = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    assert start["event"] == "start" and start["max_steps"] == 4
    assert start["epochs"] == 2 and start["steps_per_epoch"] == 2 and start["eval_units"] == 7
    assert [s["step"] for s in steps if "eval_loss" in s] == [2, 4]  # every 2 steps, and after the last
    assert straight["steps"] == 4 and straight["epochs"] == 2.0 and straight["eval_units"] == 7
    assert (
        straight["eval_loss"] == pytest.approx(steps[-1]["eval_loss"], rel=1e-5)
        and 0 < straight["eval_loss"] < 20
    )
    checkpoints = tmp_path / "straight" / "checkpoints"
    positions = [
        (d["data"]["epoch"], d["data"]["next"])
        for d in (read_saved(checkpoints / f"step-0000000{n}").state for n in (2, 4))
    ]
    assert positions == [(1, 0), (2, 0)]  # each epoch trains every unit once, then rolls over

    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoints / "step-00000001", resumed_dir / "checkpoints" / "step-00000001")
    spec["spec"]["training"]["outputDir"] = str(resumed_dir)
    resumed = train(load_train_config(write_job(tmp_path / "b.yaml", spec)), log=lambda _: None)
    assert resumed["steps_this_run"] == 3
    assert resumed["final_loss"] == straight["final_loss"] and resumed["eval_loss"] == straight["eval_loss"]
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(resumed_dir / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_path_evaluates_a_separate_pack(tiny_pack, tmp_path):
    spec = job_spec(tiny_pack, tmp_path / "run", saveFinal=False, checkpointAtEnd=False, maxSteps=1)
    spec["spec"]["data"]["evalPath"] = str(tiny_pack)
    summary = train(load_train_config(write_job(tmp_path / "job.yaml", spec)), log=lambda _: None)
    assert summary["eval_units"] == 27 and 0 < summary["eval_loss"] < 20
    spec["spec"]["data"] = {"path": str(tiny_pack), "evalPackJobRef": "evals"}
    with pytest.raises(ValueError, match="evalPackJobRef 'evals' must be resolved"):
        train(load_train_config(write_job(tmp_path / "job.yaml", spec)), log=lambda _: None)


def test_the_eval_gauge_the_trainer_serves_is_what_the_operator_reads():
    from prometheus_client import generate_latest

    from packtrain.operator.progress import progress_from_metrics
    from packtrain.trainer.metrics import TrainMetrics

    metrics = TrainMetrics(0, torch.device("cpu"))
    metrics.update({"step": 4.0, "loss": 2.5, "eval_loss": 2.75})
    text = generate_latest(metrics.registry).decode()
    assert 'packtrain_train_eval_loss{rank="0"} 2.75' in text
    progress = progress_from_metrics(text, None, "now")
    assert progress is not None and progress["evalLoss"] == 2.75 and progress["step"] == 4
