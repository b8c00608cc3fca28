"""CPU benchmark of per-rank host memory when loading, training, checkpointing and exporting a model
under FSDP2 on 1, 2 and 4 ranks: no rank should hold all of the model.

A Qwen2.5-VL of a few hundred million parameters (by default hidden 512, 12 decoder layers: 194 M,
156 M of them the real 151,936 vocabulary's embedding and untied LM head; a 2-block vision tower;
4 ranks of hidden 1024 need ~25 GB), or with `--family qwen2-vl` a Qwen2-VL whose LM head is tied
to the embedding, as Qwen2-VL-2B's (`--hidden 1536 --layers 4`: 342 M parameters, 233 M of them the
tied vocabulary weight), is saved once as a real sharded bf16 Hugging Face folder
(model-0000X-of-0000N.safetensors + the index, tokenizer and processor files), beside a small pack
of the synthetic text/image/video mix at a short maxLength. Each world size then trains it with
the trainer's own `loop.train` (FSDP2, gloo, one thread per rank; 1 rank is a single process
without a process group) for two steps, with a checkpoint and the final export. Hooks around the
trainer's functions (`recipe.setup` as the loop calls it, `loop.train_step`, `checkpoint.save`,
`export.save_final`) reset each rank's RSS high-water mark (VmHWM, via /proc/self/clear_refs)
before the phase and read it after: load (model built, weights read, sharded, optimizer made),
step (forward, backward, optimizer), checkpoint, export. Memory freed before a phase is handed
back first (malloc_trim), so a phase is not charged for the last one's freed pages. Also
recorded: the RSS after imports and the process group (the fixed overhead, "base") and the model
state (parameters + gradients + AdamW state) each rank holds after the last step. A world size
the memory available cannot hold (estimated from the single process's run) is skipped.

Goal, per phase and world size N > 1 (exit 1 when missed, or when a world size was skipped
because the memory available could not hold it):
  * peak_N <= S_1 / N + base_N + 2 T (+ A_1 in the step phase, + one export shard in the export),
    S_1 the single process's model state, T the largest parameter in fp32 (a rank may hold one
    tensor unsharded next to its fp32 copy or gradient: a bf16 tensor read and cast, a parameter
    all-gathered for the forward and its gradient before the reduce-scatter), A_1 the single
    process's step peak over base and state (activations and the optimizer's temporaries: each
    rank runs a full micro-batch, so they do not shrink with N). The export writes shards of 1/16
    of the model (`--export-shard-mib`): the trainer's 5 GB default is ~1/30 of a 72B model but
    all of this one, and rank 0 holds the shard it is filling;
  * strict: peak_N - base_N <= (peak_1 - base_1) / N + the same allowances: what the phase holds
    over the fixed overhead shrinks as 1/N (at load S_1 / N alone would let every rank hold all
    the fp32 weights up to N = 4, since the weights are a quarter of the state).

`--planner` compares `packtrain.core.memory_plan`'s per-rank prediction for this model with
what was measured, then prints its 7B / 32B / 72B table (`plan_table.py`).

    python tests/bench/bench_scale_memory.py [--quick] [--family qwen2.5-vl|qwen2-vl] [--ranks 1 2 4]
        [--hidden 512] [--layers 12] [--max-length 256] [--steps 2] [--work-dir DIR] [--planner] [--force]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
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
from support.paths import MODELS
from support.rank_memory import hand_back, reset_peak, state_bytes, status_kib

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MIB = 1 << 20
PHASES = ("load", "step", "checkpoint", "export")
FAMILIES = ("qwen2.5-vl", "qwen2-vl")
# A 2-block vision tower per family (config.json keys), full size and `--quick`.
VISION = {
    "qwen2.5-vl": {"depth": 2, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4},
    "qwen2-vl": {"depth": 2, "embed_dim": 384, "num_heads": 6},
}
QUICK_VISION = {
    "qwen2.5-vl": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2},
    "qwen2-vl": {"depth": 2, "embed_dim": 32, "num_heads": 2},
}


def source(family: str) -> Path:
    """The family's shared folder: config, tokenizer and processor files (no weights)."""
    return MODELS / family


def overrides(hidden: int, layers: int, quick: bool, family: str = "qwen2.5-vl") -> dict[str, Any]:
    """config.json keys for a model of `hidden` x `layers` with the real vocabulary: a Qwen2.5-VL
    with an untied LM head, or a Qwen2-VL with the 2B's head tied to the embedding."""
    head_dim = 32 if quick else 128
    heads, half = max(2, hidden // head_dim), head_dim // 2
    vision: dict[str, Any] = {**(QUICK_VISION if quick else VISION)[family]}
    if family == "qwen2.5-vl":
        vision |= {"out_hidden_size": hidden, "fullatt_block_indexes": [1]}
    else:
        vision["hidden_size"] = hidden  # Qwen2-VL's merger output width
    return {
        "hidden_size": hidden,
        "intermediate_size": (hidden * 11 // 4 + 127) // 128 * 128,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 2 if heads % 2 == 0 else 1,
        "max_window_layers": layers,
        "tie_word_embeddings": family == "qwen2-vl",
        # Multimodal RoPE's temporal, height and width sections of half a head (16, 24, 24 at 128).
        "rope_scaling": {"type": "mrope", "mrope_section": [half // 4, 3 * half // 8, half - 5 * half // 8]},
        "vision_config": vision,
    }


# -- the model folder and the pack (made once under the work folder) --------------------------------


def generate_model(work: Path, hidden: int, layers: int, quick: bool, family: str = "qwen2.5-vl") -> Path:
    """A random-init model saved as a sharded bf16 Hugging Face folder (about five shards), with the
    source folder's tokenizer and processor files; reused when already complete."""
    folder = work / f"{family}-h{hidden}-l{layers}{'-quick' if quick else ''}"
    if (folder / "model.safetensors.index.json").is_file():
        return folder
    import torch

    from packtrain.trainer.model.build import build_model

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = build_model(
        source(family),
        init="random",
        overrides=overrides(hidden, layers, quick, family),
        dtype=torch.bfloat16,
    )
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp, max_shard_size=f"{max(1, size // 5 // 1000**2)}MB")
    for src in source(family).iterdir():
        if src.is_file() and src.name != "config.json" and not (tmp / src.name).exists():
            shutil.copy2(src, tmp / src.name)
    del model
    tmp.rename(folder)
    return folder


def make_pack(work: Path, model: Path, max_length: int, samples: int, family: str = "qwen2.5-vl") -> Path:
    """The synthetic text/image/video mix packed at `max_length` (truncating longer samples)."""
    out = work / f"pack-{family}-L{max_length}-n{samples}"
    if (out / "manifest.json").is_file():
        return out
    from support.pack_runner import run_in_process
    from support.synth import generate_dataset

    from packtrain.core.config import PackConfig

    data = generate_dataset(work / f"data-n{samples}", samples, seed=0)
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(data)]},
            "model": {
                "family": family,
                "path": str(model),
                "maxPixels": 64 * 28 * 28,
                "videoMaxPixels": 16 * 28 * 28,
                "maxFrames": 4,
            },
            # Samples whose labels all lie past maxLength cannot be truncated: left out (a third).
            "packing": {
                "maxLength": max_length,
                "overlong": "truncate",
                "maxRejectedFraction": 0.5,
                "sequencesPerShard": 16,
            },
        }
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run_in_process(cfg, tmp)
    tmp.rename(out)
    return out


def job_spec(model: Path, pack: Path, output: Path, steps: int, dtype: str) -> dict[str, Any]:
    return {
        "data": {"path": str(pack), "numWorkers": 0},
        "model": {"path": str(model), "init": "pretrained"},
        "training": {
            "maxSteps": steps,
            "lr": 1e-5,
            "strategy": "fsdp",
            "dtype": dtype,
            "attention": "sdpa",
            "resume": False,
            "checkpointEvery": 0,
            "checkpointAtEnd": True,
            "keepCheckpoints": 1,
            "saveFinal": True,
            "outputDir": str(output),
        },
    }


# -- inside each rank ---------------------------------------------------------------------------------


class Meter:
    """Each phase's peak RSS in this process, over every call of the functions wrapped for it."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self.base: dict[str, float] = {}
        self.state: dict[str, int] = {}
        self.largest_unit = ""
        self.extra: dict[str, Any] = {}

    def _sync(self) -> None:
        """Every rank at the same point, with the memory freed so far given back to the system
        (glibc keeps freed heap pages resident: the next phase's peak would count them)."""
        import torch.distributed as dist

        hand_back()
        if dist.is_initialized():
            dist.barrier()

    def wrap(self, name: str, fn: Callable[..., Any], after: Callable[..., None] | None = None) -> Any:
        def measured(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            if not self.base:  # the first phase starts after imports and the process group
                self.base = {"rss_mib": status_kib("VmRSS:") / 1024, "hwm_mib": status_kib("VmHWM:") / 1024}
            reset_peak()
            start, clock = status_kib("VmRSS:") / 1024, time.perf_counter()
            result = fn(*args, **kwargs)
            peak = status_kib("VmHWM:") / 1024
            self._sync()
            row = self.phases.setdefault(name, {"peak_mib": 0.0, "seconds": 0.0, "calls": 0})
            row["peak_mib"] = max(row["peak_mib"], peak)
            row["seconds"] += time.perf_counter() - clock
            row["calls"] += 1
            row.setdefault("start_mib", start)
            row["end_mib"] = status_kib("VmRSS:") / 1024
            row["end_file_mib"] = status_kib("RssFile:") / 1024
            if after is not None:
                after(*args)
            return result

        return measured

    def record_state(self, run: Any, *_: Any) -> None:
        self.state = state_bytes(run.model, run.optimizer)
        self.state["largest_param_fp32"] = 4 * max(p.numel() for p in run.model.parameters())
        self.state["largest_unit_fp32"], self.largest_unit = largest_unit(run.model)


def largest_unit(model: Any) -> tuple[int, str]:
    """The FSDP2 unit whose own parameters (those of no inner unit) are the most fp32 bytes once
    gathered, and its name: what a rank holds whole while that unit runs (0 and "" without FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    owner: dict[int, tuple[str, int]] = {}
    for name, module in model.named_modules():  # outer units first: inner ones take their own
        if isinstance(module, FSDPModule):
            for p in module.parameters():
                owner[id(p)] = (name or "(root)", p.numel())
    sizes: dict[str, int] = {}
    for name, numel in owner.values():
        sizes[name] = sizes.get(name, 0) + 4 * numel
    return max(((n, name) for name, n in sizes.items()), default=(0, ""))


def _patch(
    meter: Meter,
    phase: str,
    targets: list[tuple[Any, str]],
    after: Callable[..., None] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Measure `phase` around the first of `targets` (module, function name) that exists, called
    with the keywords `extra` too when it takes them (recorded in `meter.extra`)."""
    for owner, name in targets:
        if owner is not None and hasattr(owner, name):
            fn = getattr(owner, name)
            if extra and set(extra) <= set(inspect.signature(fn).parameters):
                fn, meter.extra = functools.partial(fn, **extra), {**meter.extra, **extra}
            setattr(owner, name, meter.wrap(phase, fn, after))
            return
    raise RuntimeError(f"none of {[name for _, name in targets]} exists: the {phase} phase has no hook")


def rank_run(job: Path, out: Path) -> None:
    """One rank (under torchrun, or alone): `loop.train` with its phases measured; writes
    `out/rank-R.json`."""
    import torch

    torch.set_num_threads(1)
    from packtrain.core.sft_config import SFTSpecCore
    from packtrain.trainer import distributed, loop
    from packtrain.trainer.state import checkpoint

    cfg = SFTSpecCore.model_validate(json.loads(job.read_text()))
    shard = json.loads((out / "bench.json").read_text())["export_shard_bytes"]
    meter = Meter()
    # The names the loop calls them by (`setup` is imported into the loop from recipe; the export
    # is `export.save_final`, or `checkpoint.save_final` in older trainers).
    _patch(meter, "load", [(loop, "setup")])
    _patch(meter, "step", [(loop, "train_step")], after=meter.record_state)
    _patch(meter, "checkpoint", [(checkpoint, "save")])
    exports = [(getattr(loop, "export", None), "save_final"), (checkpoint, "save_final")]
    _patch(meter, "export", exports, extra={"shard_bytes": shard} if shard else None)
    summary = loop.train(cfg, log=lambda _: None)
    env = distributed.environ()
    record = {
        "rank": env.rank,
        "world": env.world_size,
        "base": meter.base,
        "phases": meter.phases,
        "state": meter.state,
        "largest_unit": meter.largest_unit,
        "export_shard_bytes": meter.extra.get("shard_bytes"),
        "loss": summary["final_loss"],
        "final_model": summary.get("final_model"),
    }
    (out / f"rank-{env.rank}.json").write_text(json.dumps(record, indent=1))


# -- the driver -----------------------------------------------------------------------------------------


def run_world(
    ranks: int, spec: dict[str, Any], work: Path, timeout: float, shard_bytes: int
) -> list[dict[str, Any]]:
    """Train `spec` on `ranks` processes (torchrun; one plain process for 1) and return each rank's
    record; the run's checkpoint and export are deleted afterwards (they are GBs)."""
    run_dir = work / f"run-{ranks}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = json.loads(json.dumps(spec))
    spec["training"]["outputDir"] = str(run_dir / "out")
    job = run_dir / "job.json"
    job.write_text(json.dumps(spec))
    (run_dir / "bench.json").write_text(json.dumps({"export_shard_bytes": shard_bytes}))
    script = [str(Path(__file__).resolve()), "--rank-run", str(job), str(run_dir)]
    if ranks == 1:
        cmd = [sys.executable, *script]
    else:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--nproc-per-node", str(ranks), "--master-port", str(free_port()), *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    clock = time.perf_counter()
    proc = subprocess.run(
        ["nice", "-n", "10", *cmd], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{ranks} rank(s) failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads((run_dir / f"rank-{r}.json").read_text()) for r in range(ranks)]
    for row in rows:
        row["wall_s"] = time.perf_counter() - clock
        missing = [p for p in PHASES if p not in row["phases"]]
        if missing:
            raise RuntimeError(f"rank {row['rank']} of {ranks}: phases {missing} were never called")
    shutil.rmtree(run_dir / "out", ignore_errors=True)
    return rows


def state_total(rows: list[dict[str, Any]]) -> int:
    """Model state over all ranks: parameters + gradients + AdamW state."""
    return sum(r["state"]["params"] + r["state"]["grads"] + r["state"]["optimizer"] for r in rows)


def judge(runs: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (ranks, phase): the largest per-rank peak, its ratio to the single process, and
    the goal's and the strict check's bounds (see the docstring)."""
    single = runs.get(1)
    first = single or runs[min(runs)]
    s1 = state_total(first) / MIB  # equal for every world size (FSDP2 shards it)
    t2 = 2 * first[0]["state"]["largest_param_fp32"] / MIB
    base1 = single[0]["base"]["rss_mib"] if single else None
    a1 = max(0.0, single[0]["phases"]["step"]["peak_mib"] - base1 - s1) if single and base1 else 0.0
    rows = []
    for n, ranks in sorted(runs.items()):
        base = max(r["base"]["rss_mib"] for r in ranks)
        for phase in PHASES:
            peak = max(r["phases"][phase]["peak_mib"] for r in ranks)
            extra = {"step": a1, "export": (ranks[0].get("export_shard_bytes") or 0) / MIB}.get(phase, 0.0)
            row: dict[str, Any] = {"ranks": n, "phase": phase, "peak_mib": peak, "base_mib": base}
            row["min_peak_mib"] = min(r["phases"][phase]["peak_mib"] for r in ranks)
            row["goal_mib"] = s1 / n + base + t2 + extra
            row["goal_met"] = peak <= row["goal_mib"]
            if single and base1 is not None:
                p1 = single[0]["phases"][phase]["peak_mib"]
                row["ratio"] = peak / p1
                row["strict_mib"] = (p1 - base1) / n + base + t2 + extra
                row["strict_met"] = peak <= row["strict_mib"]
            rows.append(row)
    return rows


def explain(rows: list[dict[str, Any]], runs: dict[int, list[dict[str, Any]]]) -> list[str]:
    """A line per missed bound: by how much, what the rank held entering the phase, what the phase
    added, and the largest FSDP2 unit (gathered whole while it runs)."""
    lines = []
    for r in rows:
        bound = min(r["goal_mib"], r.get("strict_mib", r["goal_mib"]))
        if r["ranks"] == 1 or r["peak_mib"] <= bound:
            continue
        worst = max(runs[r["ranks"]], key=lambda x: x["phases"][r["phase"]]["peak_mib"])
        phase, state = worst["phases"][r["phase"]], worst["state"]
        start, added = phase["start_mib"], phase["peak_mib"] - phase["start_mib"]
        unit, t = state["largest_unit_fp32"] / MIB, state["largest_param_fp32"] / MIB
        lines.append(
            f"{r['ranks']} ranks, {r['phase']}: {r['peak_mib'] - bound:,.0f} MiB over (rank {worst['rank']}: "
            f"{start:,.0f} MiB held entering the phase, +{added:,.0f} in it; largest FSDP unit "
            f"{worst['largest_unit']} = {unit:,.0f} MiB fp32 vs T = {t:,.0f})"
        )
    return lines


def print_table(rows: list[dict[str, Any]], runs: dict[int, list[dict[str, Any]]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    table = Table(title="Per-rank peak RSS (VmHWM) per phase, MiB")
    for header in ("ranks", "phase", "peak", "min peak", "/ 1 rank", "goal <=", "", "strict <=", ""):
        table.add_column(header, justify="left" if header == "phase" else "right")
    for r in rows:
        mark = {True: "ok", False: "MISS", None: "-"}
        table.add_row(
            str(r["ranks"]),
            r["phase"],
            f"{r['peak_mib']:,.0f}",
            f"{r['min_peak_mib']:,.0f}",
            f"{r['ratio']:.2f}" if "ratio" in r else "-",
            f"{r['goal_mib']:,.0f}",
            mark[r["goal_met"]],
            f"{r['strict_mib']:,.0f}" if "strict_mib" in r else "-",
            mark[r.get("strict_met")],
        )
    console.print(table)
    facts = Table(title="Per rank: fixed overhead and model state, MiB")
    heads = ("ranks", "base (imports + group)", "params", "grads", "AdamW", "state", "largest unit", "wall s")
    for header in heads:
        facts.add_column(header, justify="right")
    for n, ranks in sorted(runs.items()):
        s = ranks[0]["state"]
        facts.add_row(
            str(n),
            f"{max(r['base']['rss_mib'] for r in ranks):,.0f}",
            *(f"{s[k] / MIB:,.0f}" for k in ("params", "grads", "optimizer")),
            f"{(s['params'] + s['grads'] + s['optimizer']) / MIB:,.0f}",
            f"{ranks[0]['largest_unit']} {s['largest_unit_fp32'] / MIB:,.0f}" if n > 1 else "-",
            f"{ranks[0]['wall_s']:.0f}",
        )
    console.print(facts)
    t = runs[min(runs)][0]["state"]["largest_param_fp32"] / MIB
    print(f"T (largest parameter, fp32) = {t:,.0f} MiB; largest unit: its own parameters gathered, fp32")


def planner_comparison(
    runs: dict[int, list[dict[str, Any]]], args: argparse.Namespace, model: Path
) -> list[dict[str, Any]] | None:
    """The memory planner's per-rank figures for this model and job (FSDP2, this compute dtype and
    maxLength) vs the measured ones: its state rows vs the state each rank held, its total less the
    device reserve vs the step's peak over the fixed overhead; then its 7B / 32B / 72B table."""
    if importlib.util.find_spec("packtrain.core.memory_plan") is None:
        print("planner: skipped, this checkout has no packtrain.core.memory_plan")
        return None
    from packtrain.core.memory_plan import PlanInputs, plan_memory
    from packtrain.core.model_size import model_dims

    dims = model_dims(json.loads((model / "config.json").read_text()), args.family)
    out = []
    for n, ranks in sorted(runs.items()):
        x = PlanInputs(world_size=n, strategy="fsdp", bf16=args.dtype == "bf16", max_length=args.max_length)
        plan = plan_memory(dims, x)
        state = sum(v for k, v in plan.rows.items() if k.startswith(("parameters", "gradients", "AdamW")))
        step = sum(v for k, v in plan.rows.items() if not k.startswith("reserve"))
        measured = max(state_total([r]) for r in ranks)
        peak = max(r["phases"]["step"]["peak_mib"] - r["base"]["rss_mib"] for r in ranks)
        out.append(
            {
                "ranks": n,
                "planned_state_mib": state / MIB,
                "measured_state_mib": measured / MIB,
                "planned_step_mib": step / MIB,
                "measured_step_over_base_mib": peak,
                "planned_rows_mib": {k: v / MIB for k, v in plan.rows.items()},
            }
        )
        print(
            f"planner, {n} rank(s): state {state / MIB:,.0f} MiB planned vs {measured / MIB:,.0f} measured; "
            f"step (no reserve) {step / MIB:,.0f} MiB planned vs {peak:,.0f} measured over base"
        )
    table = HERE / "plan_table.py"
    if table.is_file():
        spec = importlib.util.spec_from_file_location("plan_table", table)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main(["--results-dir", str(args.results_dir)])
    return out


def estimate_mib(hidden: int, layers: int, quick: bool, family: str = "qwen2.5-vl") -> float:
    """The single process's need: 16 bytes a parameter (fp32 weights, gradients, AdamW) + 2 GiB."""
    from packtrain.trainer.model.build import build_model

    config = overrides(hidden, layers, quick, family)
    hf = build_model(source(family), init="random", overrides=config, device="meta")
    return (16 * sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())) / MIB + 2048


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--family", choices=FAMILIES, default="qwen2.5-vl", help="qwen2-vl: its LM head tied")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--samples", type=int, default=32, help="synthetic samples in the pack")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype (and export)")
    p.add_argument("--quick", action="store_true", help="a tiny model (hidden 64, 2 layers): a smoke run")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "packtrain-bench-scale")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    p.add_argument("--planner", action="store_true", help="compare with the memory planner")
    p.add_argument("--force", action="store_true", help="run every world size, whatever the estimate says")
    p.add_argument("--export-shard-mib", type=float, help="export shard size (0: the trainer's default)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--rank-run", nargs=2, type=Path, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers = 64, 2
    return args


def world_need_mib(n: int, runs: dict[int, list[dict[str, Any]]]) -> float | None:
    """What `n` ranks need together, from the single process's run: per rank the fixed overhead,
    its share of the state, the single process's activations and two of the largest tensors
    gathered with their gradients (an allowance: the vocabulary units hold at most one weight
    and its gradient whole at a time). `--force` runs a world size whatever this says."""
    if 1 not in runs:
        return None
    r = runs[1][0]
    base, s1 = r["base"]["rss_mib"], state_total(runs[1]) / MIB
    activations = max(0.0, r["phases"]["step"]["peak_mib"] - base - s1)
    return n * (base + s1 / n + activations + 4 * r["state"]["largest_param_fp32"] / MIB)


def export_shard_bytes(args: argparse.Namespace, model: Path) -> int:
    """The export's shard size: `--export-shard-mib`, or 1/16 of the exported weights (0: the
    trainer's default). The trainer's 5 GB default is about 1/30 of a 72B model but all of this
    one, so by default the shard scales with the model, as the model's share a rank holds does."""
    if args.export_shard_mib is not None:
        return int(args.export_shard_mib * MIB)
    bf16 = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    return (bf16 if args.dtype == "bf16" else 2 * bf16) // 16


def measure(args: argparse.Namespace) -> tuple[dict[int, list[dict[str, Any]]], dict[str, Any]]:
    """The model and the pack (made once), then each world size that fits in the memory available."""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    model = generate_model(args.work_dir, args.hidden, args.layers, args.quick, args.family)
    pack = make_pack(args.work_dir, model, args.max_length, args.samples, args.family)
    shards = sorted(p.name for p in model.glob("*.safetensors"))
    print(f"model {model.name}: {len(shards)} shards; pack {pack.name} ({time.perf_counter() - clock:.0f} s)")
    spec = job_spec(model, pack, args.work_dir / "out", args.steps, args.dtype)
    shard = export_shard_bytes(args, model)
    runs: dict[int, list[dict[str, Any]]] = {}
    skipped: dict[int, str] = {}
    for n in sorted(set(args.ranks)):
        need, available = world_need_mib(n, runs), status_kib("MemAvailable:", "/proc/meminfo") / 1024
        if need is not None and need > 0.9 * available and not args.force:
            skipped[n] = f"needs ~{need:,.0f} MiB, {available:,.0f} MiB available"
            print(f"{n} rank(s): skipped, {skipped[n]}", flush=True)
            continue
        runs[n] = run_world(n, spec, args.work_dir, args.timeout, shard)
        peaks = {p: max(r["phases"][p]["peak_mib"] for r in runs[n]) for p in PHASES}
        print(f"{n} rank(s): " + ", ".join(f"{p} {v:,.0f} MiB" for p, v in peaks.items()), flush=True)
    keys = ("family", "hidden", "layers", "max_length", "steps", "dtype", "samples")
    meta = {**{k: getattr(args, k) for k in keys}, "model": model.name, "shards": shards}
    return runs, {**meta, "export_shard_bytes": shard, "skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.rank_run:
        rank_run(*args.rank_run)
        return 0
    need = estimate_mib(args.hidden, args.layers, args.quick, args.family)
    available = status_kib("MemAvailable:", "/proc/meminfo") / 1024
    if need > available:
        print(f"skipped: the single process needs ~{need:,.0f} MiB, {available:,.0f} MiB available")
        return 1
    runs, meta = measure(args)
    if not runs:
        return 1
    rows = judge(runs)
    print_table(rows, runs)
    misses = explain(rows, runs)
    print("\n".join(misses))
    planner = planner_comparison(runs, args, args.work_dir / meta["model"]) if args.planner else None
    met = all(r["goal_met"] and r.get("strict_met", True) for r in rows if r["ranks"] > 1)
    print(f"goal {'met' if met else 'MISSED'}: per-rank peak <= 1/N of the single process plus the overhead")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    family = "" if args.family == "qwen2.5-vl" else f".{args.family}"
    name = f"bench_scale_memory{family}{'.quick' if args.quick else ''}.json"
    out = {"meta": meta, "rows": rows, "runs": runs, "planner": planner, "met": met, "misses": misses}
    (args.results_dir / name).write_text(json.dumps(out, indent=1))
    return 0 if met and not meta["skipped"] else 1


if __name__ == "__main__":
    sys.exit(main())
