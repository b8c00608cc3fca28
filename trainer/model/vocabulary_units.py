"""The vocabulary-sized weights (input embedding, LM head) as FSDP2 units that packtrain gathers
itself, only around their use, with their gradients reduce-scattered in slices (`shard_vocabulary`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from packtrain.trainer.model.loss import (
    HEAD_LOSS,
    compute_dtype,
    cross_entropy_backward,
    cross_entropy_forward,
)


def shard_vocabulary(hf: Any, policy: Any) -> None:
    """The input embedding and the LM head, the vocabulary-sized weights, as FSDP2 units of their own
    (one unit when tied: one weight), each gathered only while it is used, so no rank holds one
    whole through the step, as the root unit held the head (and a weight tied to it) from the
    forward to the end of the backward.

    FSDP2 shards them, and checkpoints and exports them as any other unit, but does not gather
    them (`_by_hand`): the lookup (`_Lookup`) and the loss (`_HeadLoss`, the head's `HEAD_LOSS`
    method) gather the weight themselves and reduce-scatter its gradient into the shards in slices,
    at every micro-step. FSDP2 would hold the weight from the lookup to the loss (a unit of several
    modules reshards once all have run), gather it again for the lookup's backward, which needs no
    weight, and reduce a vocabulary-sized gradient per use through one more buffer of that size
    (held unreduced across micro-steps). Tied, the gradient is the sum of both uses' (as autograd
    sums them in one process). A head with a bias, or an embedding with more than a plain lookup,
    is left as before: in the root unit, or (the embedding, untied) a unit FSDP2 gathers."""
    from torch.distributed.fsdp import fully_shard

    embed, head = hf.model.language_model.embed_tokens, hf.lm_head
    own_head = isinstance(head, torch.nn.Linear) and head.bias is None
    lookup = _Lookup.fits(embed)
    if embed.weight is head.weight:
        if own_head and lookup:
            fully_shard([embed, head], mp_policy=policy)
            _by_hand(embed)
            embed.forward = _Lookup(embed)
            setattr(head, HEAD_LOSS, _HeadLoss(head))
        return
    fully_shard(embed, mp_policy=policy)
    if lookup:
        _by_hand(embed)
        embed.forward = _Lookup(embed)
    if own_head:
        fully_shard(head, mp_policy=policy)
        _by_hand(head)
        setattr(head, HEAD_LOSS, _HeadLoss(head))


def _by_hand(module: Any) -> None:
    """Take FSDP2's forward hooks (gather before, reshard after) off the unit of `module`, whose
    weights its own code gathers (`FSDPModule.unshard` / `reshard`)."""
    state = module._get_fsdp_state()
    pre = getattr(state, "_pre_forward_hook_handle", None)
    post = getattr(state, "_post_forward_hook_handle", None)
    if pre is None or post is None:
        raise RuntimeError(
            "this torch's FSDP2 keeps its forward hooks where packtrain does not look for them: train "
            "with the torch the trainer image pins, or with training.strategy: ddp"
        )
    for handle in dict.fromkeys((pre, post)):  # a unit of several modules has one handle for both
        handle.remove()


@contextmanager
def _whole(module: Any) -> Iterator[torch.Tensor]:
    """The unit's weight gathered (FSDP2's all-gather, in its compute dtype), resharded on exit."""
    module.unshard()
    try:
        yield module.weight
    finally:
        module.reshard()


_SLICE_BYTES = 64 << 20  # the most a backward holds of the gradient it reduce-scatters


def _reduce_scatter_rows(
    fill: Callable[[torch.Tensor, int], None], vocab: int, width: int, group: Any, device: torch.device
) -> torch.Tensor:
    """This rank's rows of a (vocab, width) gradient summed over the ranks and averaged, as FSDP2
    reduces gradients, never holding the whole gradient: `fill(buffer, first)` writes rows `first`
    to `first + n` of every rank's shard (torch.chunk's rows, as DTensor shards them) into the
    (world, n, width) fp32 buffer, which is reduce-scattered; every rank runs every slice."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = -(-vocab // world)
    held = max(0, min(per_rank, vocab - rank * per_rank))
    out = torch.empty(held, width, dtype=torch.float32, device=device)
    step = max(1, _SLICE_BYTES // (world * width * 4))
    for first in range(0, per_rank, step):
        n = min(step, per_rank - first)
        send = torch.zeros(world, n, width, dtype=torch.float32, device=device)
        fill(send, first)
        mine = torch.empty(n, width, dtype=torch.float32, device=device)
        dist.reduce_scatter_tensor(mine, send.view(world * n, width), group=group)
        stop = min(first + n, held)
        if stop > first:
            out[first:stop] = mine[: stop - first]
    return out.div_(world)


class _Lookup:
    """A sharded `nn.Embedding`'s forward (see `_shard_vocabulary`)."""

    def __init__(self, embed: torch.nn.Embedding) -> None:
        self.embed = embed

    @staticmethod
    def fits(embed: Any) -> bool:
        """A plain lookup: no max_norm, frequency scaling or sparse gradient (FSDP2 shards the
        weight by rows, the layout the backward reduce-scatters into)."""
        return (
            isinstance(embed, torch.nn.Embedding)
            and embed.max_norm is None
            and not embed.scale_grad_by_freq
            and not embed.sparse
        )

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        embed: Any = self.embed
        weight = embed.weight
        if not isinstance(weight, DTensor):  # gathered (by the head's loss, say): a plain lookup
            return torch.nn.functional.embedding(ids, weight, embed.padding_idx)
        if weight.requires_grad and torch.is_grad_enabled():
            return _LookupGrad.apply(ids, weight.to_local(), embed)
        with _whole(embed) as whole:
            return torch.nn.functional.embedding(ids, whole, embed.padding_idx)


class _LookupGrad(torch.autograd.Function):
    """The rows of the gathered weight; backward: the shard's gradient, each rank's rows' gradients
    added into a slice of the vocabulary at a time and reduce-scattered."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, local: torch.Tensor, embed: Any) -> torch.Tensor:
        weight = embed.weight
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.dtype, ctx.shape = embed.padding_idx, local.dtype, tuple(weight.shape)
        ctx.group = weight.device_mesh.get_group()
        with _whole(embed) as whole:
            return torch.nn.functional.embedding(ids, whole, embed.padding_idx)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        vocab, width = ctx.shape
        ids = ids.reshape(-1)
        grads = grad_rows.reshape(ids.shape[0], width).float()
        if ctx.padding_idx is not None:  # its row gets no gradient, as nn.Embedding's
            grads = grads.masked_fill((ids == ctx.padding_idx)[:, None], 0.0)
        per_rank = -(-vocab // dist.get_world_size(ctx.group))
        owner, row = ids // per_rank, ids % per_rank

        def fill(send: torch.Tensor, first: int) -> None:
            n = send.shape[1]
            chosen = (row >= first) & (row < first + n)
            index = owner[chosen] * n + row[chosen] - first
            send.view(-1, width).index_add_(0, index, grads[chosen])

        out = _reduce_scatter_rows(fill, vocab, width, ctx.group, grads.device)
        return None, out.to(ctx.dtype), None


class _HeadLoss:
    """A sharded LM head's `HEAD_LOSS` method: the chunked cross-entropy (`loss.py`) with the weight
    gathered around its forward and again around its backward, whose weight gradient is then
    reduce-scattered into the shards a slice at a time."""

    def __init__(self, head: torch.nn.Linear) -> None:
        self.head = head

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        weight: Any = self.head.weight
        return _HeadLossFn.apply(hidden, weight.to_local(), self.head, targets, chunk_tokens)


class _HeadLossFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, local: torch.Tensor, head: Any, targets: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        weight = head.weight
        ctx.head, ctx.chunk, ctx.dtype, ctx.shape = head, chunk, local.dtype, tuple(weight.shape)
        ctx.group = weight.device_mesh.get_group()
        with _whole(head) as whole:
            ctx.compute = compute_dtype(hidden, whole)
            losses, lse = cross_entropy_forward(hidden, whole, None, targets, chunk, ctx.compute)
        ctx.save_for_backward(hidden, targets, lse)
        return losses

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        with _whole(ctx.head) as whole:
            grad_hidden, grad_weight, _ = cross_entropy_backward(
                hidden,
                whole,
                None,
                targets,
                lse,
                grad_losses,
                ctx.chunk,
                ctx.compute,
                (need_hidden, need_weight, False),
            )
        out = None
        if grad_weight is not None:  # the gathered weight is gone: its gradient reduced in slices
            vocab, width = ctx.shape
            per_rank = -(-vocab // dist.get_world_size(ctx.group))

            def fill(send: torch.Tensor, first: int) -> None:
                for r in range(send.shape[0]):
                    start = r * per_rank + first
                    rows = grad_weight[start : min(start + send.shape[1], vocab)]
                    send[r, : rows.shape[0]] = rows

            out = _reduce_scatter_rows(fill, vocab, width, ctx.group, grad_weight.device).to(ctx.dtype)
            del grad_weight
        return grad_hidden, out, None, None, None
