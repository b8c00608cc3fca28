"""The training recipe: setup, then for each step: batch, forward, loss, backward, optimizer, log.

One optimizer step = `gradAccum` micro-batches per rank. Before any forward,
the step's label tokens are counted over every micro-batch of every rank, and
each micro-batch backwards `sum(token losses) * world / N_global`, so the step's
gradient is that of the global token mean whatever the packing, accumulation
or world size (see `loss`). The order of the data is `sampler`'s epoch plan;
throughput, MFU and the summary are `accounting`'s; what is printed is `progress`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from packtrain.trainer import checkpoint, distributed, lora, param_groups
from packtrain.trainer.accounting import RunAccounting
from packtrain.trainer.attention import resolve_attention
from packtrain.trainer.config import DEFAULT_MAX_STEPS, SFTSpecCore
from packtrain.trainer.data import EvalDataset, PackedDataset, eval_dataset
from packtrain.trainer.data import loader as data_loader
from packtrain.trainer.evaluate import due, evaluate
from packtrain.trainer.loss import global_label_tokens, micro_batch_objective
from packtrain.trainer.media import PixelSpec
from packtrain.trainer.metrics import ModelShape, Stopwatch, TrainMetrics, device_peak_tflops
from packtrain.trainer.model import (
    VLMForTraining,
    apply_layer_options,
    build_model,
    checked_spec,
    load_config,
    move_batch,
    parameter_groups,
)
from packtrain.trainer.progress import JsonLines, Reporter
from packtrain.trainer.sampler import imbalance, plan_epoch, total_steps


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
    """Micro-batches forever, epoch after epoch, starting at the dataset's saved position."""
    while True:
        yield from data_loader(dataset, num_workers, prefetch, pin)


@dataclass
class Run:
    """Everything setup builds for the steps: data, model, optimizer and where the run starts."""

    dataset: PackedDataset
    hf: Any  # the Hugging Face model (for the export)
    model: torch.nn.Module  # what trains: VLMForTraining, wrapped by DDP/FSDP when distributed
    shape: ModelShape
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    dtype: torch.dtype
    backend: str
    imbalance_max: float  # attention-cost imbalance of the epoch this run starts in
    max_steps: int  # training.maxSteps, or epochs x steps per epoch
    evaluation: EvalDataset | None  # the evaluation set, if any
    step: int = 0
    resumed_from: Path | None = None
    adapter: Any = None  # the PeftModel around `hf` with model.lora (for the adapter export)


def train(
    cfg: SFTSpecCore, log: Callable[[str], None] = print, reporter: Reporter | None = None
) -> dict[str, Any]:
    """Run the job described by `cfg` in this process (one rank); returns the summary.

    Rank 0 reports progress to `reporter` (default: JSON lines through `log`)."""
    env = distributed.environ()
    device = distributed.pick_device(env)
    distributed.init(env, device)
    report = reporter or JsonLines(log, cfg.training.log_every)
    try:
        return _train(cfg, env, device, report if env.is_main else JsonLines(lambda _: None))
    finally:
        report.close()
        distributed.shutdown()


def setup(cfg: SFTSpecCore, env: distributed.DistEnv, device: torch.device) -> Run:
    """Data first (a folder that is not a pack, or too small a pack, fails before the model), then
    the model, the optimizer and schedule, and the checkpoint to resume from."""
    t = cfg.training
    if cfg.data.path is None:
        raise ValueError(
            f"data.packJobRef {cfg.data.pack_job_ref!r} must be resolved to data.path (the operator does)"
        )
    torch.manual_seed(t.seed)
    dtype = resolve_dtype(t.dtype, device)
    backend = resolve_attention(t.attention, device, dtype=dtype)
    config = load_config(cfg.model.path, cfg.model.config_overrides)
    spec = checked_spec(cfg.model.path, config, cfg.model.family)

    pad_id = config.text_config.pad_token_id
    dataset = PackedDataset(
        cfg.data.path,
        spec,
        PixelSpec.from_vision(spec.vision),
        rank=env.rank,
        world_size=env.world_size,
        units_per_micro_batch=t.micro_batch_sequences if t.mode == "packed" else t.padded_batch_size,
        grad_accum=t.grad_accum,
        seed=t.seed,
        mode=t.mode,
        pad_token_id=pad_id,
        # One process per node reads every shard to check it; its peers share that filesystem.
        verify_checksums=cfg.data.verify_checksums and env.local_rank == 0,
        vocab_size=config.text_config.vocab_size,
        eval_fraction=cfg.data.eval_fraction,
    )
    pack_family = dataset.manifest.get("family")
    if pack_family not in (None, spec.family.name):
        raise ValueError(f"the pack was made for {pack_family} but the model is {spec.family.name}")
    lay = dataset.layout
    # Planning epoch 0 raises when the pack holds less than one global step.
    first_plan = plan_epoch(dataset.costs, lay.world_size, lay.units_per_rank, lay.seed, 0)
    max_steps = total_steps(t.max_steps, t.epochs, lay, DEFAULT_MAX_STEPS)
    evaluation = eval_dataset(dataset, cfg.data)

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
    # LoRA first: it sets requires_grad (only adapters train) before freezing, DDP/FSDP and the optimizer.
    adapter = lora.apply(hf, cfg.model.lora, cfg.model.path) if cfg.model.lora else None
    apply_layer_options(hf, t.activation_checkpointing, t.vision_checkpointing, t.compile)
    param_groups.freeze(hf, cfg.model.freeze)  # after anything setting requires_grad, before DDP/FSDP
    core = VLMForTraining(
        hf, backend, always_run_vision=env.distributed, loss_chunk_tokens=t.loss_chunk_tokens
    ).to(device)
    shape = ModelShape.from_model(hf, parameter_groups(core))
    model = distributed.parallelize(core, t.strategy, env, device, compute_dtype=dtype)

    optimizer = torch.optim.AdamW(
        param_groups.optimizer_groups(model, t.lr, t.weight_decay, t.lr_multipliers)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.warmup, max_steps))
    step = 0
    resumed_from = checkpoint.latest(Path(t.output_dir)) if t.resume else None
    if resumed_from is not None:
        state = checkpoint.load(resumed_from, model, optimizer, scheduler, env)
        step = int(state["step"])
        dataset.load_state_dict(state["data"])
    epoch = dataset.position.epoch
    plan = (
        plan_epoch(dataset.costs, lay.world_size, lay.units_per_rank, lay.seed, epoch)
        if epoch
        else first_plan
    )
    return Run(
        dataset=dataset,
        hf=hf,
        model=model,
        shape=shape,
        optimizer=optimizer,
        scheduler=scheduler,
        dtype=dtype,
        backend=backend,
        imbalance_max=imbalance(plan, dataset.costs)["max"],
        max_steps=max_steps,
        evaluation=evaluation,
        step=step,
        resumed_from=resumed_from,
        adapter=adapter,
    )


def _train(
    cfg: SFTSpecCore, env: distributed.DistEnv, device: torch.device, report: Reporter
) -> dict[str, Any]:
    t = cfg.training
    out = Path(t.output_dir)
    run = setup(cfg, env, device)
    dataset, model, optimizer, scheduler, dtype = (
        run.dataset,
        run.model,
        run.optimizer,
        run.scheduler,
        run.dtype,
    )
    if run.resumed_from is not None:
        report.event("resumed", checkpoint=str(run.resumed_from), step=run.step)
    metrics = TrainMetrics(
        env.rank, device, None if t.metrics_port is None else t.metrics_port + env.local_rank
    )
    metrics.enable_mfu(device_peak_tflops(device, t.peak_tflops))
    metrics.info(attention=run.backend, mode=t.mode)
    metrics.update({"attention_imbalance": run.imbalance_max})
    accounting = RunAccounting(metrics, run.shape, device, env.world_size, run.step, run.max_steps)
    stream = batches(dataset, cfg.data.num_workers, cfg.data.prefetch_factor, device.type == "cuda")
    report.start(
        run.step,
        run.max_steps,
        mode=t.mode,
        attention=run.backend,
        world_size=env.world_size,
        epochs=t.epochs,
        steps_per_epoch=dataset.steps_per_epoch(),
        eval_units=_units(run.evaluation),
    )

    loss = float("nan")
    while run.step < run.max_steps:
        # batch: this step's micro-batches, and its label tokens over every rank
        clock = Stopwatch()
        micro = [next(stream) for _ in range(t.grad_accum)]
        data_wait = clock.lap()
        global_tokens = global_label_tokens(sum(b["num_label_tokens"] for b in micro), device)

        # forward, loss, backward: each micro-batch's share of the global token mean
        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, batch in enumerate(micro):
            with distributed.set_grad_sync(model, i == len(micro) - 1):
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    result = model(move_batch(batch, device, dtype))
                micro_batch_objective(result["loss_sum"], global_tokens, env.world_size).backward()
            loss_sum += result["loss_sum"].detach().double()

        # optimizer (a step whose batches hold no media on any rank ran the vision tower on dummies
        # only: its zero gradients are dropped, so it is not updated, as when training alone)
        if env.distributed and distributed.all_reduce_sum(_media_batches(micro), device) == 0:
            _drop_grads(run.hf.model.visual)
        if t.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for batch in micro:
            dataset.mark_consumed(batch)
        run.step += 1

        # log
        loss = distributed.all_reduce_sum(float(loss_sum), device) / max(global_tokens, 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = clock.lap() + data_wait
        record = accounting.step(run.step, micro, loss, param_groups.base_lr(optimizer), data_wait, step_time)
        if run.evaluation is not None and due(run.step, run.max_steps, t.eval_every):
            record["eval_loss"] = accounting.evaluated(
                evaluate(model, run.evaluation, device, dtype, cfg.data.num_workers, cfg.data.prefetch_factor)
            )
        report.step(record)
        if t.checkpoint_every and run.step % t.checkpoint_every == 0 and run.step < run.max_steps:
            _save(out, run, env, t.keep_checkpoints)

    # A rerun that found every step done has nothing new to save, and re-saving would delete and
    # rewrite the checkpoint it resumed from (the only one with keepCheckpoints: 1).
    if t.checkpoint_at_end and run.step > accounting.start_step:
        _save(out, run, env, t.keep_checkpoints)
    final = (
        checkpoint.save_final(out, model, run.hf, run.adapter, cfg.model, env, dtype)
        if t.save_final
        else None
    )
    return accounting.summary(
        run.step,
        loss,
        mode=t.mode,
        attention=run.backend,
        attention_imbalance_max=run.imbalance_max,
        resumed_from=str(run.resumed_from) if run.resumed_from else None,
        final_model=str(final) if final else None,
        steps_per_epoch=dataset.steps_per_epoch(),
        eval_units=_units(run.evaluation),
    )


def _media_batches(micro: list[dict[str, Any]]) -> int:
    return sum(b.get("pixel_values") is not None or b.get("pixel_values_videos") is not None for b in micro)


def _drop_grads(module: torch.nn.Module) -> None:
    """No gradient rather than a zero one: AdamW then leaves the parameters and their moments alone."""
    for p in module.parameters():
        p.grad = None


def _units(evaluation: EvalDataset | None) -> int:
    return 0 if evaluation is None else len(evaluation.units)


def _save(out: Path, run: Run, env: distributed.DistEnv, keep: int) -> Path:
    return checkpoint.save(
        out, run.step, run.model, run.optimizer, run.scheduler, {"data": run.dataset.state_dict()}, env, keep
    )
