"""One rank of a context-parallel group (torchrun, gloo), checked against the same row on one rank.

Arguments are MODE:FAMILY cases, all run by one torchrun (one start-up of every rank).
`samples:FAMILY`: one packed row of the family's demo samples (text, image, two images, video), fp64.
Rank 0 first runs the row unsplit (`VLMForTraining` without a mesh: the reference) and each sample
alone; then every rank runs its share under context parallelism; per sample, the loss and the
gradient of the sample's mean loss (summed over the group, as FSDP/DDP reduce them, so every rank
holds the same) must equal the unsplit row's and the sample's own forward alone. Only rank 0 computes
the references: the other ranks would compute the same numbers again. `broken:FAMILY`: positions
recomputed after the split (each rank's tokens numbered from 0): the same comparison must then fail.
`varlen:FAMILY`: as `samples` through the varlen backend (the GPU default) with a CPU reference
kernel of torch's `varlen_attn` signature. Prints one JSON line per case per rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vlm_fixtures as fx  # noqa: E402

from packtrain.core.report import write_line  # noqa: E402
from packtrain.trainer.data.batch import Batch  # noqa: E402
from packtrain.trainer.data.packed import collate_packed  # noqa: E402
from packtrain.trainer.model import context_parallel  # noqa: E402
from packtrain.trainer.model.attention import VarlenKernel, register_varlen  # noqa: E402
from packtrain.trainer.model.build import VLMForTraining, build_model  # noqa: E402
from packtrain.trainer.model.loss import per_sample_sums  # noqa: E402


def _grads(model: torch.nn.Module, group: object | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            if group is not None:
                dist.all_reduce(g, group=group)
            out[name] = g
    model.zero_grad(set_to_none=True)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _broken_split(real):  # type: ignore[no-untyped-def]
    """The control: positions recomputed after the split, so each rank's tokens count from 0."""

    def split(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        local = out.position_ids.shape[-1]
        wrong = torch.arange(local, dtype=out.position_ids.dtype).expand_as(out.position_ids).contiguous()
        return context_parallel.Split(
            out.input_ids, wrong, out.shift_labels, out.cu_seq_lens, out.max_length,
            out.full_input_ids, out.layout,
        )  # fmt: skip

    return split


KERNEL_CALLS = [0]


def _reference_varlen(
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):  # type: ignore[no-untyped-def]
    """torch 2.12's `varlen_attn` signature, computed per sequence by SDPA: the GPU default backend's
    arguments (the whole row's cu_seq_lens over (T, H/N, D) heads) checked on CPU."""
    KERNEL_CALLS[0] += 1
    causal = tuple(window_size) == (-1, 0)
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        part = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=enable_gqa
        )
        out.append(part.transpose(0, 1))
    return torch.cat(out)


def samples(family: str, broken: bool, backend: str = "sdpa") -> dict[str, object]:
    torch.set_num_threads(1)
    KERNEL_CALLS[0] = 0  # this case's calls only
    rank, world = dist.get_rank(), dist.get_world_size()
    overrides = fx.TINY[family]
    model = build_model(
        fx.FOLDER[family], init="random", overrides=overrides, dtype=torch.float64, seed=2, attention=backend
    )
    if backend == "varlen":
        register_varlen(VarlenKernel.of(_reference_varlen))
    items = fx.demo_samples(family)
    row = fx.packed_row(items, family)
    batch = collate_packed([row], fx.spec(family))
    batch = Batch(batch.inputs.to(torch.device("cpu"), torch.float64), batch.info)
    n = len(items)

    def per_sample(out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ones = torch.ones_like(out["token_losses"])
        sums = per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, n)
        counts = per_sample_sums(ones, out["positions"], batch.info.sample_index, n)
        return sums, counts

    ref: list[tuple[float, dict[str, torch.Tensor]]] = []
    alone: list[tuple[float, dict[str, torch.Tensor]]] = []
    if rank == 0:
        # the row unsplit, on this rank alone
        whole = VLMForTraining(model, backend)
        out = whole(batch.inputs)
        sums, counts = per_sample(out)
        for k in range(n):
            (sums[k] / counts[k]).backward(retain_graph=k < n - 1)
            ref.append(((sums[k] / counts[k]).item(), _grads(model)))
        # each sample alone, through the model's own forward
        for sample in items:
            inputs = {
                k: (v.double() if k.startswith("pixel_values") else v)
                for k, v in sample.hf.items()
                if k != "attention_mask"
            }
            logits = model(**inputs, use_cache=False).logits[0, :-1]
            loss = F.cross_entropy(logits, torch.tensor(sample.labels[1:]), ignore_index=-100)
            loss.backward()
            alone.append((loss.item(), _grads(model)))

    # the row split over the group
    mesh = context_parallel.make_mesh(rank, world, world)
    real_split = context_parallel.split_row
    if broken:
        context_parallel.split_row = _broken_split(real_split)  # type: ignore[assignment]
    try:
        split = VLMForTraining(model, backend, always_run_vision=True, mesh=mesh)
        out = split(batch.inputs)
    finally:
        context_parallel.split_row = real_split  # type: ignore[assignment]
    local_sums, local_counts = per_sample(out)
    full_counts = local_counts.detach().clone()
    dist.all_reduce(full_counts, group=mesh.group)
    full_sums = local_sums.detach().clone()
    dist.all_reduce(full_sums, group=mesh.group)
    worst = {"loss_vs_row": 0.0, "loss_vs_alone": 0.0, "grad_vs_row": 0.0, "grad_vs_alone": 0.0}
    for k in range(n):
        (local_sums[k] / full_counts[k]).backward(retain_graph=True)
        grads = _grads(model, mesh.group)
        if rank != 0:
            continue
        mean = (full_sums[k] / full_counts[k]).item()
        worst["loss_vs_row"] = max(worst["loss_vs_row"], abs(mean - ref[k][0]) / abs(ref[k][0]))
        worst["loss_vs_alone"] = max(worst["loss_vs_alone"], abs(mean - alone[k][0]) / abs(alone[k][0]))
        for name, g in ref[k][1].items():
            worst["grad_vs_row"] = max(worst["grad_vs_row"], _rel(grads.get(name, torch.zeros_like(g)), g))
        for name, g in alone[k][1].items():
            worst["grad_vs_alone"] = max(
                worst["grad_vs_alone"], _rel(grads.get(name, torch.zeros_like(g)), g)
            )
    shared = [worst]
    dist.broadcast_object_list(shared, src=0)  # rank 0's comparison, which the all-reduce made every rank's
    tokens = int(batch.inputs.input_ids.shape[1])
    return {
        "rank": rank,
        "family": family,
        "backend": backend,
        "kernel_calls": KERNEL_CALLS[0],
        "tokens": tokens,
        "local": int(out["positions"].numel()),
        **shared[0],
    }


def main() -> None:
    dist.init_process_group("gloo")
    try:
        for case in sys.argv[1:]:
            mode, _, family = case.partition(":")
            if mode not in ("samples", "broken", "varlen") or family not in fx.TINY:
                raise SystemExit(f"unknown case {case}: give MODE:FAMILY (MODE: samples, broken or varlen)")
            backend = "varlen" if mode == "varlen" else "sdpa"
            line = samples(family, mode == "broken", backend)
            write_line(json.dumps({"mode": mode, **line}))  # both ranks share one pipe
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
