"""Throughput and MFU accounting of a training run: per-step rates for the gauges and the log, run
totals for the final summary.

Kept beside the loop rather than in it, so the step reads as the recipe it is. Rates of one step
are this rank's; the totals are summed over ranks (tokens, FLOPs) and timed by the slowest rank,
which sets the pace of a synchronous step. The first step of a run pays for warm-up (allocator,
kernels, loader workers) and is left out of the totals, unless it is the only one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from packtrain.core.contract import TrainSummary
from packtrain.trainer.data.batch import Batch
from packtrain.trainer.distributed import all_reduce_max, all_reduce_sum
from packtrain.trainer.metrics import ModelShape, TrainMetrics, step_flops

TOTALS = ("tokens", "effective", "samples", "flops")


def batch_counts(shape: ModelShape, micro: Sequence[Batch]) -> dict[str, float]:
    """Token slots (with padding), real tokens, samples and model FLOPs of one step's micro-batches."""
    return {
        "tokens": float(sum(b.info.padded_tokens for b in micro)),
        "effective": float(sum(b.info.num_tokens for b in micro)),
        "samples": float(sum(len(b.info.seq_lens) for b in micro)),
        "flops": float(sum(step_flops(shape, b) for b in micro)),
    }


class RunAccounting:
    """Turns each finished step into its recorded metrics, and the run into its summary."""

    def __init__(
        self,
        metrics: TrainMetrics,
        shape: ModelShape | None,  # None: a run that steps no more (its summary only)
        device: torch.device,
        world_size: int,
        start_step: int,
        max_steps: int,
    ) -> None:
        self.metrics, self.shape, self.device, self.world_size = metrics, shape, device, world_size
        self.start_step, self.max_steps = start_step, max_steps
        self.totals = dict.fromkeys(TOTALS, 0.0)
        self.seconds = 0.0
        self.sm_readings: list[float] = []
        self.eval_loss: float | None = None

    def step(
        self,
        step: int,
        micro: Sequence[Batch],
        loss: float,
        learning_rate: float,
        data_wait: float,
        step_time: float,
    ) -> dict[str, float]:
        """Record step `step` (1-based, just finished) in the gauges and totals; returns what was
        recorded (rates, loss, MFU and GPU readings), for the log. Every rank calls it: the totals
        are reduced over ranks."""
        if self.shape is None:
            raise ValueError("RunAccounting without a model shape only summarises, it counts no step")
        local = batch_counts(self.shape, micro)
        recorded = self.metrics.update(
            {
                "tokens_per_second": local["tokens"] / step_time,
                "effective_tokens_per_second": local["effective"] / step_time,
                "padding_ratio": 1.0 - local["effective"] / local["tokens"],
                "samples_per_second": local["samples"] / step_time,
                "step_seconds": step_time,
                "loss": loss,
                "learning_rate": learning_rate,
                "data_wait_seconds": data_wait,
                "step": float(step),
                "flops_per_second": local["flops"] / step_time,
            }
        )
        if step > self.start_step + 1 or self.max_steps - self.start_step == 1:
            for key in TOTALS:
                self.totals[key] += all_reduce_sum(local[key], self.device)
            self.seconds += all_reduce_max(step_time, self.device)
            if "gpu_sm_utilization" in recorded:
                self.sm_readings.append(recorded["gpu_sm_utilization"])
        return recorded

    def evaluated(self, eval_loss: float) -> float:
        """Record an evaluation's loss (gauge and summary); returns it, for the step's log line."""
        self.eval_loss = eval_loss
        self.metrics.update({"eval_loss": eval_loss})
        return eval_loss

    def summary(
        self,
        steps: int,
        final_loss: float,
        *,
        mode: str,
        attention: str,
        attention_imbalance_max: float,
        resumed_from: str | None,
        final_model: str | None,
        init: str,
        steps_per_epoch: int | None = None,
        eval_units: int = 0,
    ) -> TrainSummary:
        """The run's one-line result (the operator reads it from the termination message)."""
        t = self.totals
        seconds = max(self.seconds, 1e-9)
        peak = self.metrics.peak
        summary = TrainSummary(
            steps=steps,
            steps_this_run=steps - self.start_step,
            tokens=int(t["tokens"]),
            effective_tokens=int(t["effective"]),
            tokens_per_second=t["tokens"] / seconds,
            effective_tokens_per_second=t["effective"] / seconds,
            samples_per_second=t["samples"] / seconds,
            padding_ratio=1.0 - t["effective"] / t["tokens"] if t["tokens"] else 0.0,
            # None when no step ran (a resumed run already at its last step) or the loss is not finite:
            # NaN is not JSON, and the operator writes this value into the SFTJob's status.
            final_loss=final_loss if math.isfinite(final_loss) else None,
            eval_loss=self.eval_loss,
            eval_units=eval_units,
            steps_per_epoch=steps_per_epoch,
            epochs=steps / steps_per_epoch if steps_per_epoch else None,
            model_flops_per_effective_token=t["flops"] / t["effective"] if t["effective"] else None,
            mfu=t["flops"] / seconds / (peak * 1e12) / self.world_size if peak else None,
            mode=mode,
            attention=attention,
            world_size=self.world_size,
            attention_imbalance_max=attention_imbalance_max,
            resumed_from=resumed_from,
            final_model=final_model,
            init=init,
        )
        if self.device.type == "cuda":
            summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if self.sm_readings:
            summary["gpu_sm_utilization_mean"] = sum(self.sm_readings) / len(self.sm_readings)
        return summary
