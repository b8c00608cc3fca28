"""CPU benchmark: packed vs padded training throughput on the same mixed data, one run.

Generates a deterministic text/image/video dataset (`support.synth`),
packs it with the real packer, then trains a tiny random-init Qwen2-VL built
from the shared config twice on that pack: packed (one row per packed sequence,
block-diagonal attention) and the padded baseline (one sample per row, padded to
the longest in the batch). Prints effective (non-padding) tokens/s of each,
their ratio, the fraction of processed token slots each wastes on padding, and
the model FLOPs each spends per effective token.

Reading the CPU numbers: a tiny model's cost is dominated by the 151,936-entry
vocabulary projection, which runs on label tokens only and so costs the same in
both modes; padding is wasted in the (tiny) transformer body. The FLOPs ratio
shows what padding costs once the body dominates, as it does for real models
(see gpu_bench.py).

    python tests/bench/bench_train_cpu.py [--samples 300] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from packtrain.packer.core.config import PackConfig
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.synth import generate_dataset

from packtrain.trainer.config import SFTSpecCore
from packtrain.trainer.loop import train

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO.parent / "shared" / "models" / "qwen2-vl"
TINY = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    "vision_config": {"depth": 2, "embed_dim": 64, "num_heads": 2, "hidden_size": 128},
}


def make_pack(work: Path, samples: int, max_length: int) -> Path:
    data = generate_dataset(work / "data", samples, seed=0)
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(data)]},
            "model": {
                "path": str(MODEL),
                "maxPixels": 64 * 28 * 28,
                "videoMaxPixels": 16 * 28 * 28,
                "maxFrames": 8,
            },
            "packing": {"maxLength": max_length, "overlong": "truncate"},
        }
    )
    out = work / "pack"
    convert(cfg, out, 0, 1)
    plan(cfg, out)
    materialize(cfg, out, 0, 1)
    return out


def run(pack: Path, out: Path, mode: str, steps: int, packed_batch: int, padded_batch: int) -> dict:
    cfg = SFTSpecCore.model_validate(
        {
            "data": {"path": str(pack), "numWorkers": 1},
            "model": {"path": str(MODEL), "init": "random", "configOverrides": TINY},
            "training": {
                "maxSteps": steps,
                "mode": mode,
                "microBatchSequences": packed_batch,
                "paddedBatchSize": padded_batch,
                "lr": 1e-4,
                "outputDir": str(out),
                "saveFinal": False,
                "resume": False,
            },
        }
    )
    return train(cfg, log=lambda _: None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    # About the same effective tokens per step in both modes (the synthetic mix averages ~1.1k
    # tokens per sample), so per-step overheads weigh the same.
    p.add_argument("--packed-batch", type=int, default=4, help="packed sequences per step")
    p.add_argument("--padded-batch", type=int, default=8, help="samples per step")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        pack = make_pack(work, args.samples, args.max_length)
        manifest = json.loads((pack / "manifest.json").read_text())
        print(
            f"pack: {manifest['counts']['packed']} samples -> {manifest['sequences']} sequences of "
            f"<= {args.max_length} tokens, fill {manifest['fill_ratio']:.3f} ({time.perf_counter() - t0:.1f}s)"
        )
        results = {
            mode: run(pack, work / mode, mode, args.steps, args.packed_batch, args.padded_batch)
            for mode in ("packed", "padded")
        }
    print(
        f"\n{'mode':8} {'steps':>5} {'samples/s':>10} {'tokens/s':>10} {'effective tok/s':>16} {'padding':>8}"
    )
    for mode, r in results.items():
        print(
            f"{mode:8} {r['steps']:>5} {r['samples_per_second']:>10.2f} {r['tokens_per_second']:>10.1f} "
            f"{r['effective_tokens_per_second']:>16.1f} {r['padding_ratio']:>8.1%}"
        )
    ratio = (
        results["packed"]["effective_tokens_per_second"] / results["padded"]["effective_tokens_per_second"]
    )
    flops = {m: r["model_flops_per_effective_token"] for m, r in results.items()}
    print(f"\npacked / padded effective tokens/s: {ratio:.2f}x")
    print(f"padded / packed model FLOPs per effective token: {flops['padded'] / flops['packed']:.2f}x")
    print(
        json.dumps(
            {
                "ratio_effective_tokens_per_second": ratio,
                "packed_padding_fraction": results["packed"]["padding_ratio"],
                "padded_padding_fraction": results["padded"]["padding_ratio"],
                "pack_fill_ratio": manifest["fill_ratio"],
                "flops_per_effective_token": flops,
                **{
                    f"{m}_effective_tokens_per_second": r["effective_tokens_per_second"]
                    for m, r in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
