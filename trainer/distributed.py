"""Process-group setup from the environment torchrun or a Kubeflow PyTorchJob provides.

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT per
process. A PyTorchJob injects MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK per
pod, plus PET_* variables (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR, PET_MASTER_PORT) that torchrun reads when the pod's command is
torchrun. `resolve_env` is the pure part: it accepts either.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from packtrain.trainer.model.parts import vision_blocks
from packtrain.trainer.model.vocabulary_units import shard_vocabulary


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
        shard_vocabulary(hf, policy)
        fully_shard(module, mp_policy=policy)
        fill(module)
        return module
    raise ValueError(f"unknown strategy {strategy!r}")


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
