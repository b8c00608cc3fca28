"""CPU benchmark of the memory LoRA saves against full fine-tuning.

Cases: `full` (every parameter trains), `lora-r16` and `lora-r64` (adapters on the language
model's attention and MLP projections, the `model.lora` default scope), `lora-r16-vision` (the
vision blocks' projections too). Each runs in its own process as the trainer sets it up
(`lora.apply`, `param_groups.freeze`, AdamW over `param_groups.optimizer_groups`) for a few
optimizer steps on the same packed row as `bench_freeze_memory` (the shapes, the row and the
measurements are that benchmark's): peak RSS (VmHWM), RSS after building, and the growth between
them (gradients, AdamW state, activations). Frozen base weights get no gradient and no AdamW
state; activations still flow through every layer (the adapters' gradients need them), except
through a vision tower without adapters, which runs without autograd.

    python tests/bench/bench_lora_memory.py [--quick] [--shapes tiny 2b] [--max-length 1024] [--steps 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_freeze_memory as freeze_bench  # noqa: E402

RESULTS = HERE / "results"
GIB = 1 << 30
CASES: dict[str, dict[str, Any] | None] = {
    "full": None,
    "lora-r16": {"rank": 16, "alpha": 32},
    "lora-r64": {"rank": 64, "alpha": 128},
    "lora-r16-vision": {"rank": 16, "alpha": 32, "vision": True},
}


def child(shape: str, case: str, max_length: int, steps: int, threads: int) -> dict[str, Any]:
    """One case, in this process (run as a subprocess by `main`)."""
    import gpu_bench
    import torch

    gpu_bench.import_packtrain()
    from packtrain.core.sft_config import LoraSpec
    from packtrain.trainer.model import lora, param_groups
    from packtrain.trainer.model.build import VLMForTraining, build_model, checked_spec, load_config
    from packtrain.trainer.model.loss import micro_batch_objective

    torch.set_num_threads(threads)
    overrides = freeze_bench.SHAPES[shape]
    cfg = load_config(freeze_bench.QWEN2_VL, overrides)
    fam = checked_spec(freeze_bench.QWEN2_VL, cfg)
    samples = gpu_bench.draw_samples(200, 0, max_length, fam, cfg.vision_start_token_id)
    row = max(gpu_bench.pack(samples, max_length), key=freeze_bench._patches)
    hf = build_model(freeze_bench.QWEN2_VL, init="random", overrides=overrides, seed=0)
    if CASES[case] is not None:
        lora.apply(hf, LoraSpec.model_validate(CASES[case]), freeze_bench.QWEN2_VL)
    param_groups.freeze(hf, [])  # as the trainer: a vision prefix with nothing to train runs without autograd
    built_kib = freeze_bench._kib("VmRSS:")
    core = VLMForTraining(hf, "sdpa").train()
    optimizer = torch.optim.AdamW(param_groups.optimizer_groups(core, 1e-4, 0.0, {}))
    losses = []
    batch = gpu_bench.collate_packed([row], fam)
    for _ in range(steps):
        out = core(batch.inputs)
        micro_batch_objective(out["loss_sum"], batch.info.num_label_tokens, 1).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out["loss_sum"]) / batch.info.num_label_tokens)
    params = {id(p): p for p in core.parameters()}.values()
    return {
        "shape": shape,
        "case": case,
        "peak_rss_gib": freeze_bench._kib("VmHWM:") / 2**20,
        "built_rss_gib": built_kib / 2**20,
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "frozen_params": sum(p.numel() for p in params if not p.requires_grad),
        "tokens": len(row["input_ids"]),
        "vision_patches": freeze_bench._patches(row),
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny shape only, short rows, full vs lora-r16")
    shapes = list(freeze_bench.SHAPES)
    p.add_argument("--shapes", nargs="+", default=shapes, choices=shapes)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cases = list(CASES)
    if args.quick:
        args.shapes, args.max_length, cases = ["tiny"], 512, ["full", "lora-r16"]
    if args.child:
        print(json.dumps(child(*args.child, args.max_length, args.steps, args.threads)))
        return 0
    return freeze_bench.run_cases(args, cases, "full", "case", __file__, "bench_lora_memory")


if __name__ == "__main__":
    sys.exit(main())
