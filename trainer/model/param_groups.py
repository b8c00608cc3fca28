"""Which part of the model each parameter belongs to, freezing, and the optimizer's parameter groups.

A part (`vision`, `merger`, `llm`, `embeddings`) is a set of submodules of the Hugging Face model,
named in the family's registry entry (`Family.modules`), so adding a family stays one entry.
Parameters are matched by identity under those submodules, not by name: adapters a LoRA wrapper
inserts below a module (`...qkv.lora_A.default.weight`, under whatever prefix) belong to that
module's part, and sharded (FSDP2) parameters stay the same objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, get_args

import torch
from torch import nn

from packtrain.core.errors import ConfigError
from packtrain.core.families import ModuleLayout
from packtrain.core.model_spec import family_for_model_type
from packtrain.core.sft_config import Module

MODULES: tuple[Module, ...] = get_args(Module)


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside DDP / VLMForTraining / a PEFT wrapper."""
    model = getattr(model, "module", model)  # DDP
    model = getattr(model, "hf", model)  # VLMForTraining
    get_base = getattr(model, "get_base_model", None)  # PeftModel
    return get_base() if callable(get_base) else model


def layout(hf: nn.Module) -> ModuleLayout:
    """The module layout of `hf`'s family (from its config's `model_type`)."""
    config: Any = hf.config
    return family_for_model_type(config.model_type).modules


def frozen_parts(freeze: Iterable[Module]) -> set[Module]:
    """`llm` takes the embeddings and LM head with it: a frozen LLM whose vocabulary rows still
    moved would no longer be the LLM that was frozen."""
    parts = set(freeze)
    if "llm" in parts:
        parts.add("embeddings")
    return parts


def part_of_parameters(model: nn.Module) -> dict[int, Module]:
    """id(parameter) → its part, for every parameter of the model (tied weights once).

    Raises when a parameter belongs to no part: a new submodule would otherwise train at the
    default lr and escape freezing silently."""
    hf = hf_model(model)
    owner: dict[int, Module] = {}
    modules = layout(hf)
    for part in MODULES:
        for path in modules.part(part):
            for p in _parameters_at(hf, path):
                owner.setdefault(id(p), part)
    missing = [name for name, p in hf.named_parameters() if id(p) not in owner]
    if missing:
        raise ValueError(
            f"parameters outside every part of {type(hf).__name__}: {missing[:5]}; "
            "add them to the family's `modules` in core/families.py"
        )
    return owner


def _parameters_at(hf: nn.Module, path: str) -> list[nn.Parameter]:
    """The parameters under submodule `path`, or the one parameter `path` names (a tower's own
    class token)."""
    try:
        return list(hf.get_submodule(path).parameters())
    except AttributeError:
        return [hf.get_parameter(path)]


def _no_grad(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return forward(*args, **kwargs)

    return run


def freeze(model: nn.Module, parts: Iterable[Module]) -> list[str]:
    """Stop the parts in `parts` (see `frozen_parts`) from training, in place; returns the vision
    submodules that now run without autograd.

    Call after anything that sets `requires_grad` itself (a LoRA wrapper) and before DDP/FSDP wrap
    the model (both read `requires_grad` when they wrap). Every vision submodule from the input
    up to the first one with something to train runs under `no_grad`, so a frozen tower saves no
    activations while a trainable merger after it still gets its gradient; wrapping `forward`
    (not the module) keeps parameter names and FSDP's hooks as they are."""
    hf = hf_model(model)
    frozen = frozen_parts(parts)
    owner = part_of_parameters(hf)
    for p in hf.parameters():
        if owner[id(p)] in frozen:
            p.requires_grad_(False)
    if not any(p.requires_grad for p in hf.parameters()):
        raise ConfigError(f"model.freeze {sorted(frozen)} leaves nothing to train; remove a part from it")
    embeddings: Any = hf.get_input_embeddings()  # type: ignore[operator]  # a PreTrainedModel method
    if not embeddings.weight.requires_grad:  # frozen by `parts` or by LoRA
        embeddings.register_forward_hook(_output_requires_grad)
    silenced: list[str] = []
    for path in layout(hf).vision_chain:
        module = hf.get_submodule(path)
        for name, sub in module.named_children() if isinstance(module, nn.ModuleList) else [("", module)]:
            if any(p.requires_grad for p in sub.parameters()):
                return silenced
            sub.forward = _no_grad(sub.forward)
            silenced.append(f"{path}.{name}" if name else path)
    return silenced


def _output_requires_grad(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
    """Frozen embeddings give the decoder an input without autograd history on a rank whose batch
    holds no image (with images, the vision features bring it), and FSDP2 then reduces that rank's
    first decoder layer in its final callback instead of during backward: the ranks' collectives
    fall out of order and hang. An input that requires grad keeps every rank in the same order."""
    output.requires_grad_(True)


def optimizer_groups(
    model: nn.Module, lr: float, weight_decay: float, multipliers: dict[Module, float]
) -> list[dict[str, Any]]:
    """AdamW parameter groups of the trainable parameters: one per (part, decay), in a fixed
    order so a checkpoint's groups line up on resume.

    Each group's lr is `lr` x its part's multiplier (embeddings follow llm's unless listed); the
    schedule then scales every group by the same factor. Biases and norm weights (every tensor
    under 2 dimensions) get no weight decay, as common trainers do."""
    owner = part_of_parameters(model)
    scale = {part: multipliers.get(part, 1.0) for part in MODULES}
    scale["embeddings"] = multipliers.get("embeddings", scale["llm"])
    buckets: dict[tuple[Module, bool], list[nn.Parameter]] = {
        (m, d): [] for m in MODULES for d in (True, False)
    }
    seen: set[int] = set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            buckets[owner[id(p)], p.ndim >= 2].append(p)
    return [
        {
            "params": params,
            "lr": lr * scale[part],
            "lr_scale": scale[part],
            "weight_decay": weight_decay if decay else 0.0,
            "name": f"{part}/{'decay' if decay else 'no_decay'}",
        }
        for (part, decay), params in buckets.items()
        if params
    ]


def base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The schedule's current `training.lr` (each group's lr is it times the group's multiplier)."""
    group = optimizer.param_groups[0]
    return float(group["lr"]) / float(group.get("lr_scale", 1.0))


def trainable_counts(model: nn.Module) -> dict[str, int]:
    """Trainable and frozen parameter counts per part (for the start-of-run report)."""
    owner = part_of_parameters(model)
    counts = {f"{m}_{kind}": 0 for m in MODULES for kind in ("trainable", "frozen")}
    seen: set[int] = set()
    for p in hf_model(model).parameters():
        if id(p) not in seen:
            seen.add(id(p))
            counts[f"{owner[id(p)]}_{'trainable' if p.requires_grad else 'frozen'}"] += p.numel()
    return counts
