"""Nothing silently wrong at the start and the end of a training: a model folder without weights
trains a random model only when the spec says `init: random` (and every run says which init it
used), a pack too small for one step names its reject share, and a rerun of a finished run says
"already complete" without building the model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import job_spec, write_job
from test_first_hour import chats, image_record, one_line_error, packtrain
from vlm_fixtures import FOLDER

from packtrain.core.config import PackConfig
from packtrain.core.sft_config import load_train_config
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan
from packtrain.trainer.loop import train

QWEN2 = FOLDER["qwen2-vl"]


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("init", [None, "auto", "pretrained"])
def test_a_folder_without_weights_is_refused_unless_init_random(init, pack_dir, tmp_path):
    spec = job_spec(pack_dir, tmp_path / "out")
    if init is None:
        del spec["spec"]["model"]["init"]
    else:
        spec["spec"]["model"]["init"] = init
    err = one_line_error(packtrain("train", "-c", str(write_job(tmp_path / "job.yaml", spec))), 2)
    assert err.strip() == (
        f"packtrain train: configuration error: no weights in {QWEN2}: put the safetensors there, or set "
        "model.init: random to train from scratch"
    )
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.fixture(scope="module")
def finished(pack_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A tiny random-init run trained to its end (2 steps, exported): its folder and its log lines."""
    root = tmp_path_factory.mktemp("finished")
    lines: list[str] = []
    job = write_job(root / "job.yaml", job_spec(pack_dir, root / "out", saveFinal=True))
    summary = train(load_train_config(job), log=lines.append)
    return job, [json.loads(line) for line in lines] + [dict(summary)]


def test_a_random_run_says_so_at_the_start_and_in_the_summary(finished):
    _, lines = finished
    start = next(line for line in lines if line.get("event") == "start")
    assert start["init"] == "random" and (start["step"], start["max_steps"]) == (0, 2)
    assert lines[-1]["init"] == "random" and lines[-1]["steps_this_run"] == 2


def test_a_pretrained_run_names_the_folder_it_loaded(finished, pack_dir, tmp_path):
    job, _ = finished
    final = Path(load_train_config(job).training.output_dir) / "final"
    spec = job_spec(pack_dir, tmp_path / "out", maxSteps=1)
    spec["spec"]["model"] = {"path": str(final)}  # init left at its default: the weights are there
    lines: list[str] = []
    summary = train(load_train_config(write_job(tmp_path / "job.yaml", spec)), log=lines.append)
    start = next(json.loads(line) for line in lines if '"start"' in line)
    assert start["init"] == summary["init"] == f"pretrained from {final}"


def test_a_rerun_of_a_finished_run_builds_nothing(finished, monkeypatch):
    from packtrain.trainer import recipe

    def no_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a finished run's rerun built the model")

    monkeypatch.setattr(recipe, "build_model", no_model)
    job, _ = finished
    lines: list[str] = []
    summary = train(load_train_config(job), log=lines.append)
    assert lines == []  # no start line (a "3..2" range), no step
    assert (summary["steps"], summary["steps_this_run"], summary["init"]) == (2, 0, "random")
    assert summary["resumed_from"] and summary["resumed_from"].endswith("step-00000002")
    assert summary["final_model"] and Path(summary["final_model"], "config.json").is_file()


def test_the_rerun_command_says_already_complete(finished):
    job, _ = finished
    again = packtrain("train", "-c", str(job), "--log-format", "rich")
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    out_dir = load_train_config(job).training.output_dir
    assert again.stderr.strip() == (
        f"packtrain train: already complete: {out_dir} holds all 2 steps, nothing was trained; to train "
        "more raise training.maxSteps, to start over use a new --output or delete that folder"
    )
    assert "training steps" not in again.stdout and "3..2" not in again.stdout
    assert _json_lines(again.stdout)[-1]["steps_this_run"] == 0


def _lossy_pack(root: Path) -> Path:
    """3 chats and 3 records whose image is missing (50% rejected, allowed here): one sequence."""
    (root / "media").mkdir(parents=True)
    records = chats(3) + [image_record(f"img-{i}", "gone.jpg") for i in range(3)]
    (root / "data.json").write_text(json.dumps(records))
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(root / "data.json")], "mediaRoot": str(root / "media")},
            "model": {"path": str(QWEN2)},
            "packing": {"maxLength": 1024, "maxRejectedFraction": None},
        }
    )
    convert(cfg, root / "pack", 0, 1)
    plan(cfg, root / "pack")
    materialize(cfg, root / "pack", 0, 1)
    return root / "pack"


def test_a_pack_too_small_for_one_step_names_its_reject_share(tmp_path):
    pack = _lossy_pack(tmp_path)
    job = write_job(tmp_path / "job.yaml", job_spec(pack, tmp_path / "out", microBatchSequences=50))
    err = one_line_error(packtrain("train", "-c", str(job)), 2)
    assert len(err.strip().splitlines()) == 1
    assert "but one global step needs 50 (1 ranks x 50); pack more data or shrink the batch" in err
    assert "3 of 6 samples (50.0%) were rejected" in err and "missing_media 3" in err
    assert f"{pack / 'rejects.jsonl'}" in err


def test_a_pack_without_rejects_says_so_when_too_small(pack_dir, tmp_path):
    from packtrain.trainer.data.sampler import PackTooSmall

    counts = json.loads((pack_dir / "manifest.json").read_text())["counts"]
    assert counts["rejected"] == 0
    spec = job_spec(pack_dir, tmp_path / "out", microBatchSequences=1000)
    share = f"none of its {counts['input']} input samples was rejected (reject share 0%)"
    with pytest.raises(PackTooSmall, match=rf"needs 1000 .*; {re.escape(share)}$"):
        train(load_train_config(write_job(tmp_path / "job.yaml", spec)), log=lambda _: None)
