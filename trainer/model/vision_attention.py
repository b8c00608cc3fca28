"""One attention call per vision block, over every image, frame and window of the micro-batch.

transformers' vision attention (Qwen2-VL `VisionAttention`, `Qwen2_5_VLVisionAttention`,
`Qwen3VLVisionAttention`, `Qwen3_5VisionAttention`, the same code from 5.18 to 5.24) hands the
attention function the tower's `cu_seqlens` in one call only when
`is_flash_attention_requested(self.config)`, i.e. when the *vision config's* implementation name
contains "flash". For any other name it splits q/k/v per segment (image, video frame, or Qwen2.5-VL
window) and calls once per segment: on Qwen2.5-VL-3B (28 windowed blocks of 112-pixel windows,
4 full blocks) a row of 8192 tokens with a few images and a video costs thousands of small kernel
launches per forward, as many again in the backward.

So `one_call_vision` gives the vision config, and only it, its own implementation name with
"flash" in it (`packtrain_<backend>_vision_flashlike`, no digit after "flash", so no check for a
specific flash version matches it), registered to a function that runs the chosen backend once
over all segments:

* varlen: whatever function is registered for the language model's varlen name (so a test's
  reference kernel is used here too), given the tower's cu_seqlens, bidirectional;
* flex: one `flex_attention` call with a BlockMask over the segments' ids (fully masked tiles are
  skipped, which is what makes windows cheap);
* sdpa: one SDPA call with a dense block-diagonal boolean mask: O(T^2) memory in the tower's patch
  count, the CPU reference (on a GPU prefer varlen, flash or flex);
* flash and eager are left alone: flash already gets one call, eager is transformers' reference.

Why this rather than the alternatives: registering the language model's own functions under
flash-like names would also change what transformers does for the *text* model (no mask built,
flash-style position handling), and the packed path must stay as attention.py builds it; patching
the vision attention modules' forward would copy their qkv and rotary code, which differs per family
and per release. The vision config's name is read only by those modules (and by `get_max_seqlen`,
which then computes the longest segment, the max length varlen wants), so the switch is one
attribute, and `per_segment` switches back for a reference run.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from packtrain.trainer.model.attention import (
    HF_IMPLEMENTATION,
    VARLEN_NAME,
    compiled_flex,
    document_ids,
    one_dtype,
    register_varlen,
)

ONE_CALL_BACKENDS = ("varlen", "flex", "sdpa")


def vision_name(backend: str) -> str:
    """The vision tower's implementation name for `backend` ("flash" in it is what transformers reads)."""
    return f"packtrain_{backend}_vision_flashlike"


# Masks built from one cu_seqlens tensor, for every block that gets that same tensor (a tower has
# one, Qwen2.5-VL two: windows and full images). Keyed by the tensor's id while it lives (tensors
# compare elementwise, so they cannot be dict keys themselves): a mask lives as long as its
# cu_seqlens (the tower's forward, and its recompute under activation checkpointing), never longer.
_MASKS: dict[int, tuple[weakref.ref[torch.Tensor], dict[str, Any]]] = {}


def _forgetter(key: int) -> Callable[[weakref.ref[torch.Tensor]], None]:
    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        if key in _MASKS and _MASKS[key][0] is ref:
            del _MASKS[key]

    return forget


def _cached_mask(cu: torch.Tensor, kind: str, build: Callable[[], Any]) -> Any:
    entry = _MASKS.get(id(cu))
    if entry is None or entry[0]() is not cu:
        entry = _MASKS[id(cu)] = (weakref.ref(cu, _forgetter(id(cu))), {})
    if kind not in entry[1]:
        entry[1][kind] = build()
    return entry[1][kind]


def segment_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(1, 1, T, T) boolean mask, True where query i and key j are in the same segment (bidirectional)."""
    doc = document_ids(cu_seqlens, total)
    return (doc[:, None] == doc[None, :])[None, None]


def segment_block_mask(cu_seqlens: torch.Tensor, total: int) -> Any:
    """The same pattern as a flex-attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(cu_seqlens, total)

    def same_segment(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return doc[q] == doc[kv]

    return create_block_mask(same_segment, None, None, total, total, device=str(doc.device))


def _segments(kwargs: dict[str, Any]) -> torch.Tensor:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError("one-call vision attention needs the tower's cu_seqlens (cu_seq_lens_q)")
    return cu


def vision_varlen(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The language model's varlen function, looked up at call time (one kernel for both parts)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _segments(kwargs)
    fn: Any = ALL_ATTENTION_FUNCTIONS[VARLEN_NAME]
    out: tuple[torch.Tensor, None] = fn(module, query, key, value, *args, **kwargs)
    return out


def vision_flex(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One flex_attention call over all segments: (1, H, T, D) in, (1, T, H, D) out."""
    from torch.nn.attention.flex_attention import flex_attention

    total = query.shape[2]
    mask = _cached_mask(_segments(kwargs), "flex", lambda: segment_block_mask(_segments(kwargs), total))
    fn = compiled_flex() if query.is_cuda else flex_attention
    query, key, value = one_dtype(query, key, value)
    out = fn(query, key, value, block_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def vision_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One SDPA call with the block-diagonal mask: (1, H, T, D) in, (1, T, H, D) out."""
    total = query.shape[2]
    mask = _cached_mask(_segments(kwargs), "sdpa", lambda: segment_mask(_segments(kwargs), total))
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, None]]] = {
    "varlen": vision_varlen,
    "flex": vision_flex,
    "sdpa": vision_sdpa,
}
# The vision name -> what the tower used before (transformers' per-segment loop over that function).
_PER_SEGMENT = {vision_name(b): HF_IMPLEMENTATION[b] for b in ONE_CALL_BACKENDS}


def register_vision(backend: str) -> None:
    """Make `vision_name(backend)` resolvable (and, for varlen, the function it delegates to)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if backend == "varlen" and VARLEN_NAME not in ALL_ATTENTION_FUNCTIONS:
        register_varlen()
    AttentionInterface.register(vision_name(backend), _FUNCTIONS[backend])


def _vision_config(model: Any) -> Any:
    return model.model.visual.config


def one_call_vision(model: Any, backend: str) -> None:
    """Switch the Hugging Face model's vision tower to one attention call per block, in place (a
    no-op for flash, which already has it, and eager, the reference)."""
    if backend not in ONE_CALL_BACKENDS:
        return
    register_vision(backend)
    _vision_config(model)._attn_implementation = vision_name(backend)


@contextmanager
def per_segment(model: Any) -> Iterator[None]:
    """transformers' own per-image / frame / window calls for the duration: the reference the one
    call must equal (tests on CPU, the kernel check on CUDA)."""
    config = _vision_config(model)
    current = config._attn_implementation
    config._attn_implementation = _PER_SEGMENT.get(current, current)
    try:
        yield
    finally:
        config._attn_implementation = current


@contextmanager
def counting_calls(model: Any) -> Iterator[list[int]]:
    """Count the vision tower's attention-function calls for the duration (one list entry per
    call: the number of query tokens it got), whichever name the tower uses now."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _vision_config(model)._attn_implementation
    inner: Any = ALL_ATTENTION_FUNCTIONS[name]
    calls: list[int] = []

    @functools.wraps(inner)
    def counted(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(int(query.shape[2]))
        return inner(module, query, *args, **kwargs)

    AttentionInterface.register(name, counted)
    try:
        yield calls
    finally:
        AttentionInterface.register(name, inner)
