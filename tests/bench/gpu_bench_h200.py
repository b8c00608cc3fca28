"""GPU benchmark (one H200, < 8 minutes): packed vs padded SFT of a random-init Qwen2.5-VL-3B.

Self-contained and installs nothing: it needs this checkout with its environment
(torch with CUDA, transformers, packtrain; flash-attn optional) and the shared
fixtures beside the checkout. Steps:

1. generate a deterministic mixed text/image/video dataset (`packtrain.packer.synth`);
2. pack it at 8192 tokens with the real packer;
3. train a random-init model from the shared Qwen2.5-VL-3B config in bf16, first
   packed (one 8192-token packed sequence per step, per-sample attention), then
   the padded baseline (one sample per row, padded per batch, accumulated over micro-batches so
   that an optimizer step holds about the effective tokens of a packed one) on the same pack;
4. print tokens/s, effective tokens/s, padding, MFU (attention FLOPs from the real
   sub-sample lengths, H200 dense bf16 peak 989 TFLOP/s), SM utilisation (NVML
   GPM on Hopper, else the utilisation rate) and peak memory, and the targets:
   >= 2x effective tokens/s packed vs padded, MFU >= 40% packed.

    python tests/bench/gpu_bench_h200.py [--out results.json] [--attention auto|flash|sdpa|flex]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from packtrain.packer.config import PackConfig
from packtrain.packer.local import run_all
from packtrain.packer.synth import generate_dataset
from packtrain.trainer.config import SFTSpecCore
from packtrain.trainer.loop import train

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO.parent / "shared" / "models" / "qwen2.5-vl"


def make_pack(work: Path, samples: int, max_length: int, workers: int) -> Path:
    data = generate_dataset(work / "data", samples, seed=0)
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(data)]},
            "model": {
                "family": "qwen2.5-vl",
                "path": str(MODEL),
                "maxPixels": 1024 * 28 * 28,
                "videoMaxPixels": 256 * 28 * 28,
                "maxFrames": 16,
            },
            "packing": {"maxLength": max_length, "overlong": "truncate", "sequencesPerShard": 256},
        }
    )
    out = work / "pack"
    run_all(cfg, out, workers=workers, show_progress=False)
    return out


def padded_grad_accum(manifest: dict, padded_batch: int) -> int:
    """Micro-batches per padded step so that a padded optimizer step holds about the effective
    tokens of a packed one (one packed sequence): otherwise the padded run pays the per-step
    cost (optimizer update, gradient clipping, synchronisation) on several times fewer tokens
    and the speedup measures step granularity, not padding."""
    per_sequence = manifest["tokens"] / manifest["sequences"]
    per_sample = manifest["tokens"] / manifest["counts"]["packed"]
    return max(1, round(per_sequence / (padded_batch * per_sample)))


def run(
    pack: Path,
    out: Path,
    mode: str,
    steps: int,
    padded_batch: int,
    attention: str,
    workers: int,
    grad_accum: int = 1,
) -> dict:
    cfg = SFTSpecCore.model_validate(
        {
            "data": {"path": str(pack), "numWorkers": workers, "prefetchFactor": 4},
            "model": {"path": str(MODEL), "init": "random"},
            "training": {
                "maxSteps": steps,
                "mode": mode,
                "microBatchSequences": 1,
                "paddedBatchSize": padded_batch,
                "gradAccum": grad_accum,
                "lr": 1e-5,
                "dtype": "bf16",
                "attention": attention,
                "outputDir": str(out),
                "saveFinal": False,
                "resume": False,
                "checkpointEvery": 0,
                "checkpointAtEnd": False,
                "logEvery": 5,
            },
        }
    )
    torch.cuda.reset_peak_memory_stats()
    return train(cfg, log=print)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=800)
    p.add_argument("--max-length", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    # Padded rows reach 8192 tokens when a long sample is drawn: 2 rows keep the baseline in memory
    # without activation checkpointing (which would slow both modes alike).
    p.add_argument("--padded-batch", type=int, default=2)
    p.add_argument(
        "--padded-accum",
        type=int,
        help="micro-batches per padded step (default: as many as give the effective tokens of one packed sequence)",
    )
    p.add_argument("--attention", default="auto")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        pack = make_pack(work, args.samples, args.max_length, args.workers)
        manifest = json.loads((pack / "manifest.json").read_text())
        print(
            f"pack: {manifest['counts']['packed']} samples -> {manifest['sequences']} sequences, "
            f"fill {manifest['fill_ratio']:.3f} ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
        accum = {"packed": 1, "padded": args.padded_accum or padded_grad_accum(manifest, args.padded_batch)}
        print(f"padded: {args.padded_batch} samples x {accum['padded']} micro-batches per step", flush=True)
        results = {}
        for mode in ("packed", "padded"):
            t1 = time.perf_counter()
            results[mode] = run(
                pack, work / mode, mode, args.steps, args.padded_batch, args.attention, args.workers, accum[mode]
            )
            print(f"{mode}: {time.perf_counter() - t1:.0f}s", flush=True)
    header = (
        f"{'mode':7} {'tok/s':>9} {'eff tok/s':>10} {'padding':>8} {'MFU':>6} {'SM util':>8} {'peak mem':>9}"
    )
    print("\n" + header)
    for mode, r in results.items():
        sm = r.get("gpu_sm_utilization_mean")
        print(
            f"{mode:7} {r['tokens_per_second']:>9.0f} {r['effective_tokens_per_second']:>10.0f} "
            f"{r['padding_ratio']:>8.1%} {(r['mfu'] or 0):>6.1%} {'-' if sm is None else f'{sm:.0f}%':>8} "
            f"{r.get('peak_memory_bytes', 0) / 2**30:>7.1f}GiB"
        )
    ratio = (
        results["packed"]["effective_tokens_per_second"] / results["padded"]["effective_tokens_per_second"]
    )
    mfu = results["packed"]["mfu"] or 0.0
    verdict = {
        "effective_speedup": ratio,
        "speedup_target_met": ratio >= 2.0,
        "packed_mfu": mfu,
        "mfu_target_met": mfu >= 0.40,
        "attention": results["packed"]["attention"],
        "padded_grad_accum": accum["padded"],
    }
    print(
        f"\npacked/padded effective tokens/s: {ratio:.2f}x (target >= 2x); packed MFU {mfu:.1%} (target >= 40%)"
    )
    report = {
        "device": torch.cuda.get_device_name(),
        "args": vars(args) | {"out": str(args.out)},
        **verdict,
        "results": results,
    }
    print(json.dumps(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
