"""Test tooling: run every stage of a pack in this process (the tests' and benches' shortcut)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from packtrain.core.config import PackConfig
from packtrain.core.pack.shards import MANIFEST
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan


def run_in_process(cfg: PackConfig, out: Path, workers: int = 1) -> dict[str, Any]:
    """Every stage in this process, worker slice by worker slice; returns the manifest.

    The same slicing as parallel pods, without processes: for tests and debugging.
    """
    for i in range(workers):
        convert(cfg, out, i, workers)
    plan(cfg, out)
    for i in range(workers):
        materialize(cfg, out, i, workers)
    return json.loads((out / MANIFEST).read_text())
