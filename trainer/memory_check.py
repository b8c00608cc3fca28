"""The memory plan of a training job as the trainer sees it: `packtrain train --plan` and the
start-up check every rank runs before it builds the model.

The arithmetic is the core's (`packtrain.core.memory_plan`), shared with the operator;
here the job's YAML, the pack's manifest and the machine fill in its inputs, and the result is
printed as a table (rich) or JSON. Nothing here imports torch unless it asks the GPU its size.
Every figure is one rank's: under context parallelism (`training.contextParallel`) its share of each
row's tokens, which the table's title and the JSON's `tokens_per_gpu` say.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

from packtrain.core.errors import ConfigError
from packtrain.core.memory_plan import (
    GIB,
    MemoryPlan,
    PlanInputs,
    context_parallel_problem,
    gib,
    job_inputs,
    parse_bytes,
    plan_memory,
    refusal,
)
from packtrain.core.model_folder import ModelFolder
from packtrain.core.model_size import ModelDims, model_dims
from packtrain.core.sft_config import SFTSpecCore

# Checkpointing settings the table compares (decoder layers, vision blocks).
CHECKPOINTING = {"none": (False, False), "decoder": (True, False), "decoder + vision": (True, True)}


def dims_of(cfg: SFTSpecCore) -> ModelDims:
    """The model's dimensions from model.path's config.json with model.configOverrides merged, in the
    family model.family names (else config.json's `model_type`), checked against the folder; a
    ConfigError when a size breaks a bound (`model_size.dimension_problems`)."""
    folder = ModelFolder(cfg.model.path, cfg.model.config_overrides, cfg.model.family)
    config = folder.config
    return model_dims(config, folder.family.name)


def pack_max_length(data_path: str | None) -> int | None:
    """The pack's sequence length (manifest.json `max_length`), None without a readable manifest."""
    if data_path is None:
        return None
    from packtrain.core.errors import ShardFormatError
    from packtrain.core.pack.shards import read_manifest

    try:
        manifest = read_manifest(Path(data_path))
    except (OSError, ShardFormatError):  # the trainer's own read of the pack says what is wrong
        return None
    value = manifest.get("max_length")
    return int(value) if isinstance(value, int) else None


def inputs_for(
    cfg: SFTSpecCore,
    *,
    world_size: int,
    gpus_per_host: int,
    gpu_memory: int | None,
    max_length: int | None,
    bf16: bool = True,
) -> PlanInputs:
    """PlanInputs of the job: training options, freeze / LoRA, and the pack's sequence length."""
    length = max_length or pack_max_length(cfg.data.path)
    if length is None:
        raise ConfigError(
            "the plan needs the pack's sequence length: pass --data PACK (a finished pack) or --max-length N"
        )
    return job_inputs(
        cfg.training,
        cfg.model,
        world_size=world_size,
        gpus_per_host=gpus_per_host,
        gpu_memory=gpu_memory,
        max_length=length,
        bf16=bf16,
    )


def context_parallel_refusal(cfg: SFTSpecCore, dims: ModelDims, world_size: int, world: str) -> str | None:
    """Why the job cannot split its rows over training.contextParallel ranks of this world and model
    (world size, attention heads, padded rows), naming what to set; None when it can. The trainer
    makes the same checks at start-up."""
    return context_parallel_problem(
        cfg.training.context_parallel,
        world_size=world_size,
        world=world,
        dims=dims,
        packed=cfg.training.mode == "packed",
    )


def plan_json(dims: ModelDims, plan: MemoryPlan) -> dict[str, Any]:
    """The plan for machines: every row in bytes (one rank's), the totals, the verdict and what to change."""
    x = plan.inputs
    return {
        "model": {"family": dims.family, "parameters": plan.counts.total, "trainable": plan.counts.trainable},
        "inputs": {k: v for k, v in asdict(x).items() if k != "lora"} | {"lora": x.lora is not None},
        "context_parallel": x.context_parallel,
        "data_parallel": x.world_size // x.context_parallel,
        "tokens_per_gpu": round(x.rank_tokens),
        "per_gpu_bytes": {k: round(v) for k, v in plan.rows.items()},
        "total_per_gpu_bytes": round(plan.total),
        "total_per_host_bytes": round(plan.per_host),
        "checkpointing_per_gpu_bytes": {
            name: round(plan_memory(dims, _with(x, on)).total) for name, on in CHECKPOINTING.items()
        },
        "fits": plan.fits,
        "refusal": refusal(dims, plan),
    }


def _with(x: PlanInputs, on: tuple[bool, bool]) -> PlanInputs:
    from dataclasses import replace

    return replace(x, activation_checkpointing=on[0], vision_checkpointing=on[1])


def print_table(dims: ModelDims, plan: MemoryPlan, console: Any = None) -> None:
    """The plan as a table: one row per kind of memory, per GPU and per host, then the totals
    under each activation-checkpointing setting and the verdict."""
    from rich.console import Console
    from rich.table import Table

    x, c = plan.inputs, plan.counts
    console = console or Console()
    hosts = min(x.gpus_per_host, x.world_size)
    split = (
        f", contextParallel {x.context_parallel} ({x.world_size // x.context_parallel} data-parallel x "
        f"{x.context_parallel}): {x.rank_tokens:.0f} tokens a GPU"
        if x.context_parallel > 1
        else ""
    )
    title = (
        f"{dims.family}: {c.total / 1e9:.2f} B parameters, {c.trainable / 1e9:.3f} B trainable; "
        f"{x.world_size} GPUs ({hosts} a host), {x.strategy}, maxLength {x.max_length} x {x.sequences}"
        f"{split}"
    )
    table = Table(title=title)
    table.add_column("memory")
    table.add_column("per GPU", justify="right")
    table.add_column("per host", justify="right")
    for name, value in plan.rows.items():
        table.add_row(name, gib(value), gib(value * hosts))
    table.add_row("total", gib(plan.total), gib(plan.per_host), style="bold")
    console.print(table)
    ckpt = ", ".join(f"{n}: {gib(plan_memory(dims, _with(x, on)).total)}" for n, on in CHECKPOINTING.items())
    console.print(f"per GPU with activation checkpointing {ckpt}")
    if x.gpu_memory is None:
        console.print("no GPU memory given (--gpu-memory): nothing checked")
    elif plan.fits:
        console.print(f"fits: {gib(plan.total)} of {gib(x.gpu_memory)} per GPU")
    else:
        console.print(f"[bold red]does not fit[/]: {refusal(dims, plan)}")


def device_memory() -> int | None:
    """This rank's GPU memory in bytes; None on a machine without CUDA (nothing to plan for)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def startup_refusal(cfg: SFTSpecCore, world_size: int, gpus_per_host: int) -> str | None:
    """Why this job cannot fit its GPUs (the trainer exits 2 before building the model), else None.

    Runs on every rank (the same arithmetic, so all refuse together rather than some waiting in
    a collective); skipped on CPU and with training.planCheck false. The model's sizes are checked
    first, always: nothing is built from a config that breaks a bound (ConfigError, exit 2)."""
    dims = dims_of(cfg)
    if not cfg.training.plan_check:
        return None
    memory = device_memory()
    length = pack_max_length(cfg.data.path)
    if memory is None or length is None:  # a folder that is not a pack fails in the data setup, as it says
        return None
    x = inputs_for(
        cfg, world_size=world_size, gpus_per_host=gpus_per_host, gpu_memory=memory, max_length=length
    )
    plan = plan_memory(dims, x)
    message = refusal(dims, plan)
    if message is None:
        return None
    return f"{message} (training.planCheck: false skips this check; `packtrain train --plan` shows the table)"


def spec_sizes(path: str) -> dict[str, int]:
    """World size, GPUs per host and GPU memory an SFTJob manifest's resources name (none in a bare spec)."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
        docs = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    except (OSError, yaml.YAMLError):
        return {}
    doc = next((d for d in docs if d.get("kind") == "SFTJob"), docs[0] if docs else {})
    spec = doc.get("spec", doc)
    res = spec.get("resources") if isinstance(spec, dict) else None
    if not isinstance(res, dict):
        return {}
    nodes, per_node = int(res.get("nodes", 1)), int(res.get("gpusPerNode", 1))
    out = {"world": nodes * per_node, "per_host": per_node}
    if res.get("gpuMemory"):
        with contextlib.suppress(ConfigError):  # the models check the quantity; --plan reads it leniently
            out["gpu_memory"] = parse_bytes(str(res["gpuMemory"]))
    return out


__all__ = [
    "GIB",
    "context_parallel_refusal",
    "dims_of",
    "inputs_for",
    "plan_json",
    "print_table",
    "spec_sizes",
    "startup_refusal",
]
