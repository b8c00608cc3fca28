"""One leg of a checkpoint's life, run by each rank under torchrun (or called in-process as one).

Builds the tiny Qwen2-VL as training does (VLMForTraining, parallelized by `--strategy`), loads
checkpoint `--load` if given (and re-saves it untouched as `--resave`), takes `--steps` AdamW steps
on deterministic gradients (the same full gradient whatever the world size; the vision tower gets
none, like text-only steps), saves `--save`, and exports the final folder to `--export`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "trainer")]

from vlm_fixtures import FOLDER, TINY  # noqa: E402

from packtrain.trainer import distributed  # noqa: E402
from packtrain.trainer.model.build import VLMForTraining, build_model  # noqa: E402
from packtrain.trainer.recipe import lr_lambda  # noqa: E402
from packtrain.trainer.state import checkpoint, export  # noqa: E402

FROZEN = "hf.model.visual.patch_embed."  # frozen: never in a checkpoint


def build(strategy: str, env: distributed.DistEnv) -> tuple[torch.nn.Module, Any, Any, Any]:
    """The model as a run builds it (random init, seed 0), its AdamW and schedule."""
    hf = build_model(FOLDER["qwen2-vl"], init="random", overrides=TINY["qwen2-vl"], seed=0)
    for p in hf.model.visual.patch_embed.parameters():
        p.requires_grad_(False)
    model = distributed.parallelize(VLMForTraining(hf, "sdpa"), strategy, env, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": params, "lr": 1e-2, "weight_decay": 0.1}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(1, 10))
    return model, hf, optimizer, scheduler


def gradient(name: str, shape: torch.Size, step: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{name}:{step}".encode()).digest()[:4], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def take_step(model: torch.nn.Module, optimizer: Any, scheduler: Any, step: int) -> None:
    """One AdamW step on `gradient`s: each rank sets its own part of the same full gradient."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        if not p.requires_grad or ".visual." in name:
            continue
        g = gradient(name, p.shape, step)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def run(args: argparse.Namespace, env: distributed.DistEnv) -> None:
    root = Path(args.root)
    model, hf, optimizer, scheduler = build(args.strategy, env)
    step = 0
    if args.load is not None:
        folder = root / "checkpoints" / f"step-{args.load:08d}"
        step = int(checkpoint.load(folder, model, optimizer, scheduler, env)["step"])
        draws = root / f"rng-{args.load}-{env.world_size}-{env.rank}.json"
        draws.write_text(json.dumps(torch.rand(2).tolist()))
        if args.resave is not None:
            checkpoint.save(root, args.resave, model, optimizer, scheduler, _state(step), env, keep=100)
    for _ in range(args.steps):
        step += 1
        take_step(model, optimizer, scheduler, step)
    if args.save is not None:
        checkpoint.save(root, args.save, model, optimizer, scheduler, _state(step), env, keep=100)
    if args.export is not None:
        export.save_hf(Path(args.export), model, hf, FOLDER["qwen2-vl"], env, torch.float32, args.shard_bytes)
        # bf16 as well: each rank casts its shards before the gather.
        bf16 = Path(f"{args.export}-bf16")
        export.save_hf(bf16, model, hf, FOLDER["qwen2-vl"], env, torch.bfloat16, args.shard_bytes)


def _state(step: int) -> dict[str, Any]:
    return {"data": {"seed": 0}, "trained": step}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--strategy", default="fsdp")
    p.add_argument("--load", type=int)
    p.add_argument("--resave", type=int)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--save", type=int)
    p.add_argument("--export")
    p.add_argument("--shard-bytes", type=int, default=export.SHARD_BYTES)
    return p.parse_args(argv)


if __name__ == "__main__":
    torch.set_num_threads(1)
    env = distributed.environ()
    distributed.init(env, torch.device("cpu"))
    try:
        run(parse(sys.argv[1:]), env)
    finally:
        distributed.shutdown()
    os._exit(0)
