"""The evaluation loss: the training objective's token mean over a held-out set, without gradients.

Σ token losses / Σ label tokens over the *whole* evaluation set, both summed over every rank, so the
number does not depend on how the set is packed, batched or split over ranks (a mean of per-batch or
per-rank means would weigh short batches up). Evaluation runs with `model.eval()` (no dropout) under
`torch.no_grad()`, and hands the model back in training mode; it draws nothing from the global RNG,
so a run with evaluations trains exactly as one without.
"""

from __future__ import annotations

import torch

from packtrain.trainer import distributed
from packtrain.trainer.data.packed import EvalDataset, loader


def due(step: int, max_steps: int, every: int) -> bool:
    """Evaluate after step `step` (1-based): every `every` steps (0: never in between) and after the last."""
    return step == max_steps or (every > 0 and step % every == 0)


def evaluate(
    model: torch.nn.Module,
    dataset: EvalDataset,
    device: torch.device,
    dtype: torch.dtype,
    num_workers: int = 0,
    prefetch: int = 2,
    context_parallel: int = 1,
) -> float:
    """The token-mean loss of `model` over the evaluation set (every rank calls it, and gets the same).
    The `context_parallel` ranks of a group share each unit: each holds the loss of its own tokens,
    and all count the unit's label tokens."""
    batches = loader(dataset, num_workers, prefetch, device.type == "cuda")
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    try:
        with torch.no_grad():
            for batch in batches:
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    result = model(batch.inputs.to(device, dtype))
                if batch.info.counted:
                    loss_sum += result["loss_sum"].double()
                    tokens += batch.info.num_label_tokens
    finally:
        model.train(was_training)
    total_tokens = distributed.all_reduce_sum(float(tokens), device) / context_parallel
    return distributed.all_reduce_sum(float(loss_sum), device) / max(total_tokens, 1.0)
