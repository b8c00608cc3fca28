"""Device benchmark: packed SFT with each attention backend vs the padded baseline, on one GPU.

Self-contained, from a clean checkout, in <= 8 minutes on one H200: a random-init Qwen2.5-VL-3B
(and a 7B, built from the same config with the 7B's sizes, when it fits) from the shared config,
bf16 mixed precision (fp32 weights and AdamW state, bf16 autocast) as the trainer runs it, on a
mixed text/image/video set drawn with `support.synth`'s length model and vision-token
rules, packed at 8192 tokens with the packer's planner (`pack_lengths`). For each available
backend (varlen, flash, flex, sdpa) the packed run, then the padded baseline (one sample per row,
padded per micro-batch, accumulated so a step holds about a packed sequence's tokens): effective
tokens/s, MFU (the trainer's FLOPs model), SM utilisation (NVML: GPM on Hopper, else the
utilisation rate), peak memory, step time; and packed vs each sample alone: per-sample losses of
a few samples, same backend. Prints a table, writes JSON (`--out`).

The batches are made in memory, through the trainer's own mRoPE positions and model code: token
ids are random, pixel values random (the model is random-init; shapes, grids and token counts
are exact), so neither media decoding (PyAV, Pillow, torchvision) nor pack files are involved.
`tests/bench/test_bench_smoke.py` checks that this script's collation equals the trainer's.

What the device needs: torch with CUDA and transformers (its own), numpy, and two packages the
trainer's config and loss modules import: pydantic and pyarrow; nvidia-ml-py for SM utilisation
(optional). Without internet, bring them as wheels (kept out of the repository):

    pip download --only-binary :all: --python-version 3.11 --platform manylinux2014_x86_64 \\
        -d wheels pydantic pyarrow nvidia-ml-py         # where there is a registry
    pip install --no-index --find-links wheels pydantic pyarrow nvidia-ml-py   # on the device

The trainer's forward hands the vision features to transformers as `mm_encoder_outputs`; a
transformers too old for that is reported at start: bring the project's transformers wheel too.
The checkout does not need installing: `packtrain` is imported from the repository's folders.

    python tests/bench/gpu_bench.py [--models 3b,7b] [--backends varlen,flash,flex,sdpa] [--out r.json]
    python tests/bench/gpu_bench.py --tiny      # dry run: tiny model, few steps, any device (CI, CPU)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import MODELS, REPO

MODEL = MODELS / "qwen2.5-vl"
IGNORE_INDEX = -100
# The released Qwen2.5-VL-7B's sizes over the shared 3B config (same vision tower, 3584-wide output).
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
# Per-sample mean losses, packed vs alone: bf16 rounds each matmul output to 2^-8 relative; packing
# only changes which other tokens share a kernel's tiles and reductions, so per-token losses (~12
# at random init) move by a few bf16 ulps and the means over a sample's label tokens by less.
# fp32 (the CPU dry run): reduction order only.
LOSS_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


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


def check_imports() -> None:
    missing = [m for m in ("transformers", "pydantic", "pyarrow") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"missing {', '.join(missing)}: install them (or their wheels: pip install --no-index "
            f"--find-links WHEELS {' '.join(missing)}); see this script's docstring"
        )
    import inspect

    import transformers
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    if "mm_encoder_outputs" not in inspect.signature(qwen.Qwen2_5_VLModel.forward).parameters:
        raise SystemExit(
            f"transformers {transformers.__version__} is older than the trainer's model code (its "
            "forward passes mm_encoder_outputs): bring the transformers wheel the project pins (pure "
            "Python) with the others"
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
    from packtrain.trainer.batch import Batch, BatchInfo, ModelInputs
    from packtrain.trainer.rope import packed_positions

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
    from packtrain.trainer.batch import Batch, BatchInfo, ModelInputs
    from packtrain.trainer.rope import sample_positions

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
        from packtrain.trainer.model import checked_spec, load_config

        self.args, self.device = args, device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.config = load_config(MODEL, TINY if args.tiny else None)
        self.fam = checked_spec(MODEL, self.config)
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

    def model(self, size: str, backend: str) -> tuple[Any, Any]:
        from packtrain.trainer.model import VLMForTraining, apply_layer_options, build_model

        overrides = TINY if size == "tiny" else SIZES[size]
        hf = build_model(
            MODEL,
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
        from packtrain.trainer.loss import micro_batch_objective
        from packtrain.trainer.metrics import ModelShape, step_flops
        from packtrain.trainer.model import parameter_groups

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

    def packed_vs_alone(self, core: Any) -> dict[str, Any]:
        """Per-sample mean losses of the first packed row with several samples, and of each of
        its samples alone, same backend and precision (no_grad)."""
        from packtrain.trainer.loss import per_sample_sums

        row = max(self.rows[:8], key=lambda r: len(r["seq_lens"]))
        k = min(len(row["seq_lens"]), 4)
        alone_rows = [self._sub_row(row, i) for i in range(len(row["seq_lens"]))]

        def means(batch: Any) -> torch.Tensor:
            with (
                torch.no_grad(),
                torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32),
            ):
                out = core(batch.inputs.to(self.device, self.dtype))
            n, owner = len(batch.info.seq_lens), batch.info.sample_index
            ones = torch.ones_like(out["token_losses"])
            sums = per_sample_sums(out["token_losses"].float(), out["positions"], owner, n)
            return (sums / per_sample_sums(ones.float(), out["positions"], owner, n)).cpu()

        packed = means(collate_packed([row], self.fam))[:k]
        alone = torch.cat([means(collate_packed([r], self.fam)) for r in alone_rows[:k]])
        rel = float(((packed - alone).abs() / alone.abs()).max())
        return {
            "samples": k,
            "packed": packed.tolist(),
            "alone": alone.tolist(),
            "max_rel_diff": rel,
            "tolerance": LOSS_TOLERANCE[self.dtype],
            "equal": rel <= LOSS_TOLERANCE[self.dtype],
        }

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


def available(backends: list[str], device: torch.device, dtype: torch.dtype) -> list[str]:
    from packtrain.trainer.attention import resolve_attention

    out = []
    for name in backends:
        if device.type != "cuda" and name == "flex":
            continue  # torch has no flex backward on CPU
        try:
            out.append(resolve_attention(name, device, dtype=dtype))
        except RuntimeError as e:
            print(f"skip {name}: {e}", flush=True)
    return out


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
    results: dict[str, Any] = {}
    for size in args.models.split(","):
        for mode, backend in [("packed", b) for b in backends] + [("padded", backends[0])]:
            key = f"{size}/{mode}/{backend}"
            if time.perf_counter() - started > args.budget_s:
                results[key] = {"skipped": f"over the {args.budget_s}s budget"}
                continue
            t0 = time.perf_counter()
            hf = core = None
            try:
                hf, core = bench.model(size, backend)
                steps = bench.packed_steps() if mode == "packed" else bench.padded_steps(accum)
                result = bench.train(core, steps)
                if mode == "packed":
                    result["packed_vs_alone"] = bench.packed_vs_alone(core)
            except torch.cuda.OutOfMemoryError as e:
                result = {"oom": str(e).splitlines()[0]}
            del hf, core
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            result["wall_seconds"] = time.perf_counter() - t0
            results[key] = result
            print(f"{key}: {json.dumps(_brief(result))}", flush=True)
    report = {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "fill": bench.fill,
        "padded_grad_accum": accum,
        "results": results,
        "verdict": verdict(results, args.models.split(","), backends),
        "seconds": time.perf_counter() - started,
    }
    print_table(report)
    return report


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (round(v, 4) if isinstance(v, float) else v)
        for k, v in r.items()
        if k not in ("losses", "packed_vs_alone")
    }


def verdict(results: dict[str, Any], sizes: list[str], backends: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        padded = results.get(f"{size}/padded/{backends[0]}", {})
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


def print_table(report: dict[str, Any]) -> None:
    print(
        f"\n{'run':24} {'step s':>7} {'tok/s':>9} {'eff tok/s':>10} {'padding':>8} {'MFU':>6} {'SM':>5} "
        f"{'peak mem':>9} {'packed=alone':>13}"
    )
    for key, r in report["results"].items():
        if "effective_tokens_per_second" not in r:
            print(f"{key:24} {r.get('oom') and 'out of memory' or r.get('skipped')}")
            continue
        eq = r.get("packed_vs_alone")
        mem = r["peak_memory_bytes"]
        same = "-" if eq is None else format(eq["max_rel_diff"], ".1e") + (" ok" if eq["equal"] else " NO")
        print(
            f"{key:24} {r['step_seconds']:>7.2f} {r['tokens_per_second']:>9.0f} "
            f"{r['effective_tokens_per_second']:>10.0f} "
            f"{r['padding_ratio']:>8.1%} {(r['mfu'] or 0):>6.1%} "
            f"{'-' if r['sm_utilization'] is None else format(r['sm_utilization'], '.0f') + '%':>5} "
            f"{'-' if mem is None else format(mem / 2**30, '.1f') + 'GiB':>9} "
            f"{same:>13}"
        )
    for key, v in report["verdict"].items():
        speed = v.get("effective_speedup")
        print(
            f"{key}: packed/padded effective tokens/s {'-' if speed is None else format(speed, '.2f') + 'x'} "
            f"(target >= 2x), packed MFU {(v['packed_mfu'] or 0):.1%} (target >= 40%)"
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--tiny", "--dry-run", action="store_true", help="tiny model, short sequences, few steps; any device"
    )
    p.add_argument(
        "--models",
        default="3b,7b",
        help="comma-separated: 3b, 7b (7b is reported as OOM when it does not fit)",
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
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        args.max_length = min(args.max_length, 1024)
        args.samples = min(args.samples, 40)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.models = "tiny"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
