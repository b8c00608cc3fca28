"""A collated micro-batch: the model's inputs under transformers' names, and the bookkeeping beside them.

As with transformers' `DataCollatorWithFlattening`, `ModelInputs` holds exactly what the forward
reads (and only it goes to the device); `BatchInfo` holds what the loss normaliser, the FLOPs and
throughput accounting, per-sample checks and the resume position need. The two never mix, so a
count cannot reach the model and a tensor the model needs cannot stay on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


def _map_tensors(obj: T, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> T:
    """A copy of dataclass `obj` with `fn(name, tensor)` applied to each tensor field."""
    changes = {
        f.name: fn(f.name, value)
        for f in dataclasses.fields(obj)  # type: ignore[arg-type]
        if isinstance(value := getattr(obj, f.name), torch.Tensor)
    }
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


@dataclass
class ModelInputs:
    """What `VLMForTraining.forward` reads. Packed: one (1, T) row with varlen boundaries; padded
    baseline: (B, L) rows with a padding mask. Media tensors are None when the batch has none."""

    input_ids: torch.Tensor
    labels: torch.Tensor  # as stored in the pack
    shift_labels: torch.Tensor  # next-token targets that never cross a sample boundary
    # Packed (4, 1, T): the text row restarting per sample, then per-sample mRoPE; padded (3, B, L).
    # A 1-D family (InternVL): packed (1, T), restarting per sample; padded (B, L).
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None  # padded only: (B, L), 1 on real tokens
    cu_seq_lens: torch.Tensor | None = None  # packed only: sub-sample boundaries (int32, n + 1)
    max_length: int | None = None  # packed only: the longest sub-sample
    # Image patches in order of appearance; a tiled family: (N, 3, tile, tile), images' and videos' tiles.
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None  # videos of time-scaled-rope families
    # Images per sub-sample (packed) or per row (padded), in order: a family whose tower output
    # depends on the images sharing its call (`Family.vision_groups_by_sample`) applies that per group.
    image_groups: torch.Tensor | None = None

    @property
    def has_media(self) -> bool:
        return self.pixel_values is not None or self.pixel_values_videos is not None

    def to(self, device: torch.device, dtype: torch.dtype) -> ModelInputs:
        """Tensors to `device` (non-blocking); pixel tensors to the compute dtype."""

        def move(name: str, value: torch.Tensor) -> torch.Tensor:
            value = value.to(device, non_blocking=True)
            return value.to(dtype) if name.startswith("pixel_values") else value

        return _map_tensors(self, move)


@dataclass
class BatchInfo:
    """The bookkeeping of a micro-batch: what was collated, and where it sits in the epoch."""

    seq_lens: list[int]  # tokens of each sub-sample (padded: of each row before padding)
    sample_ids: list[str]
    sample_index: torch.Tensor  # token -> its sub-sample, over the flattened rows
    num_tokens: int  # real tokens
    num_label_tokens: int  # tokens with a target: the loss normaliser's share
    padded_tokens: int  # token slots the model computes, padding included
    attention_cost: int  # Σ of squared attended lengths
    position: tuple[int, int] | None = None  # (epoch, micro-batch index), set by the dataset
    counted: bool = True  # evaluation: false on the repeats that only even out the ranks' forwards


@dataclass
class Batch:
    """One micro-batch as the DataLoader hands it over."""

    inputs: ModelInputs
    info: BatchInfo

    def pin_memory(self) -> Batch:
        """Page-locked copies of every tensor (the DataLoader calls this with `pin_memory=True`)."""
        return Batch(
            _map_tensors(self.inputs, lambda _, t: t.pin_memory()),
            _map_tensors(self.info, lambda _, t: t.pin_memory()),
        )
