"""The memory planner's figures for Qwen2.5-VL 7B, 32B and 72B on 8-GPU H200 nodes (141 GiB each).

Released sizes (hidden, MLP, layers, heads, KV heads; vocabulary 152,064, untied LM head): 7B
3584 / 18944 / 28 / 28 / 4, 32B 5120 / 27648 / 64 / 40 / 8, 72B 8192 / 29568 / 80 / 64 / 8; the
vision tower is the 3B's (the shared config) with `out_hidden_size` = hidden. Full fine-tuning,
FSDP over 8, 16, 32 and 64 GPUs, activation checkpointing off and on (decoder and vision blocks
together), maxLength 8192 and 32768, one sequence per micro-batch, the planner's default vision
share. Prints the per-GPU totals (and whether each fits) and writes every row's breakdown to
`tests/bench/results/plan_table.json`. Pure arithmetic: runs anywhere in a second.

    python tests/bench/plan_table.py [--gpu-memory 141Gi] [--lengths 8192 32768]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import MODELS
from support.qwen_sizes import RELEASED, released_overrides

from packtrain.core.memory_plan import GIB, PlanInputs, parse_bytes, plan_memory
from packtrain.core.model_size import ModelDims, model_dims, param_counts, read_config

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORLD_SIZES = (8, 16, 32, 64)
GPUS_PER_NODE = 8


def dims(size: str) -> ModelDims:
    """Qwen2.5-VL at a released size: the shared 3B config with the text sizes replaced."""
    return model_dims(read_config(MODELS / "qwen2.5-vl", released_overrides(size)))


def rows(gpu_memory: int, lengths: list[int]) -> list[dict[str, Any]]:
    out = []
    for size in RELEASED:
        d = dims(size)
        for length in lengths:
            for world in WORLD_SIZES:
                for ckpt in (False, True):
                    x = PlanInputs(
                        world_size=world,
                        gpus_per_host=GPUS_PER_NODE,
                        strategy="fsdp",
                        activation_checkpointing=ckpt,
                        vision_checkpointing=ckpt,
                        max_length=length,
                        gpu_memory=gpu_memory,
                    )
                    plan = plan_memory(d, x)
                    out.append(
                        {
                            "model": size,
                            "parameters": param_counts(d).total,
                            "max_length": length,
                            "gpus": world,
                            "checkpointing": ckpt,
                            "per_gpu_gib": plan.total / GIB,
                            "per_host_gib": plan.per_host / GIB,
                            "fits": plan.fits,
                            "rows_gib": {k: v / GIB for k, v in plan.rows.items()},
                        }
                    )
    return out


def print_table(table: list[dict[str, Any]], gpu_memory: int) -> None:
    print(f"Per-GPU GiB (FSDP, full fine-tuning, {gpu_memory / GIB:.0f} GiB GPUs; * = does not fit)")
    print(
        f"{'model':5} {'params':>7} {'maxLength':>9} {'ckpt':>5} " + " ".join(f"{w:>8}" for w in WORLD_SIZES)
    )
    keys = sorted({(r["model"], r["max_length"], r["checkpointing"]) for r in table}, key=lambda k: (
        list(RELEASED).index(k[0]), k[1], k[2]))  # fmt: skip
    for model, length, ckpt in keys:
        cells = [
            r for r in table if (r["model"], r["max_length"], r["checkpointing"]) == (model, length, ckpt)
        ]
        params = f"{cells[0]['parameters'] / 1e9:.2f}B"
        values = " ".join(f"{c['per_gpu_gib']:>7.1f}{' ' if c['fits'] else '*'}" for c in cells)
        print(f"{model:5} {params:>7} {length:>9} {'on' if ckpt else 'off':>5} {values}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-memory", default="141Gi", help="memory of one GPU (default: %(default)s, H200)")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    memory = parse_bytes(args.gpu_memory)
    table = rows(memory, args.lengths)
    print_table(table, memory)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "plan_table.json").write_text(
        json.dumps({"gpu_memory": memory, "rows": table}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
