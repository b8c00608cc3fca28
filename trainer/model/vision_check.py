"""Refuse to train when the installed transformers would drop the vision features.

`VLMForTraining` runs the vision tower itself (one call per micro-batch, see model.py) and hands
the features to the Hugging Face model's forward as `mm_encoder_outputs`. The Qwen2-VL family's
model forwards (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoE variants) take that keyword
from transformers 5.18.0 on; older ones take `**kwargs` and ignore a keyword they do not know. The
language model then trains on the placeholder tokens' own embeddings: nothing fails, the loss is
the same for any pixels, and the run is text-only on multimodal data.

The check reads the forward the run will call rather than the version string, so a patched,
backported or renamed release is judged by what it does, and it runs before the (possibly
many-GB) model is built.
"""

from __future__ import annotations

import inspect
from typing import Any

import transformers
from transformers import PretrainedConfig

from packtrain.core.errors import ConfigError

MIN_TRANSFORMERS = "5.18.0"  # the first release whose Qwen2-VL family forwards take the keyword
FEATURES_KEYWORD = "mm_encoder_outputs"


def base_model_class(config: PretrainedConfig) -> type:
    """The class whose forward `VLMForTraining` calls (`hf.model`): Qwen2VLModel for a Qwen2-VL
    config, and so on, as AutoModel maps it."""
    from transformers import MODEL_MAPPING

    found: Any = MODEL_MAPPING[type(config)]
    if isinstance(found, tuple):  # the mapping's declared value type; model classes come alone
        found = next(c for c in found if c is not None)
    cls: type = found
    return cls


def takes_vision_features(model_class: type) -> bool:
    """Whether `model_class.forward` has a `mm_encoder_outputs` parameter (a keyword that lands in
    `**kwargs` is dropped)."""
    forward = getattr(model_class, "forward", None)
    if forward is None:
        return False
    return FEATURES_KEYWORD in inspect.signature(forward).parameters


def check_vision_features(model_class: type) -> None:
    """A ConfigError (exit 2) naming the fix when `model_class` would ignore the vision features."""
    if takes_vision_features(model_class):
        return
    raise ConfigError(
        f"transformers {transformers.__version__}: {model_class.__name__}.forward takes no "
        f"`{FEATURES_KEYWORD}`, so the vision features would be silently dropped and the model would "
        f"train on text only; pip install 'transformers>={MIN_TRANSFORMERS}'"
    )


def require_vision_features(config: PretrainedConfig) -> None:
    """The start-up check: the model built from `config` must receive the vision tower's output."""
    check_vision_features(base_model_class(config))
