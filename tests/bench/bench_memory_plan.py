"""The memory planner (`packtrain.core.memory_plan`) against a measured CPU training step.

Each case runs in its own process, as the trainer sets it up (fp32 on CPU, sdpa): after the
model is built, freed heap goes back to the OS (`malloc_trim`), the peak RSS is reset
(`/proc/self/clear_refs`) and the first forward + backward is measured: peak VmHWM - VmRSS
before it = the step's gradients, activations, logits and temporaries (AdamW's state comes at
the optimizer step, after the window). The planner's matching figure is its gradients +
activations + logits rows (no reserve: that is the GPU runtime's), for the same row (its tokens
and its vision share). Printed: both figures and measured / planned; the band the planner promises
is BAND (measured / planned).

Shape: Qwen2.5-VL's layout, 512 wide, 4 decoder layers, a 4-block 256-wide vision tower, the real
vocabulary. Cases: text only, and a row with images (the synthetic mix), each with activation
checkpointing off and on.

    python tests/bench/bench_memory_plan.py [--quick] [--max-length N]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import MODELS

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GIB = 1 << 30
FOLDER = MODELS / "qwen2.5-vl"
BAND = (0.6, 1.5)
SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,  # head_dim 128: the real mRoPE sections
    "num_key_value_heads": 2,
    "vision_config": {
        "depth": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_heads": 4,
        "out_hidden_size": 512,
        "fullatt_block_indexes": [3],
    },
}
CASES = ("text", "text+ckpt", "images", "images+ckpt")


def _kib(field: str) -> int:
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line.split()[1] for line in lines if line.startswith(field)))


def _row(case: str, max_length: int, fam: Any, cfg: Any) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import gpu_bench

    samples = gpu_bench.draw_samples(300, 0, max_length, fam, cfg.vision_start_token_id)
    if case.startswith("text"):
        samples = [s for s in samples if not s["media"]]
    rows = gpu_bench.pack(samples, max_length)
    return max(rows, key=lambda r: (len(r["input_ids"]), sum(m["grid_t"] for m in r["media"])))


def child(case: str, max_length: int, threads: int) -> dict[str, Any]:
    """One case, measured in this process (run as a subprocess by `main`)."""
    import torch

    sys.path.insert(0, str(HERE))
    import gpu_bench

    gpu_bench.import_packtrain()
    from packtrain.trainer.model.build import (
        VLMForTraining,
        apply_layer_options,
        build_model,
        checked_spec,
        load_config,
    )
    from packtrain.trainer.model.loss import micro_batch_objective

    torch.set_num_threads(threads)
    cfg = load_config(FOLDER, SHAPE)
    fam = checked_spec(FOLDER, cfg)
    row = _row(case, max_length, fam, cfg)
    hf = build_model(FOLDER, init="random", overrides=SHAPE, seed=0)
    ckpt = case.endswith("ckpt")
    apply_layer_options(hf, ckpt, ckpt, False)
    core = VLMForTraining(hf, "sdpa").train()
    batch = gpu_bench.collate_packed([row], fam)

    def step() -> None:
        out = core(batch.inputs)
        micro_batch_objective(out["loss_sum"], batch.info.num_label_tokens, 1).backward()

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: RSS is what is live
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _kib("VmRSS:")
    step()
    patches = sum(m["grid_t"] * m["grid_h"] * m["grid_w"] for m in row["media"])
    return {
        "case": case,
        "tokens": len(row["input_ids"]),
        "vision_patches": patches,
        "measured_bytes": (_kib("VmHWM:") - before) * 1024,
    }


def planned(result: dict[str, Any]) -> float:
    """The planner's gradients + activations + logits for the measured row (fp32, one process)."""
    gpu_bench_dir = str(HERE)
    sys.path.insert(0, gpu_bench_dir)
    from packtrain.core.memory_plan import PlanInputs, plan_memory
    from packtrain.core.model_size import model_dims

    raw = json.loads((FOLDER / "config.json").read_text())
    raw = {**raw, **{k: v for k, v in SHAPE.items() if k != "vision_config"}}
    raw["vision_config"] = {**raw["vision_config"], **SHAPE["vision_config"]}
    dims = model_dims(raw)
    ckpt = result["case"].endswith("ckpt")
    share = result["vision_patches"] / dims.merge_size**2 / result["tokens"]
    x = PlanInputs(
        bf16=False,
        max_length=result["tokens"],
        vision_share=share,
        activation_checkpointing=ckpt,
        vision_checkpointing=ckpt,
    )
    rows = plan_memory(dims, x).rows
    keys = ("gradients (fp32)", "activations: decoder", "activations: vision", "logits (loss chunk)")
    return sum(rows[k] for k in keys)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="512-token rows, two cases")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--child", metavar="CASE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.max_length, args.threads)))
        return 0
    cases = CASES[::2] if args.quick else CASES
    length = 512 if args.quick else args.max_length
    rows = []
    print(f"{'case':12} {'tokens':>7} {'patches':>8} {'measured GiB':>13} {'planned GiB':>12} {'ratio':>6}")
    for case in cases:
        cmd = [sys.executable, __file__, "--child", case, "--max-length", str(length)]
        proc = subprocess.run(
            [*cmd, "--threads", str(args.threads)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["planned_bytes"] = planned(row)
        row["ratio"] = row["measured_bytes"] / row["planned_bytes"]
        rows.append(row)
        print(
            f"{case:12} {row['tokens']:>7} {row['vision_patches']:>8} {row['measured_bytes'] / GIB:>13.3f} "
            f"{row['planned_bytes'] / GIB:>12.3f} {row['ratio']:>6.2f}",
            flush=True,
        )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / ("bench_memory_plan.quick.json" if args.quick else "bench_memory_plan.json")
    out.write_text(json.dumps({"rows": rows, "band": BAND, "shape": SHAPE}, indent=1))
    inside = all(BAND[0] <= r["ratio"] <= BAND[1] for r in rows)
    print(f"measured / planned within {BAND}: {inside}")
    return 0 if inside else 1


if __name__ == "__main__":
    sys.exit(main())
