"""training.contextParallel: one packed row split over the ranks of a group trains what one rank trains.

Real torchrun, gloo, CPU. Per sample (fp64, every Qwen family): the loss and the gradient of each
sample's mean loss under contextParallel 2 equal the unsplit row's and the sample's own forward alone,
and a control that recomputes positions after the split fails the same check. Per run (fp32, real
packs of text, image and video samples): the per-step losses and final weights of contextParallel 4
at maxLength 8,192 equal one process's, contextParallel 2 x data-parallel 2 equals data-parallel 2,
and a contextParallel 2 run resumed from its checkpoint equals one never stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import vlm_fixtures as fx
from conftest import job_spec, make_pack, write_job
from safetensors.torch import load_file
from torchrun_job import REPO, free_port

from packtrain.core.errors import ConfigError
from packtrain.core.memory_plan import context_parallel_problem
from packtrain.core.model_size import model_dims
from packtrain.trainer.model import context_parallel as cp
from packtrain.trainer.model.build import VLMForTraining, build_model

HERE = Path(__file__).resolve().parent
FOLDERS = {"internvl": "internvl3.5", "llava-onevision-1.5": "llava-onevision-1.5"}
FP64_TOL = 1e-10
# Qwen3.5: its RMSNorms and delta rule compute in fp32 inside (transformers), as in the unsplit test.
TOL = {"qwen3.5": 1e-6}
# Four query heads (one K/V head, repeated under the split) so that contextParallel 4 divides them.
FOUR_HEADS = {
    **fx.TINY["qwen2-vl"],
    "num_attention_heads": 4,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
}


def _torchrun(nproc: int, *args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.run(
        [str(torchrun), "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO,
    )  # fmt: skip


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# -- the split ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [2, 4])
def test_the_zigzag_split_covers_the_row_once_and_balances_causal_work(size):
    total = cp.padded_length(1000, size)
    assert total % (2 * size) == 0 and total - 1000 < 2 * size
    held = [cp.zigzag(total, size, r) for r in range(size)]
    assert sorted(torch.cat(held).tolist()) == list(range(total))
    work = [int((h + 1).sum()) for h in held]  # causal attention: a token attends to its position + 1 keys
    assert max(work) == min(work)
    mesh = cp.Mesh(size, 1, None, 0, 1)
    lay = cp.layout(total, mesh)
    gathered = torch.cat(held)
    assert torch.equal(gathered[lay.natural], torch.arange(total))


def test_padding_is_a_sample_of_its_own_without_labels():
    mesh = cp.Mesh(2, 0, None, 0, 1)
    ids = torch.arange(1, 11)[None]
    positions = torch.arange(10).expand(4, 1, 10)
    labels = torch.arange(10)[None]
    split = cp.split_row(ids, positions, labels, torch.tensor([0, 4, 10]), 6, mesh, pad_id=0)
    assert split.layout.total == 12 and split.cu_seq_lens.tolist() == [0, 4, 10, 12]
    assert split.full_input_ids[0, 10:].tolist() == [0, 0]
    assert split.layout.local.tolist() == [0, 1, 2, 9, 10, 11]
    assert split.shift_labels[0].tolist() == [0, 1, 2, 9, -100, -100]
    assert split.position_ids[0, 0].tolist() == [0, 1, 2, 9, 0, 0]


def test_media_are_dealt_in_contiguous_runs_of_about_equal_patches():
    assert cp.deal([100, 100, 100, 100], 2) == [(0, 2), (2, 4)]
    assert cp.deal([400, 16, 16], 2) == [(0, 1), (1, 3)]
    runs = cp.deal([64], 4)  # one image: one rank encodes it, the others a dummy
    assert sorted(b - a for a, b in runs) == [0, 0, 0, 1]
    assert cp.deal([], 2) == [(0, 0), (0, 0)]


@pytest.mark.parametrize(
    ("world", "size", "heads", "kv", "names"),
    [
        (6, 4, 8, 8, "multiple of 4"),
        (4, 4, 6, 6, "6 attention heads"),
    ],
)
def test_a_world_or_heads_that_cannot_be_split_are_refused_naming_the_fix(world, size, heads, kv, names):
    with pytest.raises(ConfigError, match=names):
        cp.check_mesh(world, size, heads, kv)
    cp.check_mesh(8, 4, 8, 2)  # 2 K/V heads repeated to 4: each query head still meets its own
    cp.check_mesh(4, 4, 4, 1)


# -- per sample ----------------------------------------------------------------------------------------


# The per-sample cases of the three tests below, all from one torchrun (one start-up of each rank).
CASES = (
    *(f"samples:{family}" for family in fx.FAMILIES),
    "varlen:qwen2.5-vl",
    "varlen:qwen3.5",
    "broken:qwen2-vl",
)


@pytest.fixture(scope="module")
def per_sample(shared_dir) -> dict[str, list[dict]]:
    """Each case's comparison, both ranks' lines (`cp_worker.py`), keyed by MODE:FAMILY."""
    proc = _torchrun(2, str(HERE / "cp_worker.py"), *CASES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _json_lines(proc.stdout)
    return {case: [line for line in lines if f"{line['mode']}:{line['family']}" == case] for case in CASES}


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_each_sample_under_context_parallel_2_equals_the_unsplit_row_and_the_sample_alone(family, per_sample):
    ranks = per_sample[f"samples:{family}"]
    assert len(ranks) == 2
    tol = TOL.get(family, FP64_TOL)
    for rank in ranks:
        print(rank)
        for key in ("loss_vs_row", "loss_vs_alone", "grad_vs_row", "grad_vs_alone"):
            assert rank[key] <= tol, (family, key, rank)
    assert sum(r["local"] for r in ranks) > ranks[0]["local"] > 0  # both ranks hold label tokens


def test_the_varlen_backend_gets_the_whole_rows_boundaries_under_context_parallel(per_sample):
    """The GPU default (torch's FlashAttention varlen kernel) through the same wrapper, with a CPU
    reference of its signature: windowed vision (Qwen2.5-VL) and the hybrid decoder (Qwen3.5)."""
    lines = per_sample["varlen:qwen2.5-vl"] + per_sample["varlen:qwen3.5"]
    assert {line["family"] for line in lines} == {"qwen2.5-vl", "qwen3.5"} and len(lines) == 4
    for line in lines:
        assert line["backend"] == "varlen" and line["kernel_calls"] > 0, line
        for key in ("loss_vs_row", "loss_vs_alone", "grad_vs_row", "grad_vs_alone"):
            assert line[key] <= TOL.get(line["family"], FP64_TOL), line


def test_positions_recomputed_after_the_split_fail_the_same_check(per_sample):
    ranks = per_sample["broken:qwen2-vl"]
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["loss_vs_alone"] > 1e-6 and rank["grad_vs_alone"] > 1e-2, rank


# -- whole runs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_pack(tmp_path_factory, shared_dir) -> Path:
    """The demo sets (images, videos) and 500 text chats packed at maxLength 8,192: near-full rows.
    Twice the quickstart's length, and a quarter of 16k's cost: `sdpa`'s mask grows with its square."""
    return make_pack(tmp_path_factory.mktemp("cp") / "pack", max_length=8192)


def _run(pack: Path, out: Path, nproc: int, **training) -> tuple[list[float], dict, dict]:
    out.mkdir(parents=True, exist_ok=True)
    spec = job_spec(pack, out / "run", **training)
    spec["spec"]["model"]["configOverrides"] = FOUR_HEADS
    job = write_job(out / "job.yaml", spec)
    if nproc == 1:
        proc = subprocess.run(
            [sys.executable, "-m", "packtrain.trainer", "-c", str(job), "--log-format", "json"],
            capture_output=True, text=True, timeout=900, cwd=REPO,
        )  # fmt: skip
    else:
        proc = _torchrun(nproc, "-m", "packtrain.trainer", "-c", str(job), "--log-format", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _json_lines(proc.stdout)
    losses = [line["loss"] for line in lines if line.get("event") == "step"]
    summary = next(line for line in lines if "event" not in line)
    return losses, summary, load_file(out / "run" / "final" / "model.safetensors")


def _same_run(run: tuple, reference: tuple) -> None:
    """Per-step losses (the log prints 6 significant digits) and the final loss within 1e-5; every
    final weight within 1e-5 relative, or 1e-5 absolute where AdamW's normalisation lifts a gradient
    that is ~0 in both (the key projection's bias: softmax is blind to it but for the rotary
    rotation) to full-size steps of rounding noise."""
    losses, summary, weights = run
    ref_losses, ref_summary, ref_weights = reference
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-4)
    assert summary["final_loss"] == pytest.approx(ref_summary["final_loss"], rel=1e-5)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_context_parallel_4_trains_what_one_process_trains_at_8k_tokens(long_pack, tmp_path):
    """The widest split the heads allow; contextParallel 2's whole runs are the two tests below."""
    one = _run(long_pack, tmp_path / "one", 1)
    # Two steps; the totals leave the first (warm-up) out, so `tokens` is the second's row: near-full.
    assert one[1]["tokens"] > 6000 and len(one[0]) == 2
    run = _run(long_pack, tmp_path / "cp4", 4, contextParallel=4, strategy="fsdp")
    print(f"contextParallel 4: losses {run[0]} vs {one[0]}")
    assert run[1]["tokens"] == one[1]["tokens"]  # each row counted once, not once per rank
    _same_run(run, one)


def test_context_parallel_2_by_data_parallel_2_equals_data_parallel_2(pack_dir, tmp_path):
    dp = _run(pack_dir, tmp_path / "dp2", 2, strategy="fsdp", maxSteps=3)
    both = _run(pack_dir, tmp_path / "cp2dp2", 4, strategy="fsdp", maxSteps=3, contextParallel=2)
    _same_run(both, dp)


def test_a_context_parallel_run_resumes_from_its_checkpoint_as_if_never_stopped(pack_dir, tmp_path):
    """Checkpoints under contextParallel hold the whole model and the data position of the
    data-parallel world: 2 steps, stop, 2 more equal 4 straight. The degree is the layout of a step,
    as the world size is: a resume may change it where the data position maps onto the new layout."""
    straight = _run(pack_dir, tmp_path / "straight", 2, strategy="fsdp", maxSteps=4, checkpointEvery=2,
                    contextParallel=2)  # fmt: skip
    resumed = tmp_path / "resumed" / "run" / "checkpoints"
    resumed.mkdir(parents=True)
    shutil.copytree(
        tmp_path / "straight" / "run" / "checkpoints" / "step-00000002", resumed / "step-00000002"
    )
    again = _run(pack_dir, tmp_path / "resumed", 2, strategy="fsdp", maxSteps=4, contextParallel=2)
    assert again[0] == straight[0][2:]
    _same_run(([], *again[1:]), ([], *straight[1:]))
    # contextParallel 1 over the same 2 ranks doubles the data-parallel world: mid-epoch, the
    # position cannot be mapped (as for a new world size), and the refusal says so.
    other = tmp_path / "other" / "run" / "checkpoints"
    other.mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "run" / "checkpoints" / "step-00000002", other / "step-00000002")
    spec = job_spec(pack_dir, tmp_path / "other" / "run", strategy="fsdp", maxSteps=4)
    spec["spec"]["model"]["configOverrides"] = FOUR_HEADS
    proc = _torchrun(
        2, "-m", "packtrain.trainer", "-c", str(write_job(tmp_path / "other" / "job.yaml", spec))
    )
    assert proc.returncode != 0
    assert "1 data-parallel ranks x 1 units per step" in proc.stderr and "with 2 x 1" in proc.stderr


@pytest.mark.parametrize("family", ["internvl", "llava-onevision-1.5"])
def test_families_whose_rows_cannot_be_split_are_refused_by_the_planner_and_the_trainer(family, shared_dir):
    """One source (`Family.context_parallel`): the plan, the operator and the trainer say the same."""
    config = json.loads((fx.MODELS / FOLDERS[family] / "config.json").read_text())
    problem = context_parallel_problem(2, world_size=2, world="2 ranks", dims=model_dims(config), packed=True)
    assert problem is not None and f"{family} rows cannot be split" in problem
    assert "qwen2-vl" in problem and "training.contextParallel: 1" in problem
    hf = build_model(fx.MODELS / FOLDERS[family], init="random", device="meta")
    with pytest.raises(ConfigError, match="cannot be split over ranks yet"):
        VLMForTraining(hf, "sdpa", mesh=cp.Mesh(2, 0, None, 0, 1))
