"""`packtrain train --score FILE`: each packed sample's summed loss under the starting weights.

A small pack of text and image samples (several per row) is scored by the CLI on a tiny random-init
Qwen2-VL, which also exports those weights to `final/`; each sample's line must equal that model
loaded with plain transformers and run on the sample alone (its ids, labels, pixels and grids as the
pack holds them). The row scored as one sample (boundaries ignored) must not. Then 2 gloo ranks
under torchrun write the same file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import job_spec, write_job
from support.paths import DEMO
from torchrun_job import REPO, free_port
from transformers import AutoModelForImageTextToText
from vlm_fixtures import FOLDER, spec

from packtrain.core.config import PackConfig
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan
from packtrain.trainer.cli import main
from packtrain.trainer.data.media import media_pixels
from packtrain.trainer.data.packed import PackedDataset, collate_packed, split_row
from packtrain.trainer.model.build import VLMForTraining
from packtrain.trainer.model.loss import per_sample_sums

FAMILY = "qwen2-vl"
TOL = 1e-4  # fp32, relative
TEXT_CHATS = [
    [("user", "What is the capital of France?"), ("assistant", "Paris is the capital of France.")],
    [("user", "Count to five."), ("assistant", "One, two, three, four, five.")],
    [("user", "Name a primary colour."), ("assistant", "Red is a primary colour, as are blue and yellow.")],
]


@pytest.fixture(scope="module")
def small_pack(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> Path:
    """The six image chats of the demo data and three text chats, packed a few to a row."""
    root = tmp_path_factory.mktemp("score")
    text = root / "text.jsonl"
    text.write_text(
        "".join(
            json.dumps({"messages": [{"role": r, "content": c} for r, c in chat]}) + "\n"
            for chat in TEXT_CHATS
        )
    )
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(DEMO / "mllm_demo.json"), str(text)]},
            "model": {"family": FAMILY, "path": str(FOLDER[FAMILY]), "maxPixels": 48 * 28 * 28},
            "packing": {"maxLength": 320, "sequencesPerShard": 4},
        }
    )
    out = root / "pack"
    convert(cfg, out, 0, 1)
    plan(cfg, out)
    materialize(cfg, out, 0, 1)
    return out


def _job(pack: Path, output: Path, **training: Any) -> dict[str, Any]:
    spec_ = job_spec(pack, output, FAMILY, dtype="fp32", **training)
    spec_["spec"]["data"]["numWorkers"] = 0
    return spec_


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rows(pack: Path) -> list[dict[str, Any]]:
    """Every packed row in pack order, with its media decoded as the trainer decodes them."""
    data = PackedDataset(pack, spec(FAMILY))
    rows = []
    for seq in range(len(data.seq_lens)):
        row = data.reader.sequence(seq)
        row["pixels"] = [
            media_pixels(data.reader.media(ref["key"], shard=row["shard"]), ref, data.pixel_spec)
            for ref in row["media"]
        ]
        rows.append(row)
    return rows


def _alone(model: Any, sample: dict[str, Any]) -> tuple[float, int]:
    """Plain transformers on one sample: Σ cross-entropy over its label tokens, and their count."""
    ids = torch.tensor([sample["input_ids"]])
    kwargs: dict[str, Any] = {"input_ids": ids}
    if sample["pixels"]:  # what the processor returns beside the ids: 1 at image tokens
        kwargs["mm_token_type_ids"] = (ids == spec(FAMILY).token_ids.image_pad).long()
        kwargs["pixel_values"] = torch.cat(sample["pixels"])
        kwargs["image_grid_thw"] = torch.tensor(
            [[m["grid_t"], m["grid_h"], m["grid_w"]] for m in sample["media"]]
        )
    with torch.no_grad():
        logits = model(**kwargs, use_cache=False).logits[0, :-1].float()
    targets = torch.tensor(sample["labels"][1:])
    loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    return loss.item(), int((targets != -100).sum())


def _as_one_sample(model: Any, row: dict[str, Any]) -> list[float]:
    """The broken control: the row scored as one sample (no boundaries, positions running on),
    its token losses split by the real boundaries afterwards."""
    merged = {**row, "seq_lens": [sum(row["seq_lens"])], "media": [{**m, "sample": 0} for m in row["media"]]}
    batch = collate_packed([merged], spec(FAMILY))
    with torch.no_grad():
        out = VLMForTraining(model, "sdpa")(batch.inputs)
    lens = torch.tensor(row["seq_lens"])
    owner = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return per_sample_sums(out["token_losses"].double(), out["positions"], owner, len(lens)).tolist()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.fixture(scope="module")
def scored(small_pack: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """`packtrain train --score` in this process (saveFinal: the starting weights to final/)."""
    root = tmp_path_factory.mktemp("scored")
    job = write_job(root / "job.yaml", _job(small_pack, root / "run"))
    rc = main(["train", "-c", str(job), "--score", str(root / "scores.jsonl")])
    return root / "scores.jsonl", root / "run", rc


def test_score_equals_each_sample_alone_in_plain_transformers(scored, small_pack):
    path, run, rc = scored
    assert rc == 0
    lines = _lines(path)
    manifest = json.loads((small_pack / "manifest.json").read_text())
    rows = _rows(small_pack)
    samples = [s for row in rows for s in split_row(row)]
    assert len(lines) == manifest["counts"]["packed"] == len(samples) == 9
    assert any(len(row["seq_lens"]) > 1 for row in rows)  # several samples share a row
    assert [line["id"] for line in lines] == [s["sample_ids"][0] for s in samples]  # pack order
    assert not (run / "checkpoints").exists()
    model = AutoModelForImageTextToText.from_pretrained(run / "final", dtype=torch.float32).eval()
    worst = 0.0
    for line, sample in zip(lines, samples, strict=True):
        loss_sum, tokens = _alone(model, sample)
        assert line["tokens"] == tokens > 0, sample["sample_ids"]
        worst = max(worst, _rel(line["loss_sum"], loss_sum))
    broken = [s for row in rows for s in _as_one_sample(model, row)]
    control = max(_rel(b, line["loss_sum"]) for b, line in zip(broken, lines, strict=True))
    print(f"packed vs alone: max rel diff {worst:.2e}; row as one sample: {control:.2e}")
    assert worst <= TOL
    assert control > 10 * TOL  # a whole token loss moved across each boundary


def test_two_gloo_ranks_write_the_same_scores(scored, small_pack, tmp_path):
    path, _, _ = scored
    job = write_job(tmp_path / "job.yaml", _job(small_pack, tmp_path / "run", saveFinal=False))
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "packtrain.trainer", "-c", str(job), "--score", str(tmp_path / "scores.jsonl")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(summaries) == 1 and summaries[0]["samples"] == 9  # rank 0 only
    one, two = _lines(path), _lines(tmp_path / "scores.jsonl")
    assert [x["id"] for x in two] == [x["id"] for x in one]
    assert [x["tokens"] for x in two] == [x["tokens"] for x in one]
    assert all(_rel(b["loss_sum"], a["loss_sum"]) < 1e-5 for a, b in zip(one, two, strict=True))
    assert not (tmp_path / "run").exists()  # without saveFinal nothing goes to the output folder


@pytest.mark.parametrize("where", ["missing/scores.jsonl", "."])
def test_a_score_file_that_cannot_be_written_exits_2(small_pack, tmp_path, capsys, where):
    job = write_job(tmp_path / "job.yaml", _job(small_pack, tmp_path / "run"))
    assert main(["train", "-c", str(job), "--score", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("packtrain train: --score")


def test_plan_and_score_together_exit_2(small_pack, tmp_path, capsys):
    job = write_job(tmp_path / "job.yaml", _job(small_pack, tmp_path / "run"))
    assert main(["train", "-c", str(job), "--plan", "--score", str(tmp_path / "s.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("packtrain train: --plan and --score: choose one") and len(err.splitlines()) == 1
    assert not (tmp_path / "s.jsonl").exists()
