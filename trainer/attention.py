"""Per-sample attention isolation for packed sequences.

Restarting position ids is not enough: under SDPA/eager, `transformers`' Qwen2-VL
builds a plain causal mask over the whole row and samples see each other. So
every backend gets explicit boundaries: flash-attention the varlen `cu_seq_lens`
(the kernel never crosses them), SDPA/eager a block-diagonal causal boolean mask,
flex a BlockMask of the same pattern. The vision tower is isolated per image /
frame by `transformers` itself from `grid_thw`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from .config import Attention

HF_IMPLEMENTATION = {"flash": "flash_attention_2", "sdpa": "sdpa", "flex": "flex_attention", "eager": "eager"}


def flash_available() -> bool:
    """flash-attn is an optional GPU extra: look for it without importing it."""
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(requested: Attention | str, device: torch.device) -> str:
    """The backend to use: flash on CUDA when installed, else SDPA; explicit choices are checked."""
    if requested == "auto":
        return "flash" if device.type == "cuda" and flash_available() else "sdpa"
    if requested == "flash":
        if not flash_available():
            raise RuntimeError("attention: flash needs the `flash-attn` package (pip install 'packtrain[flash]')")
        if device.type != "cuda":
            raise RuntimeError("attention: flash runs on CUDA only; use sdpa or flex on this device")
    if requested not in HF_IMPLEMENTATION:
        raise ValueError(f"unknown attention backend {requested!r}")
    return str(requested)


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
