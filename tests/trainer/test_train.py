"""End-to-end training on a real pack with a tiny model: CLI, resume, padded baseline, metrics."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch
from conftest import job_spec, straight_and_resumed, write_job
from safetensors.torch import load_file
from torchrun_job import free_port, torchrun_two_processes
from transformers import AutoModelForImageTextToText

from packtrain.core.sft_config import load_train_config
from packtrain.trainer.cli import main
from packtrain.trainer.loop import train
from packtrain.trainer.model.build import build_model
from packtrain.trainer.state.checkpoint import read_saved, saved_state


def _summary(capsys: pytest.CaptureFixture[str]) -> dict:
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def test_cli_trains_and_exports_a_loadable_hf_model(pack_dir, tmp_path, capsys):
    job = write_job(tmp_path / "job.yaml", job_spec(pack_dir, tmp_path / "ignored", microBatchSequences=2))
    out = tmp_path / "run"
    assert main(["train", "-c", str(job), "--max-steps", "2", "--output", str(out)]) == 0
    summary = _summary(capsys)
    assert summary["steps"] == 2 and summary["mode"] == "packed" and summary["attention"] == "sdpa"
    assert summary["tokens"] > 0 and summary["effective_tokens_per_second"] > 0
    assert summary["padding_ratio"] == 0.0
    assert 0 < summary["final_loss"] < 20
    assert summary["mfu"] is None  # CPU: no known peak
    model = AutoModelForImageTextToText.from_pretrained(out / "final")
    saved, _ = saved_state(out / "checkpoints" / "step-00000002")
    for name, param in model.state_dict().items():
        assert torch.equal(param, saved["hf." + name]), name
    assert (out / "final" / "preprocessor_config.json").is_file()
    # The export is a model folder like any other: `init: auto` now finds weights and loads them.
    reloaded = build_model(out / "final", init="auto")
    assert all(torch.equal(p, saved["hf." + n]) for n, p in reloaded.state_dict().items())


def test_a_rerun_of_a_finished_run_reports_no_loss_as_valid_json(pack_dir, tmp_path, capsys):
    """A rerun resumes from the last checkpoint and trains no step: its summary says so with null,
    not NaN (not JSON; the operator writes the loss into the SFTJob's status)."""
    job = write_job(tmp_path / "job.yaml", job_spec(pack_dir, tmp_path / "ignored", checkpointEvery=1))
    out = tmp_path / "run"
    assert main(["train", "-c", str(job), "--max-steps", "1", "--output", str(out)]) == 0
    first = _summary(capsys)
    assert first["final_loss"] is not None
    assert main(["train", "-c", str(job), "--max-steps", "1", "--output", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    rerun = json.loads(lines[-1], parse_constant=lambda c: pytest.fail(f"{c} in the summary line"))
    assert rerun["steps"] == 1 and rerun["steps_this_run"] == 0 and rerun["final_loss"] is None


def test_2n_steps_equal_n_steps_resume_n_steps_bit_for_bit(pack_dir, tmp_path, capsys):
    spec = job_spec(pack_dir, tmp_path / "straight", maxSteps=4, checkpointEvery=2, warmup=1)
    # Interrupted after step 2: only the step-2 checkpoint exists; the rerun resumes from it.
    straight, resumed, resumed_dir = straight_and_resumed(spec, tmp_path)
    assert resumed["resumed_from"].endswith("step-00000002") and resumed["steps_this_run"] == 2
    assert resumed["final_loss"] == straight["final_loss"]
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(resumed_dir / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    _, opt_a = saved_state(tmp_path / "straight" / "checkpoints" / "step-00000004")
    _, opt_b = saved_state(resumed_dir / "checkpoints" / "step-00000004")
    for key, state in opt_a["state"].items():
        assert torch.equal(state["exp_avg"], opt_b["state"][key]["exp_avg"])
    data_a = read_saved(tmp_path / "straight" / "checkpoints" / "step-00000004").state
    data_b = read_saved(resumed_dir / "checkpoints" / "step-00000004").state
    assert data_a["data"] == data_b["data"] and data_a["data"]["next"] == 4


def test_padded_baseline_runs_on_the_same_data(pack_dir, tmp_path):
    spec = job_spec(pack_dir, tmp_path / "padded", mode="padded", paddedBatchSize=4, saveFinal=False)
    summary = train(load_train_config(write_job(tmp_path / "p.yaml", spec)), log=lambda _: None)
    assert summary["mode"] == "padded" and summary["steps"] == 2
    assert 0 < summary["padding_ratio"] < 1
    assert summary["effective_tokens"] < summary["tokens"]


def test_metrics_endpoint_is_scraped_during_a_cpu_run(pack_dir, tmp_path):
    port = free_port()
    spec = job_spec(pack_dir, tmp_path / "m", maxSteps=4, metricsPort=port, saveFinal=False)
    spec["spec"]["data"]["numWorkers"] = 0
    cfg = load_train_config(write_job(tmp_path / "m.yaml", spec))
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(train(cfg, log=lambda _: None)))
    runner.start()
    scraped = ""
    try:
        deadline = time.time() + 240
        while time.time() < deadline and runner.is_alive():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                time.sleep(0.2)
                continue
            if 'packtrain_train_step{rank="0"}' in text and 'packtrain_train_step{rank="0"} 0.0' not in text:
                scraped = text
                break
            time.sleep(0.2)
    finally:
        runner.join()
    assert result["steps"] == 4
    assert scraped, "no step metrics seen while training"
    for name in (
        "tokens_per_second",
        "effective_tokens_per_second",
        "padding_ratio",
        "samples_per_second",
        "step_seconds",
        "loss",
        "learning_rate",
        "data_wait_seconds",
        "attention_imbalance",
    ):
        assert f'packtrain_train_{name}{{rank="0"}}' in scraped, name
    assert (
        'packtrain_train_info{attention="sdpa",mode="packed",rank="0"} 1.0' in scraped
    )  # the chosen backend
    # No GPU here: GPU gauges (and MFU, which needs a known peak) are absent, not zero.
    assert "packtrain_gpu_" not in scraped
    assert "packtrain_train_mfu" not in scraped


@pytest.fixture(scope="module")
def single_process_reference(pack_dir, tmp_path_factory):
    """One process with 4 micro-batches per step: the same global batches as 2 ranks x 2 (and the
    same held-out evaluation set). With 25% held out the second step holds no media on any rank: the
    ranks run the vision tower on dummies, and its zero gradients must be dropped (as one process never
    has them), or AdamW's moments and weight decay would still move the tower."""
    out = tmp_path_factory.mktemp("single")
    spec = job_spec(pack_dir, out / "run", gradAccum=4)
    spec["spec"]["data"]["evalFraction"] = 0.25
    return train(load_train_config(write_job(out / "job.yaml", spec)), log=lambda _: None), out / "run"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_two_gloo_processes_match_one_process(
    pack_dir, tmp_path, strategy, single_process_reference
):
    spec = job_spec(pack_dir, tmp_path / "dist", strategy=strategy, gradAccum=2)
    spec["spec"]["data"]["evalFraction"] = 0.25
    proc = torchrun_two_processes(write_job(tmp_path / "job.yaml", spec))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]  # the pods' JSON lines, rank 0 only
    assert [line.get("event") for line in lines] == ["start", "step", "step", None]
    summaries = [line for line in lines if "event" not in line]
    assert len(summaries) == 1  # rank 0 only
    assert summaries[0]["world_size"] == 2 and summaries[0]["steps"] == 2
    # Loss normalised over the global batch: 2 ranks x 2 micro-batches train like 1 x 4.
    reference, ref_dir = single_process_reference
    assert summaries[0]["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-5)
    # The evaluation loss is summed over both ranks' shares of the held-out set, not a mean of their means.
    assert summaries[0]["eval_units"] == reference["eval_units"] == 18
    assert summaries[0]["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    dist_weights = load_file(tmp_path / "dist" / "final" / "model.safetensors")
    ref_weights = load_file(ref_dir / "final" / "model.safetensors")
    for name, value in ref_weights.items():
        torch.testing.assert_close(dist_weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
    AutoModelForImageTextToText.from_pretrained(tmp_path / "dist" / "final")
