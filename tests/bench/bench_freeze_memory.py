"""CPU benchmark of the memory freezing saves: model.freeze none, [vision], [vision, merger], [llm].

Each case runs in its own process, as the trainer sets it up (`param_groups.freeze`, then AdamW
over `param_groups.optimizer_groups`), for a few optimizer steps on the same packed row of the
device benchmark's synthetic text/image/video mix, fp32. Reported: the process's peak RSS
(VmHWM: weights, gradients, AdamW state, activations), the RSS right after building the model
(weights and imports), the growth between them (what training adds: gradients, AdamW state,
activations) and trainable / frozen parameter counts. Frozen parameters get no
gradient and no AdamW state (12 bytes each in fp32), and a frozen tower keeps no activations.

Shapes: `tiny` (the test model), `2b` (Qwen2-VL-2B's widths and vocabulary, with 2 decoder
layers and 4 vision blocks so it fits a few GB). A case whose estimate exceeds the memory
available is skipped and says so.

    python tests/bench/bench_freeze_memory.py [--quick] [--shapes tiny 2b] [--max-length 1024] [--steps 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import MODELS

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GIB = 1 << 30
QWEN2_VL = MODELS / "qwen2-vl"
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 64},
    },
    "2b": {"num_hidden_layers": 2, "vision_config": {"depth": 4}},
}
CASES: dict[str, list[str]] = {
    "none": [],
    "vision": ["vision"],
    "vision+merger": ["vision", "merger"],
    "llm": ["llm"],
}


def _kib(field: str, path: str = "/proc/self/status") -> int:
    return int(
        next(line.split()[1] for line in Path(path).read_text().splitlines() if line.startswith(field))
    )


def _patches(row: dict[str, Any]) -> int:
    return sum(m["grid_t"] * m["grid_h"] * m["grid_w"] for m in row["media"])


def child(shape: str, case: str, max_length: int, steps: int, threads: int) -> dict[str, Any]:
    """One case, in this process (run as a subprocess by `main`)."""
    import torch

    sys.path.insert(0, str(HERE))
    import gpu_bench

    gpu_bench.import_packtrain()
    from packtrain.trainer.model import param_groups
    from packtrain.trainer.model.build import VLMForTraining, build_model, checked_spec, load_config
    from packtrain.trainer.model.loss import micro_batch_objective

    torch.set_num_threads(threads)
    cfg = load_config(QWEN2_VL, SHAPES[shape])
    fam = checked_spec(QWEN2_VL, cfg)
    samples = gpu_bench.draw_samples(200, 0, max_length, fam, cfg.vision_start_token_id)
    # The packed row with the most vision patches: the tower's activations are what freezing it spares.
    row = max(gpu_bench.pack(samples, max_length), key=_patches)
    hf = build_model(QWEN2_VL, init="random", overrides=SHAPES[shape], seed=0)
    param_groups.freeze(hf, CASES[case])
    built_kib = _kib("VmRSS:")
    core = VLMForTraining(hf, "sdpa").train()
    optimizer = torch.optim.AdamW(param_groups.optimizer_groups(core, 1e-5, 0.1, {}))
    losses = []
    batch = gpu_bench.collate_packed([row], fam)
    for _ in range(steps):
        out = core(batch.inputs)
        micro_batch_objective(out["loss_sum"], batch.info.num_label_tokens, 1).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out["loss_sum"]) / batch.info.num_label_tokens)
    counts = param_groups.trainable_counts(core)
    return {
        "shape": shape,
        "case": case,
        "peak_rss_gib": _kib("VmHWM:") / 2**20,
        "built_rss_gib": built_kib / 2**20,
        "trainable_params": sum(v for k, v in counts.items() if k.endswith("_trainable")),
        "frozen_params": sum(v for k, v in counts.items() if k.endswith("_frozen")),
        "tokens": len(row["input_ids"]),
        "media": len(row["media"]),
        "vision_patches": _patches(row),
        "losses": losses,
    }


def estimate_bytes(shape: str) -> int:
    """Full fine-tuning's fp32 weights + gradients + AdamW state (16 bytes a parameter), plus 1 GiB."""
    sys.path.insert(0, str(HERE))
    import gpu_bench

    gpu_bench.import_packtrain()
    import torch

    from packtrain.trainer.model.build import build_model

    with torch.device("meta"):
        hf = build_model(QWEN2_VL, init="random", overrides=SHAPES[shape], device="meta")
    return 16 * sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values()) + GIB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny shape only, short rows")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.max_length = ["tiny"], 512
    if args.child:
        print(json.dumps(child(*args.child, args.max_length, args.steps, args.threads)))
        return 0
    return run_cases(args, CASES, "none", "freeze", __file__, "bench_freeze_memory")


def run_cases(
    args: argparse.Namespace, cases: Sequence[str], base: str, label: str, script: str, name: str
) -> int:
    """Each (shape, case) in a child process of `script`, a table of peak RSS and the growth saved
    against the `base` case, and the rows as JSON (shared with bench_lora_memory)."""
    rows: list[dict[str, Any]] = []
    for shape in args.shapes:
        need, available = estimate_bytes(shape), _kib("MemAvailable:", "/proc/meminfo") * 1024
        if need > available:
            print(f"{shape}: skipped, needs ~{need / GIB:.1f} GiB, {available / GIB:.1f} GiB available")
            continue
        for case in cases:
            cmd = [sys.executable, script, "--child", shape, case, "--max-length", str(args.max_length)]
            cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"{shape} {case}: {json.dumps(rows[-1])}", flush=True)
    print(f"\n{'shape':6} {label:16} {'trainable':>12} {'frozen':>12} {'built GiB':>10} {'peak RSS GiB':>13} "
          f"{'growth GiB':>11} {'growth saved':>13}")  # fmt: skip
    for row in rows:
        first = next(r for r in rows if r["shape"] == row["shape"] and r["case"] == base)
        row["growth_gib"] = row["peak_rss_gib"] - row["built_rss_gib"]
        saved = 1 - row["growth_gib"] / (first["peak_rss_gib"] - first["built_rss_gib"])
        print(
            f"{row['shape']:6} {row['case']:16} {row['trainable_params']:>12,} {row['frozen_params']:>12,} "
            f"{row['built_rss_gib']:>10.2f} {row['peak_rss_gib']:>13.2f} {row['growth_gib']:>11.2f} "
            f"{saved:>13.1%}"
        )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = f"{name}.quick.json" if args.quick else f"{name}.json"
    (args.results_dir / out).write_text(json.dumps({"rows": rows, "max_length": args.max_length}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
