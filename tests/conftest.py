"""Shared test fixtures: where the real fixture data lives."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# The suite runs hundreds of small torch processes, several at once, on a few cores. OpenMP's idle
# threads spin before they sleep, and beside other busy processes (a CI run keeps its cores busy
# throughout) that spinning is CPU the others wait for: passive waiting cut a trainer test module's
# CPU by 31% and its wall time by 24% beside two busy processes (3% alone). It is set before anything
# loads torch (OpenMP reads it when it loads) and every process the tests start inherits it; a value
# set outside is kept. The tokenizers' thread pool is kept to one thread for the same reason (a packer
# module's CPU fell 5-11% beside two busy processes); many of the suite's subprocesses set it anyway.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from support import malloc
from support.paths import SHARED

# glibc keeps freed memory for reuse in the processes the tests start (`support/malloc.py` says why
# and what it saved); those whose memory a test measures run with glibc's defaults.
malloc.tune(os.environ)

# The session-scoped `kube_cluster` fixture (a real local control plane), for any test folder, and how
# `.ci/run` splits the suite between its pytest processes (`--part`, `--share`).
pytest_plugins = ["cluster.fixture", "support.suite_parts"]


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"fixture data not found at {SHARED}: tests need the shared folder beside the checkout")
    return SHARED


@pytest.fixture(scope="module", autouse=True)
def _malloc_settings(request: pytest.FixtureRequest) -> Iterator[None]:
    """The suite's malloc settings in the pytest process too while a module runs (`support/malloc.py`),
    but for a module marked `measures_memory` (module level, so its module fixtures are covered too):
    the processes its tests start allocate as a user's do."""
    if request.node.get_closest_marker("measures_memory") is None:
        with malloc.in_this_process():
            yield
        return
    with pytest.MonkeyPatch.context() as mp:
        for key in malloc.SETTINGS:
            mp.delenv(key, raising=False)
        yield
