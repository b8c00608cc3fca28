"""`packtrain train -c CONFIG`: run an SFTJob locally or as one process of a torchrun/PyTorchJob.

CONFIG is an `SFTJob` manifest or its bare spec, the same file a cluster uses.
Under torchrun every process runs this; rank 0 prints the JSON summary line.
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import load_train_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="packtrain train", description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", required=True, help="SFTJob manifest or spec (YAML)")
    p.add_argument("--data", help="override data.path: a pack output folder")
    p.add_argument("--output", help="override training.outputDir")
    p.add_argument("--max-steps", type=int, help="override training.maxSteps")
    return p


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:
        args = args[1:]
    opts = build_parser().parse_args(args)
    cfg = load_train_config(opts.config)
    if opts.data:
        cfg.data.path = opts.data
    if opts.output:
        cfg.training.output_dir = opts.output
    if opts.max_steps is not None:
        cfg.training.max_steps = opts.max_steps
    cfg = type(cfg).model_validate(cfg.model_dump())

    from . import distributed
    from .loop import train

    summary = train(cfg)
    if distributed.environ().is_main:
        print(json.dumps(summary), flush=True)
        # On Kubernetes the operator reads the summary from the pod's termination message.
        from packtrain.packer.report import compact, termination_log_path

        term = termination_log_path()
        if term is not None:
            term.write_text(compact(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
