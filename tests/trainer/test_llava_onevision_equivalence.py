"""LLaVA-OneVision-1.5: a packed row trains exactly like each sample alone.

One packed row of four real samples (text-only; one image; two images in one turn; a multi-turn
sample with two images) through packtrain's pixel path, collator (1-D positions restarting per
sample, explicit boundaries, images grouped per sample) and one-call vision tower, against the
project's model called the plain way (`LlavaOneVision15ForConditionalGeneration(**processor
outputs)`, `Qwen2_5_VLProcessor`, the tower's own per-image attention) on each sample alone. fp64
on CPU, a tiny random model from the shared config.json.

The tower computes upstream's class-token offset over the images of one call
(`llava_onevision.py`), so the row's five images in one call equal the samples alone only when the
call takes them grouped per sample: the broken controls drop that grouping, or the boundaries.
"""

from __future__ import annotations

import dataclasses

import packed_vs_alone as side
import pytest
import torch
import vlm_fixtures as fx

from packtrain.core.errors import ConfigError
from packtrain.core.model_folder import ModelFolder
from packtrain.core.model_spec import model_spec
from packtrain.core.sft_config import LoraSpec
from packtrain.trainer.data.batch import Batch
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.model import lora, param_groups
from packtrain.trainer.model.build import VLMForTraining, build_model, checked_spec, load_config
from packtrain.trainer.model.vision_attention import counting_calls, per_segment

TOL = 1e-10  # fp64
NAMES = ["text", "one-image", "two-images", "multi-turn"]


@pytest.fixture(scope="module")
def model():
    return build_model(
        fx.LLAVA_OV_FOLDER, init="random", overrides=fx.LLAVA_OV_TINY, dtype=torch.float64, seed=1
    )


@pytest.fixture(scope="module")
def batch() -> Batch:
    samples = fx.llava_ov_samples()
    assert [s.name for s in samples] == NAMES
    packed = collate_packed([fx.llava_ov_row(samples)], model_spec(fx.LLAVA_OV_FOLDER))
    return Batch(packed.inputs.to(torch.device("cpu"), torch.float64), packed.info)


def _packed(model, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return side.packed(model, batch)


def _reference(model, total: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each sample alone through the model's own forward with the processor's outputs."""
    with per_segment(model):
        return side.alone(
            model,
            fx.llava_ov_samples(),
            total,
            lambda s: {k: v.double() if k == "pixel_values" else v for k, v in s.hf.items()},
        )


def _parts(grads: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    return {
        "vision tower": [k for k in grads if k.startswith("model.visual.") and ".merger." not in k],
        "merger": [k for k in grads if k.startswith("model.visual.merger.")],
        "llm": [k for k in grads if not k.startswith("model.visual.")],
    }


def _compare(model, batch: Batch) -> tuple[float, dict[str, float]]:
    packed, packed_grads = _packed(model, batch)
    ref, ref_grads = _reference(model, batch.info.num_label_tokens)
    assert set(packed_grads) == set(ref_grads) == {n for n, _ in model.named_parameters()}
    loss_rel = ((packed - ref).abs() / ref.abs()).max().item()
    worst = {
        part: max(side.rel(packed_grads[k], ref_grads[k]) for k in keys)
        for part, keys in _parts(ref_grads).items()
    }
    return loss_rel, worst


def test_packed_equals_each_sample_alone(model, batch):
    torch.set_num_threads(2)
    with counting_calls(model) as calls:
        VLMForTraining(model, "sdpa")(batch.inputs)
    assert len(calls) == model.config.vision_config.depth  # one attention call per block, all 5 images
    assert batch.inputs.position_ids.shape == batch.inputs.input_ids.shape  # 1-D, restarting
    assert batch.inputs.position_ids[0, batch.info.seq_lens[0]].item() == 0
    assert batch.inputs.image_groups is not None and batch.inputs.image_groups.tolist() == [0, 1, 2, 2]
    loss_rel, worst = _compare(model, batch)
    shown = ", ".join(f"{part} {value:.2e}" for part, value in worst.items())
    print(f"llava-onevision-1.5 fp64: max rel diff per-sample loss sums {loss_rel:.2e}, grads {shown}")
    assert loss_rel <= TOL
    assert all(value <= TOL for value in worst.values()), worst


def test_the_vision_side_learns(model, batch):
    """The tower's and merger's gradients are real (a zero gradient would match trivially)."""
    _, grads = _packed(model, batch)
    parts = _parts(grads)
    assert all(grads[k].norm() > 0 for k in parts["vision tower"] + parts["merger"]), [
        k for k in parts["vision tower"] + parts["merger"] if grads[k].norm() == 0
    ]


@pytest.mark.parametrize("broken", ["images in one group", "boundaries dropped"])
def test_broken_packing_fails(model, batch, broken):
    """The controls: the row's images as one group (upstream's class-token offset then runs across
    the samples, shifting every image after the first sample's), or the row's sample boundaries
    dropped (one causal run over the row)."""
    torch.set_num_threads(2)
    total = batch.inputs.input_ids.shape[1]
    if broken == "images in one group":
        inputs = dataclasses.replace(batch.inputs, image_groups=torch.tensor([5]))
    else:
        inputs = dataclasses.replace(
            batch.inputs, cu_seq_lens=torch.tensor([0, total], dtype=torch.int32), max_length=total
        )
    loss_rel, worst = _compare(model, Batch(inputs, batch.info))
    print(f"llava-onevision-1.5 fp64, {broken}: loss sums {loss_rel:.2e}, grads {worst}")
    assert loss_rel > 1e-6


def test_text_only_rank_gives_vision_zero_gradients(model):
    """`always_run_vision` on a media-free micro-batch: a dummy image through the tower (patches of
    3 x 14 x 14, one temporal patch), so every vision parameter has a (zero) gradient."""
    text = collate_packed([fx.llava_ov_row(fx.llava_ov_samples()[:1])], model_spec(fx.LLAVA_OV_FOLDER))
    assert text.inputs.pixel_values is None
    out = VLMForTraining(model, "sdpa", always_run_vision=True)(text.inputs)
    out["loss_sum"].backward()
    grads = side.grads(model)
    assert len(grads) == len(list(model.parameters()))
    vision = [k for k in grads if k.startswith("model.visual.")]
    assert vision and all(grads[k].abs().max().item() == 0.0 for k in vision)
    assert any(grads[k].norm() > 0 for k in grads if not k.startswith("model.visual."))


def test_every_parameter_has_a_part(model):
    """Freezing, LoRA targets and per-part learning rates see every parameter: the tower's own class
    token and its rotary entry in `vision`, the merger in `merger`."""
    owner = param_groups.part_of_parameters(model)
    named = dict(model.named_parameters())
    assert owner[id(named["model.visual.class_embedding"])] == "vision"
    assert owner[id(named["model.visual.class_pos_emb"])] == "vision"
    assert owner[id(named["model.visual.pre_layernorm.weight"])] == "vision"
    assert owner[id(named["model.visual.blocks.0.attn.qkv.weight"])] == "vision"
    assert owner[id(named["model.visual.merger.mlp.0.weight"])] == "merger"
    assert owner[id(named["model.language_model.layers.0.self_attn.q_norm.weight"])] == "llm"
    assert owner[id(model.lm_head.weight)] == "embeddings"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"image_token_id": 151652}, "image_token_id"),
        ({"vision_config": {"patch_size": 16}}, "vision_config.patch_size"),
        ({"vision_config": {"spatial_merge_size": 1}}, "vision_config.spatial_merge_size"),
    ],
)
def test_checked_spec_refuses_a_model_the_pack_was_not_counted_for(override, key):
    """The tiny model agrees with the folder's tokenizer and processor (image token, 14-pixel patches,
    one frame per patch, 2x2 merge); an override that breaks one of them is refused by name."""
    spec = checked_spec(
        ModelFolder(fx.LLAVA_OV_FOLDER, fx.LLAVA_OV_TINY), load_config(fx.LLAVA_OV_FOLDER, fx.LLAVA_OV_TINY)
    )
    assert spec.family.name == fx.LLAVA_OV and spec.vision.temporal_patch_size == 1
    merged = {**fx.LLAVA_OV_TINY, **override}
    if "vision_config" in override:
        merged["vision_config"] = {**fx.LLAVA_OV_TINY["vision_config"], **override["vision_config"]}
    folder = ModelFolder(fx.LLAVA_OV_FOLDER, merged)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        checked_spec(folder, load_config(folder))


def _tiny_fp32():
    return build_model(fx.LLAVA_OV_FOLDER, init="random", overrides=fx.LLAVA_OV_TINY, seed=1)


def test_a_frozen_tower_trains_only_the_merger_side(batch):
    """model.freeze [vision]: the class token, its rotary entry, the norm and the blocks stop; the
    tower up to the merger runs without autograd and the merger still learns."""
    model = _tiny_fp32()
    silenced = param_groups.freeze(model, ["vision"])
    assert silenced == [
        "model.visual.patch_embed",
        "model.visual.pre_layernorm",
        "model.visual.blocks.0",
        "model.visual.blocks.1",
    ]
    assert not model.model.visual.class_embedding.requires_grad
    assert not model.model.visual.class_pos_emb.requires_grad
    out = VLMForTraining(model, "sdpa")(
        Batch(batch.inputs.to(torch.device("cpu"), torch.float32), batch.info).inputs
    )
    out["loss_sum"].backward()
    assert all(
        p.grad is None
        for n, p in model.named_parameters()
        if n.startswith("model.visual.") and ".merger." not in n
    )
    assert all(p.grad is not None and p.grad.norm() > 0 for p in model.model.visual.merger.parameters())


def test_lora_on_the_tower_adapts_its_blocks():
    """model.lora with vision: adapters in the tower's blocks (never the patch conv or the class
    token), only they train, and the no-autograd prefix stops at the first adapted block."""
    model = _tiny_fp32()
    peft_model = lora.apply(model, LoraSpec(vision=True, rank=4, alpha=8), fx.LLAVA_OV_FOLDER)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    adapted = {n.split(".lora_")[0].split("model.visual.", 1)[1] for n in trainable if ".visual." in n}
    assert any(n.startswith("blocks.0.") for n in adapted) and any(n.startswith("blocks.1.") for n in adapted)
    assert not any(n.startswith(("patch_embed", "class_")) for n in adapted)
    assert param_groups.freeze(peft_model, []) == ["model.visual.patch_embed", "model.visual.pre_layernorm"]
