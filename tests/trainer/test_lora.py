"""LoRA (model.lora): what gets adapters, packed == each sample alone, the PEFT adapter and merged
exports, exact resume, and DDP / FSDP2 under torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import vlm_fixtures as fx
import yaml
from conftest import job_spec, straight_and_resumed, write_job
from peft import PeftModel
from pydantic import ValidationError
from safetensors.torch import load_file
from test_equivalence import _double_batch, _grads, _reference, _rel
from torchrun_job import torchrun_two_processes
from transformers import AutoModelForImageTextToText

from packtrain.core.sft_config import LoraSpec, load_train_config
from packtrain.operator.api import SFTJobSpec
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.loop import train
from packtrain.trainer.model import lora
from packtrain.trainer.model.build import VLMForTraining, build_model
from packtrain.trainer.state.checkpoint import saved_state

REPO = Path(__file__).resolve().parents[2]
EXACT = 1e-10  # fp64: packed and unpacked differ only by summation order
LORA = {"rank": 4, "alpha": 8}


def _tiny(family: str, dtype: torch.dtype = torch.float32):
    return build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=dtype, seed=1)


def _randomize_adapters(model: torch.nn.Module) -> None:
    """PEFT starts B at zero (so A gets no gradient); random adapters test every adapter gradient."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)


@pytest.mark.parametrize("vision", [False, True])
def test_adapters_go_only_where_asked_and_only_they_train(vision, shared_dir):
    model = _tiny("qwen2.5-vl")
    lora.apply(model, LoraSpec(vision=vision, **LORA), fx.FOLDER["qwen2.5-vl"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    layers = {n.split(".lora_")[0] for n in trainable}
    llm = {n for n in layers if n.startswith("model.language_model.layers.")}
    assert {n.rsplit(".", 1)[1] for n in llm} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    visual = {n for n in layers if n.startswith("model.visual.")}
    if vision:  # every block's attention and MLP projections; never the patch-embedding conv
        assert {n.rsplit(".", 1)[1] for n in visual} == {"qkv", "proj", "gate_proj", "up_proj", "down_proj"}
        assert all(n.startswith("model.visual.blocks.") for n in visual)
    else:  # Qwen2.5-VL's vision MLP shares the LLM's projection names: the scope keeps it out
        assert visual == set()
    assert layers <= llm | visual  # neither embeddings nor LM head


def test_targets_that_match_nothing_or_do_not_compile_are_refused(shared_dir):
    with pytest.raises(ValueError, match="matched no linear layer.*e.g. q_proj"):
        lora.apply(_tiny("qwen2-vl"), LoraSpec(targetModules=["qproj"]), fx.FOLDER["qwen2-vl"])
    with pytest.raises(ValidationError, match="not a regular expression"):
        LoraSpec(targetModules=["q_proj("])


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
@pytest.mark.parametrize("vision", [False, True])
def test_packed_equals_each_sample_alone_with_lora(family, vision, shared_dir):
    """Every adapter's gradient from one packed batch equals the sum over each sample alone (fp64),
    and no frozen base weight gets a gradient."""
    torch.set_num_threads(2)
    samples = fx.demo_samples(family)
    model = _tiny(family, torch.float64)
    lora.apply(model, LoraSpec(vision=vision, **LORA), fx.FOLDER[family])
    _randomize_adapters(model)
    batch = _double_batch(
        collate_packed(
            [fx.packed_row(samples[:2], family), fx.packed_row(samples[2:], family)], fx.spec(family)
        )
    )
    total = batch.info.num_label_tokens
    out = VLMForTraining(model, "sdpa")(batch.inputs)
    (out["loss_sum"] / total).backward()
    packed = _grads(model)
    _reference(model, samples, total)
    alone = _grads(model)

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(packed) == set(alone) == trainable  # frozen base weights: grad None on both sides
    assert all(alone[n].norm() > 0 for n in trainable)
    rel = max(_rel(packed[n], alone[n]) for n in trainable)
    print(f"{family} lora vision={vision}: max rel diff of {len(trainable)} adapter grads {rel:.2e}")
    assert rel <= EXACT
    assert any("visual" in n for n in trainable) == vision


@pytest.fixture(scope="module")
def lora_runs(pack_dir, tmp_path_factory):
    """A LoRA run of 4 steps with checkpoints at 2 and 4, and its rerun from the step-2 checkpoint."""
    tmp = tmp_path_factory.mktemp("lora")
    spec = job_spec(pack_dir, tmp / "straight", maxSteps=4, checkpointEvery=2, warmup=1)
    spec["spec"]["model"]["lora"] = {**LORA, "vision": True, "saveMerged": True}
    straight, resumed, resumed_dir = straight_and_resumed(spec, tmp)
    return straight, resumed, tmp / "straight", resumed_dir


def test_lora_resume_is_bit_for_bit_and_checkpoints_hold_only_adapters(lora_runs):
    straight, resumed, a_dir, b_dir = lora_runs
    assert resumed["resumed_from"].endswith("step-00000002") and resumed["steps_this_run"] == 2
    assert resumed["final_loss"] == straight["final_loss"]
    a = load_file(a_dir / "final" / "adapter_model.safetensors")
    b = load_file(b_dir / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    saved, opt_a = saved_state(a_dir / "checkpoints" / "step-00000004")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)  # the base is rebuilt, not saved
    _, opt_b = saved_state(b_dir / "checkpoints" / "step-00000004")
    # Optimizer state for exactly the adapters (those that saw an image so far: text-only steps
    # leave the vision adapters without a gradient, as full fine-tuning does).
    assert opt_a["state"].keys() == opt_b["state"].keys() <= saved.keys()
    assert {k for k in saved if "language_model" in k} <= opt_a["state"].keys()
    assert all(torch.equal(s["exp_avg"], opt_b["state"][k]["exp_avg"]) for k, s in opt_a["state"].items())


def test_resume_restores_no_optimizer_state_the_saved_run_did_not_have(pack_dir, tmp_path):
    """Full fine-tuning too: parameters without a gradient yet at the checkpoint (the vision tower
    after text-only steps) stay without AdamW state on resume, so their first update (bias
    correction by the step count) is the straight run's."""
    spec = job_spec(pack_dir, tmp_path / "straight", maxSteps=4, checkpointEvery=2, saveFinal=False)
    straight_and_resumed(spec, tmp_path)
    step4 = Path("checkpoints") / "step-00000004"
    a = saved_state(tmp_path / "straight" / step4)[1]["state"]
    b = saved_state(tmp_path / "resumed" / step4)[1]["state"]
    assert any("visual" in k for k in a) is False  # this data: no image in the first 4 steps
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k]["step"], b[k]["step"]) for k in a)


def test_adapter_loads_with_peft_and_matches_the_trained_and_merged_model(lora_runs, pack_dir):
    _, _, run_dir, _ = lora_runs
    final = run_dir / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(fx.FOLDER["qwen2-vl"]) and config["r"] == LORA["rank"]
    assert (final / "preprocessor_config.json").is_file()
    trained, _ = saved_state(run_dir / "checkpoints" / "step-00000004")
    adapter = load_file(final / "adapter_model.safetensors")
    # The adapter file is the trained adapters (PEFT's names: no adapter name, base_model.model. prefix).
    assert len(adapter) == len(trained)
    for name, value in trained.items():
        peft_name = "base_model.model." + name.removeprefix("hf.").replace(".default.", ".")
        assert torch.equal(adapter[peft_name], value), name
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())  # the adapters moved

    # The run's base: the same random init (training.seed 0 seeds it).
    base = build_model(fx.FOLDER["qwen2-vl"], init="random", overrides=fx.TINY["qwen2-vl"], seed=0)
    loaded = PeftModel.from_pretrained(base, final).eval()
    merged = AutoModelForImageTextToText.from_pretrained(run_dir / "final-merged").eval()
    plain = build_model(fx.FOLDER["qwen2-vl"], init="random", overrides=fx.TINY["qwen2-vl"], seed=0).eval()
    samples = fx.demo_samples("qwen2-vl")
    with torch.no_grad():
        for s in samples:
            want = loaded(**s.hf).logits
            torch.testing.assert_close(merged(**s.hf).logits, want, rtol=1e-4, atol=1e-5)
            assert (plain(**s.hf).logits - want).abs().max() > 1e-4  # the adapters change the output


def test_lora_example_validates():
    doc = yaml.safe_load((REPO / "examples" / "sftjob-lora.yaml").read_text())
    assert doc["kind"] == "SFTJob"
    spec = SFTJobSpec.model_validate(doc["spec"])
    assert spec.model.lora is not None and spec.model.lora.save_merged
    core = load_train_config(REPO / "examples" / "sftjob-lora.yaml")
    assert core.model.lora == spec.model.lora


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_torchrun_two_gloo_processes_match_one_process(pack_dir, tmp_path, strategy):
    """2 ranks x 2 micro-batches train the same adapters as 1 rank x 4 (loss normalised globally)."""

    def spec(out: Path, **training) -> dict:
        s = job_spec(pack_dir, out, **training)
        s["spec"]["model"]["lora"] = {**LORA, "vision": True, "saveMerged": True}
        return s

    train(load_train_config(write_job(tmp_path / "one.yaml", spec(tmp_path / "one", gradAccum=4))), log=print)
    job = write_job(tmp_path / "two.yaml", spec(tmp_path / "two", gradAccum=2, strategy=strategy))
    proc = torchrun_two_processes(job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "final" / "adapter_model.safetensors")
    assert one.keys() == two.keys() and any("visual" in k for k in one)
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, rtol=1e-4, atol=1e-6, msg=name)
    # The merged export is gathered from the shards (FSDP2) or the replica (DDP) on rank 0.
    merged_one = load_file(tmp_path / "one" / "final-merged" / "model.safetensors")
    merged_two = load_file(tmp_path / "two" / "final-merged" / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in merged_two)
    # As with save_hf, FSDP2's gathered state also names the tied LM head: the embedding again.
    assert merged_two.keys() - merged_one.keys() <= {"lm_head.weight"}
    for name, value in merged_one.items():
        torch.testing.assert_close(merged_two[name], value, rtol=1e-4, atol=1e-6, msg=name)
