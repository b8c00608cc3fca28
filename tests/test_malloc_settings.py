"""The suite's glibc malloc settings (`support/malloc.py`): the processes the tests start get them,
and every test module that measures a process's memory is marked so that its processes do not."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support import malloc

TESTS = Path(__file__).resolve().parent
# What measuring a process's memory reads (the kernel's peak, rusage, the peak's reset) or runs (a
# memory benchmark named in a string: loaded or started; the per-rank memory helpers).
MEASURES = re.compile(r"VmHWM|maxrss|clear_refs|[\"']bench_\w*memory|rank_memory")


def test_every_module_that_measures_memory_is_marked() -> None:
    unmarked = [
        str(path.relative_to(TESTS))
        for path in sorted(TESTS.rglob("test_*.py"))
        if path != Path(__file__).resolve()
        and MEASURES.search(text := path.read_text())
        and "pytestmark = pytest.mark.measures_memory" not in text
    ]
    assert not unmarked, f"these measure memory: add `pytestmark = pytest.mark.measures_memory`: {unmarked}"


def test_the_processes_a_test_starts_get_the_settings() -> None:
    seen = subprocess.run(
        [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for key, value in malloc.SETTINGS.items():
        assert f'"{key}": "{os.environ.get(key, value)}"' in seen


def test_a_measuring_command_runs_with_glibc_defaults() -> None:
    env = malloc.glibc_default(os.environ | malloc.SETTINGS)
    assert not set(malloc.SETTINGS) & set(env) and env["PATH"] == os.environ["PATH"]
