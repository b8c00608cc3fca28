"""`packtrain pack …`: the packer's command line.

The stage commands (`convert`, `plan`, `materialize`) are what Kubernetes pods
run; `run` chains them locally. Every stage accepts a whole `PackJob` manifest or
just its spec, so one YAML serves both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from packtrain.core.config import ModelConfig, PackConfig, load_pack_config
from packtrain.core.contract import PACK_STAGES, ErrorReport, pack_outcome_error
from packtrain.core.errors import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_OK,
    ConfigError,
    ShardFormatError,
    write_failure,
)
from packtrain.core.families import FAMILY_NAMES
from packtrain.core.model_spec import pack_family
from packtrain.core.output_lock import claim_output
from packtrain.core.report import report, write_line


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    cfg = " (default: the config's, else the packer's default)"
    p.add_argument(
        "-c", "--config", help="PackJob manifest or spec (YAML) (default: none; then give the flags)"
    )
    p.add_argument("-o", "--output", required=True, help="output folder of the pack (required)")
    p.add_argument(
        "--input",
        action="append",
        help="dataset file or glob (repeatable); overrides source.paths (default: the config's)",
    )
    p.add_argument("--media-root", help="folder that relative media paths resolve against" + cfg)
    p.add_argument(
        "--format", choices=["auto", "sharegpt", "messages", "typed"], help="dataset record format" + cfg
    )
    p.add_argument("--model", help="model folder (tokenizer, chat template, preprocessor config)" + cfg)
    p.add_argument(
        "--family", choices=list(FAMILY_NAMES), help="model family (default: detected from config.json)"
    )
    p.add_argument("--max-length", type=int, help="tokens per packed sequence" + cfg)
    p.add_argument(
        "--algorithm", choices=["bfd", "next_fit", "swift", "knapsack"], help="bin-packing algorithm" + cfg
    )
    p.add_argument(
        "--overlong", choices=["drop", "truncate", "error"], help="what to do with too-long samples" + cfg
    )
    p.add_argument(
        "--media-storage", choices=["original", "resized"], help="media bytes stored in the pack" + cfg
    )
    p.add_argument(
        "--max-rejected-fraction",
        type=float,
        help="refuse a pack that rejects more than this share of its samples" + cfg,
    )


def _add_slice_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", type=int, help="this worker's index (default: $JOB_COMPLETION_INDEX, else 0)")
    p.add_argument(
        "--count", type=int, default=1, help="number of workers sharing the stage (default: %(default)s)"
    )


def build_config(args: argparse.Namespace) -> PackConfig:
    """Config file first, then flags on top, validated as one model."""
    data: dict[str, Any] = load_pack_config(args.config).dump() if args.config else {}
    source = data.setdefault("source", {})
    model = data.setdefault("model", {})
    packing = data.setdefault("packing", {})
    if args.input:
        source["paths"] = args.input
    for key, value in (("mediaRoot", args.media_root), ("format", args.format)):
        if value is not None:
            source[key] = value
    for key, value in (("path", args.model), ("family", args.family)):
        if value is not None:
            model[key] = value
    if not model.get("family") and isinstance(model.get("path"), str):  # as --family's help says, -c too
        model["family"] = pack_family(ModelConfig(path=model["path"])).name
    for key, value in (
        ("maxLength", args.max_length),
        ("algorithm", args.algorithm),
        ("overlong", args.overlong),
        ("mediaStorage", args.media_storage),
        ("maxRejectedFraction", args.max_rejected_fraction),
    ):
        if value is not None:
            packing[key] = value
    if not source.get("paths") or not model.get("path"):
        raise ConfigError("give a config (-c FILE) or at least --input PATH and --model MODEL_DIR")
    return PackConfig.model_validate(data)


def _index(args: argparse.Namespace) -> int:
    if args.index is not None:
        return args.index
    return int(os.environ.get("JOB_COMPLETION_INDEX", "0"))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="packtrain pack", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("convert", "tokenize and measure a slice of the input"),
        ("plan", "assign samples to sequences and shards (one process)"),
        ("materialize", "write a slice of the shards; the last one writes the manifest"),
        ("run", "all stages locally, with N worker processes"),
        ("refresh", "keep a finished pack whose inputs are unchanged, else clear it for a rebuild"),
    ):
        p = sub.add_parser(name, help=help_)
        _add_config_flags(p)
        if name in ("convert", "materialize"):
            _add_slice_flags(p)
        if name == "run":
            p.add_argument(
                "--workers",
                type=int,
                default=max(1, (os.cpu_count() or 1)),
                help="worker processes for convert and materialize (default: the CPU count, %(default)s)",
            )
            p.add_argument("--no-progress", action="store_true", help="no progress bars (default: bars)")
    p = sub.add_parser("inspect", help="statistics of a pack")
    p.add_argument("path", help="the pack folder")
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="write a PNG with the length histogram and per-sequence fill (default: no plot)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table (default: table)")
    p = sub.add_parser(
        "verify",
        help="everything a trainer trusts: checksums, config hash, counts, token ids, labels, media grids "
        "(exit 2 when anything is off)",
    )
    p.add_argument("path", help="the pack folder")
    p = sub.add_parser("unpack", help="the original samples back, one JSON line each")
    p.add_argument("path", help="the pack folder")
    p.add_argument(
        "--sample",
        action="append",
        help="only this sample id (repeatable; a rejected one prints its reject; default: every sample)",
    )
    shown = p.add_mutually_exclusive_group()
    shown.add_argument(
        "--json",
        action="store_true",
        help="JSON lines with a `text` field, the sample decoded as --text shows it (default: JSON lines "
        "without it, no tokenizer needed)",
    )
    shown.add_argument(
        "--text",
        action="store_true",
        help="each sample decoded with the pack's tokenizer, vision pad runs collapsed (<|image_pad|>×64) "
        "and the trained tokens (those with labels) wrapped in ⟦ ⟧ (default: JSON lines)",
    )
    p = sub.add_parser("export", help="write a pack in another trainer's dataset format")
    formats = p.add_subparsers(dest="format", required=True)
    p = formats.add_parser("energon", help="a Megatron-Energon dataset (WebDataset tar shards and .nv-meta/)")
    p.add_argument("path", help="the pack folder")
    p.add_argument("-o", "--output", required=True, help="a new (or empty) folder for the dataset")
    p.add_argument(
        "--samples",
        action="store_true",
        help="one WebDataset sample per original sample (default: one per packed sequence)",
    )
    return ap


def _run(args: argparse.Namespace) -> int:
    from packtrain.packer import tools

    if args.cmd == "inspect":
        return tools.inspect_cmd(Path(args.path), args.plot, args.json)
    if args.cmd == "verify":
        return tools.verify_cmd(Path(args.path))
    if args.cmd == "unpack":
        show = "text" if args.text else "json" if args.json else "lines"
        return tools.unpack_cmd(Path(args.path), args.sample, show)
    if args.cmd == "export":
        from packtrain.packer.export_energon import export_energon

        layout = "samples" if args.samples else "packed"
        write_line(json.dumps(export_energon(Path(args.path), Path(args.output), layout)))
        return EXIT_OK

    cfg = build_config(args)
    out = Path(args.output)
    if args.cmd == "run":
        return _pack_run(cfg, out, args)
    # A PackJob's pods share their folder (each its own slice); a `pack run` there is refused.
    with claim_output(out, f"pack {args.cmd}", "-o", shared=True):
        return _stage(args.cmd, cfg, out, args)


def _stage(cmd: str, cfg: PackConfig, out: Path, args: argparse.Namespace) -> int:
    """One stage command (what a PackJob's pods run) on its claimed output folder."""
    from packtrain.packer.stages.convert import convert
    from packtrain.packer.stages.materialize import materialize
    from packtrain.packer.stages.plan import plan
    from packtrain.packer.stages.workdir import PackRefused

    if cmd == "refresh":  # `packtrain run` asks before convert: one line, kept or rebuilding
        from packtrain.packer.stages.inputs import refresh

        note = refresh(cfg, out)
        if note:
            print(note, flush=True)
    elif cmd == "convert":
        report(dict(convert(cfg, out, _index(args), args.count)))
    elif cmd == "plan":
        summary = plan(cfg, out)
        problem = pack_outcome_error(
            summary["samples"],
            summary["packed"],
            summary["rejected_by_reason"],
            cfg.packing.max_rejected_fraction,
        )
        if problem is not None:
            print(f"packtrain pack plan: {problem['error']}", file=sys.stderr)
            report({**summary, **problem})  # the counts too: the operator shows them beside the reason
            return EXIT_CONFIG
        report(dict(summary))
    elif cmd == "materialize":
        try:
            report(dict(materialize(cfg, out, _index(args), args.count)))
        except PackRefused as exc:  # the final counts (materialize's rejects) left too little packed
            print(f"packtrain pack materialize: {exc.report['error']}", file=sys.stderr)
            report({**exc.report, **(exc.summary or {})})  # the counts too: the operator shows them
            return EXIT_CONFIG
    return EXIT_OK


def _pack_run(cfg: PackConfig, out: Path, args: argparse.Namespace) -> int:
    """`pack run`: every stage here (`run_all` claims the folder), then the pack's stats."""
    from packtrain.packer import tools
    from packtrain.packer.local import run_all
    from packtrain.packer.stages.workdir import PackRefused

    timings: dict[str, Any] = {}
    try:
        manifest = run_all(
            cfg, out, workers=args.workers, show_progress=not args.no_progress, timings=timings
        )
    except PackRefused as exc:  # no manifest; the stats of what would have been packed
        tools.print_stats(exc.manifest, out)
        write_line(json.dumps(tools.summary_line(exc.manifest, out) | {"timings": timings}))
        print(f"packtrain pack run: {exc.report['error']}", file=sys.stderr)
        return EXIT_CONFIG
    tools.print_stats(manifest, out)
    write_line(json.dumps(tools.summary_line(manifest, out) | {"timings": timings}))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _run(args)
    except ShardFormatError as exc:  # inspect/unpack pointed at something that is not a finished pack
        from packtrain.packer.tools import refused_message

        path = getattr(args, "path", None)
        try:
            said = path and refused_message(Path(path)) or exc
        except ShardFormatError as damaged:  # the refusal record itself is damaged: say so
            said = damaged
        print(f"packtrain pack {args.cmd}: {said}", file=sys.stderr)
        return EXIT_CONFIG
    except (ConfigError, ValidationError, FileNotFoundError) as exc:
        return _config_error(args.cmd, str(exc))
    except KeyboardInterrupt:
        again = " — run the same command again to resume" if args.cmd in (*PACK_STAGES, "run") else ""
        print(f"packtrain pack {args.cmd}: interrupted{again}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a crash: the short error in the termination message, the traceback in the log
        output = getattr(args, "output", None)
        full = write_failure(exc, Path(output), "-o") if output else None
        if full is not None:  # no room or no permission in the output folder: what to free or change
            return _config_error(args.cmd, str(full))
        if args.cmd in PACK_STAGES:
            error: ErrorReport = {"stage": args.cmd, "error": f"{type(exc).__name__}: {exc}"[:3000]}
            report(dict(error))
        raise


def _config_error(cmd: str, msg: str) -> int:
    print(f"packtrain pack {cmd}: configuration error: {msg}", file=sys.stderr)
    if cmd in PACK_STAGES:  # what pods run: their outcome goes to the termination log
        report({"stage": cmd, "error": msg[:3000]})
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
