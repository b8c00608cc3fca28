"""The data path: shard folder → this rank's micro-batches → model inputs.

`PackedDataset` is map-style over *this rank's* micro-batches of the current
epoch, in the order `sampler` plans: the DataLoader's workers take disjoint
indices, decode media in parallel and return collated tensors, and the main
process records how far it consumed (`state_dict`) so a resumed run restarts at
the exact next micro-batch. The collators are pure functions of rows that
already carry decoded pixels.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TypedDict

import numpy as np
import torch
from torch.utils.data import DataLoader

from packtrain.core.errors import MediaError, PackIntegrityError
from packtrain.core.model_spec import ModelSpec
from packtrain.core.pack.integrity import ModelFacts, grid_problem, ref_problem, row_problem
from packtrain.core.pack.schema import IGNORE_INDEX
from packtrain.core.pack.shards import ShardReader
from packtrain.core.pixels import pack_alpha
from packtrain.core.sft_config import DataSpec
from packtrain.trainer.data.batch import Batch, BatchInfo, ModelInputs
from packtrain.trainer.data.media import PixelSpec, media_pixels
from packtrain.trainer.data.rope import packed_positions, sample_positions
from packtrain.trainer.data.sampler import (
    Layout,
    Plan,
    Position,
    after,
    attention_cost,
    carve_eval,
    eval_micro_batches,
    plan_epoch,
    position_state,
    rank_micro_batches,
    resume_position,
    units_and_costs,
)


def shift_labels(labels: np.ndarray, seq_lens: Sequence[int]) -> np.ndarray:
    """Next-token targets per sub-sample: position t learns labels[t+1] of the *same* sample, and
    the last token of each sample learns nothing, so no sample's first label is predicted
    from the previous sample."""
    out = np.full_like(labels, IGNORE_INDEX)
    offset = 0
    for n in seq_lens:
        out[offset : offset + n - 1] = labels[offset + 1 : offset + n]
        offset += n
    return out


class _Media(TypedDict, total=False):
    """The media fields of `ModelInputs` that a batch fills (those without media stay None)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_groups: torch.Tensor
    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor
    second_per_grid_ts: torch.Tensor


def _media_of(
    rows: Sequence[dict[str, Any]], kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rows' media of one kind, in order of appearance: (pixels, grids, seconds per grid)."""
    pixels, grids, spg = [], [], []
    for row in rows:
        media = row.get("media") or []
        decoded = row.get("pixels")
        if media and (decoded is None or len(decoded) != len(media)):
            raise ValueError("rows with media must carry decoded `pixels` (one tensor per media ref)")
        for ref, px in zip(media, decoded or [], strict=False):
            if ref["kind"] == kind:
                pixels.append(px)
                grids.append([int(ref["grid_t"]), int(ref["grid_h"]), int(ref["grid_w"])])
                spg.append(float(ref.get("second_per_grid") or 1.0))
    if not pixels:
        return None
    return torch.cat(pixels), torch.tensor(grids, dtype=torch.long), torch.tensor(spg, dtype=torch.float32)


def _tiles_in_order(rows: Sequence[dict[str, Any]]) -> _Media:
    """A tiled family's media: every image's and video's tiles in one `pixel_values`, in order of
    appearance, with one grid per media item (as InternVLProcessor merges videos into its
    `pixel_values`): images and video frames fill the same `<IMG_CONTEXT>` runs, in that order."""
    pixels, grids = [], []
    for row in rows:
        media, decoded = row.get("media") or [], row.get("pixels") or []
        if len(decoded) != len(media):
            raise ValueError("rows with media must carry decoded `pixels` (one tensor per media ref)")
        for ref, px in zip(media, decoded, strict=True):
            pixels.append(px)
            grids.append([int(ref["grid_t"]), int(ref["grid_h"]), int(ref["grid_w"])])
    if not pixels:
        return {}
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}


def _images_per_sample(rows: Sequence[dict[str, Any]]) -> torch.Tensor:
    """How many images each sub-sample of `rows` holds, in order (a padded row is one sub-sample):
    the groups a tower whose output depends on its call's images takes them in."""
    counts = []
    for row in rows:
        samples = [int(m["sample"]) for m in row.get("media") or [] if m["kind"] == "image"]
        if samples != sorted(samples):
            raise ValueError(f"a row's images are not in sample order: {samples[:20]}")
        counts += [samples.count(k) for k in range(len(row.get("seq_lens") or [1]))]
    return torch.tensor(counts, dtype=torch.long)


def _media_tensors(rows: Sequence[dict[str, Any]], spec: ModelSpec) -> _Media:
    if spec.family.vision_input == "tiles":
        return _tiles_in_order(rows)
    out: _Media = {}
    image = _media_of(rows, "image")
    if image is not None:
        out["pixel_values"], out["image_grid_thw"], _ = image
        if spec.family.vision_groups_by_sample:
            out["image_groups"] = _images_per_sample(rows)
    video = _media_of(rows, "video")
    if video is not None:
        out["pixel_values_videos"], out["video_grid_thw"], seconds = video
        if spec.family.time_scaled_rope:
            out["second_per_grid_ts"] = seconds
    return out


def collate_packed(rows: Sequence[dict[str, Any]], spec: ModelSpec) -> Batch:
    """Packed sequences (SEQUENCE_SCHEMA rows + decoded `pixels`) → one (1, T) row for the model:
    varlen boundaries instead of a mask (see `ModelInputs`), and the bookkeeping counts. `spec`
    is the model folder's facts (`core.model_spec`)."""
    ids_parts, label_parts, shift_parts, pos_parts, lens = [], [], [], [], []
    sample_ids: list[str] = []
    for row in rows:
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        labels = np.asarray(row["labels"], dtype=np.int64)
        seq_lens = [int(n) for n in row["seq_lens"]]
        if len(labels) != len(ids) or sum(seq_lens) != len(ids) or min(seq_lens, default=1) < 1:
            raise ValueError(f"malformed row: {len(ids)} tokens, {len(labels)} labels, seq_lens {seq_lens}")
        media = row.get("media") or []
        per_sample = [[m for m in media if m["sample"] == k] for k in range(len(seq_lens))]
        ids_parts.append(ids)
        label_parts.append(labels)
        shift_parts.append(shift_labels(labels, seq_lens))
        pos_parts.append(packed_positions(ids, seq_lens, per_sample, spec))
        lens.extend(seq_lens)
        sample_ids.extend(row.get("sample_ids") or [f"?{i}" for i in range(len(seq_lens))])
    lens_t = torch.tensor(lens, dtype=torch.int64)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens_t, 0)
    shifted = torch.from_numpy(np.concatenate(shift_parts))[None]
    positions = torch.from_numpy(np.concatenate(pos_parts, axis=1))[:, None, :]
    inputs = ModelInputs(
        input_ids=torch.from_numpy(np.concatenate(ids_parts))[None],
        labels=torch.from_numpy(np.concatenate(label_parts))[None],
        shift_labels=shifted,
        position_ids=positions[0] if spec.family.positions == "1d" else positions,
        cu_seq_lens=cu,
        max_length=int(lens_t.max()),
        **_media_tensors(rows, spec),
    )
    info = BatchInfo(
        seq_lens=lens,
        sample_ids=sample_ids,
        sample_index=torch.repeat_interleave(torch.arange(len(lens)), lens_t),
        num_tokens=int(lens_t.sum()),
        num_label_tokens=int((shifted != IGNORE_INDEX).sum()),
        padded_tokens=int(lens_t.sum()),
        attention_cost=attention_cost(lens),
    )
    return Batch(inputs, info)


def split_row(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A packed sequence → its sub-samples as stand-alone rows (for the padded baseline)."""
    out, offset = [], 0
    pixels = row.get("pixels")
    for k, n in enumerate(row["seq_lens"]):
        keep = [i for i, m in enumerate(row.get("media") or []) if m["sample"] == k]
        sample = {
            "input_ids": list(row["input_ids"][offset : offset + n]),
            "labels": list(row["labels"][offset : offset + n]),
            "seq_lens": [n],
            "sample_ids": [row["sample_ids"][k]] if row.get("sample_ids") else [f"?{k}"],
            "media": [{**row["media"][i], "sample": 0} for i in keep],
        }
        if pixels is not None:
            sample["pixels"] = [pixels[i] for i in keep]
        out.append(sample)
        offset += n
    return out


def collate_padded(
    samples: Sequence[dict[str, Any]], spec: ModelSpec, pad_token_id: int | None = None
) -> Batch:
    """The baseline: one sample per row, right-padded to the longest in the batch, as common
    trainers do; positions are each sample's mRoPE (3, B, L) and a 2-D padding mask. Pads with
    `pad_token_id`, by default the tokenizer's pad token."""
    pad_token_id = spec.token_ids.pad if pad_token_id is None else pad_token_id
    lengths = [len(s["input_ids"]) for s in samples]
    width = max(lengths)
    b = len(samples)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.long)
    shifted = torch.full((b, width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    linear = spec.family.positions == "1d"
    pos = torch.ones((1 if linear else 3, b, width), dtype=torch.long)
    for i, s in enumerate(samples):
        n = lengths[i]
        sid = np.asarray(s["input_ids"], dtype=np.int64)
        lab = np.asarray(s["labels"], dtype=np.int64)
        media = s.get("media") or []
        ids[i, :n] = torch.from_numpy(sid)
        labels[i, :n] = torch.from_numpy(lab)
        shifted[i, :n] = torch.from_numpy(shift_labels(lab, [n]))
        mask[i, :n] = 1
        pos[:, i, :n] = torch.from_numpy(sample_positions(sid, media, spec))
    inputs = ModelInputs(
        input_ids=ids,
        labels=labels,
        shift_labels=shifted,
        position_ids=pos[0] if linear else pos,
        attention_mask=mask,
        **_media_tensors(samples, spec),
    )
    info = BatchInfo(
        seq_lens=lengths,
        sample_ids=[s["sample_ids"][0] for s in samples],
        sample_index=torch.arange(b)[:, None].expand(b, width).reshape(-1),
        num_tokens=sum(lengths),
        num_label_tokens=int((shifted != IGNORE_INDEX).sum()),
        padded_tokens=b * width,
        attention_cost=b * width * width,
    )
    return Batch(inputs, info)


class PackedDataset(torch.utils.data.Dataset):
    """This rank's micro-batches of one epoch, over a finished pack folder.

    Unit of work: a packed sequence (packed mode) or one sub-sample (padded mode); which units
    make up each micro-batch, and where a resumed run restarts, is `sampler`'s epoch plan. Item k
    is micro-batch `position.next + k` of `position.epoch`, so DataLoader workers decode disjoint
    micro-batches and the order does not depend on the number of workers.
    """

    def __init__(
        self,
        path: str | Path,
        spec: ModelSpec,
        pixel_spec: PixelSpec | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        units_per_micro_batch: int = 1,
        grad_accum: int = 1,
        seed: int = 0,
        mode: str = "packed",
        pad_token_id: int | None = None,
        verify_checksums: bool = True,
        vocab_size: int | None = None,
        eval_fraction: float = 0.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.path = Path(path)
        self.spec = spec
        self.rank = rank
        self.mode, self.vocab_size = mode, vocab_size
        self.pad_token_id = spec.token_ids.pad if pad_token_id is None else pad_token_id
        self.verify_checksums = verify_checksums
        self._reader: ShardReader | None = ShardReader(self.path, verify_checksums=verify_checksums)
        self.manifest = self._reader.manifest
        # Transparency is the pack's choice (its resized media were made with it), never the caller's.
        self.pixel_spec = dataclasses.replace(
            pixel_spec or PixelSpec.from_model(spec), alpha=pack_alpha(self.manifest)
        )
        self.seq_lens = self._reader.seq_lens()
        # Sequences held out as the evaluation set are never units of training.
        train, self.eval_sequences = carve_eval(len(self.seq_lens), eval_fraction, seed)
        self.units, self.costs = units_and_costs(self.seq_lens, mode, train)
        self.layout = Layout(seed, world_size, units_per_micro_batch, grad_accum, mode, len(self.units))
        self.position = Position()
        self._plan_cache: tuple[int, Plan] | None = None

    # -- pickling for workers: memory maps are reopened in each worker, not copied ------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"] = None
        state["_plan_cache"] = None
        return state

    @property
    def reader(self) -> ShardReader:
        if self._reader is None:
            self._reader = ShardReader(self.path, verify_checksums=False)
        return self._reader

    @property
    def seed(self) -> int:
        return self.layout.seed

    @property
    def grad_accum(self) -> int:
        return self.layout.grad_accum

    # -- what to serve: the plan's micro-batches for this rank, from the saved position ----------
    def micro_batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's micro-batches (unit indices) for the epoch, in order."""
        epoch = self.position.epoch if epoch is None else epoch
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            lay = self.layout
            self._plan_cache = (
                epoch,
                plan_epoch(self.costs, lay.world_size, lay.units_per_rank, lay.seed, epoch),
            )
        return rank_micro_batches(self._plan_cache[1], self.rank, self.layout)

    def steps_per_epoch(self) -> int:
        return self.layout.steps_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return position_state(self.layout, self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = resume_position(self.layout, state)

    def mark_consumed(self, batch: Batch) -> None:
        """Record that the training loop has used `batch` (called in the main process)."""
        if batch.info.position is None:
            raise ValueError("a batch from outside this dataset has no position to mark")
        self.position = after(self.layout, *batch.info.position)

    # -- items -----------------------------------------------------------------------------
    def view(self) -> PackedDataset:
        """A frozen copy of the current position for a DataLoader, so that `mark_consumed` on this
        object while the loader runs does not shift the indices it hands out."""
        return copy.copy(self)

    def __len__(self) -> int:
        return self.layout.micro_batches_per_epoch - self.position.next

    def checked_row(self, seq: int) -> dict[str, Any]:
        """Sequence `seq`, after the cheap invariants every packed row satisfies (`packer.integrity`):
        a damaged or edited pack stops here, naming shard and row, instead of training on it. Also
        its length against the pack's max_length and its media refs against the pack's pixel caps,
        before a tensor is allocated for them."""
        row = self.reader.sequence(seq)
        problem = row_problem(
            np.asarray(row["input_ids"], dtype=np.int64),
            np.asarray(row["labels"], dtype=np.int64),
            np.asarray(row["seq_lens"], dtype=np.int64),
            self.vocab_size,
        )
        max_length = self.manifest.get("max_length")
        if problem is None and isinstance(max_length, int) and len(row["input_ids"]) > max_length:
            problem = f"{len(row['input_ids'])} tokens, over the pack's max_length {max_length}"
        for ref in row["media"] if problem is None else ():
            problem = problem or ref_problem(ref, *self._pixel_caps())
        if problem is None:  # vision-token runs against media grids: what the mRoPE positions assume
            ids = np.asarray(row["input_ids"], dtype=np.int64)
            problem = grid_problem(ids, row["seq_lens"], row["media"], self._facts())
        if problem is not None:
            self._refuse(seq, problem)
        return row

    def _facts(self) -> ModelFacts:
        """The model's pad ids and merge size that `grid_problem` checks the vision-token runs with."""
        ids, family = self.spec.token_ids, self.spec.family
        frames = family.video_fill == "image_pad"  # InternVL: one image-context run per video frame
        return ModelFacts(
            self.vocab_size,
            ids.image_pad,
            ids.video_pad,
            self.spec.vision.merge_size,
            family.video_timestamps,
            frames,
        )

    def _pixel_caps(self) -> tuple[int, int, int, int, int | None]:
        """The pack's own pixel caps (its config's, else the processor's), doubled for the rounding up to
        whole merged patches that min-pixel bounds allow, its patch sizes and a tiled family's tile."""
        model = (self.manifest.get("config") or {}).get("model") or {}
        vision, p = self.spec.vision, self.pixel_spec

        def cap(key: str, default: int) -> int:
            value = model.get(key)
            return value if isinstance(value, int) and value > 0 else default

        image, video = cap("maxPixels", vision.max_pixels), cap("videoMaxPixels", vision.video_max_pixels)
        return 2 * image, 2 * video, p.patch_size, p.temporal_patch_size, p.tile_size

    def _refuse(self, seq: int, problem: str) -> NoReturn:
        shard, index = self.reader.locate(seq)
        raise PackIntegrityError(
            f"{self.path / self.reader.shard_file(shard)} row {index}: {problem}. The pack was damaged "
            "or edited: run `packtrain pack verify` on it, and re-pack the data."
        )

    def _decoded_row(self, seq: int, cache: dict[tuple[Any, ...], torch.Tensor]) -> dict[str, Any]:
        row = self.checked_row(seq)
        pixels = []
        for ref in row["media"]:
            key = (ref["key"], ref["height"], ref["width"], tuple(ref["frames"] or ()))
            if key not in cache:
                blob = self.reader.media(ref["key"], shard=row["shard"])
                try:
                    cache[key] = media_pixels(blob, ref, self.pixel_spec)
                except (MediaError, OSError, ValueError, SyntaxError) as exc:  # PIL: not an allowed format
                    what = f"{type(exc).__name__}: {exc}"
                    self._refuse(seq, f"media {ref['key'][:12]}… does not decode ({what})")
            pixels.append(cache[key])
        row["pixels"] = pixels
        return row

    def __getitem__(self, k: int) -> Batch:
        index = self.position.next + k
        units = self.micro_batches()[index]
        cache: dict[tuple[Any, ...], torch.Tensor] = {}
        if self.mode == "packed":
            batch = collate_packed([self._decoded_row(self.units[u][0], cache) for u in units], self.spec)
        else:
            rows: dict[int, list[dict[str, Any]]] = {}
            samples = []
            for u in units:
                seq, sub = self.units[u]
                if seq not in rows:
                    rows[seq] = split_row(self._decoded_row(seq, cache))
                samples.append(rows[seq][sub])
            batch = collate_padded(samples, self.spec, self.pad_token_id)
        batch.info.position = (self.position.epoch, index)
        return batch


def loader(dataset: Any, num_workers: int, prefetch: int, pin: bool) -> DataLoader:
    """One pass over `dataset.view()`'s micro-batches, in its order, with its own generator: a
    DataLoader iterator draws its workers' base seed from the generator it is given, else from the
    global torch RNG, and a resumed run (which starts a loader at the resume point) or an evaluation
    would then leave the global RNG one draw off the straight run."""
    return DataLoader(
        dataset.view(),
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        prefetch_factor=prefetch if num_workers else None,
        pin_memory=pin,
        generator=torch.Generator().manual_seed(dataset.seed),
    )


class EvalDataset(PackedDataset):
    """This rank's share of an evaluation set, in a fixed order: over all ranks every unit is
    evaluated exactly once (`sampler.eval_micro_batches`); items carry `counted`, false on the
    repeats that only keep the ranks' forward counts equal."""

    def __init__(
        self,
        path: str | Path,
        spec: ModelSpec,
        pixel_spec: PixelSpec | None = None,
        *,
        sequences: Sequence[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
        units_per_micro_batch: int = 1,
        mode: str = "packed",
        pad_token_id: int | None = None,
        verify_checksums: bool = True,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(
            path,
            spec,
            pixel_spec,
            rank=rank,
            world_size=world_size,
            units_per_micro_batch=units_per_micro_batch,
            mode=mode,
            pad_token_id=pad_token_id,
            verify_checksums=verify_checksums,
            vocab_size=vocab_size,
        )
        if sequences is not None:
            self.units, self.costs = units_and_costs(self.seq_lens, mode, sequences)
        self.batches, self.counted = eval_micro_batches(
            len(self.units), world_size, rank, units_per_micro_batch
        )

    def micro_batches(self, epoch: int | None = None) -> list[list[int]]:
        return self.batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> Batch:
        batch = super().__getitem__(k)
        batch.info.counted = k < self.counted
        return batch


def eval_dataset(train: PackedDataset, spec: DataSpec) -> EvalDataset | None:
    """The evaluation set beside `train`: the pack at `spec.evalPath`, else the sequences `train`
    held out (`evalFraction`), else none. Batched like training (same units, micro-batch size, ranks)."""
    path = spec.eval_path
    if path is None and spec.eval_pack_job_ref is not None:
        raise ValueError(
            f"data.evalPackJobRef {spec.eval_pack_job_ref!r} must be resolved to data.evalPath "
            "(the operator does)"
        )
    if path is None and not train.eval_sequences:
        return None
    evaluation = EvalDataset(
        train.path if path is None else path,
        train.spec,
        train.pixel_spec,
        sequences=train.eval_sequences if path is None else None,
        rank=train.rank,
        world_size=train.layout.world_size,
        units_per_micro_batch=train.layout.units_per_micro_batch,
        mode=train.mode,
        pad_token_id=train.pad_token_id,
        verify_checksums=train.verify_checksums and path is not None,
        vocab_size=train.vocab_size,
    )
    family = evaluation.manifest.get("family")
    if family not in (None, train.spec.family.name):
        raise ValueError(
            f"the evaluation pack {path} was made for {family}, but the model is {train.spec.family.name}"
        )
    return evaluation
