"""LoRA adapters with PEFT: injected into the built model, merged for the optional full export.

`apply` injects adapters in place: the Hugging Face model object stays the one
`VLMForTraining` drives (its submodules, registered attention backend and packed
mRoPE positions unchanged), only its targeted `nn.Linear`s become PEFT LoRA layers,
and every other parameter stops requiring gradients. The returned `PeftModel`
wraps that same object and is kept only to write the adapter in PEFT's format.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from packtrain.core.errors import ConfigError
from packtrain.core.families import ModuleLayout
from packtrain.core.sft_config import LoraSpec
from packtrain.trainer.model import param_groups

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER = "default"


def target_regex(spec: LoraSpec, modules: ModuleLayout) -> str:
    """PEFT `target_modules` as one regex (PEFT full-matches it against each module's name): a
    module in the language model (and, with `vision`, the vision tower) whose last name part
    matches one of `spec.target_modules`; where those parts sit is the family's `modules`."""
    scopes = [modules.lora_llm] + ([modules.lora_vision] if spec.vision else [])
    names = "|".join(f"(?:{p})" for p in spec.target_modules)
    return f"(?:{'|'.join(scopes)})(?:.*\\.)?(?:{names})"


def apply(model: PreTrainedModel, spec: LoraSpec, base_path: str | Path) -> PeftModel:
    """Adapters into `model` in place; only they train afterwards."""
    # PEFT is imported here, not at the top: it adds 0.6 CPU-s to the trainer's start-up (measured),
    # which a run without model.lora (and every rank of it) would pay for nothing.
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # PEFT scales by alpha / r in float; annotated int
        lora_dropout=spec.dropout,
        target_modules=target_regex(spec, param_groups.layout(model)),
        bias="none",
    )
    try:
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    except ValueError as exc:
        raise ConfigError(
            f"model.lora.targetModules {spec.target_modules} matched no linear layer of the "
            f"{'language model or vision tower' if spec.vision else 'language model'} ({exc}); name "
            "layers as they appear last in module names, e.g. q_proj, o_proj, gate_proj"
        ) from exc
    # Set after: PEFT replaces a config's value with the model's `name_or_path` (empty at random init).
    peft_model.peft_config[ADAPTER].base_model_name_or_path = str(base_path)
    if peft_model.base_model.model is not model:  # VLMForTraining must keep driving this object
        raise RuntimeError("PEFT replaced the model object instead of injecting adapters in place")
    return peft_model


def is_lora_layer(module: torch.nn.Module) -> bool:
    """Whether `module` is a PEFT LoRA layer. Where `apply` never ran, PEFT is not loaded, and then
    no module can be one."""
    tuners = sys.modules.get("peft.tuners.lora")
    return tuners is not None and isinstance(module, tuners.LoraLayer)


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """Each LoRA layer's name (as in `model`'s state dict, without the adapter suffix) → its scale."""
    return {name: layer.scaling[ADAPTER] for name, layer in model.named_modules() if is_lora_layer(layer)}


def merged_state_dict(state: dict[str, torch.Tensor], scale: dict[str, float]) -> dict[str, torch.Tensor]:
    """A full state dict of the LoRA model (names as in `scalings`) → the plain model's, each
    targeted weight W replaced by W + scale · B·A (in fp32), as PEFT's `merge_and_unload` does."""
    out: dict[str, torch.Tensor] = {}
    lora_part = re.compile(rf"\.lora_[A-Za-z_]+\.{ADAPTER}(?:\.|$)")
    for key, value in state.items():
        if lora_part.search(key):
            continue
        layer, sep, rest = key.partition(".base_layer.")
        if not sep:
            out[key] = value
            continue
        name = f"{layer}.{rest}"
        if rest == "weight":
            a = state[f"{layer}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{layer}.lora_B.{ADAPTER}.weight"].float()
            delta = (b.flatten(1) @ a.flatten(1)).view(value.shape)
            out[name] = (value.float() + scale[layer] * delta).to(value.dtype)
        else:
            out[name] = value
    return out
