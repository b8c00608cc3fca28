"""Token-level loss with a global normaliser, and the LM head computed in chunks.

Packing must not change the objective: the loss of a step is the sum of all
label-token losses divided by the number of label tokens in the *whole global
batch* (every micro-batch of every rank), not a mean of per-sequence means.
Each micro-batch contributes `sum / N_global`; since DDP/FSDP average gradients
over ranks, the local term is multiplied by the world size to undo that average.

The LM head's output is the largest tensor of a step (tokens x 151,936 for Qwen): only label
positions go through it, and those `chunk_tokens` at a time, in forward and backward alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from packtrain.core.pack.schema import IGNORE_INDEX
from packtrain.core.sft_config import LOSS_CHUNK_TOKENS

# The LM head's method (hidden, targets, chunk_tokens) -> losses that `token_losses` calls when the
# head has one: FSDP2 gives it one that gathers the head's shards for the loss (distributed.py).
HEAD_LOSS = "chunked_cross_entropy"


def token_losses(
    hidden: torch.Tensor,
    lm_head: torch.nn.Linear,
    shift_labels: torch.Tensor,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of every label token → (losses (n,), flat positions (n,)).

    Only positions that have a target go through the LM head; with `chunk_tokens` > 0 their
    logits exist `chunk_tokens` rows at a time (0: all label rows at once, through the module),
    through the head's `HEAD_LOSS` method when it has one (0: one chunk of all rows). The softmax
    runs in at least fp32.
    """
    flat_labels = shift_labels.reshape(-1)
    positions = torch.nonzero(flat_labels != IGNORE_INDEX).squeeze(-1)
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
    targets = flat_labels.index_select(0, positions)
    head_loss = getattr(lm_head, HEAD_LOSS, None)
    if head_loss is not None:
        return head_loss(
            selected, targets, chunk_tokens if chunk_tokens > 0 else max(1, len(targets))
        ), positions
    if chunk_tokens <= 0:
        logits = lm_head(selected)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, targets, reduction="none"), positions
    return chunked_linear_cross_entropy(selected, lm_head, targets, chunk_tokens), positions


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, lm_head: torch.nn.Linear, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """`cross_entropy(lm_head(hidden), targets, reduction="none")` holding at most `chunk_tokens`
    rows of logits at any time (forward and backward).

    Reads `lm_head.weight` / `.bias` inside the caller's forward: under FSDP2 the head is then in
    the root module's group, whose parameters are gathered for the whole root forward and
    backward, so these are the full tensors and their gradients reach FSDP's reduce-scatter (a
    head sharded as a unit of its own has a `HEAD_LOSS` method instead, which `token_losses`
    calls). Under autocast the matmuls run in the autocast dtype, as `lm_head(hidden)` would.
    """
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if _is_dtensor(weight):
        raise ValueError(
            "the LM head's weight is sharded (an FSDP unit of its own), so it cannot be read outside "
            f"its forward: give the head a {HEAD_LOSS!r} method that gathers it (distributed.parallelize "
            "does), leave lm_head in the root module's FSDP group, or set training.lossChunkTokens: 0"
        )
    compute = compute_dtype(hidden, weight)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_tokens, compute)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's when it is on, as `lm_head(hidden)` would."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not dist.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4: DTensor was private (and FSDP2 absent from torch.distributed.fsdp)
        return False
    return isinstance(tensor, DTensor)


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """(rows, vocab) logits of one chunk, in `out_dtype` (weight and bias already in compute dtype)."""
    h = hidden.to(weight.dtype)
    logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    return logits.to(out_dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Linear + cross-entropy that saves only the per-row log-sum-exp and recomputes each chunk's
    logits in backward (one extra LM-head matmul).

    A custom function rather than `torch.utils.checkpoint` per chunk: the softmax gradient is
    formed in place in the recomputed logits (one chunk buffer, not log-softmax + its gradient),
    and the weight gradient is accumulated in one buffer instead of autograd allocating a
    (vocab x hidden) gradient per chunk and summing them.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        compute: torch.dtype,
    ) -> torch.Tensor:
        losses, lse = cross_entropy_forward(hidden, weight, bias, targets, chunk, compute)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)  # type: ignore[arg-type]  # None is allowed
        ctx.chunk, ctx.compute = chunk, compute  # type: ignore[attr-defined]
        return losses

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_losses: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        needs = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        chunk, compute = ctx.chunk, ctx.compute  # type: ignore[attr-defined]
        grads = cross_entropy_backward(hidden, weight, bias, targets, lse, grad_losses, chunk, compute, needs)
        grad_hidden, grad_weight, grad_bias = grads
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: int,
    compute: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, per-row log-sum-exp) of `hidden @ weight.T (+ bias)`, `chunk` rows of logits at a time."""
    loss_dtype = torch.promote_types(compute, torch.float32)
    losses = torch.empty(hidden.shape[0], dtype=loss_dtype, device=hidden.device)
    lse = torch.empty_like(losses)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(compute)
        b = None if bias is None else bias.to(compute)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = _chunk_logits(hidden[rows], w, b, loss_dtype)
            picked = logits.gather(1, targets[rows].unsqueeze(1)).squeeze(1)
            # log-sum-exp in place (torch.logsumexp would allocate a second chunk buffer).
            top = logits.amax(dim=-1, keepdim=True)
            torch.add(logits.sub_(top).exp_().sum(dim=-1).log_(), top.squeeze(1), out=lse[rows])
            torch.sub(lse[rows], picked, out=losses[rows])
            del logits
    return losses, lse


def cross_entropy_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_losses: torch.Tensor,
    chunk: int,
    compute: torch.dtype,
    needs: tuple[bool, ...] = (True, True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients (hidden, weight, bias; None where `needs` says no) of `cross_entropy_forward`'s
    losses, each chunk's logits recomputed; the weight's and bias's in at least fp32."""
    need_hidden, need_weight, need_bias = needs
    grad_losses = grad_losses.to(lse.dtype)

    def accumulator(param: torch.Tensor) -> torch.Tensor:
        return torch.zeros(
            param.shape, dtype=torch.promote_types(param.dtype, torch.float32), device=param.device
        )

    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = accumulator(weight) if need_weight else None
    grad_bias = accumulator(bias) if need_bias and bias is not None else None
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(compute)
        b = None if bias is None else bias.to(compute)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            # d loss_i / d logits_i = g_i * (softmax(logits_i) - onehot(target_i)), in place.
            dlogits = _chunk_logits(hidden[rows], w, b, lse.dtype).sub_(lse[rows, None]).exp_()
            dlogits[torch.arange(dlogits.shape[0], device=dlogits.device), targets[rows]] -= 1
            dlogits.mul_(grad_losses[rows, None])
            if grad_bias is not None:
                grad_bias.add_(dlogits.sum(0))
            d = dlogits.to(compute)
            del dlogits
            if grad_hidden is not None:
                grad_hidden[rows] = d @ w
            if grad_weight is not None:
                h = hidden[rows].to(compute)
                if grad_weight.dtype == compute:
                    grad_weight.addmm_(d.t(), h)
                else:
                    grad_weight.add_(d.t() @ h)
            del d
    return grad_hidden, grad_weight, grad_bias


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


def aux_objective(
    aux_loss: torch.Tensor, coef: float, label_tokens: int, global_tokens: int, world_size: int
) -> torch.Tensor:
    """A micro-batch's router load-balancing term: `coef` x its aux loss x its share of the step's
    label tokens, so the accumulated, rank-averaged term is the label-token-weighted mean of the
    micro-batches' aux losses (each over its own real tokens), whatever the accumulation."""
    return aux_loss * (coef * label_tokens * world_size / max(global_tokens, 1))
