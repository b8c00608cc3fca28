"""GPU benchmark: packed SFT with each attention backend vs the padded baseline, on one GPU.

A random-init Qwen2.5-VL-3B built from `--model` (default `tests/bench/models/qwen2.5-vl-3b`: its
config.json, preprocessor_config.json and special-token ids, nothing else: no weights, no
tokenizer), bf16 mixed precision as the trainer runs it (fp32 weights and AdamW state, bf16
autocast), on a mixed text/image/video set drawn with `support.synth`'s length model and vision-token
rules, packed at 8192 tokens with the packer's planner (`pack_lengths`). For each available backend
(varlen, flash, flex, sdpa) the packed run, then the padded baseline (one sample per row, padded per
micro-batch, accumulated so a step holds about a packed sequence's tokens): effective tokens/s, MFU
(the trainer's FLOPs model), SM utilisation (NVML: GPM on Hopper, else the utilisation rate), peak
memory, step time.

Packed == each sample alone, checked so that it can fail: per-token losses of the samples of one
packed row, in bf16, against each sample alone in fp32 (sdpa), as a ratio to the same sample alone
in bf16 against fp32 (rounding only: ~1 when isolation holds); and the same figure for a broken
control (the row as one causal sequence, positions still restarting), which must exceed the bound.
The script exits 1 when the real check fails or the control passes.

The batches are made in memory, through the trainer's own mRoPE positions and model code: token ids
and pixel values are random (the model is random-init; shapes, grids and token counts are exact),
so neither media decoding (PyAV, Pillow, torchvision) nor pack files are involved.
`tests/bench/test_bench_smoke.py` checks that this script's collation equals the trainer's.

On a GPU machine without internet: fetch the wheels it lacks where there is a package index
(`bash tests/bench/fetch_wheels.sh wheels`: transformers at the project's floor, pydantic, pyarrow,
nvidia-ml-py, for CPython 3.12), copy the `wheels/` folder with the checkout, and run the one
command `bash tests/bench/device_run.sh`: it installs them, runs `kernel_check.py`, this script
(`--tiny`, then 3B), and writes one JSON and one table. The checkout needs no installing:
`packtrain` is imported from the repository's folders.

    python tests/bench/gpu_bench.py [--model DIR] [--models 3b] [--backends varlen,flex,sdpa] [--out r.json]
    python tests/bench/gpu_bench.py --tiny      # dry run: tiny model, few steps, any device (CI, CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.util
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import REPO

HERE = Path(__file__).resolve().parent
MODEL = HERE / "models" / "qwen2.5-vl-3b"
IGNORE_INDEX = -100
# The released Qwen2.5-VL-7B's sizes over the 3B config (same vision tower, 3584-wide output). Not
# run by default: fp32 master weights, gradients and AdamW state take 16 bytes per parameter, and
# 8.3 B parameters x 16 = 124 GiB before any activation leave under 10 GiB of a 141 GB H200 for the
# activations of 8192 tokens; the 3B (3.75 B with its vision tower) takes 56 GiB.
SIZES: dict[str, dict[str, Any]] = {
    "3b": {},
    "7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "vision_config": {"out_hidden_size": 3584},
    },
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "fullatt_block_indexes": [1],
    },
}
# Media sizes of the mix (pixels after the processor's resize): as the former H200 pack used.
IMAGE_MAX_PIXELS = 1024 * 28 * 28
VIDEO_MAX_PIXELS = 256 * 28 * 28
MAX_FRAMES = 16
TARGETS = {"effective_speedup": 2.0, "packed_mfu": 0.40}
# Packed vs alone, per token, in bf16 against the sample alone in fp32: when isolation holds the
# packed row computes the same sums as the sample alone, only tiled and reduced differently, so its
# error is bf16 rounding, of the size of the sample alone in bf16 (ratio ~1; 1 exactly where the
# kernel's tiles do not depend on the row). A sample that sees another sample's tokens moves by what
# it saw, independent of precision. Bound: twice the rounding error.
RATIO_MAX = 2.0
MIN_LABEL_TOKENS = 16  # fewer label tokens make a per-sample RMS too noisy to compare
MAX_CHECK_SAMPLES = 6


def import_packtrain() -> None:
    """Use the installed package, or map `packtrain.packer` / `packtrain.trainer` onto this
    checkout's folders (the package is a namespace over them, see pyproject.toml)."""
    try:
        importlib.import_module("packtrain.trainer")
        return
    except ImportError:
        pass
    root = Path(tempfile.mkdtemp(prefix="packtrain-src-"))
    (root / "packtrain").mkdir()
    for name in ("packer", "trainer"):
        (root / "packtrain" / name).symlink_to(REPO / name)
    sys.path.insert(0, str(root))


def transformers_floor() -> tuple[int, ...]:
    """The transformers version pyproject.toml requires (what the trainer's model code needs)."""
    found = re.search(r'"transformers>=([0-9.]+)', (REPO / "pyproject.toml").read_text())
    return tuple(int(x) for x in found.group(1).split(".")) if found else (0,)


def check_imports() -> None:
    missing = [m for m in ("transformers", "pydantic", "pyarrow") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"missing {', '.join(missing)}: install them (or their wheels: pip install --no-index "
            f"--find-links WHEELS {' '.join(missing)}); see this script's docstring"
        )
    import transformers

    have = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:3])
    floor = transformers_floor()
    if have < floor:
        raise SystemExit(
            f"transformers {transformers.__version__} is older than the project's floor "
            f"{'.'.join(map(str, floor))} (the trainer's model code): bring its wheel "
            "(tests/bench/fetch_wheels.sh) and install it first"
        )
    import inspect

    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    # What the version stands for: an older forward drops the vision features into **kwargs.
    if "mm_encoder_outputs" not in inspect.signature(qwen.Qwen2_5_VLModel.forward).parameters:
        raise SystemExit(
            f"transformers {transformers.__version__}: Qwen2_5_VLModel.forward takes no "
            "mm_encoder_outputs (the trainer's model code passes the vision features so)"
        )


# -- data -----------------------------------------------------------------------------------------


def draw_samples(n: int, seed: int, max_length: int, fam: Any, vision_start: int) -> list[dict[str, Any]]:
    """`n` samples of the synthetic mix: text lengths from `synthetic_lengths` (text-only draw:
    multi-turn, heavy-tailed, a few long documents), then images / videos in synth's proportions
    with synth's resize rule, at most `max_length` tokens each. Labels: the last 60% of the text."""
    from support import synth

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    text = synth.synthetic_lengths(4 * n, seed, max_length, image_frac=0.0, video_frac=0.0)
    patch, merge, tp = fam.vision.patch_size, fam.vision.merge_size, fam.vision.temporal_patch_size
    samples: list[dict[str, Any]] = []
    for length in text.tolist():
        if len(samples) == n:
            break
        kind = rng.random()
        grids: list[tuple[str, int, int, int]] = []
        if kind < synth.IMAGE_FRAC:
            for _ in range(1 if rng.random() < 0.85 else int(rng.integers(2, 4))):
                w = float(np.clip(rng.lognormal(math.log(800), 0.6), 32, 4000))
                h = float(np.clip(w / math.exp(rng.normal(0.25, 0.3)), 32, 4000))
                hh, ww = synth.smart_resize(
                    np.array([h]), np.array([w]), synth.IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS
                )
                grids.append(("image", 1, int(hh[0]) // patch, int(ww[0]) // patch))
        elif kind < synth.IMAGE_FRAC + synth.VIDEO_FRAC:
            frames = int(np.clip(round(rng.lognormal(math.log(12), 0.6)) * 2, synth.MIN_FRAMES, MAX_FRAMES))
            h, w = [(360, 640), (480, 854), (720, 1280)][int(rng.integers(0, 3))]
            hh, ww = synth.smart_resize(
                np.array([h]), np.array([w]), synth.VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS
            )
            grids.append(("video", frames // tp, int(hh[0]) // patch, int(ww[0]) // patch))
        vision = sum(t * (h // merge) * (w // merge) + 2 for _, t, h, w in grids)
        if length + vision > max_length:
            continue
        user = max(1, int(length * 0.4))
        ids = rng.integers(0, 151000, length).tolist()
        labels = [IGNORE_INDEX] * user + ids[user:]
        media_ids: list[int] = []
        for kind_name, t, h, w in grids:
            pad = fam.token_ids.image_pad if kind_name == "image" else fam.token_ids.video_pad
            media_ids += [vision_start] + [pad] * (t * (h // merge) * (w // merge)) + [vision_start + 1]
        media = [
            {"kind": k, "grid_t": t, "grid_h": h, "grid_w": w, "second_per_grid": 1.0, "sample": 0}
            for k, t, h, w in grids
        ]
        samples.append(
            {
                "input_ids": ids[:user] + media_ids + ids[user:],
                "labels": labels[:user] + [IGNORE_INDEX] * len(media_ids) + labels[user:],
                "sample_ids": [f"synth-{len(samples)}"],
                "media": media,
                "pixels": [
                    torch.randn(t * h * w, 3 * tp * patch * patch, generator=gen) for _, t, h, w in grids
                ],
            }
        )
    return samples


def pack(samples: list[dict[str, Any]], max_length: int) -> list[dict[str, Any]]:
    """Packed rows (the shard row layout plus decoded `pixels`), planned by the packer's planner."""
    from packtrain.packer.binpack import pack_lengths

    rows = []
    for bin_ in pack_lengths([len(s["input_ids"]) for s in samples], max_length):
        row: dict[str, Any] = {
            "input_ids": [],
            "labels": [],
            "seq_lens": [],
            "sample_ids": [],
            "media": [],
            "pixels": [],
        }
        for k, i in enumerate(bin_):
            s = samples[i]
            row["input_ids"] += s["input_ids"]
            row["labels"] += s["labels"]
            row["seq_lens"].append(len(s["input_ids"]))
            row["sample_ids"] += s["sample_ids"]
            row["media"] += [{**m, "sample": k} for m in s["media"]]
            row["pixels"] += s["pixels"]
        rows.append(row)
    return rows


def _shift(labels: np.ndarray, seq_lens: list[int]) -> np.ndarray:
    out = np.full_like(labels, IGNORE_INDEX)
    offset = 0
    for n in seq_lens:
        out[offset : offset + n - 1] = labels[offset + 1 : offset + n]
        offset += n
    return out


def _media(rows: list[dict[str, Any]], fam: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for kind, px_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        pairs = [
            (m, p) for r in rows for m, p in zip(r["media"], r["pixels"], strict=True) if m["kind"] == kind
        ]
        if pairs:
            out[px_key] = torch.cat([p for _, p in pairs])
            out[grid_key] = torch.tensor([[m["grid_t"], m["grid_h"], m["grid_w"]] for m, _ in pairs])
            if kind == "video" and fam.family.time_scaled_rope:
                out["second_per_grid_ts"] = torch.tensor(
                    [m["second_per_grid"] for m, _ in pairs], dtype=torch.float32
                )
    return out


def collate_packed(rows: list[dict[str, Any]], fam: Any) -> Any:
    """What the trainer's `data.collate_packed` makes of these rows (the smoke test compares),
    without its media-decoding imports."""
    from packtrain.trainer.data.batch import Batch, BatchInfo, ModelInputs
    from packtrain.trainer.data.rope import packed_positions

    ids, labels, shifted, pos, lens, sample_ids = [], [], [], [], [], []
    for row in rows:
        r_ids = np.asarray(row["input_ids"], dtype=np.int64)
        per_sample = [[m for m in row["media"] if m["sample"] == k] for k in range(len(row["seq_lens"]))]
        ids.append(r_ids)
        labels.append(np.asarray(row["labels"], dtype=np.int64))
        sample_ids += row["sample_ids"]
        shifted.append(_shift(np.asarray(row["labels"], dtype=np.int64), row["seq_lens"]))
        pos.append(packed_positions(r_ids, row["seq_lens"], per_sample, fam))
        lens += row["seq_lens"]
    lens_t = torch.tensor(lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens_t, 0)
    shift_t = torch.from_numpy(np.concatenate(shifted))[None]
    inputs = ModelInputs(
        input_ids=torch.from_numpy(np.concatenate(ids))[None],
        labels=torch.from_numpy(np.concatenate(labels))[None],
        shift_labels=shift_t,
        position_ids=torch.from_numpy(np.concatenate(pos, axis=1))[:, None, :],
        cu_seq_lens=cu,
        max_length=int(lens_t.max()),
        **_media(rows, fam),
    )
    info = BatchInfo(
        seq_lens=lens,
        sample_ids=sample_ids,
        sample_index=torch.repeat_interleave(torch.arange(len(lens)), lens_t),
        num_tokens=int(lens_t.sum()),
        num_label_tokens=int((shift_t != IGNORE_INDEX).sum()),
        padded_tokens=int(lens_t.sum()),
        attention_cost=sum(n * n for n in lens),
    )
    return Batch(inputs, info)


def collate_padded(samples: list[dict[str, Any]], fam: Any, pad_id: int) -> Any:
    """What the trainer's `data.collate_padded` makes of these samples: right-padded rows."""
    from packtrain.trainer.data.batch import Batch, BatchInfo, ModelInputs
    from packtrain.trainer.data.rope import sample_positions

    lengths = [len(s["input_ids"]) for s in samples]
    b, width = len(samples), max(lengths)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.long)
    shifted = torch.full((b, width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    pos = torch.ones((3, b, width), dtype=torch.long)
    for i, s in enumerate(samples):
        n, sid = lengths[i], np.asarray(s["input_ids"], dtype=np.int64)
        ids[i, :n] = torch.from_numpy(sid)
        labels[i, :n] = torch.from_numpy(np.asarray(s["labels"], dtype=np.int64))
        shifted[i, :n] = torch.from_numpy(_shift(np.asarray(s["labels"], dtype=np.int64), [n]))
        mask[i, :n] = 1
        pos[:, i, :n] = torch.from_numpy(sample_positions(sid, s["media"], fam))
    inputs = ModelInputs(
        input_ids=ids,
        labels=labels,
        shift_labels=shifted,
        position_ids=pos,
        attention_mask=mask,
        **_media(samples, fam),
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


# -- runs -----------------------------------------------------------------------------------------


def padded_grad_accum(manifest: dict[str, Any], padded_batch: int) -> int:
    """Micro-batches per padded step so that a padded optimizer step holds about the effective
    tokens of a packed one (one packed sequence): otherwise the padded run pays the per-step
    cost (optimizer update, gradient clipping) on several times fewer tokens and the speedup
    measures step granularity, not padding."""
    per_sequence = manifest["tokens"] / manifest["sequences"]
    per_sample = manifest["tokens"] / manifest["counts"]["packed"]
    return max(1, round(per_sequence / (padded_batch * per_sample)))


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        from packtrain.trainer.metrics import GpuProbe, device_peak_tflops
        from packtrain.trainer.model.build import checked_spec, load_config

        self.args, self.device = args, device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.config = load_config(args.model, TINY if args.tiny else None)
        self.fam = checked_spec(args.model, self.config)
        self.peak = device_peak_tflops(device)
        self.probe = GpuProbe.open(device)
        pad = self.config.text_config.pad_token_id
        self.pad_id = 151643 if pad is None else pad
        self.samples = draw_samples(
            args.samples, 0, args.max_length, self.fam, self.config.vision_start_token_id
        )
        self.rows = pack(self.samples, args.max_length)
        tokens = sum(len(s["input_ids"]) for s in self.samples)
        self.manifest = {
            "tokens": tokens,
            "sequences": len(self.rows),
            "counts": {"packed": len(self.samples)},
        }
        self.fill = tokens / (len(self.rows) * args.max_length)
        self.references: dict[str, dict[str, Any]] = {}

    def model(self, size: str, backend: str) -> tuple[Any, Any]:
        """A fresh random init (seed 0: every backend and the fp32 reference start from the same
        weights) wrapped as the trainer wraps it."""
        from packtrain.trainer.model.build import VLMForTraining, apply_layer_options, build_model

        overrides = TINY if size == "tiny" else SIZES[size]
        hf = build_model(
            self.args.model,
            init="random",
            overrides=overrides,
            dtype=torch.float32,
            attention=backend,
            device=self.device,
        )
        apply_layer_options(hf, self.args.activation_checkpointing, False, self.args.compile)
        return hf, VLMForTraining(hf, backend).to(self.device).train()

    def train(self, core: Any, micro_batches: list[list[Any]]) -> dict[str, Any]:
        """Optimizer steps over `micro_batches` (a list per step) as the trainer's loop does them."""
        from packtrain.trainer.metrics import ModelShape, step_flops
        from packtrain.trainer.model.build import parameter_groups
        from packtrain.trainer.model.loss import micro_batch_objective

        shape = ModelShape.from_model(core.hf, parameter_groups(core))
        optimizer = torch.optim.AdamW(core.parameters(), lr=1e-5)
        times, tokens, effective, flops, losses = [], 0, 0, 0.0, []
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        for step, micro in enumerate(micro_batches):
            if step == self.args.warmup and self.probe is not None:
                self.probe.sm_utilization()  # starts the GPM interval of the timed steps
            t0 = time.perf_counter()
            n = sum(b.info.num_label_tokens for b in micro)
            total = 0.0
            for batch in micro:
                with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
                    out = core(batch.inputs.to(self.device, self.dtype))
                micro_batch_objective(out["loss_sum"], n, 1).backward()
                total += float(out["loss_sum"].detach())
            torch.nn.utils.clip_grad_norm_(core.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(self.device)
            losses.append(total / max(n, 1))
            if step >= self.args.warmup:  # warm-up steps pay for allocator, kernels and compilation
                times.append(time.perf_counter() - t0)
                tokens += sum(b.info.padded_tokens for b in micro)
                effective += sum(b.info.num_tokens for b in micro)
                flops += sum(step_flops(shape, b) for b in micro)
        seconds = sum(times)
        sm = self.probe.sm_utilization() if self.probe is not None else None
        return {
            "steps_timed": len(times),
            "step_seconds": seconds / len(times),
            "tokens_per_second": tokens / seconds,
            "effective_tokens_per_second": effective / seconds,
            "padding_ratio": 1.0 - effective / tokens,
            "mfu": flops / seconds / (self.peak * 1e12) if self.peak else None,
            "sm_utilization": None if sm is None else sm[0],
            "sm_utilization_source": None if sm is None else sm[1],
            "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None,
            "losses": losses,
        }

    def check_row(self) -> tuple[dict[str, Any], list[int]]:
        """The packed row with the most samples and which of them to compare: the last (those with
        the most other samples before them to leak from) with enough label tokens."""
        row = max(self.rows, key=lambda r: len(r["seq_lens"]))
        eligible = [
            k
            for k in range(len(row["seq_lens"]))
            if sum(label != IGNORE_INDEX for label in self._sub_row(row, k)["labels"][1:]) >= MIN_LABEL_TOKENS
        ]
        return row, eligible[-MAX_CHECK_SAMPLES:]

    def reference(self, size: str, row: dict[str, Any], chosen: list[int]) -> dict[str, Any]:
        """Each chosen sample alone in fp32 through sdpa (any backend's math; the FlashAttention
        ones have no fp32), from the same seed-0 weights; built once per size, then freed."""
        if size not in self.references:
            hf, core = self.model(size, "sdpa")
            losses = [
                sample_losses(core, collate_packed([self._sub_row(row, k)], self.fam), self.device, None)[0]
                for k in chosen
            ]
            self.references[size] = {"losses": losses, "fingerprint": fingerprint(hf)}
            del hf, core
            release(self.device)
        return self.references[size]

    def packed_vs_alone(self, core: Any, size: str) -> dict[str, Any]:
        """Per-token losses of one packed row's samples vs each alone (see `equivalence`), and of
        the broken control; run on the fresh model, before any step, so the weights are the
        reference's."""
        row, chosen = self.check_row()
        if len(row["seq_lens"]) < 2 or not chosen or chosen == [0]:
            return {"error": "no packed row holds two samples with enough label tokens", "passed": False}
        ref = self.reference(size, row, chosen)
        if fingerprint(core.hf) != ref["fingerprint"]:
            return {"error": "the fp32 reference's weights differ from this model's", "passed": False}
        bf16 = torch.bfloat16
        packed_batch = collate_packed([row], self.fam)
        packed = sample_losses(core, packed_batch, self.device, bf16)
        control = sample_losses(core, without_isolation(packed_batch), self.device, bf16)
        alone = [
            sample_losses(core, collate_packed([self._sub_row(row, k)], self.fam), self.device, bf16)[0]
            for k in chosen
        ]
        figures = equivalence(ref["losses"], alone, [packed[k] for k in chosen], [control[k] for k in chosen])
        return {"row_samples": len(row["seq_lens"]), "compared": chosen, **figures}

    @staticmethod
    def _sub_row(row: dict[str, Any], k: int) -> dict[str, Any]:
        start = sum(row["seq_lens"][:k])
        n = row["seq_lens"][k]
        keep = [i for i, m in enumerate(row["media"]) if m["sample"] == k]
        return {
            "input_ids": row["input_ids"][start : start + n],
            "labels": row["labels"][start : start + n],
            "seq_lens": [n],
            "sample_ids": [row["sample_ids"][k]],
            "media": [{**row["media"][i], "sample": 0} for i in keep],
            "pixels": [row["pixels"][i] for i in keep],
        }

    def packed_steps(self) -> list[list[dict[str, Any]]]:
        steps = self.args.warmup + self.args.steps
        return [[collate_packed([self.rows[i % len(self.rows)]], self.fam)] for i in range(steps)]

    def padded_steps(self, accum: int) -> list[list[dict[str, Any]]]:
        order = np.random.default_rng(1).permutation(len(self.samples)).tolist()
        b = self.args.padded_batch
        micro = [
            collate_padded([self.samples[j] for j in order[i : i + b]], self.fam, self.pad_id)
            for i in range(0, len(order) - b + 1, b)
        ]
        steps = self.args.warmup + self.args.steps
        return [[micro[(s * accum + a) % len(micro)] for a in range(accum)] for s in range(steps)]


# -- packed == alone ------------------------------------------------------------------------------


def sample_losses(
    core: Any, batch: Any, device: torch.device, dtype: torch.dtype | None
) -> list[torch.Tensor]:
    """Per-sample label-token losses (fp32, on the CPU) of one no-grad forward: under `dtype`
    autocast as the trainer runs, or (None) plain fp32."""
    compute = dtype or torch.float32
    with torch.no_grad(), torch.autocast(device.type, dtype=compute, enabled=dtype is not None):
        out = core(batch.inputs.to(device, compute))
    owner = batch.info.sample_index.to(out["positions"].device).index_select(0, out["positions"])
    losses = out["token_losses"].float()
    return [losses[owner == k].cpu() for k in range(len(batch.info.seq_lens))]


def without_isolation(batch: Any) -> Any:
    """The broken control: the same packed row as one causal sequence (no sample boundaries for
    any backend), positions still restarting per sample: what packing without isolation computes."""
    from packtrain.trainer.data.batch import Batch

    total = batch.inputs.input_ids.shape[1]
    cu = torch.tensor([0, total], dtype=torch.int32)
    return Batch(dataclasses.replace(batch.inputs, cu_seq_lens=cu, max_length=total), batch.info)


def fingerprint(model: Any) -> float:
    """A float64 sum over every parameter: equal for two builds from the same seed, not otherwise."""
    with torch.no_grad():
        return float(sum(p.detach().sum(dtype=torch.float64) for p in model.parameters()))


def _rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def equivalence(
    ref: list[torch.Tensor],
    alone: list[torch.Tensor],
    packed: list[torch.Tensor],
    control: list[torch.Tensor],
) -> dict[str, Any]:
    """Per sample: RMS over its label tokens of bf16-alone, packed and control losses minus the
    fp32-alone ones; the ratio of each to the bf16-alone error (the rounding the precision makes).
    The real check passes at a ratio <= RATIO_MAX for every sample, the control must exceed it."""
    samples = []
    for r, a, p, c in zip(ref, alone, packed, control, strict=True):
        if not len(r) == len(a) == len(p) == len(c):
            raise ValueError(f"label tokens differ: {len(r)}, {len(a)}, {len(p)}, {len(c)}")
        # bf16 never rounds every token's loss exactly; the floor only keeps a ratio finite.
        noise = max(_rms(a - r), 1e-7 * float(r.abs().mean()))
        samples.append(
            {
                "label_tokens": len(r),
                "mean_loss_fp32": float(r.mean()),
                "bf16_alone_rms": noise,
                "packed_rms": _rms(p - r),
                "control_rms": _rms(c - r),
                "packed_ratio": _rms(p - r) / noise,
                "control_ratio": _rms(c - r) / noise,
                "packed_bitwise_alone": bool(torch.equal(p, a)),
            }
        )
    packed_ratio = max(s["packed_ratio"] for s in samples)
    control_ratio = max(s["control_ratio"] for s in samples)
    equal, detected = packed_ratio <= RATIO_MAX, control_ratio > RATIO_MAX
    return {
        "ratio_max": RATIO_MAX,
        "packed_ratio": packed_ratio,
        "control_ratio": control_ratio,
        "equal": equal,
        "control_detected": detected,
        "passed": equal and detected,
        "samples": samples,
    }


# -- runs -----------------------------------------------------------------------------------------


def available(backends: list[str], device: torch.device, dtype: torch.dtype) -> list[str]:
    from packtrain.trainer.model.attention import resolve_attention

    out = []
    for name in backends:
        if device.type != "cuda" and name == "flex":
            print("skip flex: torch has no flex-attention backward on CPU", flush=True)
            continue
        try:
            out.append(resolve_attention(name, device, dtype=dtype))
        except RuntimeError as e:
            print(f"skip {name}: {e}", flush=True)
    return out


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_one(bench: Bench, size: str, mode: str, backend: str, accum: int) -> dict[str, Any]:
    """One model build and timed run; a packed run first checks packed == alone on the fresh model."""
    t0 = time.perf_counter()
    hf = core = None
    result: dict[str, Any] = {}
    try:
        hf, core = bench.model(size, backend)
        check = bench.packed_vs_alone(core, size) if mode == "packed" else None
        steps = bench.packed_steps() if mode == "packed" else bench.padded_steps(accum)
        result = bench.train(core, steps)
        if check is not None:
            result["packed_vs_alone"] = check
    except torch.cuda.OutOfMemoryError as e:
        result = {"oom": str(e).splitlines()[0]}
    del hf, core
    release(bench.device)
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    import_packtrain()
    check_imports()
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        raise SystemExit("this benchmark needs a CUDA GPU; --tiny runs a dry run anywhere")
    started = time.perf_counter()
    bench = Bench(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device: {name}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{len(bench.samples)} samples -> {len(bench.rows)} sequences of <= {args.max_length}, "
        f"fill {bench.fill:.3f}",
        flush=True,
    )
    backends = available(args.backends.split(","), device, bench.dtype)
    accum = args.padded_accum or padded_grad_accum(bench.manifest, args.padded_batch)
    report: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "fill": bench.fill,
        "padded_grad_accum": accum,
        "backends": backends,
        "results": {},
    }
    for size in args.models.split(","):
        # The baseline right after the first packed run: a budget cut leaves the speedup measured.
        order = [("packed", b) for b in backends[:1]] + [("padded", b) for b in backends[:1]]
        for mode, backend in order + [("packed", b) for b in backends[1:]]:
            key = f"{size}/{mode}/{backend}"
            if time.perf_counter() - started > args.budget_s:
                report["results"][key] = {"skipped": f"over the {args.budget_s:.0f}s budget"}
                continue
            report["results"][key] = run_one(bench, size, mode, backend, accum)
            print(f"{key}: {json.dumps(_brief(report['results'][key]))}", flush=True)
            finish(report, args, started)  # what is done so far survives a kill
    finish(report, args, started)
    print_table(report)
    return report


def finish(report: dict[str, Any], args: argparse.Namespace, started: float) -> None:
    sizes = args.models.split(",")
    report["verdict"] = verdict(report["results"], sizes, report["backends"])
    report["equivalence_passed"] = equivalence_passed(report["results"])
    report["seconds"] = time.perf_counter() - started
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


def equivalence_passed(results: dict[str, Any]) -> bool:
    """Every packed run that finished had its check pass (and its control fail), and one did."""
    checks = [r["packed_vs_alone"] for r in results.values() if "packed_vs_alone" in r]
    return bool(checks) and all(c["passed"] for c in checks)


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    out = {
        k: (round(v, 4) if isinstance(v, float) else v)
        for k, v in r.items()
        if k not in ("losses", "packed_vs_alone")
    }
    eq = r.get("packed_vs_alone")
    if eq is not None:
        out["packed_vs_alone"] = {k: v for k, v in eq.items() if k != "samples"}
    return out


def verdict(results: dict[str, Any], sizes: list[str], backends: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        padded = results.get(f"{size}/padded/{backends[0]}", {}) if backends else {}
        for backend in backends:
            packed = results.get(f"{size}/packed/{backend}", {})
            if "effective_tokens_per_second" not in packed:
                continue
            entry: dict[str, Any] = {"packed_mfu": packed["mfu"]}
            if "effective_tokens_per_second" in padded:
                entry["effective_speedup"] = (
                    packed["effective_tokens_per_second"] / padded["effective_tokens_per_second"]
                )
            entry["targets_met"] = {
                k: (entry.get(k) or 0.0) >= target
                for k, target in TARGETS.items()
                if entry.get(k) is not None
            }
            out[f"{size}/{backend}"] = entry
    return out


def equivalence_cell(eq: dict[str, Any] | None) -> str:
    """'packed ratio / control ratio' and the outcome of both, for the table."""
    if eq is None:
        return "-"
    if "error" in eq:
        return "ERROR"
    ok = ("ok" if eq["equal"] else "NO") + "/" + ("caught" if eq["control_detected"] else "MISSED")
    return f"{eq['packed_ratio']:.2f}/{eq['control_ratio']:.0f} {ok}"


def table_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        f"{'run':24} {'step s':>7} {'tok/s':>9} {'eff tok/s':>10} {'padding':>8} {'MFU':>6} {'SM':>5} "
        f"{'peak mem':>9} {'packed/control vs bf16 noise':>30}"
    ]
    for key, r in report["results"].items():
        if "effective_tokens_per_second" not in r:
            lines.append(f"{key:24} {r.get('oom') and 'out of memory' or r.get('skipped')}")
            continue
        mem = r["peak_memory_bytes"]
        lines.append(
            f"{key:24} {r['step_seconds']:>7.2f} {r['tokens_per_second']:>9.0f} "
            f"{r['effective_tokens_per_second']:>10.0f} "
            f"{r['padding_ratio']:>8.1%} {(r['mfu'] or 0):>6.1%} "
            f"{'-' if r['sm_utilization'] is None else format(r['sm_utilization'], '.0f') + '%':>5} "
            f"{'-' if mem is None else format(mem / 2**30, '.1f') + 'GiB':>9} "
            f"{equivalence_cell(r.get('packed_vs_alone')):>30}"
        )
    for key, v in report["verdict"].items():
        speed = v.get("effective_speedup")
        lines.append(
            f"{key}: packed/padded effective tokens/s {'-' if speed is None else format(speed, '.2f') + 'x'} "
            f"(target >= 2x), packed MFU {(v['packed_mfu'] or 0):.1%} (target >= 40%)"
        )
    lines.append(
        f"packed == alone (per-token, bf16 error / bf16 rounding <= {RATIO_MAX}; broken control above "
        f"it): {'passed' if report['equivalence_passed'] else 'FAILED'}"
    )
    return lines


def print_table(report: dict[str, Any]) -> None:
    print("\n" + "\n".join(table_lines(report)), flush=True)


# -- device_run.sh's one report ------------------------------------------------------------------

# Each part's JSON (written by its phase as it goes) and the phase that writes it.
PARTS = {"kernel_check": "kernels", "smoke": "smoke", "bench": "bench"}


def read_phases(path: Path) -> list[dict[str, Any]]:
    """device_run.sh's phases.tsv: name, status (ok, failed, timeout, skipped), rc, seconds, note."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, status, rc, seconds, note = (line.split("\t") + ["-"] * 5)[:5]
        rows.append(
            {
                "phase": name,
                "status": status,
                "rc": None if rc == "-" else int(rc),
                "seconds": int(seconds),
                "note": None if note == "-" else note,
            }
        )
    return rows


def load_part(folder: Path, name: str, phases: list[dict[str, Any]]) -> dict[str, Any]:
    path = folder / f"{name}.json"
    if path.is_file():
        try:
            return dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            return {"missing": f"{path.name} is not JSON ({e}): its phase was cut mid-write"}
    phase = next((p for p in phases if p["phase"] == PARTS[name]), None)
    if phase is None:
        return {"missing": "its phase did not run"}
    return {"missing": f"phase {phase['status']}" + (f": {phase['note']}" if phase["note"] else "")}


def bench_summary(part: dict[str, Any]) -> dict[str, Any]:
    """Per size and backend: effective tokens/s packed and padded, MFU, SM utilisation, peak
    memory, and the packed == alone figures with the broken control's."""
    out: dict[str, Any] = {}
    results = part.get("results", {})
    for key, verdict_entry in part.get("verdict", {}).items():
        size, backend = key.split("/")
        packed = results[f"{size}/packed/{backend}"]
        padded = results.get(f"{size}/padded/{part['backends'][0]}", {})
        eq = packed.get("packed_vs_alone", {})
        mem = packed.get("peak_memory_bytes")
        out[key] = {
            "effective_tokens_per_second_packed": packed["effective_tokens_per_second"],
            "effective_tokens_per_second_padded": padded.get("effective_tokens_per_second"),
            "effective_speedup": verdict_entry.get("effective_speedup"),
            "mfu": packed["mfu"],
            "sm_utilization": packed["sm_utilization"],
            "peak_memory_gib": None if mem is None else mem / 2**30,
            "packed_vs_alone_ratio": eq.get("packed_ratio"),
            "control_ratio": eq.get("control_ratio"),
            "ratio_max": eq.get("ratio_max"),
            "packed_equal_alone": eq.get("equal"),
            "broken_control_detected": eq.get("control_detected"),
        }
    return out


def on_purpose(phase: dict[str, Any]) -> bool:
    """A phase that did its job: ran and exited 0, or was left out by the dry run (never one
    skipped for want of time: a report of nothing is no pass)."""
    return phase["status"] == "ok" or (
        phase["status"] == "skipped" and str(phase["note"]).startswith("dry run")
    )


def part_passed(name: str, part: dict[str, Any], phases: list[dict[str, Any]]) -> bool:
    """A part passes when it ran and passed, or when the dry run left its phase out."""
    if "missing" in part:
        return any(p["phase"] == PARTS[name] and p["status"] == "skipped" and on_purpose(p) for p in phases)
    return bool(part.get("passed" if name == "kernel_check" else "equivalence_passed"))


def merge(folder: Path) -> int:
    """One JSON (device_run.json) and one table (device_run.txt) from what the phases left."""
    phases = read_phases(folder / "phases.tsv")
    parts = {name: load_part(folder, name, phases) for name in PARTS}
    summary = {name: bench_summary(parts[name]) for name in ("smoke", "bench") if "results" in parts[name]}
    phases_ok = bool(phases) and all(on_purpose(p) for p in phases)
    passed = phases_ok and all(part_passed(name, part, phases) for name, part in parts.items())
    report = {"passed": passed, "phases": phases, **parts, "summary": summary}
    (folder / "device_run.json").write_text(json.dumps(report, indent=1))
    text = "\n".join(merged_table(report))
    (folder / "device_run.txt").write_text(text + "\n")
    print(text, flush=True)
    return 0 if passed else 1


def merged_table(report: dict[str, Any]) -> list[str]:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import kernel_check

    lines = [
        f"device run: {'PASSED' if report['passed'] else 'FAILED'}",
        f"{'phase':10} {'status':8} {'s':>5}",
    ]
    lines += [
        f"{p['phase']:10} {p['status']:8} {p['seconds']:>5}  {p['note'] or ''}" for p in report["phases"]
    ]
    for name in PARTS:
        part = report[name]
        lines.append(f"\n== {name}" + (f" ({part['device']})" if "device" in part else ""))
        if "missing" in part:
            lines.append(part["missing"])
        elif name == "kernel_check":
            lines += kernel_check.table_lines(part)
        else:
            lines += table_lines(part)
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--tiny", "--dry-run", action="store_true", help="tiny model, short sequences, few steps; any device"
    )
    p.add_argument(
        "--model",
        type=Path,
        default=MODEL,
        help="model folder: config.json, preprocessor_config.json and the special-token ids are read",
    )
    p.add_argument(
        "--models",
        default="3b",
        help="comma-separated: 3b, 7b. 7b only when asked: its fp32 weights, gradients and AdamW "
        "state (16 bytes x 8.3 B parameters = 124 GiB) leave one H200 no room for activations",
    )
    p.add_argument(
        "--backends", default="varlen,flash,flex,sdpa", help="those available on the device are run"
    )
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--max-length", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per run")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps first (allocator, kernels, compilation)"
    )
    # Padded rows reach 8192 tokens when a long sample is drawn: 2 rows keep the baseline in memory.
    p.add_argument("--padded-batch", type=int, default=2)
    p.add_argument(
        "--padded-accum", type=int, help="micro-batches per padded step (default: a packed step's tokens)"
    )
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--budget-s", type=float, default=360.0, help="skip the runs left after this many seconds")
    p.add_argument("--out", type=Path, help="write the results as JSON here (after every run)")
    p.add_argument("--merge", type=Path, metavar="DIR", help="device_run.sh: merge DIR's parts, then exit")
    args = p.parse_args(argv)
    if args.tiny:
        args.max_length = min(args.max_length, 1024)
        args.samples = min(args.samples, 40)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.models = "tiny"
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit 1 when packed != alone or the broken control went unnoticed: the speed of a packed run
    that mixes samples is worth nothing."""
    args = parse(argv)
    if args.merge:
        return merge(args.merge)
    report = run(args)
    return 0 if report["equivalence_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
