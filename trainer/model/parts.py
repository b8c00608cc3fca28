"""Where the vision side of each family's Hugging Face model sits.

Qwen-style models keep the tower and its merger in one `model.visual` with `blocks`; InternVL keeps
a `model.vision_tower` (blocks in `encoder.layer`) and a separate `model.multi_modal_projector`.
FSDP wrapping, per-block checkpointing, dropping the vision gradients of a media-free step and the
FLOPs counts read them here, so they need not know which layout a family has.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from packtrain.core.model_folder import family_for_model_type


def is_tiled(hf: Any) -> bool:
    """Whether `hf` is a tiled family's model (InternVL: tower and projector apart), as its entry says."""
    return family_for_model_type(hf.config.model_type).vision_input == "tiles"


def vision_side(hf: Any) -> list[nn.Module]:
    """The modules that turn pixels into the language model's vision features."""
    if is_tiled(hf):
        return [hf.model.vision_tower, hf.model.multi_modal_projector]
    return [hf.model.visual]


def vision_blocks(hf: Any) -> list[nn.Module]:
    """The vision tower's transformer blocks, in order."""
    if is_tiled(hf):
        return list(hf.model.vision_tower.encoder.layer)
    return list(hf.model.visual.blocks)
