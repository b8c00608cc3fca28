"""Per-sample attention isolation for packed sequences, and the choice of kernel.

Restarting position ids is not enough: under SDPA/eager, `transformers`' Qwen2-VL
builds a plain causal mask over the whole row and samples see each other, and
Qwen3-VL's text model infers boundaries from a restarting text position row only
when no KV cache exists (its default `use_cache=True` makes one). So the model
always runs with `use_cache=False` and every backend gets explicit boundaries:

* varlen: PyTorch's own FlashAttention varlen kernel (`torch.nn.attention.varlen`,
  CUDA only, no extra package), given `cu_seq_lens`; the kernel never crosses them;
* flash: the `flash-attn` package's varlen kernel, same arguments (optional extra);
* flex: `flex_attention` with a BlockMask built from document ids (fully masked tiles skipped);
* sdpa (and eager): a dense block-diagonal causal boolean mask: O(L^2) memory, the CPU reference.

The vision tower is isolated per image / frame (and per window) from `grid_thw` by
`transformers` itself (Qwen3-VL's learned position grid is also resampled per item), which hands
the segments over in one call only to backends it takes for flash; `vision_attention` makes every
backend here one such call per vision block (bidirectional, over the tower's cu_seqlens) instead
of one call per segment. The language model's packed path is this module's alone.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from packtrain.core.sft_config import Attention

FLEX_NAME = "packtrain_flex"
VARLEN_NAME = "packtrain_varlen"
HF_IMPLEMENTATION = {
    "varlen": VARLEN_NAME,
    "flash": "flash_attention_2",
    "sdpa": "sdpa",
    "flex": FLEX_NAME,
    "eager": "eager",
}
# What `auto` tries on CUDA, best first (CPU: always sdpa, the only one without a CUDA kernel or compile).
AUTO_ORDER = ("varlen", "flash", "flex", "sdpa")
HALF_ONLY = ("varlen", "flash")  # FlashAttention kernels: CUDA, bf16/fp16


def flash_available() -> bool:
    """flash-attn is an optional GPU extra: look for it without importing it."""
    return importlib.util.find_spec("flash_attn") is not None


def varlen_available() -> bool:
    """torch >= 2.10 ships `torch.nn.attention.varlen.varlen_attn`."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def available_backends() -> dict[str, bool]:
    return {"varlen": varlen_available(), "flash": flash_available(), "flex": flex_available(), "sdpa": True}


_INSTALL_HINT = {
    "varlen": "needs torch >= 2.10 (torch.nn.attention.varlen)",
    "flash": "needs the `flash-attn` package (pip install 'packtrain[flash]')",
    "flex": "needs torch with torch.nn.attention.flex_attention (>= 2.5)",
}


def resolve_attention(
    requested: Attention | str,
    device: torch.device,
    available: Mapping[str, bool] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """The backend to use. auto: on CUDA the first available of varlen, flash, flex, sdpa (the
    FlashAttention kernels only in bf16/fp16); on other devices sdpa. Explicit choices are
    checked against the device, the compute dtype and what is installed."""
    have = dict(available_backends() if available is None else available)
    have["sdpa"] = True
    half = dtype in (torch.bfloat16, torch.float16)
    if requested == "auto":
        if device.type != "cuda":
            return "sdpa"
        return next(name for name in AUTO_ORDER if have.get(name) and (half or name not in HALF_ONLY))
    if requested not in HF_IMPLEMENTATION:
        raise ValueError(f"unknown attention backend {requested!r}; use one of auto, {', '.join(AUTO_ORDER)}")
    if requested in _INSTALL_HINT and not have.get(requested):
        hint = _INSTALL_HINT[requested]
        raise RuntimeError(f"attention: {requested} {hint}; or set training.attention: auto")
    if requested in HALF_ONLY and device.type != "cuda":
        raise RuntimeError(f"attention: {requested} runs on CUDA only; use sdpa or flex on this device")
    if requested in HALF_ONLY and not half:
        raise RuntimeError(
            f"attention: {requested} runs in bf16/fp16 only; set training.dtype: bf16 or use flex"
        )
    return str(requested)


# -- varlen -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VarlenKernel:
    """A `varlen_attn`-like function and the keywords its torch version takes.

    torch 2.10 has `is_causal: bool` and neither `scale` nor `enable_gqa`; 2.11 replaced
    `is_causal` with `window_size=(left, right)` ((-1, 0) is causal) and added `scale`; 2.12 added
    `enable_gqa` and from then on refuses K/V with fewer heads than Q without it.

    Grouped-query K/V (`grouped_kv`): 2.10 and 2.11 have no keyword for it but need none. Their
    `varlen_attn` checks no head counts and hands K/V as they are to `aten._flash_attention_forward`
    (their cuDNN branch is switched off), whose FlashAttention-2 varlen kernel takes H_kv dividing
    H_q, and its backward sums dK/dV over each group back to H_kv heads. Repeating K/V there would
    only store 8x copies for the backward (Qwen2.5-VL-3B: ~2 GB at 8192 tokens). `grouped_kv=False`
    is for a kernel that needs equal heads: K/V are then repeated.
    """

    fn: Callable[..., Any]
    window_size: bool  # causality as window_size=(-1, 0) rather than is_causal=True
    scale: bool
    gqa: bool  # takes enable_gqa
    grouped_kv: bool = True  # takes K/V with fewer heads than Q (with enable_gqa where it has it)

    @classmethod
    def of(cls, fn: Callable[..., Any], grouped_kv: bool = True) -> VarlenKernel:
        params = inspect.signature(fn).parameters
        if "window_size" not in params and "is_causal" not in params:
            raise RuntimeError(
                "torch.nn.attention.varlen.varlen_attn takes neither window_size nor is_causal in this "
                "torch version; set training.attention to flash, flex or sdpa"
            )
        return cls(fn, "window_size" in params, "scale" in params, "enable_gqa" in params, grouped_kv)


@functools.cache
def torch_varlen_kernel() -> VarlenKernel:
    from torch.nn.attention.varlen import varlen_attn

    return VarlenKernel.of(varlen_attn)


def varlen_call(
    kernel: VarlenKernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq: torch.Tensor,
    max_length: int,
    *,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """Packed (T, H, D) query and (T, H_kv, D) key/value through the kernel, whatever its version."""
    kwargs: dict[str, Any] = {}
    head_dim = query.shape[-1]
    if scale is not None and kernel.scale:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale * head_dim**0.5 - 1.0) > 1e-6:
        query = query * (scale * head_dim**0.5)  # the kernel scales by 1/sqrt(D): fold the rest into q
    if key.shape[1] != query.shape[1]:
        if not kernel.grouped_kv:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        elif kernel.gqa:
            kwargs["enable_gqa"] = True
    if kernel.window_size:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    cu = cu_seq.to(device=query.device, dtype=torch.int32)
    out = kernel.fn(query, key, value, cu, cu, int(max_length), int(max_length), **kwargs)
    return out[0] if isinstance(out, tuple) else out


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    kernel: VarlenKernel | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: (B, H, T, D) in, (B, T, H, D) out.

    With `cu_seq_lens_q` (the packed language model) the row is cut at those boundaries, causal.
    Without (one vision segment, or the padded baseline whose rows transformers hands over
    without a mask for a custom backend) each row is one sequence, causal as the module says:
    right padding means no real token sees a pad.
    """
    if attention_mask is not None:
        raise ValueError("varlen attention takes sequence boundaries (cu_seq_lens), not a mask")
    if dropout:
        raise ValueError("varlen attention has no dropout; set attention dropout to 0")
    kernel = kernel or torch_varlen_kernel()
    batch, heads, total, head_dim = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        cu = torch.arange(0, (batch + 1) * total, total, device=query.device, dtype=torch.int32)
        max_length = total
    else:
        max_length = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = bool(getattr(module, "is_causal", True))

    # Rotary embeddings in fp32 promote q and k under autocast; the kernel wants one half dtype.
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None

    def packed(x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2).reshape(batch * total, x.shape[1], head_dim)
        return x if dtype is None else x.to(dtype)

    out = varlen_call(
        kernel, packed(query), packed(key), packed(value), cu, max_length, causal=causal, scale=scaling
    )
    return out.view(batch, total, heads, head_dim), None


def register_varlen(kernel: VarlenKernel | None = None) -> None:
    """Register varlen in transformers' AttentionInterface (no mask function: transformers then
    builds no mask at all for it). `kernel` defaults to torch's; a test on a machine without
    CUDA substitutes a reference implementation of the same signature."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_NAME, functools.partial(varlen_attention, kernel=kernel))


# -- flex ---------------------------------------------------------------------------------------


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
    vision tower's per-segment calls where it makes them (`vision_attention.per_segment`, the
    reference; no mask, `is_causal=False`: bidirectional) and the padded
    baseline's language model, which transformers calls without a mask for a custom backend, so
    it must be causal there (right padding: no real token sees a pad)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if isinstance(attention_mask, BlockMask):
        # Eager flex is a slow reference; compiled it becomes a fused kernel (CUDA).
        fn = compiled_flex() if query.is_cuda else flex_attention
        query, key, value = one_dtype(query, key, value)
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


def one_dtype(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in one dtype, as flex_attention requires: the autocast dtype when autocast is on
    (rotary embeddings in fp32 promote q and k while v stays in the autocast dtype), else v's."""
    device_type = query.device.type
    enabled = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if enabled else value.dtype
    return query.to(dtype), key.to(dtype), value.to(dtype)


@functools.cache
def compiled_flex() -> Any:
    """Compiled once per shape at first, then with a dynamic length: packed rows differ in length
    from step to step, and a static compile per length would soon hit the recompile limit."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def register_flex() -> None:
    """transformers does not offer flex attention for Qwen2-VL, so register our own function."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_NAME, _flex_attention)


def register_backend(backend: str) -> None:
    """Make a backend's transformers implementation name resolvable before the model is built."""
    if backend == "flex":
        register_flex()
    elif backend == "varlen":
        register_varlen()


# -- boundaries ---------------------------------------------------------------------------------


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
    if backend in ("flash", "varlen"):
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
