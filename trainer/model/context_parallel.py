"""Context parallelism: one packed row split over the N ranks of a group, trained as one rank trains it.

The world is a data-parallel x context-parallel mesh: ranks `g*N .. g*N+N-1` form context group `g`,
read the same micro-batches (data-parallel rank `g`) and each hold 1/N of every row's tokens. FSDP
still shards over the whole world: each rank's loss covers only its own tokens, so the world-averaged
gradient of `sum(local token losses) * world / N_global` is the gradient of the global token mean,
exactly as without context parallelism (`loss.micro_batch_objective`).

What is split, and what stays whole:

* the row is padded to a multiple of 2N (the padding is a sample of its own: isolated, no labels)
  and cut into 2N chunks; rank r holds chunks r and 2N-1-r (zigzag: with causal attention the work of
  a token grows with its position, so every rank gets as much early as late work);
* token ids, per-sample positions (the 3-D mRoPE rows included, computed by the packer for the whole
  row: split with the tokens, never recomputed) and next-token labels (shifted before the split, so a
  label at a chunk edge is the row's own) are sliced with that index;
* attention is Ulysses: an all-to-all turns (1/N of the tokens, all heads) into (all tokens, 1/N of
  the heads), in the row's own order, so the backend's sample boundaries (`cu_seq_lens`, the block
  mask) apply unchanged; another all-to-all turns the output back. Grouped-query K/V with fewer
  heads than N are repeated to lcm(H_kv, N) heads first (each query head still meets its own K/V);
* a linear-attention layer (Qwen3.5's Gated DeltaNet) projects its own tokens, exchanges heads the
  same way, runs conv and delta rule over the full sequence of its heads (restarting at every sample),
  and exchanges back before its output projection;
* the vision tower encodes each image / video once per group: the row's media are dealt out in
  contiguous runs of about equal patch counts, and the features gathered (their gradient summed
  over the group on the way back); each rank then takes the features of its own placeholders.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from packtrain.core.errors import ConfigError
from packtrain.core.pack.schema import IGNORE_INDEX

LAYOUT = "packtrain_cp_layout"
"""Keyword carrying a row's `Layout` down to the attention and linear-attention layers."""
CP_NAME = "packtrain_context_parallel"
"""The transformers attention implementation of the language model under context parallelism."""


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the data-parallel x context-parallel world."""

    size: int  # N: ranks per context group
    rank: int  # this rank within its group
    group: Any  # its process group (None when N == 1)
    dp_rank: int
    dp_size: int

    @property
    def on(self) -> bool:
        return self.size > 1

    @classmethod
    def single(cls, rank: int = 0, world_size: int = 1) -> Mesh:
        """No context parallelism: every rank its own data-parallel rank."""
        return cls(1, 0, None, rank, world_size)


def check_mesh(world_size: int, size: int, heads: int, kv_heads: int | None = None) -> None:
    """ConfigError naming what to change when the world or the attention heads cannot be split N ways.
    K/V heads need no check of their own: fewer than N are repeated to lcm(H_kv, N), which divides
    the query heads whenever N and H_kv both do."""
    if size < 1:
        raise ConfigError(f"training.contextParallel is {size}; use 1 (off) or more ranks per row")
    if world_size % size:
        raise ConfigError(
            f"training.contextParallel is {size} but the job runs {world_size} rank(s); make the number of "
            f"ranks a multiple of {size} (nodes x GPUs per node) or pick a contextParallel that divides it"
        )
    if heads % size:
        raise ConfigError(
            f"training.contextParallel is {size} but the model has {heads} attention heads, which cannot be "
            f"split {size} ways; use a contextParallel that divides {heads}"
        )


def make_mesh(rank: int, world_size: int, size: int) -> Mesh:
    """The mesh of `size`-rank context groups (consecutive ranks: one node's GPUs when N divides
    them, where the all-to-alls are fastest). Every rank creates every group, as `new_group` needs."""
    if size <= 1:
        return Mesh.single(rank, world_size)
    group = None
    for first in range(0, world_size, size):
        ranks = list(range(first, first + size))
        made = dist.new_group(ranks)
        if rank in ranks:
            group = made
    return Mesh(size, rank % size, group, rank // size, world_size // size)


# -- the split --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How one (padded) row of `total` tokens is spread over a group: `local` the positions this rank
    holds, `natural` the permutation from the group's gathered order (rank 0's tokens, rank 1's, ...)
    to the row's own."""

    total: int
    local: torch.Tensor
    natural: torch.Tensor
    mesh: Mesh


def padded_length(total: int, size: int) -> int:
    return -(-total // (2 * size)) * (2 * size)


def zigzag(total: int, size: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions rank `rank` holds of a row of `total` tokens (a multiple of 2 x size): chunks
    `rank` and `2 x size - 1 - rank`, in increasing order."""
    chunk = total // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])


def layout(total: int, mesh: Mesh, device: torch.device | str = "cpu") -> Layout:
    gathered = torch.cat([zigzag(total, mesh.size, r, device) for r in range(mesh.size)])
    natural = torch.empty_like(gathered)
    natural[gathered] = torch.arange(total, device=device)
    return Layout(total, zigzag(total, mesh.size, mesh.rank, device), natural, mesh)


@dataclass(frozen=True)
class Split:
    """A packed row's inputs for one rank of its group: its tokens, positions and labels, and the
    whole (padded) row's boundaries the attention needs."""

    input_ids: torch.Tensor  # (1, T/N)
    position_ids: torch.Tensor  # (..., 1, T/N)
    shift_labels: torch.Tensor  # (1, T/N)
    cu_seq_lens: torch.Tensor  # the padded row's boundaries (the padding a sample of its own)
    max_length: int
    full_input_ids: torch.Tensor  # (1, T): where each placeholder's vision feature sits in the row
    layout: Layout


def split_row(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    shift_labels: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_length: int,
    mesh: Mesh,
    pad_id: int,
) -> Split:
    """One packed (1, T) row padded to a multiple of 2N and cut for this rank (see the module)."""
    if input_ids.shape[0] != 1:
        raise ValueError("context parallelism splits one packed row per micro-batch (microBatchSequences: 1)")
    total = input_ids.shape[1]
    padded = padded_length(total, mesh.size)
    extra = padded - total
    cu = cu_seq_lens.to(input_ids.device)
    if extra:
        input_ids = torch.cat([input_ids, input_ids.new_full((1, extra), pad_id)], dim=1)
        shift_labels = torch.cat([shift_labels, shift_labels.new_full((1, extra), IGNORE_INDEX)], dim=1)
        position_ids = torch.cat(
            [position_ids, position_ids.new_zeros((*position_ids.shape[:-1], extra))], -1
        )
        cu = torch.cat([cu, cu.new_tensor([padded])])
        max_length = max(max_length, extra)
    lay = layout(padded, mesh, input_ids.device)
    return Split(
        input_ids=input_ids[:, lay.local],
        position_ids=position_ids[..., lay.local],
        shift_labels=shift_labels[:, lay.local],
        cu_seq_lens=cu,
        max_length=max_length,
        full_input_ids=input_ids,
        layout=lay,
    )


# -- all-to-all ------------------------------------------------------------------------------------


def _seq_to_heads(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """(B, H, T/N, D) this rank's tokens, all heads -> (B, H/N, T, D) all tokens of its heads."""
    n = lay.mesh.size
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=lay.mesh.group)
    full = recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)  # gathered order
    return full.index_select(2, lay.natural)


def _heads_to_seq(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The inverse: (B, H/N, T, D) -> (B, H, T/N, D)."""
    n = lay.mesh.size
    b, hn, t, d = x.shape
    gathered = torch.empty_like(x).index_copy_(2, lay.natural, x)  # back to the gathered order
    send = gathered.reshape(b, hn, n, t // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=lay.mesh.group)
    return recv.transpose(0, 1).reshape(b, n * hn, t // n, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lay: Layout) -> torch.Tensor:
        ctx.lay = lay
        return _seq_to_heads(x, lay)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad.contiguous(), ctx.lay), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lay: Layout) -> torch.Tensor:
        ctx.lay = lay
        return _heads_to_seq(x, lay)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad.contiguous(), ctx.lay), None


def seq_to_heads(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    return _SeqToHeads.apply(x, lay)


def heads_to_seq(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    return _HeadsToSeq.apply(x, lay)


# -- attention --------------------------------------------------------------------------------------


class _HeadShare:
    """The attention module as the inner backend sees it on 1/N of the heads: its K/V groups as
    they are after any repetition, everything else the module's own."""

    def __init__(self, module: torch.nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *,
    inner: Callable[..., tuple[torch.Tensor, Any]],
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over a context group: (B, H, T/N, D) in, (B, T/N, H, D) out,
    the inner backend running on (B, H/N, T, D) with the whole row's boundaries."""
    lay: Layout | None = kwargs.pop(LAYOUT, None)
    if lay is None:
        raise ValueError(
            "context-parallel attention needs the row's layout; run the model through VLMForTraining"
        )
    n = lay.mesh.size
    kv_heads = key.shape[1]
    if kv_heads % n:  # fewer K/V heads than ranks: repeat each to lcm(H_kv, N) heads
        repeat = math.lcm(kv_heads, n) // kv_heads
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    q, k, v = (seq_to_heads(t.contiguous(), lay) for t in (query, key, value))
    share = _HeadShare(module, q.shape[1] // k.shape[1])
    out, _ = inner(share, q, k, v, attention_mask, **kwargs)  # (B, T, H/N, D)
    return heads_to_seq(out.transpose(1, 2).contiguous(), lay).transpose(1, 2), None


def register(backend_impl: str) -> str:
    """Register the context-parallel attention around the transformers implementation `backend_impl`
    (already registered: sdpa, eager, or packtrain's varlen / flex); returns its name."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if backend_impl == "eager":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import eager_attention_forward

        inner: Callable[..., Any] = eager_attention_forward
    else:
        inner = ALL_ATTENTION_FUNCTIONS[backend_impl]
    AttentionInterface.register(CP_NAME, functools.partial(attention, inner=inner))
    return CP_NAME


# -- vision -----------------------------------------------------------------------------------------


def deal(weights: list[int], size: int) -> list[tuple[int, int]]:
    """`size` contiguous runs [start, stop) of the items, of about equal total weight (an item is
    never split; a run may be empty)."""
    total = sum(weights)
    runs, start, acc = [], 0, 0
    for r in range(size):
        stop = start
        target = total * (r + 1) / size
        while stop < len(weights) and (r == size - 1 or acc + weights[stop] / 2 <= target):
            acc += weights[stop]
            stop += 1
        runs.append((start, stop))
        start = stop
    return runs


class _GatherRows(torch.autograd.Function):
    """Every rank's rows (their counts known to all), concatenated in rank order; the gradient of a
    rank's rows is the sum over the group of the gradients of those rows."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        most = max(max(counts), 1)
        padded = rows.new_zeros((most, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        first = sum(ctx.counts[: ctx.rank])
        return grad[first : first + ctx.counts[ctx.rank]], None, None, None


def gather_rows(rows: torch.Tensor, counts: list[int], mesh: Mesh) -> torch.Tensor:
    return _GatherRows.apply(rows, counts, mesh.rank, mesh.group)


def local_rows(features: torch.Tensor, full_ids: torch.Tensor, token_id: int, lay: Layout) -> torch.Tensor:
    """The rows of `features` (one per `token_id` placeholder of the whole row, in order) that belong
    to this rank's placeholders, in its token order."""
    is_token = full_ids[0] == token_id
    index = torch.cumsum(is_token, 0) - 1  # each placeholder's feature row
    mine = lay.local[is_token[lay.local]]
    return features.index_select(0, index[mine])


# -- linear attention (Gated DeltaNet) ---------------------------------------------------------------


def linear_attention(
    layer: Any, kernels: Any, hidden_states: torch.Tensor, cu: torch.Tensor, lay: Layout
) -> torch.Tensor:
    """`Qwen3_5GatedDeltaNet.forward` (training, no cache) on this rank's tokens of a row: projections
    on its own tokens, then conv and delta rule over all tokens of 1/N of the heads (restarting at each
    sample's first token, `kernels` as in `linear_attention._varlen_forward`), then back."""
    _, s, _ = hidden_states.shape
    n = lay.mesh.size
    hk, hv = layer.num_k_heads, layer.num_v_heads
    if hk % n or hv % n:
        raise ConfigError(
            f"training.contextParallel {n}: the linear-attention layers have {hk} key and {hv} value heads, "
            f"which cannot be split {n} ways; use a contextParallel that divides {math.gcd(hk, hv)}"
        )
    dk, dv = layer.head_k_dim, layer.head_v_dim
    qkv = layer.in_proj_qkv(hidden_states)
    query, key, value = torch.split(qkv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)

    def heads(
        x: torch.Tensor, count: int, dim: int
    ) -> torch.Tensor:  # (1, S, count*dim) -> (1, T, count/N, dim)
        return seq_to_heads(x.reshape(1, s, count, dim).transpose(1, 2).contiguous(), lay).transpose(1, 2)

    q, k, v = heads(query, hk, dk), heads(key, hk, dk), heads(value, hv, dv)
    total = q.shape[1]
    # The depthwise conv acts per channel: this rank's channels of q, k and v, in the layer's order.
    weight = layer.conv1d.weight.squeeze(1)
    bias = layer.conv1d.bias
    r = lay.mesh.rank
    chans = torch.cat(
        [
            torch.arange(r * hk // n * dk, (r + 1) * hk // n * dk),
            layer.key_dim + torch.arange(r * hk // n * dk, (r + 1) * hk // n * dk),
            2 * layer.key_dim + torch.arange(r * hv // n * dv, (r + 1) * hv // n * dv),
        ]
    ).to(weight.device)
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    cu = cu.to(device=hidden_states.device, dtype=torch.long)
    mixed = kernels.conv(
        mixed, weight.index_select(0, chans), None if bias is None else bias.index_select(0, chans),
        layer.activation, cu,
    )  # fmt: skip
    sizes = [hk // n * dk, hk // n * dk, hv // n * dv]
    q, k, v = torch.split(mixed, sizes, dim=-1)
    q, k, v = q.reshape(1, total, -1, dk), k.reshape(1, total, -1, dk), v.reshape(1, total, -1, dv)
    b = heads(layer.in_proj_b(hidden_states), hv, 1).squeeze(-1)
    a = heads(layer.in_proj_a(hidden_states), hv, 1).squeeze(-1)
    heads_v = slice(r * hv // n, (r + 1) * hv // n)
    g = -layer.A_log[heads_v].float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias[heads_v])
    core = kernels.delta_rule(q, k, v, g, b.sigmoid(), cu).to(hidden_states.dtype)  # (1, T, Hv/N, dv)
    core = heads_to_seq(core.transpose(1, 2).contiguous(), lay).transpose(1, 2)  # (1, S, Hv, dv)
    z = layer.in_proj_z(hidden_states).reshape(-1, dv)
    core = layer.norm(core.reshape(-1, dv), z).reshape(1, s, -1)
    return layer.out_proj(core)
