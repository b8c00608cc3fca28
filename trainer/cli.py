"""`packtrain train -c CONFIG` (or `python -m packtrain.trainer`): run an SFTJob locally or as one
process of a torchrun/PyTorchJob.

CONFIG is an `SFTJob` manifest or its bare spec, the same file a cluster uses.
Under torchrun every process runs this; rank 0 shows progress (a bar in a terminal, JSON lines
otherwise or with `--log-format json`) and prints the JSON summary line last.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from packtrain.core.contract import ErrorReport
from packtrain.core.errors import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_OK,
    ConfigError,
    ShardFormatError,
)
from packtrain.core.progress import LOG_FORMATS, reporter_for
from packtrain.core.report import write_line
from packtrain.core.sft_config import load_train_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="packtrain train", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    p.add_argument("-c", "--config", required=True, help="SFTJob manifest or spec (YAML) (required)")
    p.add_argument(
        "--data",
        metavar="PACK",
        help="a pack output folder, overriding data.path (default: the config's data.path; needed when the "
        "config names data.packJobRef)",
    )
    p.add_argument("--output", help="override training.outputDir (default: the config's, else runs/sft)")
    p.add_argument("--max-steps", type=int, help="override training.maxSteps (default: the config's)")
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="auto",
        help="progress as a bar (rich) or JSON lines (json); auto: a bar when stdout is a terminal "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--score",
        metavar="FILE",
        help="score every packed sample with the starting weights and exit without training: one JSON "
        'line per sample, {"id", "loss_sum", "tokens"}, in FILE (with training.saveFinal those weights '
        "also go to final/) (default: train)",
    )
    add_plan_arguments(p)
    return p


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """`--plan`: print the job's memory plan and exit (2 when it does not fit) without training."""
    g = p.add_argument_group("memory plan (--plan: print it and exit; nothing is built or trained)")
    g.add_argument(
        "--plan",
        action="store_true",
        help="print the per-GPU and per-host memory plan and exit (default: train)",
    )
    g.add_argument(
        "--json", action="store_true", help="with --plan: the plan as one JSON object (default: a table)"
    )
    g.add_argument(
        "--world-size",
        type=int,
        help="GPUs of the run (default: WORLD_SIZE, else nodes x gpus per node of the SFTJob, else 1)",
    )
    g.add_argument(
        "--gpus-per-host",
        type=int,
        help="GPUs of one host (default: LOCAL_WORLD_SIZE, else the SFTJob's gpusPerNode, else 8)",
    )
    g.add_argument(
        "--gpu-memory",
        metavar="QUANTITY",
        help="memory of one GPU, e.g. 80GiB or 141Gi (default: the SFTJob's resources.gpuMemory, else no "
        "check)",
    )
    g.add_argument("--max-length", type=int, help="tokens per packed sequence (default: the pack's manifest)")


def worker_message(exc: BaseException) -> str:
    """The message a DataLoader worker raised, without the traceback the loader wraps it in."""
    text = str(exc)
    if "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]  # "module.ErrorClass: the worker's message"
    return last.split(": ", 1)[1] if ": " in last else last


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:
        args = args[1:]
    opts = build_parser().parse_args(args)
    try:
        cfg = load_train_config(opts.config)
        if opts.data:
            cfg.data.path = opts.data
        if opts.output:
            cfg.training.output_dir = opts.output
        if opts.max_steps is not None:
            cfg.training.max_steps = opts.max_steps
        cfg = type(cfg).model_validate(cfg.model_dump())
    except (ConfigError, ValidationError, FileNotFoundError) as exc:
        return _fail(f"configuration error: {exc}")
    if opts.plan and opts.score:
        return _fail(
            "--plan and --score: choose one (--plan prints the memory plan, --score scores the pack)"
        )
    if opts.plan:
        return _plan(opts, cfg)
    if cfg.data.path is None:
        return _fail(
            f"data.packJobRef {cfg.data.pack_job_ref!r} names a PackJob, which only the operator and "
            "`packtrain run` resolve: pass --data PACK (the folder `packtrain pack run -o PACK` wrote)"
        )

    from packtrain.trainer import distributed

    env = distributed.environ()
    try:
        refused = _score_file_problem(opts.score) if opts.score else _startup_plan(cfg, env.world_size)
    except ConfigError as exc:
        return _fail(f"configuration error: {exc}")
    if refused is not None:
        return _fail(refused)
    try:
        summary = _run(opts, cfg)
    except ShardFormatError as exc:  # data.path is not a finished pack, or one that was damaged or edited
        return _fail(worker_message(exc))
    except ConfigError as exc:  # found once the model is built (LoRA targets, a freeze leaving nothing)
        return _fail(f"configuration error: {exc}")
    except KeyboardInterrupt:
        again = "score again" if opts.score else "resume from the newest checkpoint"
        print(f"packtrain train: interrupted — run the same command again to {again}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as exc:  # a crash: the short error in the termination message, the traceback logged
        full = _write_failure(exc, cfg.training.output_dir)
        if full is not None:  # no room or no permission in the output folder: what to free or change
            return _fail(f"configuration error: {full}")
        if isinstance(exc, Exception):
            _terminate({"error": f"{type(exc).__name__}: {worker_message(exc)}"})
        raise
    if distributed.environ().is_main:
        write_line(json.dumps(summary))
        _terminate(summary)
        if summary.get("resumed_from") and not summary.get("steps_this_run"):
            print(f"packtrain train: {already_complete(cfg.training.output_dir, summary)}", file=sys.stderr)
    return EXIT_OK


def _run(opts: argparse.Namespace, cfg: Any) -> Mapping[str, Any]:
    """Train (the default), or with `--score FILE` score the pack with the starting weights."""
    if opts.score:
        from pathlib import Path

        from packtrain.trainer.score import score

        return score(cfg, Path(opts.score))
    from packtrain.trainer.loop import train

    return train(cfg, reporter=reporter_for(opts.log_format, sys.stdout, cfg.training.log_every))


def _score_file_problem(file: str) -> str | None:
    """Why `--score FILE` cannot be written (its folder missing, or FILE a folder), or None."""
    from pathlib import Path

    path = Path(file)
    if path.is_dir():
        return f"--score {file}: is a folder; name the file to write the scores into"
    if not path.parent.is_dir():
        return f"--score {file}: its folder {path.parent} does not exist; create it first"
    return None


def _write_failure(exc: BaseException, output_dir: str) -> str | None:
    """A write into the output folder that failed for lack of space or permission (a checkpoint
    writer's error included, which is no Exception): the one line naming the folder and the fix."""
    from pathlib import Path

    from packtrain.core.errors import write_failure
    from packtrain.trainer.state.output import OUTPUT_OPTION

    full = write_failure(exc, Path(output_dir), OUTPUT_OPTION)
    return None if full is None else str(full)


def _startup_plan(cfg: Any, world_size: int) -> str | None:
    """The start-up memory check (every rank, before the model is built): why it cannot fit, or None."""
    import os

    from packtrain.trainer.memory_check import startup_refusal

    per_host = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("PET_NPROC_PER_NODE") or 1)
    return startup_refusal(cfg, world_size, per_host)


def _plan(opts: argparse.Namespace, cfg: Any) -> int:
    """`--plan`: the table (or JSON); exit 2 when the job does not fit the GPUs given."""
    import os

    from packtrain.core.memory_plan import parse_bytes, plan_memory
    from packtrain.trainer.memory_check import (
        context_parallel_refusal,
        dims_of,
        inputs_for,
        plan_json,
        print_table,
        spec_sizes,
    )

    sizes = spec_sizes(opts.config)
    env_world = int(os.environ.get("WORLD_SIZE") or 0)
    world = opts.world_size or env_world or sizes.get("world") or 1
    source = "one process: pass --world-size"  # where the world size came from, for a refusal to name
    if opts.world_size or env_world:
        source = "--world-size" if opts.world_size else "WORLD_SIZE"
    elif sizes.get("world"):
        source = "the SFTJob's resources.nodes x gpusPerNode"
    per_host = (
        opts.gpus_per_host or int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or sizes.get("per_host") or 8
    )
    try:
        memory = parse_bytes(opts.gpu_memory) if opts.gpu_memory else sizes.get("gpu_memory")
        dims = dims_of(cfg)
        x = inputs_for(
            cfg, world_size=world, gpus_per_host=per_host, gpu_memory=memory, max_length=opts.max_length
        )
    except ConfigError as exc:
        return _fail(f"configuration error: {exc}")
    if (split := context_parallel_refusal(cfg, dims, world, source)) is not None:
        return _fail(f"configuration error: {split}")
    plan = plan_memory(dims, x)
    if opts.json:
        write_line(json.dumps(plan_json(dims, plan)))
    else:
        print_table(dims, plan)
    return EXIT_OK if plan.fits else EXIT_CONFIG


def already_complete(output_dir: str, summary: Mapping[str, Any]) -> str:
    """The line for a rerun that found every step done (it trained nothing and kept the model)."""
    return (
        f"already complete: {output_dir} holds all {summary.get('steps')} steps, nothing was trained; to "
        "train more raise training.maxSteps, to start over use a new --output or delete that folder"
    )


def _terminate(doc: Mapping[str, Any]) -> None:
    """On Kubernetes the operator reads the summary, or the error, from the pod's termination message."""
    from packtrain.core.report import compact, termination_log_path

    term = termination_log_path()
    if term is not None:
        term.write_text(compact(dict(doc)))


def _fail(message: str) -> int:
    """A configuration problem: said on stderr and in the termination message; exit 2 (no retry helps)."""
    print(f"packtrain train: {message}", file=sys.stderr)
    error: ErrorReport = {"error": message[:3000], "exit_code": EXIT_CONFIG}
    _terminate(error)
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
