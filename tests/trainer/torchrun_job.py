"""A job file trained by two gloo processes under the real torchrun, as a pod's torchrun runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cluster.controlplane import free_port

REPO = Path(__file__).resolve().parents[2]


def torchrun_two_processes(job: Path) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc-per-node 2 -m packtrain.trainer -c JOB --log-format json`, one thread per rank;
    stdout holds rank 0's JSON lines."""
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "packtrain.trainer", "-c", str(job), "--log-format", "json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO,
    )  # fmt: skip


def torchrun_script(
    script: Path, nproc: int, *args: str, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc-per-node NPROC SCRIPT ARGS...` on gloo, one thread per rank (a test's own
    worker script, for what a job file cannot ask)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.run(
        [str(torchrun), "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
         str(script), *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO,
    )  # fmt: skip
