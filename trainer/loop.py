"""The training recipe: `setup` (see `recipe`), then for each step: batch, `train_step`, log, checkpoint.

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
from pathlib import Path
from typing import Any

import torch

from packtrain.core.contract import TrainSummary
from packtrain.core.progress import METRICS_PORT_EVENT, JsonLines, Reporter
from packtrain.core.sft_config import SFTSpecCore, TrainingSpec
from packtrain.trainer import distributed, non_finite
from packtrain.trainer.accounting import RunAccounting
from packtrain.trainer.data.batch import Batch
from packtrain.trainer.data.packed import EvalDataset, PackedDataset
from packtrain.trainer.data.packed import loader as data_loader
from packtrain.trainer.evaluate import due, evaluate
from packtrain.trainer.metrics import Stopwatch, TrainMetrics, device_peak_tflops
from packtrain.trainer.model import param_groups
from packtrain.trainer.model.linear_attention import linear_path
from packtrain.trainer.model.loss import aux_objective, global_label_tokens, micro_batch_objective
from packtrain.trainer.model.parts import vision_side
from packtrain.trainer.recipe import Finished, Run, setup
from packtrain.trainer.state import checkpoint, export, output


def batches(dataset: PackedDataset, num_workers: int, prefetch: int, pin: bool) -> Iterator[Batch]:
    """Micro-batches forever, epoch after epoch, starting at the dataset's saved position."""
    while True:
        yield from data_loader(dataset, num_workers, prefetch, pin)


def train(
    cfg: SFTSpecCore, log: Callable[[str], None] = print, reporter: Reporter | None = None
) -> TrainSummary:
    """Run the job described by `cfg` in this process (one rank); returns the summary.

    Rank 0 reports progress to `reporter` (default: JSON lines through `log`)."""
    env = distributed.environ()
    device = distributed.pick_device(env)
    distributed.init(env, device)
    report = reporter or JsonLines(log, cfg.training.log_every)
    try:
        with output.claimed(Path(cfg.training.output_dir), env, device):  # one run per output folder
            return _train(cfg, env, device, report if env.is_main else JsonLines(lambda _: None))
    finally:
        report.close()
        distributed.shutdown()


def train_step(
    run: Run, micro: list[Batch], env: distributed.DistEnv, device: torch.device, t: TrainingSpec
) -> float:
    """One optimizer step over this rank's micro-batches; returns the step's loss (the global token mean)."""
    model, dtype = run.model, run.dtype
    # The step's label tokens over every rank: each micro-batch's share of the global token mean.
    # The ranks of a context group all count their shared rows: each row once.
    global_tokens = global_label_tokens(sum(b.info.num_label_tokens for b in micro), device) // run.mesh.size

    # forward, loss, backward (gradients are synchronized on the last micro-batch only)
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(micro):
        with distributed.set_grad_sync(model, i == len(micro) - 1):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                result = model(batch.inputs.to(device, dtype))
            objective = micro_batch_objective(result["loss_sum"], global_tokens, env.world_size)
            if "aux_loss" in result:  # mixture of experts: the router's load-balancing term
                coef = run.hf.config.text_config.router_aux_loss_coef
                label_tokens = batch.info.num_label_tokens
                objective = objective + aux_objective(
                    result["aux_loss"], coef, label_tokens, global_tokens, env.world_size
                )
            objective.backward()
        loss_sum += result["loss_sum"].detach().double()

    # optimizer (a step whose batches hold no media on any rank ran the vision tower on dummies
    # only: its zero gradients are dropped, so it is not updated, as when training alone)
    if env.distributed and distributed.all_reduce_sum(_media_batches(micro), device) == 0:
        for module in vision_side(run.hf):
            _drop_grads(module)
    loss = distributed.all_reduce_sum(float(loss_sum), device) / max(global_tokens, 1)
    norm = non_finite.grad_norm(model, t.max_grad_norm)
    if math.isfinite(loss) and math.isfinite(norm):
        run.optimizer.step()
    else:  # not applied: a NaN update would spread into every weight AdamW touches
        run.skipped = non_finite.skip_or_stop(
            run.hf, run.step + 1, loss, norm, run.skipped, t.max_non_finite_steps
        )
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss


def _train(
    cfg: SFTSpecCore, env: distributed.DistEnv, device: torch.device, report: Reporter
) -> TrainSummary:
    t, data = cfg.training, cfg.data
    out = Path(t.output_dir)
    run = setup(cfg, env, device)
    if isinstance(run, Finished):  # a rerun of a finished run: nothing was built, nothing trains
        return _finished_summary(run, cfg, env, device)
    non_finite.check_weights(run.hf, f"at step {run.step}, where the run starts")
    accounting = _start(run, cfg, env, device, report)
    stream = batches(run.dataset, data.num_workers, data.prefetch_factor, device.type == "cuda")
    loss = float("nan")
    while run.step < run.max_steps:
        clock = Stopwatch()
        micro = [next(stream) for _ in range(t.grad_accum)]
        data_wait = clock.lap()
        loss = train_step(run, micro, env, device, t)
        for batch in micro:
            run.dataset.mark_consumed(batch)
        run.step += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = clock.lap() + data_wait
        record = accounting.step(
            run.step, micro, loss, param_groups.base_lr(run.optimizer), data_wait, step_time
        )
        if run.evaluation is not None and due(run.step, run.max_steps, t.eval_every):
            eval_loss = evaluate(
                run.model, run.evaluation, device, run.dtype, data.num_workers, data.prefetch_factor,
                context_parallel=run.mesh.size,
            )  # fmt: skip
            record["eval_loss"] = accounting.evaluated(eval_loss)
        report.step(record)
        if t.checkpoint_every and run.step % t.checkpoint_every == 0 and run.step < run.max_steps:
            _save(out, run, env, t.keep_checkpoints)
    return _finish(run, cfg, env, accounting, loss)


def _start(
    run: Run, cfg: SFTSpecCore, env: distributed.DistEnv, device: torch.device, report: Reporter
) -> RunAccounting:
    """The gauges and the accounting of the run, and its start reported."""
    t = cfg.training
    if run.resumed_from is not None:
        report.event("resumed", checkpoint=str(run.resumed_from), step=run.step)
    wanted = None if t.metrics_port is None else t.metrics_port + env.local_rank
    metrics = TrainMetrics(env.rank, device, wanted)
    if metrics.port != wanted:  # taken, and `packtrain run` allowed another (METRICS_ANY_PORT)
        report.event(METRICS_PORT_EVENT, wanted=wanted, port=metrics.port)
    metrics.enable_mfu(device_peak_tflops(device, t.peak_tflops))
    # Hybrid decoders: how the linear-attention layers keep samples apart (fla kernels or per sample).
    linear = linear_path(run.hf)
    chosen = {"attention": run.backend, **({"linear_attention": linear} if linear else {})}
    metrics.info(mode=t.mode, **chosen)
    metrics.update({"attention_imbalance": run.imbalance_max})
    report.start(
        run.step,
        run.max_steps,
        mode=t.mode,
        **chosen,
        world_size=env.world_size,
        **({"context_parallel": run.mesh.size} if run.mesh.on else {}),
        init=run.init,
        epochs=t.epochs,
        steps_per_epoch=run.dataset.steps_per_epoch(),
        eval_units=_units(run.evaluation),
    )
    return RunAccounting(
        metrics, run.shape, device, env.world_size, run.step, run.max_steps, share=1 / run.mesh.size
    )


def _finish(
    run: Run, cfg: SFTSpecCore, env: distributed.DistEnv, accounting: RunAccounting, loss: float
) -> TrainSummary:
    """The last checkpoint and the final export, then the run's summary."""
    t, out = cfg.training, Path(cfg.training.output_dir)
    non_finite.check_end(run.hf, run.step, loss, run.step > accounting.start_step)  # else nothing is saved
    # A rerun that found every step done has nothing new to save, and re-saving would delete and
    # rewrite the checkpoint it resumed from (the only one with keepCheckpoints: 1).
    if t.checkpoint_at_end and run.step > accounting.start_step:
        _save(out, run, env, t.keep_checkpoints)
    # Nothing steps again: the AdamW moments (twice the trainable weights) are freed before the export
    # gathers its first unit, so the export's peak is the model's shard plus one unit, not that too.
    run.optimizer.state.clear()
    final = (
        export.save_final(
            out,
            run.model,
            run.hf,
            run.adapter,
            cfg.model,
            env,
            run.dtype,
            pack=run.dataset.manifest,
            step=run.step,
        )
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
        steps_per_epoch=run.dataset.steps_per_epoch(),
        eval_units=_units(run.evaluation),
        init=run.init,
    )


def _finished_summary(
    done: Finished, cfg: SFTSpecCore, env: distributed.DistEnv, device: torch.device
) -> TrainSummary:
    """The summary of a rerun that found every step done: no step ran (no totals, rates or loss); the
    model is the earlier run's export, if it saved one."""
    t, final = cfg.training, Path(cfg.training.output_dir) / "final"
    metrics = TrainMetrics(env.rank, device)  # not served: no step will update it
    accounting = RunAccounting(metrics, None, device, env.world_size, done.step, done.step)
    return accounting.summary(
        done.step,
        float("nan"),
        mode=t.mode,
        attention=done.backend,
        attention_imbalance_max=done.imbalance_max,
        resumed_from=str(done.checkpoint),
        final_model=str(final) if t.save_final else None,
        steps_per_epoch=done.dataset.steps_per_epoch(),
        eval_units=_units(done.evaluation),
        init=done.init,
    )


def _media_batches(micro: list[Batch]) -> int:
    return sum(b.inputs.has_media for b in micro)


def _drop_grads(module: torch.nn.Module) -> None:
    """No gradient rather than a zero one: AdamW then leaves the parameters and their moments alone."""
    for p in module.parameters():
        p.grad = None


def _units(evaluation: EvalDataset | None) -> int:
    return 0 if evaluation is None else len(evaluation.units)


def _save(out: Path, run: Run, env: distributed.DistEnv, keep: int) -> Path:
    state: dict[str, Any] = {"data": run.dataset.state_dict()}
    if run.config is not None:  # the settings a resume must match
        state |= {"config": run.config, "config_hash": checkpoint.config_hash(run.config)}
    return checkpoint.save(out, run.step, run.model, run.optimizer, run.scheduler, state, env, keep)
