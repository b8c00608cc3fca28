"""CPU benchmark of the training options: activation checkpointing (decoder layers, vision blocks)
and torch.compile of the decoder layers, each on and off, on a small random-init Qwen2.5-VL.

Each configuration runs in its own process (peak memory is the process's VmHWM, the high-water
mark of its resident memory: model, AdamW state, activations) for a few optimizer steps on the
same packed batches (the device benchmark's in-memory mixed text/image/video rows, one packed
sequence per step, fp32); reported: peak RSS, time of the first step (compilation included) and
the mean of the others, and the loss of each step (the options must not change it beyond
float reordering).

    python tests/bench/bench_train_options.py [--quick] [--max-length 4096] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# Large enough that per-layer activations (tokens x hidden/intermediate) weigh next to the weights.
MODEL = {
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
    "vision_config": {
        "depth": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_heads": 4,
        "out_hidden_size": 512,
        "fullatt_block_indexes": [3],
    },
}
CONFIGS = {
    "baseline": (False, False, False),
    "activation_checkpointing": (True, False, False),
    "activation+vision_checkpointing": (True, True, False),
    "compile": (False, False, True),
}


def child(
    config: str, max_length: int, steps: int, samples: int, threads: int, quick: bool
) -> dict[str, Any]:
    """One configuration, in this process (run as a subprocess by `main`)."""
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
    sizes = gpu_bench.TINY if quick else MODEL
    cfg = load_config(gpu_bench.MODEL, sizes)
    fam = checked_spec(gpu_bench.MODEL, cfg)
    rows = gpu_bench.pack(
        gpu_bench.draw_samples(samples, 0, max_length, fam, cfg.vision_start_token_id), max_length
    )
    rows.sort(key=lambda r: -len(r["input_ids"]))
    hf = build_model(gpu_bench.MODEL, init="random", overrides=sizes, seed=0)
    apply_layer_options(hf, *CONFIGS[config])
    core = VLMForTraining(hf, "sdpa").train()
    optimizer = torch.optim.AdamW(core.parameters(), lr=1e-5)
    times, losses = [], []
    for step in range(steps):
        batch = gpu_bench.collate_packed([rows[step % len(rows)]], fam)
        t0 = time.perf_counter()
        out = core(batch.inputs)
        micro_batch_objective(out["loss_sum"], batch.info.num_label_tokens, 1).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(out["loss_sum"]) / batch.info.num_label_tokens)
    status = Path("/proc/self/status").read_text()
    hwm_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    return {
        "config": config,
        "peak_rss_gib": hwm_kib / 2**20,
        "first_step_seconds": times[0],
        "step_seconds": sum(times[1:]) / max(1, len(times) - 1),
        "losses": losses,
        "tokens_per_step": [len(rows[s % len(rows)]["input_ids"]) for s in range(steps)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="the tiny model, short sequences, 2 steps, no compile"
    )
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.max_length, args.steps, args.samples = 1024, 2, 12
        args.configs = "baseline,activation+vision_checkpointing"
    if args.child:
        result = child(args.child, args.max_length, args.steps, args.samples, args.threads, args.quick)
        print(json.dumps(result))
        return 0
    rows = []
    for config in args.configs.split(","):
        cmd = [sys.executable, __file__, "--child", config, "--max-length", str(args.max_length)]
        cmd += ["--steps", str(args.steps), "--samples", str(args.samples), "--threads", str(args.threads)]
        cmd += ["--quick"] if args.quick else []
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{config}: {json.dumps(rows[-1])}", flush=True)
    base = rows[0]
    print(f"\n{'config':34} {'peak RSS':>9} {'vs base':>8} {'step s':>7} {'vs base':>8} {'first step s':>13}")
    for r in rows:
        print(
            f"{r['config']:34} {r['peak_rss_gib']:>7.2f}GiB {r['peak_rss_gib'] / base['peak_rss_gib']:>8.2f} "
            f"{r['step_seconds']:>7.2f} {r['step_seconds'] / base['step_seconds']:>8.2f} "
            f"{r['first_step_seconds']:>13.1f}"
        )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    name = "bench_train_options.quick.json" if args.quick else "bench_train_options.json"
    (args.results_dir / name).write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
