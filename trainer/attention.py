"""Per-sample attention isolation for packed sequences.

Restarting position ids is not enough: under SDPA/eager, `transformers`' Qwen2-VL
builds a plain causal mask over the whole row and samples see each other. So
every backend gets explicit boundaries: flash-attention the varlen `cu_seq_lens`
(the kernel never crosses them), SDPA/eager a block-diagonal causal boolean mask,
flex a BlockMask of the same pattern. The vision tower is isolated per image /
frame by `transformers` itself from `grid_thw`.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from .config import Attention

FLEX_NAME = "packtrain_flex"
HF_IMPLEMENTATION = {"flash": "flash_attention_2", "sdpa": "sdpa", "flex": FLEX_NAME, "eager": "eager"}


def flash_available() -> bool:
    """flash-attn is an optional GPU extra: look for it without importing it."""
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(requested: Attention | str, device: torch.device) -> str:
    """The backend to use: flash on CUDA when installed, else SDPA; explicit choices are checked."""
    if requested == "auto":
        return "flash" if device.type == "cuda" and flash_available() else "sdpa"
    if requested == "flash":
        if not flash_available():
            raise RuntimeError(
                "attention: flash needs the `flash-attn` package (pip install 'packtrain[flash]')"
            )
        if device.type != "cuda":
            raise RuntimeError("attention: flash runs on CUDA only; use sdpa or flex on this device")
    if requested not in HF_IMPLEMENTATION:
        raise ValueError(f"unknown attention backend {requested!r}")
    return str(requested)


def _flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """flex_attention with our BlockMask for the language model; SDPA for everything else: the
    vision tower's per-image chunks (no mask, `is_causal=False`: bidirectional) and the padded
    baseline's language model, which transformers calls without a mask for a custom backend, so
    it must be causal there (right padding: no real token sees a pad)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if isinstance(attention_mask, BlockMask):
        # Eager flex is a slow reference; compiled it becomes a fused kernel (CUDA).
        fn = _compiled_flex() if query.is_cuda else flex_attention
        out = fn(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True)
    else:
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = bool(getattr(module, "is_causal", False))
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            scale=scaling,
            is_causal=is_causal and attention_mask is None,
        )
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def register_flex() -> None:
    """transformers does not offer flex attention for Qwen2-VL, so register our own function."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_NAME, _flex_attention)


def document_ids(cu_seq_lens: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) index of the sub-sample each token belongs to."""
    lengths = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seq_lens.device), lengths)
    if ids.numel() != total:
        raise ValueError(f"cu_seq_lens cover {ids.numel()} tokens, the row has {total}")
    return ids


def block_causal_mask(cu_seq_lens: torch.Tensor, total: int) -> torch.Tensor:
    """(1, 1, T, T) boolean mask, True where query i may attend key j: same sample and j <= i."""
    doc = document_ids(cu_seq_lens, total)
    pos = torch.arange(total, device=doc.device)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    return mask[None, None]


def flex_block_mask(cu_seq_lens: torch.Tensor, total: int) -> Any:
    """The same pattern as a flex-attention BlockMask (blocks of fully masked tiles are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(cu_seq_lens, total)

    def same_doc_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (doc[q] == doc[kv]) & (kv <= q)

    return create_block_mask(same_doc_causal, None, None, total, total, device=str(doc.device))


def attention_kwargs(backend: str, cu_seq_lens: torch.Tensor, max_length: int, total: int) -> dict[str, Any]:
    """Keyword arguments for the language model's forward that enforce per-sample attention."""
    if backend == "flash":
        cu = cu_seq_lens.to(torch.int32)
        return {
            "attention_mask": None,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": int(max_length),
            "max_length_k": int(max_length),
        }
    if backend == "flex":
        return {"attention_mask": flex_block_mask(cu_seq_lens, total)}
    return {"attention_mask": block_causal_mask(cu_seq_lens, total)}
