"""Resume holes, checkpoint replacement, fail-fast error paths and precision: regressions once found."""

from __future__ import annotations

import pytest
import torch
from conftest import job_spec, straight_and_resumed, write_job
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText
from vlm_fixtures import FOLDER, TINY
from vlm_fixtures import spec as family_spec

from packtrain.core.sft_config import load_train_config
from packtrain.trainer.data.media import PixelSpec
from packtrain.trainer.data.packed import PackedDataset
from packtrain.trainer.loop import batches, train
from packtrain.trainer.model.build import build_model, load_config
from packtrain.trainer.state.checkpoint import saved_state


def test_dataloader_does_not_draw_from_the_global_rng(pack_dir):
    """Creating a DataLoader iterator draws its worker base seed from the global torch RNG, so a
    resumed run (which creates one at the resume point) would be one draw off the straight run."""
    ds = PackedDataset(
        pack_dir, family_spec("qwen2-vl"), PixelSpec.from_folder(FOLDER["qwen2-vl"]), units_per_micro_batch=4
    )
    torch.manual_seed(0)
    before = torch.get_rng_state()
    next(batches(ds, 0, 2, False))
    assert torch.equal(before, torch.get_rng_state())


def test_resume_is_bit_for_bit_with_dropout(pack_dir, tmp_path):
    """With dropout the global RNG matters: the restored RNG must be the one the step used."""
    spec = job_spec(pack_dir, tmp_path / "straight", maxSteps=4, checkpointEvery=2, saveFinal=True)
    spec["spec"]["model"]["configOverrides"] = {
        **spec["spec"]["model"]["configOverrides"],
        "attention_dropout": 0.5,
    }
    straight, resumed, resumed_dir = straight_and_resumed(spec, tmp_path)
    assert resumed["steps_this_run"] == 2
    assert resumed["final_loss"] == straight["final_loss"]
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(resumed_dir / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_data_path_without_manifest_fails_fast_with_exit_2(tmp_path, capsys, monkeypatch):
    """A folder that is not a finished pack is a configuration error: exit 2 with the reason,
    before the (possibly many-GB) model is built."""
    from packtrain.trainer import cli, recipe

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the pack was checked")

    monkeypatch.setattr(recipe, "build_model", no_model)
    empty = tmp_path / "not-a-pack"
    empty.mkdir()
    job = write_job(tmp_path / "job.yaml", job_spec(empty, tmp_path / "out"))
    assert cli.main(["-c", str(job)]) == 2
    err = capsys.readouterr().err
    assert "manifest.json" in err and str(empty) in err


def test_restart_after_the_last_step_keeps_the_checkpoint_it_resumed_from(pack_dir, tmp_path):
    """A rerun that finds maxSteps already done must not delete and rewrite the checkpoint it
    resumed from (with keepCheckpoints: 1 that folder is the only copy of the run)."""
    spec = job_spec(pack_dir, tmp_path / "run", keepCheckpoints=1, saveFinal=False)
    cfg = write_job(tmp_path / "job.yaml", spec)
    train(load_train_config(cfg), log=lambda _: None)
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    before = (ckpt.stat().st_ino, (ckpt / "trainer.json").stat().st_mtime_ns)
    again = train(load_train_config(cfg), log=lambda _: None)
    assert again["steps_this_run"] == 0 and again["resumed_from"] == str(ckpt)
    assert (ckpt.stat().st_ino, (ckpt / "trainer.json").stat().st_mtime_ns) == before


def test_resume_inside_a_later_epoch_continues_the_same_stream(pack_dir):
    """maxSteps beyond one epoch: the stream wraps into reshuffled epochs, and a stream resumed
    from a state saved in the middle of the second epoch (loader workers on) continues with the
    same micro-batches as the uninterrupted one."""

    def dataset():
        return PackedDataset(
            pack_dir,
            family_spec("qwen2-vl"),
            PixelSpec.from_folder(FOLDER["qwen2-vl"]),
            units_per_micro_batch=16,
            grad_accum=2,
            verify_checksums=False,
        )

    def take(ds, steps):
        stream, out = batches(ds, 1, 2, False), []
        for _ in range(steps):
            micro = [next(stream) for _ in range(ds.grad_accum)]
            for b in micro:
                ds.mark_consumed(b)
            out.extend((tuple(b.info.position), b.info.sample_ids) for b in micro)
        return out

    straight = dataset()
    assert straight.steps_per_epoch() == 2
    full = take(straight, 5)
    assert [p for p, _ in full] == [(e, i) for e in range(3) for i in range(4)][:10]
    assert [ids for _, ids in full[:4]] != [ids for _, ids in full[4:8]]  # each epoch reshuffled
    first = dataset()
    take(first, 3)
    resumed = dataset()
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 2) == full[6:]
    assert resumed.state_dict()["epoch"] == 2 and resumed.state_dict()["next"] == 2


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_bf16_build_keeps_rope_frequencies_in_fp32(family, shared_dir):
    """`model.to(dtype=bf16)` also casts the rotary `inv_freq` buffers, which transformers keeps
    in fp32: at position 8000 a bf16 inv_freq is off by up to ~16 radians, and the trained model
    would differ from what `from_pretrained` later loads."""
    model = build_model(FOLDER[family], init="random", overrides=TINY[family], dtype=torch.bfloat16)
    reference = AutoModelForImageTextToText.from_config(
        load_config(FOLDER[family], TINY[family]), dtype=torch.bfloat16
    )
    assert {n: b.dtype for n, b in model.named_buffers()} == {
        n: b.dtype for n, b in reference.named_buffers()
    }
    assert model.model.language_model.rotary_emb.inv_freq.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_pack_smaller_than_one_global_step_fails_before_the_model(pack_dir, tmp_path, monkeypatch):
    """Fewer sequences than ranks x micro-batch x grad accumulation: a clear error, raised before
    the model is built (every rank raises it, so none waits in a collective)."""
    from packtrain.trainer import recipe

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the data was planned")

    monkeypatch.setattr(recipe, "build_model", no_model)
    spec = job_spec(pack_dir, tmp_path / "out", microBatchSequences=50, gradAccum=2)
    with pytest.raises(ValueError, match=r"pack holds \d+ units but one global step needs 100 "):
        train(load_train_config(write_job(tmp_path / "job.yaml", spec)), log=lambda _: None)


def test_gpu_bench_parses_on_cpu_and_matches_tokens_per_step():
    """The device bench must import and parse its arguments on a CPU-only machine, and its padded
    baseline must take about a packed sequence's effective tokens per optimizer step."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "gpu_bench.py"
    proc = subprocess.run([sys.executable, str(bench), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--padded-accum" in proc.stdout
    sys.path.insert(0, str(bench.parent))
    try:
        import gpu_bench
    finally:
        sys.path.remove(str(bench.parent))
    manifest = {"tokens": 8000 * 100, "sequences": 100, "counts": {"packed": 400}}  # 2000-token samples
    assert gpu_bench.padded_grad_accum(manifest, 2) == 2
    assert gpu_bench.padded_grad_accum(manifest, 8) == 1


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_flex_backend_is_causal_in_the_padded_baseline(shared_dir):
    """In padded mode transformers hands the registered flex function no mask for the language
    model; it must still attend causally (as SDPA does), not bidirectionally over the row."""
    import vlm_fixtures as fx

    from packtrain.trainer.data.packed import collate_padded, split_row
    from packtrain.trainer.model.build import VLMForTraining

    family = "qwen2-vl"
    samples = fx.demo_samples(family)
    rows = [fx.packed_row(samples[:2], family), fx.packed_row(samples[2:], family)]
    padded = collate_padded([s for r in rows for s in split_row(r)], fx.spec(family))
    losses = {}
    for backend in ("flex", "sdpa"):
        model = build_model(FOLDER[family], init="random", overrides=TINY[family], attention=backend, seed=1)
        with torch.no_grad():
            losses[backend] = VLMForTraining(model, backend)(padded.inputs)["token_losses"]
    torch.testing.assert_close(losses["flex"], losses["sdpa"], rtol=1e-5, atol=1e-5)


def test_bf16_is_mixed_precision_with_fp32_master_weights(pack_dir, tmp_path):
    """bf16 weights would round most lr-1e-5 AdamW updates away; fp32 masters keep every one."""
    spec = job_spec(
        pack_dir, tmp_path / "run", maxSteps=1, lr=1e-5, warmup=0, dtype="bf16", checkpointEvery=1
    )
    summary = train(load_train_config(write_job(tmp_path / "job.yaml", spec)), log=lambda _: None)
    assert summary["steps"] == 1 and summary["final_loss"] == summary["final_loss"]  # not NaN
    trained, _ = saved_state(tmp_path / "run" / "checkpoints" / "step-00000001")
    initial = build_model(
        spec["spec"]["model"]["path"],
        init="random",
        overrides=spec["spec"]["model"]["configOverrides"],
        seed=0,
    ).state_dict()
    name = next(k for k in initial if k.endswith("layers.0.mlp.down_proj.weight"))
    after = trained["hf." + name]
    assert after.dtype == torch.float32
    changed = (after != initial[name]).float().mean().item()
    assert changed > 0.9, f"only {changed:.0%} of the weights moved"
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert {v.dtype for v in final.values() if v.is_floating_point()} == {torch.bfloat16}
