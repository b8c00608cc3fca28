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

`--family qwen3.5` trains a tiny Qwen3.5 (hybrid decoder) instead: its packed rows run the
linear-attention layers once per sample (see trainer/model/linear_attention.py on CPU), the padded
baseline once per padded row.

    python tests/bench/bench_train_cpu.py [--samples 300] [--steps 4] [--family qwen3.5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from packtrain.core.config import PackConfig
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import MODELS
from support.synth import generate_dataset

from packtrain.core.sft_config import SFTSpecCore
from packtrain.trainer.loop import train

MODEL = MODELS / "qwen2-vl"
TINY = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    "vision_config": {"depth": 2, "embed_dim": 64, "num_heads": 2, "hidden_size": 128},
}
# --family qwen3.5: the same body sizes as a hybrid decoder (three Gated DeltaNet linear-attention
# layers, then one full-attention layer), whose packed rows run the linear layers once per sample.
TINY_QWEN3_5 = {
    "text_config": {
        **{k: v for k, v in TINY.items() if k not in ("rope_scaling", "vision_config")},
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "rope_parameters": {"mrope_section": [2, 1, 1]},
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 128,
    },
}
FAMILIES = {"qwen2-vl": (MODEL, TINY), "qwen3.5": (MODELS / "qwen3.5", TINY_QWEN3_5)}


def make_pack(work: Path, samples: int, max_length: int, family: str = "qwen2-vl") -> Path:
    model = FAMILIES[family][0]
    data = generate_dataset(work / "data", samples, seed=0)
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(data)]},
            "model": {
                "family": family,
                "path": str(model),
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


def run(
    pack: Path,
    out: Path,
    mode: str,
    steps: int,
    packed_batch: int,
    padded_batch: int,
    family: str = "qwen2-vl",
) -> dict:
    model, tiny = FAMILIES[family]
    cfg = SFTSpecCore.model_validate(
        {
            "data": {"path": str(pack), "numWorkers": 1},
            "model": {"path": str(model), "init": "random", "configOverrides": tiny},
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
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen2-vl")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        pack = make_pack(work, args.samples, args.max_length, args.family)
        manifest = json.loads((pack / "manifest.json").read_text())
        print(
            f"pack: {manifest['counts']['packed']} samples -> {manifest['sequences']} sequences of "
            f"<= {args.max_length} tokens, fill {manifest['fill_ratio']:.3f} "
            f"({time.perf_counter() - t0:.1f}s)"
        )
        results = {
            mode: run(pack, work / mode, mode, args.steps, args.packed_batch, args.padded_batch, args.family)
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
