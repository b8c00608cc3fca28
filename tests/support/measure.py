"""A command's exit code, output, wall time and peak memory, for the hostile-input tests that bound
what one bad input may cost."""

from __future__ import annotations

import os
import subprocess
import sys

from .malloc import glibc_default

# A parent of its own: this test process's RUSAGE_CHILDREN would include every earlier child, and a
# child forked from it would start from its peak (Linux keeps it across fork).
_PROBE = (
    "import resource, subprocess, sys, time\n"
    "t = time.monotonic()\n"
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "sys.stderr.write(p.stderr)\n"
    "sys.stdout.write(p.stdout + '\\n')\n"
    "print(p.returncode, time.monotonic() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def run_measured(args: list[str], timeout: float = 600) -> tuple[int, str, str, float, float]:
    """(exit code, stdout, stderr, seconds, peak RSS in MiB) of one command."""
    # glibc's default malloc settings, as a user's process has (support/malloc.py).
    env = glibc_default(os.environ)
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "300"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    *out, last = done.stdout.rstrip("\n").split("\n")
    code, seconds, kib = last.split()
    return int(code), "\n".join(out), done.stderr, float(seconds), int(kib) / 1024


def one_line(code: int, stderr: str, stdout: str = "") -> str:
    """The single line a configuration error prints: exit 2, no traceback."""
    assert code == 2, (code, stderr[-3000:])
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]
