"""The one check that the planner's parameter counts (`model_size.param_counts`) are the trainer's:
totals, trainable parameters and their parts, the largest block and what FSDP leaves at the root,
for a model after LoRA and freezing; every family's size tests run it."""

from __future__ import annotations

from typing import Any

from packtrain.core.model_size import LoraShape, model_dims, param_counts
from packtrain.core.sft_config import LoraSpec
from packtrain.trainer.model import param_groups, parts


def check_counts(
    model: Any,
    raw: dict[str, Any],
    freeze: list[str],
    lora_kw: dict[str, Any] | None,
    family: str | None = None,
) -> None:
    spec = LoraSpec(**lora_kw) if lora_kw is not None else None
    shape = LoraShape(spec.rank, tuple(spec.target_modules), spec.vision) if spec else None
    counts = param_counts(model_dims(raw, family), freeze, shape)
    params = list(model.parameters())  # tied weights once
    assert counts.total == sum(p.numel() for p in params)
    assert counts.trainable == sum(p.numel() for p in params if p.requires_grad)
    by_part = param_groups.trainable_counts(model)
    assert counts.trainable_by_part == {p: by_part[f"{p}_trainable"] for p in counts.trainable_by_part}
    hf = param_groups.hf_model(model)
    blocks = [*hf.model.language_model.layers, *parts.vision_blocks(hf)]
    assert counts.largest_block == max(sum(p.numel() for p in b.parameters()) for b in blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    assert counts.root == sum(p.numel() for p in params if id(p) not in in_blocks)
