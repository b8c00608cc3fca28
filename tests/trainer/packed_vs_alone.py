"""The two sides of a family's packed == alone test: a packed row through packtrain's training
forward, and each sample alone through the model's own forward with its processor's outputs; per
sample summed losses and the gradients of their sum over the row's label tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from packtrain.trainer.data.batch import Batch
from packtrain.trainer.model.build import VLMForTraining
from packtrain.trainer.model.loss import per_sample_sums


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient (those that have one), then cleared."""
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def packed(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample loss sums of the packed row, and the gradients of Σ sums / label tokens."""
    out = VLMForTraining(model, "sdpa")(batch.inputs)
    (out["loss_sum"] / batch.info.num_label_tokens).backward()
    n = len(batch.info.seq_lens)
    sums = per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, n)
    return sums.detach(), grads(model)


def alone(
    model: torch.nn.Module,
    samples: Iterable[Any],
    total: int,
    inputs: Callable[[Any], dict[str, Any]] = lambda s: s.hf,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each sample (`.hf` processor outputs, `.labels`) alone through `model(**inputs(sample))`: its
    summed loss, and the gradients of Σ sums / `total` (the packed row's label tokens)."""
    sums = []
    for s in samples:
        logits = model(**inputs(s)).logits[0, :-1]
        token = F.cross_entropy(logits, torch.tensor(s.labels[1:]), reduction="none", ignore_index=-100)
        (token.sum() / total).backward()
        sums.append(token.sum().detach())
    return torch.stack(sums), grads(model)
