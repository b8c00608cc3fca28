"""CPU benchmark of context parallelism: per-rank peak host memory and step time of one training
step on a packed row of 8k, 16k and 32k tokens, with `training.contextParallel` 1, 2 and 4.

The model is a random-init Qwen2-VL (fp32) wide enough that a long row's activations outweigh its
state: hidden 1024, intermediate 2816, 2 decoder layers, 8 query / 2 K/V heads (head dim 128, so
contextParallel 4 splits the heads), a 2-block vision tower and the real 151,936-token vocabulary,
which stays (the tokenizer must match) and makes the tied embedding / LM head 156 M of the model's
182 M parameters: the model state (fp32 weights, gradients, AdamW: 16 bytes a parameter, 2.7 GiB
in one process) is mostly that one tensor. What grows with the row is the activations (~linear in
tokens: ~122 KiB a token measured, so they pass the model state at ~23k tokens) and the attention
mask (quadratic: it passes the per-token activations at ~14k).

Each length gets its own pack of the shared text chats (fastchat, glaive tool calls) and the
multimodal demo set (a few images), at maxLength 8192 / 16384 / 32768, so that every micro-batch is
one near-full row. Each (length, N) trains that pack with the trainer's own `loop.train` for
`--steps` steps: N = 1 is one plain process without a process group, N > 1 is N gloo ranks under
torchrun with `strategy: fsdp` and `contextParallel: N` (one thread per rank, attention `sdpa`, the
CPU path). Hooks around `loop.setup` and `loop.train_step` read, in every rank, the RSS after imports
and the process group ("base"), and per step the high-water mark of its resident memory (VmHWM,
reset through /proc/self/clear_refs after freed memory is handed back with malloc_trim) and the
step's wall and CPU seconds (the CPU time of the rank's one thread: the work it was given, which
the wall time on a shared 2-core machine is not). Reported per (length, N): the last step's peak
over base (the steady state: AdamW's moments exist from the first step on), the largest over the
ranks, and its ratio to N = 1; the step's seconds, the largest rank's CPU seconds and their
ratios; the row's tokens and each step's loss (which must equal N = 1's: the same rows, split).

The mask: `sdpa` isolates the samples of a row with a dense (T x T) boolean block-causal mask that
every rank builds for the whole row (T² bytes: 1 GiB at 32k), and PyTorch's CPU attention converts
it to an additive fp32 mask (4 T² bytes) in each decoder layer's call and keeps that copy for the
backward, so a step holds T² + 4 T² x layers of mask whatever N is (9 GiB at 32k with 2 layers;
an additive fp32 mask passed in is used as is, one 4 T² for all layers).
Ulysses splits the heads, never the keys, so none of this shrinks with N. The table gives it as its
own column (computed) and the rest of the peak net of it and of the rank's model state
("activations": what context parallelism should divide by N, but for one part that stays: the
LM head's logits of one loss chunk, 1024 label tokens x 151,936 x 4 bytes = 594 MiB, and their
gradient).

A configuration the memory available cannot hold (estimated from N = 1 at that length, or at the
longest ones run, extrapolated, plus what context-parallel runs so far held beyond their share) is
skipped and marked so in the table; one that fails (a rank killed when others' jobs took the memory)
is marked failed, and the benchmark goes on.

    python tests/bench/bench_context_parallel.py [--quick] [--lengths 8192 16384 32768] [--cp 1 2 4]
        [--steps 2] [--work-dir DIR] [--results-dir DIR] [--previous JSON]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from cluster.controlplane import free_port
from support.paths import DATASETS, DEMO, MODELS
from support.rank_memory import hand_back, reset_peak, state_bytes, status_kib

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MIB = 1 << 20
SOURCE = MODELS / "qwen2-vl"  # config, tokenizer and processor files (no weights)
MODEL = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_window_layers": 2,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 2, "embed_dim": 384, "num_heads": 6, "hidden_size": 1024},
}
QUICK_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_window_layers": 2,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 64},
}
TEXT = [DATASETS / "text-sft" / "fastchat" / "*.json", DATASETS / "text-sft" / "glaive-toolcall" / "*.json"]
# The share of the memory available a configuration may plan to use: the machine is shared, and a
# rank that runs it out is killed (and, ours being the likelier victims, see `rank_run`, not another's).
MEMORY_SHARE = 0.8
LOSS_RTOL = 1e-4  # fp32, the same rows split N ways: only the order of sums differs


# -- the packs (made once per length under the work folder) -------------------------------------------


def make_pack(work: Path, max_length: int, quick: bool) -> Path:
    """The shared text chats and the image demo set packed at `max_length`: near-full rows."""
    out = work / f"pack-L{max_length}{'-quick' if quick else ''}"
    if (out / "manifest.json").is_file():
        return out
    from support.pack_runner import run_in_process

    from packtrain.core.config import PackConfig

    paths = [DEMO / "mllm_demo.json", *(TEXT[:1] if quick else TEXT)]
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(p) for p in paths]},
            "model": {"family": "qwen2-vl", "path": str(SOURCE), "maxPixels": 48 * 28 * 28},
            "packing": {"maxLength": max_length, "sequencesPerShard": 16},
        }
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run_in_process(cfg, tmp)
    tmp.rename(out)
    return out


def job_spec(pack: Path, output: Path, cp: int, steps: int, quick: bool) -> dict[str, Any]:
    return {
        "data": {"path": str(pack), "numWorkers": 0},
        "model": {
            "path": str(SOURCE),
            "init": "random",
            "configOverrides": QUICK_MODEL if quick else MODEL,
        },
        "training": {
            "maxSteps": steps,
            "lr": 1e-5,
            "strategy": "fsdp",
            "contextParallel": cp,
            "dtype": "fp32",
            "attention": "sdpa",
            "resume": False,
            "checkpointAtEnd": False,
            "saveFinal": False,
            "outputDir": str(output),
        },
    }


# -- inside each rank ---------------------------------------------------------------------------------


def _sync() -> None:
    """Every rank at the same point, the memory freed so far handed back to the system."""
    import torch.distributed as dist

    hand_back()
    if dist.is_initialized():
        dist.barrier()


class Meter:
    """The RSS before the model is built, and each training step's peak RSS and seconds."""

    def __init__(self) -> None:
        self.base_mib = 0.0
        self.steps: list[dict[str, Any]] = []

    def setup(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def measured(*args: Any, **kwargs: Any) -> Any:
            _sync()
            self.base_mib = status_kib("VmRSS:") / 1024  # after imports and the process group
            return fn(*args, **kwargs)

        return measured

    def step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def measured(run: Any, micro: list[Any], *args: Any, **kwargs: Any) -> Any:
            _sync()
            reset_peak()
            start, clock, cpu = status_kib("VmRSS:") / 1024, time.perf_counter(), time.process_time()
            loss = fn(run, micro, *args, **kwargs)
            seconds, cpu_seconds = time.perf_counter() - clock, time.process_time() - cpu
            peak = status_kib("VmHWM:") / 1024
            self.steps.append(
                {
                    "peak_mib": peak,
                    "start_mib": start,
                    "seconds": seconds,
                    "cpu_seconds": cpu_seconds,
                    "tokens": sum(int(b.inputs.input_ids.shape[1]) for b in micro),
                    "label_tokens": sum(int(b.info.num_label_tokens) for b in micro),
                    "loss": loss,
                    "state_mib": sum(state_bytes(run.model, run.optimizer).values()) / MIB,
                }
            )
            _sync()
            return loss

        return measured


def rank_run(job: Path, out: Path) -> None:
    """One rank (under torchrun, or alone): `loop.train` with its steps measured; writes
    `out/rank-R.json`."""
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(OSError):  # when memory runs out, the kernel kills a benchmark rank first
        Path("/proc/self/oom_score_adj").write_text("1000")
    from packtrain.core.sft_config import SFTSpecCore
    from packtrain.trainer import distributed, loop

    cfg = SFTSpecCore.model_validate(json.loads(job.read_text()))
    meter = Meter()
    loop.setup = meter.setup(loop.setup)  # type: ignore[assignment]
    loop.train_step = meter.step(loop.train_step)  # type: ignore[assignment]
    loop.train(cfg, log=lambda _: None)
    env = distributed.environ()
    record = {"rank": env.rank, "world": env.world_size, "base_mib": meter.base_mib, "steps": meter.steps}
    (out / f"rank-{env.rank}.json").write_text(json.dumps(record, indent=1))


# -- the driver -----------------------------------------------------------------------------------------


def run_config(spec: dict[str, Any], ranks: int, run_dir: Path, timeout: float) -> list[dict[str, Any]]:
    """Train `spec` on `ranks` processes (torchrun; one plain process for 1); each rank's record."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = json.loads(json.dumps(spec))
    spec["training"]["outputDir"] = str(run_dir / "out")
    job = run_dir / "job.json"
    job.write_text(json.dumps(spec))
    script = [str(Path(__file__).resolve()), "--rank-run", str(job), str(run_dir)]
    if ranks == 1:
        cmd = [sys.executable, *script]
    else:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--nproc-per-node", str(ranks), "--master-port", str(free_port()), *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        ["nice", "-n", "10", *cmd], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{ranks} rank(s) failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads((run_dir / f"rank-{r}.json").read_text()) for r in range(ranks)]
    shutil.rmtree(run_dir / "out", ignore_errors=True)
    return rows


def mask_mib(tokens: int, layers: int) -> float:
    """What a step holds of the sdpa mask on every rank: the (T x T) boolean block mask and, per
    decoder layer, PyTorch's fp32 additive copy of it, kept for the backward (see the docstring)."""
    return (tokens * tokens + layers * 4 * tokens * tokens) / MIB


def summarise(ranks: list[dict[str, Any]], layers: int) -> dict[str, Any]:
    """The last step (AdamW's moments allocated, as in every step after the first) of the rank with
    the highest peak, the others' range, and the split of that peak."""
    last = [r["steps"][-1] for r in ranks]
    over = [s["peak_mib"] - r["base_mib"] for s, r in zip(last, ranks, strict=True)]
    worst = max(range(len(ranks)), key=lambda i: over[i])
    step = last[worst]
    n = len(ranks)
    padded = -(-step["tokens"] // (2 * n)) * (2 * n) if n > 1 else step["tokens"]
    mask = mask_mib(padded, layers)
    return {
        "tokens": step["tokens"],
        "padded_tokens": padded,
        "label_tokens": step["label_tokens"],
        "base_mib": ranks[worst]["base_mib"],
        "peak_over_base_mib": over[worst],
        "min_peak_over_base_mib": min(over),
        "state_mib": step["state_mib"],
        "mask_mib": mask,
        "activations_mib": over[worst] - step["state_mib"] - mask,
        "step_s": max(s["seconds"] for s in last),
        "step_cpu_s": max(s["cpu_seconds"] for s in last),
        "first_step_s": max(r["steps"][0]["seconds"] for r in ranks),
        "losses": [s["loss"] for s in ranks[0]["steps"]],
        "step_tokens": [s["tokens"] for s in ranks[0]["steps"]],
    }


def estimate_need_mib(
    length: int, n: int, done: dict[int, dict[int, dict[str, Any]]], layers: int, embedding_mib: float
) -> float | None:
    """What `n` ranks need together at `length`, from the runs so far: per rank the base, 1/N of one
    process's model state and activations, the mask, and for N > 1 what a rank holds beyond those
    (the vocabulary weight gathered whole, the all-to-all buffers): the most any context-parallel run
    so far held, else the embedding's size. One process's activations at this length, else the line
    through its two longest lengths (the loss chunk's logits are a constant part), else its one
    length's scaled by tokens. None without any one-process run."""
    singles = {length_: cps[1] for length_, cps in done.items() if "step_s" in cps.get(1, {})}
    if not singles:
        return None

    def activations(at: int) -> float:
        if at in singles:
            return float(singles[at]["activations_mib"])
        if len(singles) >= 2:
            (l1, r1), (l2, r2) = sorted(singles.items())[-2:]
            slope = (r2["activations_mib"] - r1["activations_mib"]) / (l2 - l1)
            return max(0.0, r2["activations_mib"] + slope * (at - l2))
        ((l1, r1),) = singles.items()
        return max(0.0, r1["activations_mib"] * at / l1)

    ref = singles[max(singles)]
    state = ref["state_mib"]
    extra = 0.0
    if n > 1:
        held = [
            r["peak_over_base_mib"] - (state + activations(at)) / m - r["mask_mib"]
            for at, cps in done.items()
            for m, r in cps.items()
            if m > 1 and "step_s" in r
        ]
        extra = max(held, default=embedding_mib)
    per_rank = ref["base_mib"] + (state + activations(length)) / n + mask_mib(length, layers) + extra
    return n * per_rank


def measure(args: argparse.Namespace) -> dict[int, dict[int, dict[str, Any]]]:
    """Every (length, N) that fits in the memory available: its summary, or why it was skipped."""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = QUICK_MODEL if args.quick else MODEL
    layers = int(model["num_hidden_layers"])
    embedding_mib = 151_936 * int(model["hidden_size"]) * 4 / MIB
    done: dict[int, dict[int, dict[str, Any]]] = {}
    earlier = previous_runs(args.previous, model)
    for length in args.lengths:
        clock = time.perf_counter()
        pack = make_pack(args.work_dir, length, args.quick)
        print(f"pack at {length:,} tokens: {time.perf_counter() - clock:.0f} s", flush=True)
        done[length] = {}
        for n in sorted(set(args.cp)):
            if "step_s" in earlier.get(length, {}).get(n, {}):
                done[length][n] = earlier[length][n] | {"previous": True}
                print(f"{length:,} tokens, CP {n}: from {args.previous}", flush=True)
                continue
            need = estimate_need_mib(length, n, done, layers, embedding_mib)
            available = status_kib("MemAvailable:", "/proc/meminfo") / 1024
            if need is not None and need > MEMORY_SHARE * available and not args.force:
                reason = f"needs ~{need:,.0f} MiB, {available:,.0f} MiB available"
                done[length][n] = {"skipped": reason, "need_mib": need, "available_mib": available}
                print(f"{length:,} tokens, CP {n}: skipped, {reason}", flush=True)
                continue
            load = os.getloadavg()[0]
            spec = job_spec(pack, args.work_dir / "out", n, args.steps, args.quick)
            try:
                ranks = run_config(spec, n, args.work_dir / f"run-L{length}-cp{n}", args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # e.g. killed when memory ran out
                done[length][n] = {"failed": str(e).splitlines()[0], "error": str(e)}
                print(f"{length:,} tokens, CP {n}: FAILED, {e}", flush=True)
                continue
            row = summarise(ranks, layers)
            row |= {"need_mib": need, "load_before": load, "load_after": os.getloadavg()[0], "ranks": ranks}
            done[length][n] = row
            print(
                f"{length:,} tokens, CP {n}: peak {row['peak_over_base_mib']:,.0f} MiB over base, "
                f"step {row['step_s']:.1f} s (load {load:.1f})",
                flush=True,
            )
    return done


def previous_runs(path: Path | None, model: dict[str, Any]) -> dict[int, dict[int, dict[str, Any]]]:
    """The measured configurations of an earlier invocation's JSON (`--previous`), for the same model."""
    if path is None:
        return {}
    earlier = json.loads(path.read_text())
    if earlier["meta"]["model"] != model:
        raise SystemExit(f"{path} measured another model; leave --previous out")
    return {int(length): {int(n): r for n, r in cps.items()} for length, cps in earlier["runs"].items()}


def table_rows(done: dict[int, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (length, N), with ratios to N = 1 at the same length and the loss check."""
    rows = []
    for length, cps in done.items():
        one = cps[1] if "step_s" in cps.get(1, {}) else None
        for n, r in cps.items():
            row: dict[str, Any] = {"max_length": length, "cp": n, "previous": r.get("previous", False)}
            if "step_s" not in r:
                rows.append(row | {k: r[k] for k in ("skipped", "failed") if k in r})
                continue
            keys = (
                "tokens",
                "peak_over_base_mib",
                "mask_mib",
                "state_mib",
                "activations_mib",
                "step_s",
                "step_cpu_s",
            )
            row |= {k: r[k] for k in keys}
            if one is not None:
                row["peak_ratio"] = r["peak_over_base_mib"] / one["peak_over_base_mib"]
                row["activations_ratio"] = r["activations_mib"] / one["activations_mib"]
                row["step_ratio"] = r["step_s"] / one["step_s"]
                row["cpu_ratio"] = r["step_cpu_s"] / one["step_cpu_s"]
                same_rows = r["step_tokens"] == one["step_tokens"]
                close = all(
                    abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(r["losses"], one["losses"], strict=True)
                )
                row["loss_equal"] = same_rows and close
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title="Per-rank peak RSS over the post-import base (largest rank), last step, MiB")
    heads = ("maxLength", "CP", "row tokens", "peak", "/ CP 1", "mask", "state", "activations", "/ CP 1")
    for header in (*heads, "step s", "/ CP 1", "CPU s", "/ CP 1", "loss = CP 1"):
        table.add_column(header, justify="right")

    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f}" if key in r else "-"

    for r in rows:
        if "step_s" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r['failed']}"
            table.add_row(f"{r['max_length']:,}", str(r["cp"]), why)
            continue
        table.add_row(
            f"{r['max_length']:,}",
            f"{r['cp']}{'*' if r['previous'] else ''}",
            f"{r['tokens']:,}",
            f"{r['peak_over_base_mib']:,.0f}",
            ratio(r, "peak_ratio"),
            f"{r['mask_mib']:,.0f}",
            f"{r['state_mib']:,.0f}",
            f"{r['activations_mib']:,.0f}",
            ratio(r, "activations_ratio"),
            f"{r['step_s']:.1f}",
            ratio(r, "step_ratio"),
            f"{r['step_cpu_s']:.1f}",
            ratio(r, "cpu_ratio"),
            {True: "yes", False: "NO"}.get(r.get("loss_equal"), "-"),  # type: ignore[arg-type]
        )
    console.print(table)
    print(
        "mask: the (T x T) bool block mask + its fp32 copy per decoder layer (sdpa on CPU), the same "
        "on every rank; state: the rank's weights, gradients and AdamW moments; activations: the rest; "
        "*: from --previous"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="pack maxLength")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="contextParallel sizes")
    p.add_argument("--steps", type=int, default=2, help="the last one is reported")
    p.add_argument(
        "--quick", action="store_true", help="a tiny model at 1024 tokens, CP 1 and 2: a smoke run"
    )
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "packtrain-bench-cp")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per configuration")
    p.add_argument("--force", action="store_true", help="run every configuration, whatever the estimate")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--previous", type=Path, help="an earlier JSON: its measured configurations are kept")
    p.add_argument("--rank-run", nargs=2, type=Path, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.cp = [1024], [1, 2]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.rank_run:
        rank_run(*args.rank_run)
        return 0
    done = measure(args)
    rows = table_rows(done)
    print_table(rows)
    meta = {
        "model": QUICK_MODEL if args.quick else MODEL,
        "vocabulary": 151_936,
        "tied_embedding": True,
        "dtype": "fp32",
        "attention": "sdpa",
        "steps": args.steps,
        "threads_per_rank": 1,
        "cpus": os.cpu_count(),
        "mem_total_mib": status_kib("MemTotal:", "/proc/meminfo") / 1024,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    name = f"bench_context_parallel{'.quick' if args.quick else ''}.json"
    runs = {str(length): {str(n): r for n, r in cps.items()} for length, cps in done.items()}
    (args.results_dir / name).write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
    return 0 if all(r.get("loss_equal", True) and "failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
