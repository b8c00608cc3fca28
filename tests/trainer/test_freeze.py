"""model.freeze and training.lrMultipliers: which parameters train, at what lr and decay, what
runs without autograd, and that packed still equals each sample alone and resume stays exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import vlm_fixtures as fx
import yaml
from conftest import job_spec, straight_and_resumed, write_job
from pydantic import ValidationError
from safetensors.torch import load_file
from test_equivalence import _double_batch, _grads, _reference, _rel
from torchrun_job import torchrun_two_processes
from transformers import AutoConfig, AutoModelForImageTextToText

from packtrain.core.sft_config import SFTSpecCore, TrainingSpec, load_train_config
from packtrain.operator.api import SFTJobSpec
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.loop import train
from packtrain.trainer.model import param_groups
from packtrain.trainer.model.build import VLMForTraining, build_model
from packtrain.trainer.state.checkpoint import saved_state

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "sftjob-freeze-vit.yaml"
EXACT = 1e-10  # fp64: what differs is only the order of summation


def tiny(family: str, dtype: torch.dtype = torch.float32):
    return build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=dtype, seed=1)


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def tiny_qwen3_vl():
    config = AutoConfig.for_model(
        "qwen3_vl",
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1000,
                     "rope_scaling": {"rope_type": "default", "mrope_section": [4, 6, 6]}},
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "deepstack_visual_indexes": [0, 1]},
    )  # fmt: skip
    return AutoModelForImageTextToText.from_config(config)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_every_parameter_is_in_exactly_one_part(family, shared_dir):
    model = tiny_qwen3_vl() if family == "qwen3-vl" else tiny(family)
    owner = param_groups.part_of_parameters(model)
    parts_of: dict[int, set[str]] = {}
    for part in param_groups.MODULES:
        for path in param_groups.layout(model).part(part):
            for p in model.get_submodule(path).parameters():
                parts_of.setdefault(id(p), set()).add(part)
    assert all(len(parts) == 1 for parts in parts_of.values())
    names = {n: owner[id(p)] for n, p in model.named_parameters()}
    assert set(names.values()) == set(param_groups.MODULES)
    for name, part in names.items():
        expected = (
            "merger" if ".merger." in name or "deepstack" in name
            else "vision" if "visual." in name
            else "embeddings" if "embed_tokens" in name or name.startswith("lm_head")
            else "llm"
        )  # fmt: skip
        assert part == expected, name


def test_freeze_semantics(shared_dir):
    model = tiny("qwen2-vl")
    everything = trainable(model)
    param_groups.freeze(model, ["vision"])
    assert trainable(model) == {n for n in everything if "visual" not in n or ".merger." in n}

    model = tiny("qwen2-vl")
    param_groups.freeze(model, ["llm"])  # embeddings and LM head go with the LLM
    assert trainable(model) == {n for n in everything if "visual" in n}

    model = tiny("qwen2-vl")
    param_groups.freeze(model, ["embeddings"])
    assert trainable(model) == {n for n in everything if "embed_tokens" not in n and "lm_head" not in n}

    with pytest.raises(ValueError, match="leaves nothing to train"):
        param_groups.freeze(tiny("qwen2-vl"), ["vision", "merger", "llm"])


@pytest.mark.parametrize(
    ("freeze", "merger_input_graph", "merger_output_graph"),
    [([], True, True), (["vision"], False, True), (["vision", "merger"], False, False)],
)
def test_a_frozen_tower_builds_no_autograd_graph(freeze, merger_input_graph, merger_output_graph, shared_dir):
    """The merger's input carries a graph only while the tower trains; a trainable merger after a
    frozen tower still builds its own (and so gets its gradient)."""
    model = tiny("qwen2.5-vl")
    param_groups.freeze(model, freeze)
    seen = {}
    model.model.visual.merger.register_forward_hook(
        lambda _m, args, out: seen.update(inp=args[0].grad_fn is not None, out=out.grad_fn is not None)
    )
    model.model.visual.blocks[0].attn.register_forward_pre_hook(
        lambda *_: seen.update(grad=torch.is_grad_enabled())
    )
    sample = fx.demo_samples("qwen2.5-vl")[1]
    model.model.visual(sample.hf["pixel_values"], grid_thw=sample.hf["image_grid_thw"])
    assert seen == {"inp": merger_input_graph, "out": merger_output_graph, "grad": merger_input_graph}


def test_lora_adapters_belong_to_the_module_they_sit_in(shared_dir):
    """A real PEFT wrapper: adapters under a vision block are `vision`, under a decoder layer `llm`;
    only they are trainable, only they are in the optimizer, and the vision blocks without
    adapters ahead of the first adapted one run without autograd."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        tiny("qwen2-vl"),
        LoraConfig(r=4, target_modules=r".*(blocks\.1\.attn\.qkv|layers\.\d+\.self_attn\.q_proj)"),
    )
    silenced = param_groups.freeze(peft_model, [])
    assert silenced == ["model.visual.patch_embed", "model.visual.blocks.0"]
    groups = param_groups.optimizer_groups(peft_model, 1e-4, 0.1, {"vision": 0.5})
    names = {id(p): n for n, p in peft_model.named_parameters()}
    by_group = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in groups}
    assert set(by_group) == {"vision/decay", "llm/decay"}
    assert all("visual.blocks.1.attn.qkv.lora_" in n for n in by_group["vision/decay"])
    assert all("self_attn.q_proj.lora_" in n for n in by_group["llm/decay"])
    assert sum(map(len, by_group.values())) == sum(p.requires_grad for p in peft_model.parameters()) == 6


def test_groups_lr_and_weight_decay(shared_dir):
    model = tiny("qwen2-vl")
    param_groups.freeze(model, ["vision"])
    groups = param_groups.optimizer_groups(model, 1e-3, 0.1, {"merger": 2.0, "llm": 0.5})
    by_name = {g["name"]: g for g in groups}
    assert list(by_name) == [
        "merger/decay", "merger/no_decay", "llm/decay", "llm/no_decay", "embeddings/decay"
    ]  # fmt: skip
    assert by_name["merger/decay"]["lr"] == 2e-3 and by_name["llm/decay"]["lr"] == 5e-4
    assert by_name["embeddings/decay"]["lr"] == 5e-4  # follows llm unless listed
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        assert g["weight_decay"] == (0.1 if g["name"].endswith("/decay") else 0.0)
        for p in g["params"]:
            assert (p.ndim >= 2) == g["name"].endswith("/decay")
            assert p.requires_grad
    assert any(names[id(p)].endswith("norm.weight") for p in by_name["llm/no_decay"]["params"])
    assert any(names[id(p)].endswith("proj.bias") for p in by_name["llm/no_decay"]["params"])
    in_groups = [id(p) for g in groups for p in g["params"]]
    assert sorted(in_groups) == sorted({id(p) for p in model.parameters() if p.requires_grad})


def test_config_fields():
    spec = TrainingSpec.model_validate({"lrMultipliers": {"vision": 0.1, "merger": 1.0}})
    assert spec.lr_multipliers == {"vision": 0.1, "merger": 1.0}
    for bad in ({"vision": 0}, {"vision": -1.0}, {"projector": 1.0}):
        with pytest.raises(ValidationError):
            TrainingSpec.model_validate({"lrMultipliers": bad})
    core = {"data": {"path": "p"}, "model": {"path": "m", "freeze": ["vision", "merger"]}}
    assert SFTSpecCore.model_validate(core).model.freeze == ["vision", "merger"]
    with pytest.raises(ValidationError, match="freeze"):
        SFTSpecCore.model_validate({**core, "model": {"path": "m", "freeze": ["vit"]}})


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_packed_equals_each_sample_alone_with_a_frozen_tower(family, shared_dir):
    """As test_equivalence, with freeze [vision]: every trainable parameter's gradient (merger
    included) equals the reference's; the tower's parameters get none, on either side."""
    torch.set_num_threads(2)
    samples = fx.demo_samples(family)
    model = tiny(family, torch.float64)
    param_groups.freeze(model, ["vision"])
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
    reference = _grads(model)
    assert set(packed) == set(reference) == trainable(model)
    assert not any("visual" in n and ".merger." not in n for n in packed)
    merger = max(_rel(packed[k], reference[k]) for k in reference if ".merger." in k)
    rest = max(_rel(packed[k], reference[k]) for k in reference if ".merger." not in k)
    print(f"{family} frozen tower: max rel diff merger grads {merger:.2e}, LLM grads {rest:.2e}")
    assert merger <= EXACT and rest <= EXACT
    assert all(reference[k].norm() > 0 for k in reference if ".merger." in k)


def test_freeze_and_multipliers_resume_bit_for_bit(pack_dir, tmp_path):
    """2N steps == N + resume + N with a frozen tower and per-part learning rates: the same
    weights, the same AdamW state per group, no state for frozen parameters, frozen weights as
    initialised."""
    # Seed 2, two sequences a micro-batch: steps 1 and 3 hold images, so the merger trains on both sides.
    spec = job_spec(pack_dir, tmp_path / "straight", maxSteps=4, checkpointEvery=2, warmup=1, seed=2,
                    microBatchSequences=2, weightDecay=0.1,
                    lrMultipliers={"merger": 2.0, "llm": 0.5})  # fmt: skip
    spec["spec"]["model"]["freeze"] = ["vision"]
    straight, resumed, resumed_dir = straight_and_resumed(spec, tmp_path)
    assert resumed["final_loss"] == straight["final_loss"]
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(resumed_dir / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    init = build_model(
        fx.FOLDER["qwen2-vl"], init="random", overrides=fx.TINY["qwen2-vl"], seed=2
    ).state_dict()
    trained = AutoModelForImageTextToText.from_pretrained(
        resumed_dir / "final", dtype=torch.float32
    ).state_dict()
    tower = [k for k in init if "visual" in k and ".merger." not in k]
    assert tower and all(torch.equal(trained[k], init[k].to(trained[k].dtype)) for k in tower)
    unchanged = [
        k for k, v in init.items() if ".merger." in k and torch.equal(trained[k], v.to(trained[k].dtype))
    ]
    assert not unchanged, unchanged
    step4 = "checkpoints/step-00000004"
    _, opt_a = saved_state(tmp_path / "straight" / step4)
    _, opt_b = saved_state(resumed_dir / step4)
    assert not any("visual" in k and ".merger." not in k for k in opt_a["state"])
    assert any(".merger." in k for k in opt_a["state"])
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for key, state in opt_a["state"].items():
        assert torch.equal(state["exp_avg"], opt_b["state"][key]["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], opt_b["state"][key]["exp_avg_sq"])
    groups = {g["name"]: g for g in opt_b["param_groups"]}
    assert groups["merger/decay"]["lr"] == pytest.approx(4 * groups["llm/decay"]["lr"])
    assert groups["llm/no_decay"]["weight_decay"] == 0.0


def test_example_validates_and_renders():
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = SFTJobSpec.model_validate(doc["spec"])
    assert spec.model.freeze == ["vision"] and spec.training.lr_multipliers == {"merger": 2.0}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("packtrain")), "render", str(EXAMPLE),
         "--pack-claim", "packtrain-data"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config_map = next(d for d in yaml.safe_load_all(proc.stdout) if d["kind"] == "ConfigMap")
    rendered = yaml.safe_load(next(iter(config_map["data"].values())))
    assert rendered["spec"]["model"]["freeze"] == ["vision"]


def _freeze_job(pack_dir: Path, out: Path, **training) -> dict:
    """One step, whose batch holds images (seed 2): a later text-only step would update the merger
    from its AdamW momentum on the ranks that run the dummy image, but not in one process."""
    spec = job_spec(pack_dir, out, seed=2, maxSteps=1, lrMultipliers={"merger": 2.0}, **training)
    spec["spec"]["model"]["freeze"] = ["vision"]
    return spec


@pytest.fixture(scope="module")
def frozen_single_process(pack_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("frozen-single")
    train(
        load_train_config(write_job(out / "job.yaml", _freeze_job(pack_dir, out / "run", gradAccum=4))),
        log=lambda _: None,
    )
    return out / "run"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_frozen_tower_under_ddp_and_fsdp2_matches_one_process(
    pack_dir, tmp_path, strategy, frozen_single_process
):
    """2 gloo ranks x 2 micro-batches train like 1 x 4 with a frozen tower: DDP needs no
    find_unused_parameters (it only tracks parameters that require grad), and FSDP2 takes the
    root unit's mix of frozen (patch embedding) and trainable (merger, embeddings) parameters."""
    job = write_job(
        tmp_path / "job.yaml", _freeze_job(pack_dir, tmp_path / "dist", strategy=strategy, gradAccum=2)
    )
    proc = torchrun_two_processes(job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist = load_file(tmp_path / "dist" / "final" / "model.safetensors")
    single = load_file(frozen_single_process / "final" / "model.safetensors")
    for name, value in single.items():
        torch.testing.assert_close(dist[name], value, rtol=1e-4, atol=1e-5, msg=name)
    init = build_model(fx.FOLDER["qwen2-vl"], init="random", overrides=fx.TINY["qwen2-vl"], seed=2)
    trained = AutoModelForImageTextToText.from_pretrained(tmp_path / "dist" / "final", dtype=torch.float32)
    changed = {n for n, p in trained.state_dict().items() if not torch.equal(p, init.state_dict()[n])}
    assert changed == {n for n in init.state_dict() if "visual" not in n or ".merger." in n}


@pytest.mark.cluster
def test_the_api_server_takes_the_example_and_refuses_unknown_parts(kube_cluster):
    """The CRD cannot restrict map keys in its schema; its CEL rule refuses an unknown part."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/sftjobs.packtrain.dev")
    doc = yaml.safe_load(EXAMPLE.read_text())
    with kube_cluster.api_client() as api:
        custom = client.CustomObjectsApi(api)

        def create(spec: dict) -> None:
            body = {**doc, "metadata": {"name": "probe"}, "spec": spec}
            custom.create_namespaced_custom_object(
                "packtrain.dev", "v1alpha1", "default", "sftjobs", body, dry_run="All"
            )

        create(doc["spec"])
        for edit, words in (
            (("training", "lrMultipliers", {"projector": 1.0}), "lrMultipliers keys are parts of the model"),
            (("training", "lrMultipliers", {"vision": 0}), "spec.training.lrMultipliers.vision"),
            (("model", "freeze", ["vit"]), "spec.model.freeze[0]"),
        ):
            section, key, value = edit
            spec = {**doc["spec"], section: {**doc["spec"][section], key: value}}
            with pytest.raises(ApiException) as refused:
                create(spec)
            assert refused.value.status == 422 and words in str(refused.value.body), refused.value.body


def test_flops_count_frozen_parts_without_their_weight_gradients() -> None:
    """MFU must not credit work a frozen part never does: a frozen tower runs forward only (2 FLOPs
    per parameter and patch), a frozen or LoRA-adapted LLM still back-propagates to its inputs (4 + 2 x
    the trainable share), full fine-tuning stays 6."""
    from packtrain.trainer.metrics import _factor

    full = {"llm": 100, "vision": 50}
    assert _factor(full, "llm", frozen_forward_only=False) == 6.0
    assert _factor(full, "vision", frozen_forward_only=True) == 6.0
    frozen = {"llm": 100, "llm_trainable": 0, "vision": 50, "vision_trainable": 0}
    assert _factor(frozen, "vision", frozen_forward_only=True) == 2.0
    assert _factor(frozen, "llm", frozen_forward_only=False) == 4.0
    lora = {"llm": 100, "llm_trainable": 1}
    assert _factor(lora, "llm", frozen_forward_only=False) == pytest.approx(4.02)
