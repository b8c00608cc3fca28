"""InternVL in the core's sizes: the parameter counts (`core/model_size.py`) equal `sum(p.numel())` of
transformers' `InternVLForConditionalGeneration` built on the meta device (the shared InternVL3.5-8B
config, a Qwen2-decoder InternVL3 config, InternViT-6B's RMSNorm + qk-norm tower, tied and untied
heads, freeze and LoRA as the trainer applies them); the vision dimensions InternVL adds are refused
before anything uses them; the memory plan counts the tower per tile; the FLOPs of a tiled batch
equal a hand count; and the released InternVL3.5 sizes have their published parameter counts.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
import transformers
from count_checks import check_counts
from support.paths import MODELS
from support.qwen_sizes import INTERNVL35, internvl_overrides

from packtrain.core.errors import ConfigError
from packtrain.core.memory_plan import PlanInputs, plan_memory, vision_block_bytes
from packtrain.core.model_size import (
    _TOP_DEFAULTS,
    _VISION_DEFAULTS,
    INTERNVL_TEXT,
    deep_merge,
    dimension_problems,
    model_dims,
    param_counts,
    planning_config,
    read_config,
)
from packtrain.core.sft_config import LoraSpec
from packtrain.trainer import accounting
from packtrain.trainer.model import lora, param_groups

FOLDER = MODELS / "internvl3.5"
SMALL_TEXT = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "layer_types": None}  # fmt: skip
SMALL_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4}
# config.json keys over the shared 8B config: one variant per choice InternVL's modules make.
VARIANTS: dict[str, dict[str, Any]] = {
    "internvl3.5-8b": {},
    "untied-8b": {"tie_word_embeddings": False},
    # InternVL3-style: a Qwen2 decoder (q/k/v biases, no q/k norms), tied, written without model_type
    "qwen2-decoder": {
        "tie_word_embeddings": True,
        "text_config": {**SMALL_TEXT, "model_type": None, "head_dim": None, "num_attention_heads": 8},
        "vision_config": SMALL_VISION,
    },
    # InternViT-6B-style: RMSNorm, qk norm, no q/k/v bias; a final LayerNorm (no mean pooling), a mask token
    "rms-qk-norm": {
        "tie_word_embeddings": False,
        "text_config": {**SMALL_TEXT, "attention_bias": True},
        "vision_config": {
            **SMALL_VISION,
            "norm_type": "rms_norm",
            "use_qk_norm": True,
            "attention_bias": False,
            "use_mean_pooling": False,
            "use_mask_token": True,
        },
    },  # fmt: skip
    # no absolute positions, a quarter ratio (4x4 patches a token) on 224-pixel tiles (16 patches a side)
    "ratio-quarter": {
        "downsample_ratio": 0.25,
        "text_config": SMALL_TEXT,
        "vision_config": {**SMALL_VISION, "use_absolute_position_embeddings": False, "image_size": 224},
    },
}
CASES: list[tuple[list[str], dict[str, Any] | None]] = [
    ([], None),
    (["vision"], None),
    (["vision", "merger"], None),
    (["llm"], None),
    ([], {}),
    ([], {"vision": True, "rank": 8}),
    (["vision"], {"vision": True}),
    ([], {"targetModules": ["q_proj", "fc1", "linear_1"], "vision": True, "rank": 4}),
]


def _raw(change: dict[str, Any]) -> dict[str, Any]:
    """The shared 8B config.json with `change` merged; a text key set to None is left out (a missing
    model_type: InternVLConfig's default decoder)."""
    raw = deep_merge(json.loads((FOLDER / "config.json").read_text()), change)
    if isinstance(raw["text_config"], dict):
        raw["text_config"] = {k: v for k, v in raw["text_config"].items() if v is not None}
    return raw


def _meta_model(raw: dict[str, Any]) -> Any:
    body = {k: v for k, v in raw.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model("internvl", **body)
    with torch.device("meta"):
        return transformers.InternVLForConditionalGeneration._from_config(config)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_counts_equal_the_real_model_on_meta(variant, shared_dir):
    raw = _raw(VARIANTS[variant])
    check_counts(_meta_model(raw), raw, [], None)


@pytest.mark.parametrize("freeze,lora_kw", CASES)
@pytest.mark.parametrize("variant", ["internvl3.5-8b", "rms-qk-norm"])
def test_freeze_and_lora_counts_equal_the_trainers(variant, freeze, lora_kw, shared_dir):
    raw = _raw(VARIANTS[variant])
    model = _meta_model(raw)
    if lora_kw is not None:
        model = lora.apply(model, LoraSpec(**lora_kw), FOLDER)
    param_groups.freeze(model, freeze)
    check_counts(model, raw, freeze, lora_kw)


def test_a_wrong_layout_is_caught():
    """The broken control: counting the shared 8B config as untied, or its tower with RMSNorm, is off
    by exactly the LM head, or the norm biases, so the equality above can fail."""
    raw = _raw({})
    real = sum(p.numel() for p in _meta_model(raw).parameters())
    untied = param_counts(model_dims({**raw, "tie_word_embeddings": False})).total
    assert untied - real == 151936 * 4096
    rms = param_counts(model_dims(deep_merge(raw, {"vision_config": {"norm_type": "rms_norm"}}))).total
    assert real - rms == 24 * 2 * 1024


def test_defaults_are_the_transformers_config_classes():
    for text_type, defaults in INTERNVL_TEXT.items():
        text = transformers.AutoConfig.for_model(text_type).to_dict()
        assert {k: text[k] for k in defaults} == defaults, text_type
    config = transformers.AutoConfig.for_model("internvl")
    vision = config.vision_config.to_dict()
    assert {k: vision[k] for k in _VISION_DEFAULTS["internvl"]} == _VISION_DEFAULTS["internvl"]
    assert {k: getattr(config, k) for k in _TOP_DEFAULTS["internvl"]} == _TOP_DEFAULTS["internvl"]
    assert config.text_config.model_type == "qwen2"


def test_planning_config_keeps_what_the_sizes_need():
    for change in VARIANTS.values():
        raw = _raw(change)
        small = planning_config(raw)
        assert model_dims(small) == model_dims(raw)
        assert len(json.dumps(small)) < 2500
    dims = model_dims(_raw(VARIANTS["rms-qk-norm"]))
    assert type(dims).from_dict(json.loads(json.dumps(dims.to_dict()))) == dims


HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"vision_config": {"num_hidden_layers": 0}}, "vision_config.num_hidden_layers is 0"),
    ({"vision_config": {"num_hidden_layers": -3}}, "vision_config.num_hidden_layers is -3"),
    ({"vision_config": {"num_hidden_layers": 10**8}}, "vision_config.num_hidden_layers is 100000000"),
    ({"vision_config": {"num_hidden_layers": 1e8}}, "vision_config.num_hidden_layers is 100000000.0"),
    ({"text_config": {"num_hidden_layers": 10**8}}, "text_config.num_hidden_layers is 100000000"),
    ({"vision_config": {"num_attention_heads": 0}}, "vision_config.num_attention_heads is 0"),
    ({"vision_config": {"num_attention_heads": 15}}, "num_attention_heads 15 does not divide"),
    ({"vision_config": {"hidden_size": -1024}}, "vision_config.hidden_size is -1024"),
    ({"vision_config": {"image_size": [0, 0]}}, "vision_config.image_size is [0, 0]"),
    ({"vision_config": {"image_size": 10**9}}, "vision_config.image_size is 1000000000"),
    ({"vision_config": {"patch_size": [14, 14, 14]}}, "vision_config.patch_size is [14, 14, 14]"),
    ({"vision_config": {"patch_size": "14"}}, "vision_config.patch_size is '14'"),
    ({"vision_config": {"image_size": [448, 224]}}, "must be square"),
    ({"vision_config": {"image_size": 450}}, "450 is not a whole number of patch_size 14 patches"),
    ({"vision_config": {"image_size": 434}}, "(31 patches a side) is not a whole number of merged"),
    ({"vision_config": {"image_size": 16380, "patch_size": 1}}, "too many positions"),
    ({"vision_config": {"num_channels": 0}}, "vision_config.num_channels is 0"),
    ({"vision_config": {"norm_type": "batch_norm"}}, "norm_type is 'batch_norm'"),
    ({"downsample_ratio": 0}, "downsample_ratio is 0"),
    ({"downsample_ratio": -0.5}, "downsample_ratio is -0.5"),
    ({"downsample_ratio": 0.3}, "downsample_ratio is 0.3"),
    ({"downsample_ratio": 1e-8}, "downsample_ratio is 1e-08"),
    ({"downsample_ratio": True}, "downsample_ratio is True"),
    ({"text_config": {"model_type": "qwen3_moe"}}, "text_config.model_type is 'qwen3_moe'"),
]


# Rules between keys, checked on the whole config (overrides alone may set one key of the pair).
WHOLE_CONFIG_RULES = (
    "does not divide",
    "square",
    "patches",
    "merged",
    "positions",
    "norm_type",
    "model_type",
)


@pytest.mark.parametrize("change,message", HOSTILE, ids=[m for _, m in HOSTILE])
def test_hostile_vision_dimensions_are_refused_before_use(change, message):
    raw = _raw(change)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        param_counts(model_dims(raw))
    assert message in str(err.value)
    assert time.perf_counter() - start < 1.0
    if not any(rule in message for rule in WHOLE_CONFIG_RULES):
        assert dimension_problems(change)  # the overrides alone are refused too (an SFTJob's)


def test_the_released_shapes_pass():
    assert dimension_problems(_raw({}), "internvl") == []
    for change in VARIANTS.values():
        assert dimension_problems(_raw(change), "internvl") == []
        assert dimension_problems(change) == []


# InternVL3.5's published totals, in billions (as rounded where they are quoted).
PUBLISHED = {"1B": 1.06, "2B": 2.3, "4B": 4.7, "8B": 8.5, "14B": 15.1, "38B": 38.4}


@pytest.mark.parametrize("size", list(INTERNVL35))
def test_the_released_sizes_have_their_published_counts(size, shared_dir):
    raw = read_config(FOLDER, internvl_overrides(size))
    counts = param_counts(model_dims(raw))
    assert counts.total == sum(p.numel() for p in _meta_model(raw).parameters())
    assert counts.total / 1e9 == pytest.approx(PUBLISHED[size], abs=0.05)


def test_the_memory_plan_runs_the_tower_per_tile():
    """A row of 4,096 tokens, half of them vision: 8 tiles of 256 tokens, each 1,025 patches through
    all 24 InternViT layers; the decoder as any Qwen3's."""
    d = model_dims(_raw({}))
    x = PlanInputs(max_length=4096, vision_share=0.5)
    plan = plan_memory(d, x)
    tiles = 0.5 * 4096 / 256
    per_tile = 24 * vision_block_bytes(d, True) * 1025
    assert plan.rows["activations: vision"] > tiles * per_tile
    assert plan.rows["activations: vision"] < tiles * per_tile * 1.1  # + the projector and the shuffle
    frozen = plan_memory(d, PlanInputs(max_length=4096, freeze=("vision", "merger")))
    assert frozen.rows["activations: vision"] < plan.rows["activations: vision"] / 10


def test_flops_of_a_tiled_batch_equal_a_hand_count(shared_dir):
    """The tiny `ratio-quarter` model: 224-pixel tiles, 16 patches a side + the cls token through 2
    layers of width 32, 4x4 patches a token (16 tokens a tile) through the projector into width 64."""
    raw = _raw(VARIANTS["ratio-quarter"])
    shape = accounting.model_shape(_meta_model(raw))
    assert isinstance(shape, accounting.TiledShape)
    e, i, depth, n, merged = 32, 48, 2, 16 * 16 + 1, 16
    vision_params = depth * (4 * (e * e + e) + 2 * e * i + i + e + 2 * 2 * e + 2 * e)
    vision_params += e + 3 * 14 * 14 * e + e  # cls token, patch conv (no positions in this variant)
    projector = 2 * 16 * e + 16 * e * 64 + 64 + 64 * 64 + 64
    tiles = 3
    hand = 6 * vision_params * n * tiles + 12 * depth * e * n * n * tiles + 6 * projector * merged * tiles
    assert accounting.vision_flops(shape, tiles) == pytest.approx(hand)
    assert accounting.vision_flops(shape, 0) == 0
