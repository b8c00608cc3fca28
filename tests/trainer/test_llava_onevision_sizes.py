"""LLaVA-OneVision-1.5 in the core's sizes: the parameter counts (`core/model_size.py`) equal
`sum(p.numel())` of the project's `LlavaOneVision15ForConditionalGeneration` built on the meta device
(the shared 8B config, a tied head, small towers and decoders of other widths; freeze and LoRA as the
trainer applies them); the family's default sizes are upstream's config classes'; the vision
dimensions RICE-ViT adds are refused before anything uses them; the memory plan and the FLOPs count
the class token each image runs through the tower with, and the merger per merged token, as a hand
count does; and the released 4B and 8B have plausible totals.
"""

from __future__ import annotations

import ast
import json
import time
from dataclasses import replace
from typing import Any

import pytest
import torch
from count_checks import check_counts
from support.paths import MODELS
from support.qwen_sizes import LLAVA_OV15, llava_ov15_overrides

from packtrain.core.errors import ConfigError
from packtrain.core.memory_plan import (
    RICE_CLASS_TOKEN_SHARE,
    PlanInputs,
    plan_memory,
    vision_block_bytes,
)
from packtrain.core.model_size import (
    _TEXT_DEFAULTS,
    _VISION_DEFAULTS,
    LLAVA_OV,
    deep_merge,
    dimension_problems,
    model_dims,
    param_counts,
    planning_config,
    read_config,
    vision_tensors,
)
from packtrain.core.sft_config import LoraSpec
from packtrain.trainer import accounting
from packtrain.trainer.data.batch import Batch, BatchInfo, ModelInputs
from packtrain.trainer.metrics import ModelShape, step_flops
from packtrain.trainer.model import llava_onevision, lora, param_groups

FOLDER = MODELS / "llava-onevision-1.5"
SMALL_TEXT = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "layer_types": None,
              "max_window_layers": 2}  # fmt: skip
SMALL_VISION = {"depth": 2, "embed_dim": 32, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4,
                "text_hidden_size": 64}  # fmt: skip
# config.json keys over the shared 8B config: one variant per choice the model's modules make.
VARIANTS: dict[str, dict[str, Any]] = {
    "llava-ov-1.5-8b": {},
    "tied-8b": {"tie_word_embeddings": True},
    "small": {"text_config": SMALL_TEXT, "vision_config": SMALL_VISION},
    # a 3x3 merge window, 16-pixel patches, 2 input channels, a head width of 16 (2 heads)
    "merge-3": {
        "tie_word_embeddings": True,
        "text_config": SMALL_TEXT,
        "vision_config": {
            **SMALL_VISION,
            "spatial_merge_size": 3,
            "patch_size": 16,
            "in_channels": 2,
            "num_heads": 2,
        },
    },  # fmt: skip
}
CASES: list[tuple[list[str], dict[str, Any] | None]] = [
    ([], None),
    (["vision"], None),
    (["vision", "merger"], None),
    (["llm"], None),
    (["embeddings"], None),
    ([], {}),
    ([], {"vision": True, "rank": 8}),
    (["vision"], {"vision": True}),
    ([], {"targetModules": ["q_proj", "qkv", "fc1", "proj"], "vision": True, "rank": 4}),
]


def _raw(change: dict[str, Any]) -> dict[str, Any]:
    """The shared 8B config.json with `change` merged; a text key set to None is left out."""
    raw = deep_merge(json.loads((FOLDER / "config.json").read_text()), change)
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if v is not None}
    return raw


def _meta_model(raw: dict[str, Any]) -> Any:
    body = {k: v for k, v in raw.items() if k != "model_type"}
    config = llava_onevision.LlavaOneVision15Config(**body)
    with torch.device("meta"):
        return llava_onevision.LlavaOneVision15ForConditionalGeneration._from_config(config)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_counts_equal_the_real_model_on_meta(variant, shared_dir):
    raw = _raw(VARIANTS[variant])
    check_counts(_meta_model(raw), raw, [], None)


@pytest.mark.parametrize("freeze,lora_kw", CASES)
@pytest.mark.parametrize("variant", ["llava-ov-1.5-8b", "merge-3"])
def test_freeze_and_lora_counts_equal_the_trainers(variant, freeze, lora_kw, shared_dir):
    raw = _raw(VARIANTS[variant])
    model = _meta_model(raw)
    if lora_kw is not None:
        model = lora.apply(model, LoraSpec(**lora_kw), FOLDER)
    param_groups.freeze(model, freeze)
    check_counts(model, raw, freeze, lora_kw)


def test_a_wrong_layout_is_caught(shared_dir):
    """The broken control: the shared 8B config counted tied is off by exactly the LM head, and
    RICE-ViT counted as Qwen2-VL's tower (no class token, rotary entry or pre-LayerNorm) by exactly
    those, so the equalities above can fail."""
    raw = _raw({})
    d = model_dims(raw)
    real = sum(p.numel() for p in _meta_model(raw).parameters())
    assert real - param_counts(model_dims({**raw, "tie_word_embeddings": True})).total == 151936 * 4096
    as_qwen2 = sum(t.numel for t in vision_tensors(replace(d, family="qwen2-vl")))
    assert sum(t.numel for t in vision_tensors(d)) - as_qwen2 == 1024 + 64 // 2 + 2 * 1024


def _upstream_defaults(class_name: str) -> dict[str, Any]:
    """The keyword defaults of an upstream config class's `__init__`, read from the shared folder's
    configuration file as text (its Python is never run)."""
    tree = ast.parse((FOLDER / "configuration_llavaonevision1_5.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names = [a.arg for a in init.args.args[-len(init.args.defaults) :]]
    return {n: ast.literal_eval(d) for n, d in zip(names, init.args.defaults, strict=True)}


def test_defaults_are_upstreams_config_classes(shared_dir):
    """A config.json that leaves a key out means what upstream's classes say (the 4B's sizes)."""
    text, vision = _upstream_defaults("LLaVAOneVision1_5_TextConfig"), _upstream_defaults("RiceConfig")
    assert {k: text[k] for k in _TEXT_DEFAULTS[LLAVA_OV]} == _TEXT_DEFAULTS[LLAVA_OV]
    assert {k: vision[k] for k in _VISION_DEFAULTS[LLAVA_OV]} == _VISION_DEFAULTS[LLAVA_OV]
    assert text["tie_word_embeddings"] is False


def test_the_projects_config_classes_have_upstreams_defaults():
    """The project's model reads a config.json as upstream does: a key left out gets the same size,
    so the planner's count (upstream's defaults) is the model the trainer builds."""
    config = llava_onevision.LlavaOneVision15Config()
    text, vision = config.text_config.to_dict(), config.vision_config.to_dict()
    assert {k: vision[k] for k in _VISION_DEFAULTS[LLAVA_OV]} == _VISION_DEFAULTS[LLAVA_OV]
    assert {k: text[k] for k in _TEXT_DEFAULTS[LLAVA_OV]} == _TEXT_DEFAULTS[LLAVA_OV]
    bare = {"model_type": "llavaonevision1_5", "text_config": {}, "vision_config": {}}
    assert param_counts(model_dims(bare)).total == sum(p.numel() for p in _meta_model(bare).parameters())


def test_planning_config_keeps_what_the_sizes_need(shared_dir):
    for change in VARIANTS.values():
        raw = _raw(change)
        small = planning_config(raw)
        assert model_dims(small) == model_dims(raw)
        assert len(json.dumps(small)) < 2500
    dims = model_dims(_raw(VARIANTS["merge-3"]))
    assert type(dims).from_dict(json.loads(json.dumps(dims.to_dict()))) == dims


HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"vision_config": {"depth": 0}}, "vision_config.depth is 0"),
    ({"vision_config": {"depth": -3}}, "vision_config.depth is -3"),
    ({"vision_config": {"depth": 10**8}}, "vision_config.depth is 100000000"),
    ({"vision_config": {"depth": 1e8}}, "vision_config.depth is 100000000.0"),
    ({"text_config": {"num_hidden_layers": 10**8}}, "text_config.num_hidden_layers is 100000000"),
    ({"vision_config": {"num_heads": 0}}, "vision_config.num_heads is 0"),
    ({"vision_config": {"num_heads": -16}}, "vision_config.num_heads is -16"),
    ({"vision_config": {"num_heads": 15}}, "num_heads 15 does not divide"),
    ({"vision_config": {"num_heads": 512}}, "hidden_size / num_heads is 2"),
    ({"vision_config": {"hidden_size": -1024}}, "vision_config.hidden_size is -1024"),
    ({"vision_config": {"hidden_size": 0}}, "vision_config.hidden_size is 0"),
    ({"vision_config": {"hidden_size": 2048}}, "embed_dim 1024 is not vision_config.hidden_size 2048"),
    ({"vision_config": {"intermediate_size": 0}}, "vision_config.intermediate_size is 0"),
    ({"vision_config": {"patch_size": 0}}, "vision_config.patch_size is 0"),
    ({"vision_config": {"patch_size": "14"}}, "vision_config.patch_size is '14'"),
    ({"vision_config": {"spatial_merge_size": 0}}, "vision_config.spatial_merge_size is 0"),
    ({"vision_config": {"spatial_merge_size": 10**6}}, "vision_config.spatial_merge_size is 1000000"),
    ({"vision_config": {"in_channels": 0}}, "vision_config.in_channels is 0"),
    ({"vision_config": {"temporal_patch_size": 2}}, "temporal_patch_size is 2"),
    ({"vision_config": {"text_hidden_size": 0}}, "vision_config.text_hidden_size is 0"),
    ({"vision_config": {"text_hidden_size": 10**9}}, "vision_config.text_hidden_size is 1000000000"),
    ({"vision_config": {"text_hidden_size": 2560}}, "text_hidden_size 2560 is not the decoder's hidden_size"),
    ({"text_config": {"num_attention_heads": 0}}, "text_config.num_attention_heads is 0"),
    ({"text_config": {"num_key_value_heads": 7}}, "num_key_value_heads 7 does not divide"),
]
# Rules between keys, checked on the whole config (overrides alone may set one key of the pair).
WHOLE_CONFIG_RULES = ("does not divide", "num_heads is", "is not", "temporal_patch_size is 2")


@pytest.mark.parametrize("change,message", HOSTILE, ids=[m for _, m in HOSTILE])
def test_hostile_vision_dimensions_are_refused_before_use(change, message, shared_dir):
    raw = _raw(change)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        param_counts(model_dims(raw))
    assert message in str(err.value)
    assert time.perf_counter() - start < 1.0
    if not any(rule in message for rule in WHOLE_CONFIG_RULES):
        assert dimension_problems(change)  # the overrides alone are refused too (an SFTJob's)


def test_the_released_shapes_pass(shared_dir):
    for change in VARIANTS.values():
        assert dimension_problems(_raw(change), LLAVA_OV) == []
        assert dimension_problems(change) == []


# The totals of the released sizes (untied LM heads), in billions: RICE-ViT-L 0.303B + the merger +
# Qwen3-4B / Qwen3-8B with their own LM heads.
TOTALS = {"4B": 4.742, "8B": 8.527}


@pytest.mark.parametrize("size", list(LLAVA_OV15))
def test_the_released_sizes_have_plausible_counts(size, shared_dir):
    raw = read_config(FOLDER, llava_ov15_overrides(size))
    counts = param_counts(model_dims(raw))
    assert counts.total == sum(p.numel() for p in _meta_model(raw).parameters())
    assert counts.total / 1e9 == pytest.approx(TOTALS[size], abs=0.001)
    assert counts.by_part["vision"] == 302_914_592  # RICE-ViT-L in both


def test_the_memory_plan_runs_each_image_with_its_class_token(shared_dir):
    """A row of 4,096 tokens, half of them vision: 2,048 x 4 patches and their class tokens (as the
    smallest default image's, one per 16 patches) through 24 blocks, the pre-LayerNorm's fp32 input;
    frozen, one block's tensors at a time."""
    d = model_dims(_raw({}))
    rows = 0.5 * 4096 * 4 * (1 + RICE_CLASS_TOKEN_SHARE)
    plan = plan_memory(d, PlanInputs(max_length=4096, vision_share=0.5))
    block = vision_block_bytes(d, True)
    assert plan.rows["activations: vision"] == pytest.approx(rows * (24 * block + 4 * 1024))
    frozen = plan_memory(d, PlanInputs(max_length=4096, vision_share=0.5, freeze=("vision",)))
    assert frozen.rows["activations: vision"] == pytest.approx(rows * block)
    assert block == vision_block_bytes(replace(d, family="qwen2-vl"), True)  # the same block as Qwen2-VL's


def _batch(grid: list[list[int]], tokens: int, labels: int) -> Batch:
    ids = torch.zeros(1, tokens, dtype=torch.long)
    inputs = ModelInputs(
        input_ids=ids,
        labels=ids,
        shift_labels=ids,
        position_ids=torch.arange(tokens)[None],
        image_grid_thw=torch.tensor(grid),
    )
    info = BatchInfo(
        seq_lens=[tokens],
        sample_ids=["a"],
        sample_index=torch.zeros(tokens, dtype=torch.long),
        num_tokens=tokens,
        num_label_tokens=labels,
        padded_tokens=tokens,
        attention_cost=tokens * tokens,
    )
    return Batch(inputs=inputs, info=info)


def test_flops_of_a_batch_equal_a_hand_count(shared_dir):
    """The `small` model (tower width 32, 2 blocks, 4 heads; decoder width 64, 2 layers): two images
    of 4x6 and 2x2 patches, each with its class token through the tower and attending within itself,
    the merger per merged token (2x2 patches), the decoder as any Qwen3's over 1-D positions."""
    model = _meta_model(_raw(VARIANTS["small"]))
    shape = accounting.model_shape(model)
    assert isinstance(shape, ModelShape) and shape.vision_class_tokens == 1
    e, i, depth = 32, 48, 2
    block = 4 * e + (3 * e * e + 3 * e) + (e * e + e) + (e * i + i) + (i * e + e)
    tower = depth * block + 3 * 14 * 14 * e + e + (e // 4) // 2 + 2 * e
    merger = 2 * e + (4 * e * 4 * e + 4 * e) + (4 * e * 64 + 64)
    assert (shape.vision_params, shape.merger_params) == (tower, merger)
    grid, tokens, labels = [[1, 4, 6], [1, 2, 2]], 40, 7
    vision = 6 * tower * (24 + 4 + 2) + 12 * depth * e * ((24 + 1) ** 2 + (4 + 1) ** 2) + 6 * merger * 7
    layer = (64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16) + 3 * 64 * 96 + 2 * 64
    decoder = 6 * 2 * layer * tokens + 6 * 1000 * 64 * labels + 12 * 2 * 64 * tokens * tokens / 2
    assert (shape.llm_params, shape.attn_dim) == (2 * layer, 64)
    assert step_flops(shape, _batch(grid, tokens, labels)) == pytest.approx(decoder + vision)
    param_groups.freeze(model, ["vision", "merger"])
    frozen = accounting.model_shape(model)
    vision_frozen = 2 * tower * 30 + 4 * depth * e * (25**2 + 5**2) + 2 * merger * 7
    assert step_flops(frozen, _batch(grid, tokens, labels)) == pytest.approx(decoder + vision_frozen)
