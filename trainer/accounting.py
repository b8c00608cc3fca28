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
from dataclasses import dataclass
from typing import Any

import torch

from packtrain.core.contract import TrainSummary
from packtrain.core.model_folder import family_for_model_type
from packtrain.trainer.data.batch import Batch
from packtrain.trainer.distributed import all_reduce_max, all_reduce_sum
from packtrain.trainer.metrics import ModelShape, TrainMetrics, step_flops

TOTALS = ("tokens", "effective", "samples", "flops")


@dataclass(frozen=True)
class TiledShape:
    """A tiled family's (InternVL's) FLOPs shape: the decoder as `ModelShape` (its vision terms zero),
    and the tower and projector per 448-pixel tile, the unit its pixels come in."""

    llm: ModelShape
    vision_params: int  # InternViT: embeddings, layers (the projector apart)
    projector_params: int
    vision_depth: int
    vision_dim: int
    tile_tokens: int  # through the tower: (image_size / patch_size)² patches + the cls token
    tile_merged: int  # into the decoder: after the pixel shuffle
    vision_factor: float  # FLOPs per parameter and token, as `ModelShape`'s (2: frozen, forward only)
    projector_factor: float


def _part_factor(params: list[torch.nn.Parameter]) -> float:
    """`metrics._factor` of one part: 2 forward only when none trains, else 4 + 2 x the trainable share."""
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return 2.0 if trainable == 0 else 4.0 + 2.0 * trainable / max(total, 1)


def model_shape(hf: Any) -> ModelShape | TiledShape:
    """The FLOPs shape of the Hugging Face model `hf` (LoRA and freezing applied): InternVL's tiled
    tower counted per tile, every other family's by `ModelShape.from_model`."""
    from packtrain.trainer.model.build import parameter_groups  # the model package loads on use

    if family_for_model_type(getattr(hf.config, "model_type", None)).vision_input != "tiles":
        return ModelShape.from_model(hf, parameter_groups(hf))
    text, vision = hf.config.text_config, hf.config.vision_config
    tower, projector = (
        list(hf.model.vision_tower.parameters()),
        list(hf.model.multi_modal_projector.parameters()),
    )
    layers = list(hf.model.language_model.layers.parameters())
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    llm = ModelShape(
        llm_params=sum(p.numel() for p in layers),
        lm_head_params=hf.lm_head.weight.numel(),
        vision_params=0,
        layers=text.num_hidden_layers,
        attn_dim=text.num_attention_heads * head_dim,
        vision_depth=0,
        vision_dim=0,
        spatial_merge=1,
        vision_full_layers=0,
        vision_window=0,
        full_attention_layers=text.num_hidden_layers,
        linear_attention_layers=0,
        linear_flops_per_token=0.0,
        llm_factor=_part_factor(layers),
    )
    grid, merge = vision.image_size[0] // vision.patch_size[0], round(1 / hf.config.downsample_ratio)
    return TiledShape(
        llm=llm,
        vision_params=sum(p.numel() for p in tower),
        projector_params=sum(p.numel() for p in projector),
        vision_depth=vision.num_hidden_layers,
        vision_dim=vision.hidden_size,
        tile_tokens=grid * grid + 1,
        tile_merged=(grid // merge) ** 2,
        vision_factor=_part_factor(tower),
        projector_factor=_part_factor(projector),
    )


def vision_flops(shape: TiledShape, tiles: int) -> float:
    """Training FLOPs of `tiles` tiles: the tower's matmuls per token, its full (non-causal) attention
    within each tile (4 forward, x3 when it trains), the projector per decoder token."""
    attn_factor = 4.0 if shape.vision_factor == 2.0 else 12.0
    tower = shape.vision_factor * shape.vision_params * shape.tile_tokens
    attention = attn_factor * shape.vision_depth * shape.vision_dim * shape.tile_tokens**2
    projector = shape.projector_factor * shape.projector_params * shape.tile_merged
    return float(tiles) * (tower + attention + projector)


def batch_tiles(batch: Batch) -> int:
    """The tiles (image tiles, thumbnails and video frames) of a tiled family's micro-batch: the rows
    of its (tiles, channels, height, width) pixels."""
    return sum(
        int(v.shape[0])
        for v in (batch.inputs.pixel_values, batch.inputs.pixel_values_videos)
        if v is not None and v.dim() == 4
    )


def micro_batch_flops(shape: ModelShape | TiledShape, batch: Batch) -> float:
    if isinstance(shape, TiledShape):
        return step_flops(shape.llm, batch) + vision_flops(shape, batch_tiles(batch))
    return step_flops(shape, batch)


def batch_counts(shape: ModelShape | TiledShape, micro: Sequence[Batch]) -> dict[str, float]:
    """Token slots (with padding), real tokens, samples and model FLOPs of one step's micro-batches."""
    return {
        "tokens": float(sum(b.info.padded_tokens for b in micro)),
        "effective": float(sum(b.info.num_tokens for b in micro)),
        "samples": float(sum(len(b.info.seq_lens) for b in micro)),
        "flops": float(sum(micro_batch_flops(shape, b) for b in micro)),
    }


class RunAccounting:
    """Turns each finished step into its recorded metrics, and the run into its summary."""

    def __init__(
        self,
        metrics: TrainMetrics,
        shape: ModelShape | TiledShape | None,  # None: a run that steps no more (its summary only)
        device: torch.device,
        world_size: int,
        start_step: int,
        max_steps: int,
        share: float = 1.0,
    ) -> None:
        self.metrics, self.shape, self.device, self.world_size = metrics, shape, device, world_size
        # The part of each micro-batch this rank computes: 1 / contextParallel (a group shares its rows).
        self.share = share
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
        local = {key: value * self.share for key, value in batch_counts(self.shape, micro).items()}
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
            tokens=round(t["tokens"]),
            effective_tokens=round(t["effective"]),
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
