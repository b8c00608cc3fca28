"""Shared test fixtures: where the real fixture data lives."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.paths import SHARED

# The session-scoped `kube_cluster` fixture (a real local control plane), for any test folder, and how
# `.ci/run` splits the suite between its two pytest processes (`--part`, `--share`).
pytest_plugins = ["cluster.fixture", "support.suite_parts"]


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"fixture data not found at {SHARED}: tests need the shared folder beside the checkout")
    return SHARED
