"""Token-level loss with a global normaliser.

Packing must not change the objective: the loss of a step is the sum of all
label-token losses divided by the number of label tokens in the *whole global
batch* (every micro-batch of every rank), not a mean of per-sequence means.
Each micro-batch contributes `sum / N_global`; since DDP/FSDP average gradients
over ranks, the local term is multiplied by the world size to undo that average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from packtrain.packer.shard_format import IGNORE_INDEX


def token_losses(
    hidden: torch.Tensor, lm_head: torch.nn.Module, shift_labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of every label token → (losses (n,), flat positions (n,)).

    Only positions that have a target go through the LM head, so the (tokens x vocab) logits
    exist for label tokens alone; the softmax runs in at least fp32.
    """
    flat_labels = shift_labels.reshape(-1)
    positions = torch.nonzero(flat_labels != IGNORE_INDEX).squeeze(-1)
    logits = lm_head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, flat_labels.index_select(0, positions), reduction="none"), positions


def per_sample_sums(
    losses: torch.Tensor, positions: torch.Tensor, sample_index: torch.Tensor, n: int
) -> torch.Tensor:
    """Sum of token losses per sub-sample (for equivalence checks and per-sample reporting)."""
    owner = sample_index.to(positions.device).index_select(0, positions)
    return torch.zeros(n, dtype=losses.dtype, device=losses.device).index_add_(0, owner, losses)


def global_label_tokens(local: int, device: torch.device) -> int:
    """Σ label tokens over all ranks for the current optimizer step (all micro-batches)."""
    count = torch.tensor([local], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count)
    return int(count.item())


def micro_batch_objective(loss_sum: torch.Tensor, global_tokens: int, world_size: int) -> torch.Tensor:
    """What to backward for one micro-batch so that the accumulated, rank-averaged gradient is
    the gradient of Σ(all token losses) / global_tokens."""
    return loss_sum * (world_size / max(global_tokens, 1))
