"""`packtrain`: one command for every part of the product.

    packtrain pack …       packer (convert, plan, materialize, run, refresh, inspect, verify, unpack, export)
    packtrain train …      the trainer (run under torchrun for several processes)
    packtrain run …        a PackJob/SFTJob YAML on this machine, same commands as the operator
    packtrain render …     the objects the operator would create for a PackJob/SFTJob YAML
    packtrain operator …   the Kubernetes operator (kopf)
    packtrain crds …       write the CustomResourceDefinitions generated from the API models
    packtrain docs …       write docs/reference.md (every spec field) and docs/rejects.md (reject reasons)

Subcommands are imported only when chosen, so `packtrain pack` never loads kopf
or torch, and `packtrain operator` never loads torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

from packtrain.core.errors import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK

# subcommand -> (module with main(argv) -> int, one-line help)
DELEGATES: dict[str, tuple[str, str]] = {
    "pack": (
        "packtrain.packer.cli",
        "pack a dataset (convert, plan, materialize, run, refresh, inspect, verify, unpack, export)",
    ),
    "train": ("packtrain.trainer.cli", "train on a pack (packtrain train -c SFTJOB.yaml)"),
    "run": ("packtrain.operator.local_run", "run a PackJob/SFTJob YAML locally with the operator's commands"),
    "render": (
        "packtrain.operator.render",
        "print the objects the operator would create for a PackJob/SFTJob YAML (--values: chart values)",
    ),
}


def _operator_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "operator", help="run the Kubernetes operator", description="Run the packtrain operator."
    )
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable; globs allowed); default: all namespaces",
    )
    p.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        metavar="URL",
        help="kopf liveness probe endpoint (default: %(default)s; empty: off)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="Prometheus /metrics port (0: off; default: %(default)s)",
    )
    p.add_argument(
        "--peering",
        metavar="NAME",
        help="coordinate with other operator replicas through this KopfPeering (default: standalone)",
    )
    p.add_argument(
        "--log-format",
        choices=("plain", "full", "json"),
        default="full",
        help="log lines as text (plain: no timestamps) or JSON objects; each names its resource (default: "
        "%(default)s)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (default: info)")


def _crds_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("crds", help="write the CRDs generated from the API models")
    p.add_argument("--out", default="crds", help="folder to write to (default: %(default)s)")
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when the folder is out of date (default: write the files)",
    )


def _docs_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "docs",
        help="write the reference pages generated from the API models and the reject reasons",
        description="Write reference.md (every PackJob and SFTJob spec field: type, default, description) "
        "and rejects.md (every reject reason and its fix), generated from the code.",
    )
    p.add_argument("--out", default="docs", help="folder to write to (default: %(default)s)")
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when the folder is out of date (default: write the files)",
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="packtrain", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_) in DELEGATES.items():
        sub.add_parser(name, help=help_, add_help=False)
    _operator_parser(sub)
    _crds_parser(sub)
    _docs_parser(sub)
    return ap


# Modules an optional extra installs: a missing one is an install step, not a crash.
EXTRAS: dict[str, str] = {
    **dict.fromkeys(("kopf", "kubernetes", "aiohttp", "jsonschema", "prometheus_client"), "operator"),
    **dict.fromkeys(("torch", "torchvision", "peft", "pynvml"), "trainer"),
    "matplotlib": "plot",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The one line to print for a module an optional extra provides, else None (a real bug)."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return f"this command needs {top}, which the core install leaves out: pip install 'packtrain[{extra}]'"


def run_operator(args: argparse.Namespace) -> int:
    import kopf

    from packtrain.operator import handlers, logs  # noqa: F401  (importing handlers registers them)

    logs.configure(args.log_format, args.verbose)
    kopf.run(
        standalone=args.peering is None,
        peering_name=args.peering,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(metrics_port=args.metrics_port),
    )
    return 0


def run_generated(args: argparse.Namespace) -> int:
    """`packtrain crds` / `packtrain docs`: write the files generated from the models, or with
    `--check` name the stale ones (exit 1)."""
    from pathlib import Path

    from packtrain.operator import crdgen, docgen

    generator = docgen if args.command == "docs" else crdgen
    if args.check:
        stale = generator.stale(Path(args.out))
        for path in stale:
            print(f"{path} is out of date: run `packtrain {args.command} --out {args.out}`", file=sys.stderr)
        return 1 if stale else 0
    for path in generator.write_all(args.out):
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except ModuleNotFoundError as exc:
        message = missing_extra(exc)
        if message is None:
            raise
        print(f"packtrain {argv[0] if argv else ''}: {message}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:  # a subcommand without its own handler (theirs say how to resume)
        print(f"packtrain {argv[0] if argv else ''}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `packtrain pack unpack P | head`: the reader is gone, nothing to say
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the interpreter flushes it at exit)
        return EXIT_OK


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in DELEGATES:
        module, _ = DELEGATES[argv[0]]
        return int(importlib.import_module(module).main(argv[1:]) or 0)
    args = parser().parse_args(argv)
    if args.command == "operator":
        return run_operator(args)
    return run_generated(args)


if __name__ == "__main__":
    sys.exit(main())
