"""The training loop, top to bottom: setup, resume, steps, checkpoints, final export.

One optimizer step = `gradAccum` micro-batches per rank. Before any forward,
the step's label tokens are counted over every micro-batch of every rank, and
each micro-batch backwards `sum(token losses) * world / N_global`, so the step's
gradient is that of the global token mean whatever the packing, accumulation
or world size (see `loss`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from . import checkpoint, distributed
from .attention import resolve_attention
from .config import SFTSpecCore
from .data import DEFAULT_PAD_TOKEN_ID, PackedDataset
from .loss import global_label_tokens, micro_batch_objective
from .media import PixelSpec
from .metrics import ModelShape, Stopwatch, TrainMetrics, device_peak_tflops, step_flops
from .model import VLMForTraining, build_model, load_config, move_batch, parameter_groups
from .rope import family_from_config


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "bf16":
        return torch.bfloat16
    if name == "fp32":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def batches(dataset: PackedDataset, num_workers: int, prefetch: int, pin: bool) -> Iterator[dict[str, Any]]:
    """Micro-batches forever, epoch after epoch, starting at the dataset's saved position.

    Each loader gets its own generator: a DataLoader iterator draws its workers' base seed from
    the generator it is given, else from the global torch RNG, and a resumed run (which starts a
    loader at the resume point) would then leave the global RNG one draw off the straight run.
    """
    while True:
        loader = DataLoader(
            dataset.view(),
            batch_size=None,
            shuffle=False,
            num_workers=num_workers,
            prefetch_factor=prefetch if num_workers else None,
            pin_memory=pin,
            generator=torch.Generator().manual_seed(dataset.seed),
        )
        yield from loader


def train(cfg: SFTSpecCore, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the job described by `cfg` in this process (one rank); returns the summary."""
    env = distributed.environ()
    device = distributed.pick_device(env)
    distributed.init(env, device)
    try:
        return _train(cfg, env, device, log)
    finally:
        distributed.shutdown()


def _train(
    cfg: SFTSpecCore, env: distributed.DistEnv, device: torch.device, log: Callable[[str], None]
) -> dict[str, Any]:
    t = cfg.training
    out = Path(t.output_dir)
    if cfg.data.path is None:
        raise ValueError(
            f"data.packJobRef {cfg.data.pack_job_ref!r} must be resolved to data.path (the operator does)"
        )
    torch.manual_seed(t.seed)
    dtype = resolve_dtype(t.dtype, device)
    backend = resolve_attention(t.attention, device)
    config = load_config(cfg.model.path, cfg.model.config_overrides)
    family = family_from_config(config)
    if cfg.model.family is not None and cfg.model.family != family.name:
        raise ValueError(f"model.family is {cfg.model.family} but {cfg.model.path} is a {family.name} model")

    # -- data (first: a folder that is not a pack, or too small a pack, fails before the model) ---
    pad_id = config.text_config.pad_token_id
    dataset = PackedDataset(
        cfg.data.path,
        family,
        PixelSpec.from_folder(cfg.model.path),
        rank=env.rank,
        world_size=env.world_size,
        units_per_micro_batch=t.micro_batch_sequences if t.mode == "packed" else t.padded_batch_size,
        grad_accum=t.grad_accum,
        seed=t.seed,
        mode=t.mode,
        pad_token_id=DEFAULT_PAD_TOKEN_ID if pad_id is None else pad_id,
        # One process per node reads every shard to check it; its peers share that filesystem.
        verify_checksums=cfg.data.verify_checksums and env.local_rank == 0,
        vocab_size=config.text_config.vocab_size,
    )
    pack_family = dataset.manifest.get("family")
    if pack_family not in (None, family.name):
        raise ValueError(f"the pack was made for {pack_family} but the model is {family.name}")
    dataset.balance()  # plans the epoch: raises if the pack holds less than one global step

    # -- model ---------------------------------------------------------------------------
    # Mixed precision: weights and AdamW state stay fp32 (bf16 weights would round most small
    # updates away); matmuls run in `dtype` under autocast.
    hf = build_model(
        cfg.model.path,
        init=cfg.model.init,
        overrides=cfg.model.config_overrides,
        dtype=torch.float32,
        attention=backend,
        seed=t.seed,
        device=device,
    )
    if cfg.model.gradient_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    core = VLMForTraining(hf, backend, always_run_vision=env.distributed).to(device)
    shape = ModelShape.from_model(hf, parameter_groups(core))
    model = distributed.parallelize(core, t.strategy, env, device, compute_dtype=dtype)

    # -- optimizer, schedule, resume -----------------------------------------------------
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.warmup, t.max_steps))
    step = 0
    resumed_from = checkpoint.latest(out) if t.resume else None
    if resumed_from is not None:
        state = checkpoint.load(resumed_from, model, optimizer, scheduler, env)
        step = int(state["step"])
        dataset.load_state_dict(state["data"])
        if env.is_main:
            log(json.dumps({"event": "resumed", "checkpoint": str(resumed_from), "step": step}))

    metrics = TrainMetrics(
        env.rank, device, None if t.metrics_port is None else t.metrics_port + env.local_rank
    )
    metrics.enable_mfu(device_peak_tflops(device, t.peak_tflops))
    balance = dataset.balance()  # of the epoch this run starts in
    metrics.update({"attention_imbalance": balance["max"]})
    stream = batches(dataset, cfg.data.num_workers, cfg.data.prefetch_factor, device.type == "cuda")

    # -- steps ---------------------------------------------------------------------------
    totals = {"tokens": 0.0, "effective": 0.0, "samples": 0.0, "seconds": 0.0, "flops": 0.0, "timed_steps": 0}
    sm_readings: list[float] = []
    loss_value = float("nan")
    start_step = step
    while step < t.max_steps:
        clock = Stopwatch()
        micro = [next(stream) for _ in range(t.grad_accum)]
        data_wait = clock.lap()
        global_tokens = global_label_tokens(sum(b["num_label_tokens"] for b in micro), device)

        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, batch in enumerate(micro):
            with distributed.set_grad_sync(model, i == len(micro) - 1):
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    result = model(move_batch(batch, device, dtype))
                micro_batch_objective(result["loss_sum"], global_tokens, env.world_size).backward()
            loss_sum += result["loss_sum"].detach().double()
        if t.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for batch in micro:
            dataset.mark_consumed(batch)
        step += 1

        loss_value = distributed.all_reduce_sum(float(loss_sum), device) / max(global_tokens, 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = clock.lap() + data_wait
        local = {
            "tokens": float(sum(b["padded_tokens"] for b in micro)),
            "effective": float(sum(b["num_tokens"] for b in micro)),
            "samples": float(sum(len(b["seq_lens"]) for b in micro)),
            "flops": float(sum(step_flops(shape, b) for b in micro)),
        }
        recorded = metrics.update(
            {
                "tokens_per_second": local["tokens"] / step_time,
                "effective_tokens_per_second": local["effective"] / step_time,
                "padding_ratio": 1.0 - local["effective"] / local["tokens"],
                "samples_per_second": local["samples"] / step_time,
                "step_seconds": step_time,
                "loss": loss_value,
                "learning_rate": scheduler.get_last_lr()[0],
                "data_wait_seconds": data_wait,
                "step": float(step),
                "flops_per_second": local["flops"] / step_time,
            }
        )
        # The first step of a run pays for warm-up (allocator, kernels, workers); leave it out of rates.
        if step > start_step + 1 or t.max_steps - start_step == 1:
            for key in ("tokens", "effective", "samples", "flops"):
                totals[key] += distributed.all_reduce_sum(local[key], device)
            totals["seconds"] += distributed.all_reduce_max(step_time, device)
            totals["timed_steps"] += 1
            if "gpu_sm_utilization" in recorded:
                sm_readings.append(recorded["gpu_sm_utilization"])
        if env.is_main and step % t.log_every == 0:
            log(json.dumps({"event": "step", **{k: _round(v) for k, v in recorded.items()}}))
        if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.max_steps:
            checkpoint.save(
                out,
                step,
                model,
                optimizer,
                scheduler,
                {"data": dataset.state_dict()},
                env,
                t.keep_checkpoints,
            )

    # -- end -----------------------------------------------------------------------------
    # A rerun that found every step done has nothing new to save, and re-saving would delete and
    # rewrite the checkpoint it resumed from (the only one with keepCheckpoints: 1).
    if t.checkpoint_at_end and step > start_step:
        checkpoint.save(
            out, step, model, optimizer, scheduler, {"data": dataset.state_dict()}, env, t.keep_checkpoints
        )
    final = checkpoint.save_hf(out / "final", model, hf, cfg.model.path, env, dtype) if t.save_final else None
    seconds = max(totals["seconds"], 1e-9)
    peak = metrics.peak
    summary = {
        "steps": step,
        "steps_this_run": step - start_step,
        "tokens": int(totals["tokens"]),
        "effective_tokens": int(totals["effective"]),
        "tokens_per_second": totals["tokens"] / seconds,
        "effective_tokens_per_second": totals["effective"] / seconds,
        "samples_per_second": totals["samples"] / seconds,
        "padding_ratio": 1.0 - totals["effective"] / totals["tokens"] if totals["tokens"] else 0.0,
        "final_loss": loss_value,
        "model_flops_per_effective_token": totals["flops"] / totals["effective"]
        if totals["effective"]
        else None,
        "mfu": totals["flops"] / seconds / (peak * 1e12) / env.world_size if peak else None,
        "mode": t.mode,
        "attention": backend,
        "world_size": env.world_size,
        "attention_imbalance_max": balance["max"],
        "resumed_from": str(resumed_from) if resumed_from else None,
        "final_model": str(final) if final else None,
    }
    if device.type == "cuda":
        summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    if sm_readings:
        summary["gpu_sm_utilization_mean"] = sum(sm_readings) / len(sm_readings)
    return summary


def _round(v: float) -> float:
    return float(f"{v:.6g}")
