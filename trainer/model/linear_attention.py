"""Per-sample isolation in the linear-attention layers of a hybrid decoder (Qwen3.5's Gated DeltaNet).

A Gated DeltaNet layer carries state along the sequence: a causal depthwise conv1d (kernel 4) over
the q/k/v projections and the recurrent state of the gated delta rule. In a packed row both must
start fresh at each sample's first token, or every sample reads its predecessors. `transformers`'
CPU fallbacks (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`) ignore `cu_seq_lens_q` and
`seq_idx`, so a plain packed forward leaks silently, whatever the attention backend does for the
full-attention layers. So each linear-attention layer's `forward` is wrapped (in place, so parameter
names, checkpoints and PEFT's adapters are untouched) to take the row's sample boundaries as the
keyword `SEGMENTS` and run:

* torch: the layer's own forward once per sample, on that sample's slice of the row: exactly the
  computation of the sample alone (the chunked delta rule pads each call to its chunk size, as it
  does alone). The reference, and the path on CPU and wherever `fla` is missing;
* fla: one call for the whole row to the `flash-linear-attention` package's varlen kernels
  (`chunk_gated_delta_rule(..., cu_seqlens=...)` and `causal_conv1d(..., cu_seqlens=...)`, whose
  conv window restarts at every boundary); CUDA only, imported lazily (`packtrain[linear]`).

Without `SEGMENTS` (the padded baseline, a plain forward) the layer runs as `transformers` wrote it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from packtrain.trainer.model import context_parallel
from packtrain.trainer.model.context_parallel import LAYOUT as CP_LAYOUT

SEGMENTS = "packtrain_linear_cu_seq_lens"
"""Keyword carrying the packed row's sample boundaries (int, n + 1) down to the linear-attention layers."""
PATHS = ("fla", "torch")
# Varlen keywords meant for the attention kernels; the per-sample slices must not see them.
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """The model's linear-attention (Gated DeltaNet) layers, in order."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def has_linear_attention(model: nn.Module) -> bool:
    return bool(linear_layers(model))


def fla_available() -> bool:
    """flash-linear-attention is an optional GPU extra: look for it without importing it."""
    return importlib.util.find_spec("fla") is not None


def resolve_linear(device: torch.device | str, available: bool | None = None) -> str:
    """fla on CUDA when the package is installed, else the per-sample torch path."""
    have = fla_available() if available is None else available
    return "fla" if torch.device(device).type == "cuda" and have else "torch"


@dataclass(frozen=True)
class VarlenKernels:
    """Varlen conv and delta rule in `flash-linear-attention`'s signatures (one (1, T, ...) row).

    conv(x (1, T, C), weight (C, W), bias, activation, cu_seqlens) -> (1, T, C);
    delta_rule(q, k (1, T, Hk, Dk), v (1, T, Hv, Dv), g, beta (1, T, Hv), cu_seqlens) -> (1, T, Hv, Dv),
    q and k l2-normalised inside, each sample's state starting at zero.
    """

    conv: Callable[..., torch.Tensor]
    delta_rule: Callable[..., torch.Tensor]


def fla_kernels() -> VarlenKernels:
    """The `flash-linear-attention` kernels (CUDA, Triton), imported on first use (an optional extra,
    absent from the trainer image unless installed)."""
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        raise ImportError(
            "the 'fla' linear-attention path needs flash-linear-attention: pip install 'packtrain[linear]'"
        ) from exc

    def conv(x: torch.Tensor, weight: torch.Tensor, bias: Any, activation: str, cu: torch.Tensor) -> Any:
        out = causal_conv1d(x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu)
        return out[0] if isinstance(out, tuple) else out

    def delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, cu: torch.Tensor) -> Any:
        if k.shape[2] != v.shape[2]:  # grouped values: each q/k head serves consecutive value heads
            groups = v.shape[2] // k.shape[2]
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        out = chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, output_final_state=False
        )
        return out[0] if isinstance(out, tuple) else out

    return VarlenKernels(conv, delta_rule)


def _varlen_forward(
    layer: Any, kernels: VarlenKernels, hidden_states: torch.Tensor, cu: torch.Tensor
) -> torch.Tensor:
    """`Qwen3_5GatedDeltaNet.forward` (training, no cache) over a packed (1, T, D) row, with the
    conv and the delta rule restarted at the boundaries `cu` by varlen kernels."""
    _, total, _ = hidden_states.shape
    cu = cu.to(device=hidden_states.device, dtype=torch.long)  # fla: LongTensor cu_seqlens
    mixed = kernels.conv(
        layer.in_proj_qkv(hidden_states),
        layer.conv1d.weight.squeeze(1),
        layer.conv1d.bias,
        layer.activation,
        cu,
    )
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(1, total, -1, layer.head_k_dim)
    key = key.reshape(1, total, -1, layer.head_k_dim)
    value = value.reshape(1, total, -1, layer.head_v_dim)
    beta = layer.in_proj_b(hidden_states).sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(hidden_states).float() + layer.dt_bias)
    core = kernels.delta_rule(query, key, value, g, beta, cu).to(hidden_states.dtype)
    z = layer.in_proj_z(hidden_states).reshape(-1, layer.head_v_dim)
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z).reshape(1, total, -1)
    return layer.out_proj(core)


def _bounds(cu: torch.Tensor, total: int) -> list[tuple[int, int]]:
    edges = [int(c) for c in cu.tolist()]
    if edges[0] != 0 or edges[-1] != total or any(b < a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"linear attention: boundaries {edges} do not cut a row of {total} tokens")
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def isolate(layer: nn.Module, path: str, kernels: VarlenKernels | None = None) -> None:
    """Wrap `layer.forward` so that, given `SEGMENTS`, each sample starts with a fresh conv window
    and recurrent state. `kernels` (fla path) default to `flash-linear-attention`'s; a test on a
    machine without CUDA substitutes reference kernels of the same signatures."""
    if path not in PATHS:
        raise ValueError(f"unknown linear-attention path {path!r}; use one of {', '.join(PATHS)}")
    forward = layer.forward
    kernels = (kernels or fla_kernels()) if path == "fla" else None

    def run(
        hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        cu = kwargs.pop(SEGMENTS, None)
        split = kwargs.pop(CP_LAYOUT, None)  # a context-parallel row: this rank holds 1/N of its tokens
        if split is not None:
            return context_parallel.linear_attention(
                layer, kernels or reference_kernels(), hidden_states, cu, split
            )
        if cu is None:
            return forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if cache is not None or hidden_states.shape[0] != 1:
            raise ValueError("linear attention: sample boundaries need one packed row and no cache")
        if kernels is not None:
            return _varlen_forward(layer, kernels, hidden_states, cu)
        rest = {k: v for k, v in kwargs.items() if k not in _VARLEN_KEYS}
        parts = [forward(hidden_states[:, a:b], **rest) for a, b in _bounds(cu, hidden_states.shape[1])]
        return torch.cat(parts, dim=1)

    layer.forward = run
    layer.packtrain_linear_path = path  # type: ignore[assignment]


def isolate_linear_attention(model: nn.Module, path: str, kernels: VarlenKernels | None = None) -> str | None:
    """Isolate every linear-attention layer of `model` (see `isolate`); the path, or None when the
    model has no such layer."""
    layers = linear_layers(model)
    if path == "fla" and layers:
        kernels = kernels or fla_kernels()
    for layer in layers:
        isolate(layer, path, kernels)
    return path if layers else None


def linear_path(model: nn.Module) -> str | None:
    """The path the model's linear-attention layers run (None: it has none)."""
    for layer in linear_layers(model):
        return getattr(layer, "packtrain_linear_path", None)
    return None


# -- a reference for the varlen kernels -----------------------------------------------------------


def reference_kernels() -> VarlenKernels:
    """`transformers`' own torch conv and chunked delta rule, called once per sample: what the fla
    kernels compute, in their signatures, so the varlen forward can be checked on CPU."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    def conv(x: torch.Tensor, weight: torch.Tensor, bias: Any, activation: str, cu: torch.Tensor) -> Any:
        parts = [
            q35.causal_conv1d_fn(x[:, a:b].transpose(1, 2), weight, bias, activation=activation).transpose(
                1, 2
            )
            for a, b in _bounds(cu, x.shape[1])
        ]
        return torch.cat(parts, dim=1)

    def delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, cu: torch.Tensor) -> Any:
        parts = [
            q35.torch_chunk_gated_delta_rule(
                q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], use_qk_l2norm_in_kernel=True
            )[0]
            for a, b in _bounds(cu, q.shape[1])
        ]
        return torch.cat(parts, dim=1)

    return VarlenKernels(conv, delta_rule)
