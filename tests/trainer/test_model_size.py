"""The core's parameter counts (`core/model_size.py`, what the memory planner sizes a job
with) equal `sum(p.numel())` of the real transformers models built on the meta device: every
shared config (real sizes), the tiny test configs, the mixture-of-experts variants, and the
trainable counts under `model.freeze` and `model.lora` as the trainer applies them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import transformers
import vlm_fixtures as fx
from count_checks import check_counts
from support.paths import MODELS
from test_moe import MOE

from packtrain.core.families import FAMILIES
from packtrain.core.model_size import (
    _TEXT_DEFAULTS,
    _VISION_DEFAULTS,
    LLAVA_OV,
    deep_merge,
    lora_target_regex,
)
from packtrain.core.sft_config import LORA_TARGET_MODULES, LoraSpec
from packtrain.trainer.model import lora, param_groups
from packtrain.trainer.model.build import load_config

SHARED_CONFIGS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5")
# Freeze / LoRA cases: (freeze, LoraSpec keyword arguments or None).
CASES: list[tuple[list[str], dict[str, Any] | None]] = [
    ([], None),
    (["vision"], None),
    (["vision", "merger"], None),
    (["llm"], None),
    (["embeddings"], None),
    ([], {}),
    ([], {"vision": True, "rank": 8}),
    (["vision"], {"vision": True}),
    ([], {"targetModules": ["q_proj", "v_proj", "qkv"], "vision": True, "rank": 4}),
]


def _raw(folder: str, overrides: dict[str, Any]) -> dict[str, Any]:
    raw = json.loads((MODELS / folder / "config.json").read_text())
    return deep_merge(raw, overrides)


def _meta_model(config: Any) -> transformers.PreTrainedModel:
    cls = getattr(transformers, FAMILIES[_family(config.model_type)].model_class)
    with torch.device("meta"):
        return cls._from_config(config)


def _family(model_type: str) -> str:
    return next(f.name for f in FAMILIES.values() if f.model_type == model_type)


def _apply(model: Any, freeze: list[str], lora_kw: dict[str, Any] | None, folder: str) -> None:
    if lora_kw is not None:
        lora.apply(model, LoraSpec(**lora_kw), MODELS / folder)
    param_groups.freeze(model, freeze)


@pytest.mark.parametrize("freeze,lora_kw", CASES)
@pytest.mark.parametrize("folder", SHARED_CONFIGS)
def test_counts_equal_the_real_model_on_meta(folder, freeze, lora_kw, shared_dir):
    raw = _raw(folder, {})
    model = _meta_model(load_config(MODELS / folder))
    _apply(model, freeze, lora_kw, folder)
    check_counts(model, raw, freeze, lora_kw, _family(raw["model_type"]))


@pytest.mark.parametrize("freeze,lora_kw", CASES[:2] + CASES[5:7])
@pytest.mark.parametrize("family", fx.FAMILIES)
def test_counts_equal_the_tiny_models(family, freeze, lora_kw, shared_dir):
    raw = _raw(family, fx.TINY[family])
    model = _meta_model(load_config(MODELS / family, fx.TINY[family]))
    _apply(model, freeze, lora_kw, family)
    check_counts(model, raw, freeze, lora_kw, family)


def _moe_raw(family: str) -> dict[str, Any]:
    """A tiny MoE config as test_moe builds it (the dense family's tiny sizes, 8 experts)."""
    dense = "qwen3.5" if family == "qwen3.5-moe" else "qwen3-vl"
    tiny = fx.TINY[dense]
    text = {k: v for k, v in tiny["text_config"].items() if k not in ("rope_scaling", "rope_parameters")}
    text.update(MOE)
    if family == "qwen3.5-moe":
        text["shared_expert_intermediate_size"] = 32
    else:
        text.update({"num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 1})
    vision = tiny["vision_config"]
    return {"model_type": FAMILIES[family].model_type, "text_config": text, "vision_config": vision}


@pytest.mark.parametrize("freeze,lora_kw", CASES[:1] + CASES[3:4] + CASES[5:6])
@pytest.mark.parametrize("family", ["qwen3.5-moe", "qwen3-vl-moe"])
def test_counts_equal_the_mixture_of_experts_models(family, freeze, lora_kw):
    raw = _moe_raw(family)
    config = transformers.AutoConfig.for_model(**raw)
    model = _meta_model(config)
    _apply(model, freeze, lora_kw, "qwen3.5" if family == "qwen3.5-moe" else "qwen3-vl")
    check_counts(model, raw, freeze, lora_kw, family)


def test_defaults_are_the_transformers_config_classes():
    """A config.json that leaves a key out gets the class default, as transformers builds it
    (LLaVA-OneVision-1.5's are upstream's config classes': test_llava_onevision_sizes)."""
    for family, text in _TEXT_DEFAULTS.items():
        if family == LLAVA_OV:
            continue
        cfg = transformers.AutoConfig.for_model(FAMILIES[family].model_type)
        t, v = cfg.text_config.to_dict(), cfg.vision_config.to_dict()
        t.setdefault("num_experts", getattr(cfg.text_config, "num_experts", None))
        t.setdefault("full_attention_interval", 4)
        assert {k: t[k] for k in text} == text, family
        v.setdefault("deepstack_visual_indexes", [])  # Qwen3.5's tower has no DeepStack
        assert {k: v[k] for k in _VISION_DEFAULTS[family]} == _VISION_DEFAULTS[family], family


def test_the_lora_regex_is_the_trainers():
    spec = LoraSpec(vision=True)
    for family in FAMILIES.values():
        assert lora_target_regex(LORA_TARGET_MODULES, True, family.modules) == lora.target_regex(
            spec, family.modules
        )
