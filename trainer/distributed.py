"""Process-group setup from the environment torchrun or a Kubeflow PyTorchJob provides.

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT per
process. A PyTorchJob injects MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK per
pod, plus PET_* variables (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR, PET_MASTER_PORT) that torchrun reads when the pod's command is
torchrun. `resolve_env` is the pure part: it accepts either.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from packtrain.trainer.model.loss import (
    HEAD_LOSS,
    compute_dtype,
    cross_entropy_backward,
    cross_entropy_forward,
)
from packtrain.trainer.model.parts import vision_blocks


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        if env.get(name, "") != "":
            return int(env[name])
    return default


def resolve_env(env: Mapping[str, str]) -> DistEnv:
    """DistEnv from environment variables (torchrun's, else a PyTorchJob's)."""
    nproc = _int(env, "PET_NPROC_PER_NODE", default=1)
    launched_by_torchrun = "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env
    if not launched_by_torchrun and nproc > 1:
        raise RuntimeError(
            f"PET_NPROC_PER_NODE={nproc} asks for {nproc} processes per pod, but this process was not "
            f"started by torchrun; run `torchrun -m {__package__} ...` (torchrun reads the PET_* variables)"
        )
    world = _int(env, "WORLD_SIZE", default=1)
    rank = _int(env, "RANK", default=0)
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", default=0),
        master_addr=env.get("MASTER_ADDR") or env.get("PET_MASTER_ADDR") or "127.0.0.1",
        master_port=_int(env, "MASTER_PORT", "PET_MASTER_PORT", default=29500),
    )


def init(env: DistEnv, device: torch.device) -> None:
    """Join the process group (NCCL on CUDA, gloo on CPU) when there is more than one process."""
    if not env.distributed or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(minutes=30),
        device_id=device if device.type == "cuda" else None,
    )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def pick_device(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_sum(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return float(t.item())


def environ() -> DistEnv:
    return resolve_env(os.environ)


def parallelize(
    module: torch.nn.Module,
    strategy: str,
    env: DistEnv,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
    fill: Callable[[torch.nn.Module], object] = lambda module: None,
) -> torch.nn.Module:
    """DDP (replicated weights) or FSDP2 (`fully_shard` per decoder layer / vision block, the input
    embedding and the LM head (one unit when tied), then the root); a single process trains the
    module as is. FSDP2 gathers parameters in `compute_dtype` and reduces gradients in fp32, so its
    shards keep fp32 master weights.

    `fill` gives a module built on the meta device its weights: FSDP2 shards the empty module
    first, so each rank then allocates and reads only its own shards; DDP needs the whole module
    before it wraps it (it broadcasts rank 0's weights)."""
    if not env.distributed:
        fill(module)
        return module
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        fill(module)
        return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        hf: Any = module.hf  # VLMForTraining's Hugging Face model
        for block in vision_blocks(hf):
            fully_shard(block, mp_policy=policy)
        for layer in hf.model.language_model.layers:
            fully_shard(layer, mp_policy=policy)
        _shard_vocabulary(hf, policy)
        fully_shard(module, mp_policy=policy)
        fill(module)
        return module
    raise ValueError(f"unknown strategy {strategy!r}")


def _shard_vocabulary(hf: Any, policy: Any) -> None:
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


def set_grad_sync(module: torch.nn.Module, enabled: bool) -> AbstractContextManager[object]:
    """Context for one micro-step: skip the gradient all-reduce on all but the last micro-step."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return nullcontext() if enabled else module.no_sync()
    set_sync = getattr(module, "set_requires_gradient_sync", None)  # FSDP2
    if set_sync is not None:
        set_sync(enabled)
    return nullcontext()


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)
