"""A run never trains on, or exports, non-finite numbers.

Weights that hold NaN or inf (a model folder's safetensors, a checkpoint, an update gone wrong)
give a NaN loss at every step, and AdamW spreads one NaN gradient into every weight it updates;
a run that went on would end "successfully" with a NaN model. So the weights are checked where
the run starts and before the export, and every step's loss and gradient norm (both global: the
same on every rank) before its update is applied. A non-finite step is skipped (no update, the
schedule and the data move on) while `training.maxNonFiniteSteps` allows it; past that, or at
once for the weights, the run stops with a ConfigError (exit 2) naming the step and the first
parameter, or gradient, that is not finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from packtrain.core.errors import ConfigError

_WHAT_TO_DO = (
    "lower training.lr or set training.maxGradNorm, check the data, or allow a few such steps with "
    "training.maxNonFiniteSteps"
)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def first_non_finite(named: Iterable[tuple[str, torch.nn.Parameter]], grads: bool) -> str | None:
    """The first parameter (in model order) whose value, or gradient with `grads`, holds NaN or inf
    on any rank; None when all are finite. Every rank must call it (one all-reduce)."""
    names: list[str] = []
    flags: list[torch.Tensor] = []
    for name, p in named:
        t = p.grad if grads else p
        if t is None or not t.is_floating_point():
            continue
        local = _local(t)
        names.append(name)
        flags.append(~torch.isfinite(local).all() if local.numel() else local.new_zeros((), dtype=torch.bool))
    if not flags:
        return None
    found = torch.stack(flags).to(torch.float32)
    if dist.is_initialized():
        dist.all_reduce(found)
    hits = torch.nonzero(found).flatten().tolist()
    return names[hits[0]] if hits else None


def check_weights(hf: Any, when: str) -> None:
    """ConfigError naming the first non-finite parameter of `hf`; `when`: where the run is."""
    name = first_non_finite(hf.named_parameters(), grads=False)
    if name is not None:
        raise ConfigError(
            f"{when}, parameter {name} holds NaN or infinite values; nothing was exported. Start from "
            "finite weights (model.path's safetensors, or model.init: random), or from an earlier checkpoint"
        )


def check_end(hf: Any, step: int, loss: float, trained: bool) -> None:
    """Before the last checkpoint and the export: finite weights, and (when this run `trained`) a last
    step that was not skipped: a model whose last step was NaN is no result, even when every step
    was allowed to be skipped."""
    check_weights(hf, f"after step {step}")
    if trained and not math.isfinite(loss):
        raise ConfigError(
            f"step {step}, the last, had a loss of {loss} and was skipped; nothing was exported: "
            + _WHAT_TO_DO
        )


def grad_norm(model: torch.nn.Module, max_norm: float | None) -> float:
    """The step's global gradient norm, clipped to `max_norm` when set (as `clip_grad_norm_` does)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


def skip_or_stop(hf: Any, step: int, loss: float, norm: float, skipped: int, allowed: int) -> int:
    """A non-finite step: the number of steps skipped once it is, or ConfigError when `allowed`
    (training.maxNonFiniteSteps) are spent, naming the first non-finite parameter or gradient."""
    if skipped < allowed:
        return skipped + 1
    weight = first_non_finite(hf.named_parameters(), grads=False)
    grad = None if weight is not None else first_non_finite(hf.named_parameters(), grads=True)
    where = (
        f"parameter {weight} holds NaN or infinite values"
        if weight is not None
        else f"the gradient of {grad} is not finite"
        if grad is not None
        else "no parameter or gradient is, so the loss itself overflowed"
    )
    budget = f"{skipped} such steps skipped, training.maxNonFiniteSteps is {allowed}"
    raise ConfigError(
        f"step {step}: the loss is {_number(loss)} and the gradient norm {_number(norm)} ({where}; "
        f"{budget}); the run stops, nothing was exported: {_WHAT_TO_DO}"
    )


def _number(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)
