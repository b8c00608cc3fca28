"""A run's output folder is its own: claimed for the whole run, then swept of a killed export.

The global rank 0 holds the claim (`core/output_lock.py`) for every rank of its job, on any number of
nodes, and tells them whether it got it: a second job on the same folder stops on every rank, before
anything of the folder is read or written. Once the folder is this run's, no other export can be in
progress there, so every temp folder an export left is a killed one's (`export.sweep_exports`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from packtrain.core.errors import ConfigError
from packtrain.core.output_lock import claim_output
from packtrain.trainer.distributed import DistEnv, all_reduce_sum
from packtrain.trainer.state import export

OUTPUT_OPTION = "--output, or training.outputDir"


@contextlib.contextmanager
def claimed(root: Path, env: DistEnv, device: torch.device) -> Iterator[None]:
    """Hold `root` for this run (rank 0 claims it, every rank learns the outcome) until the block ends."""
    with contextlib.ExitStack() as stack:
        failed: Exception | None = None
        if env.is_main:
            try:
                stack.enter_context(claim_output(root, "train", OUTPUT_OPTION))
                export.sweep_exports(root)
            except Exception as exc:  # every rank must reach the all-reduce below, or they would wait
                failed = exc
        if all_reduce_sum(float(failed is not None), device) > 0:
            raise failed or ConfigError(f"rank 0 could not claim {root} for this run: its message says why")
        yield
