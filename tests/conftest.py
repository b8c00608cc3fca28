"""Shared test fixtures: where the real fixture data lives."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.paths import SHARED

# The session-scoped `kube_cluster` fixture (a real local control plane), for any test folder.
pytest_plugins = ["cluster.fixture"]


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"fixture data not found at {SHARED}: tests need the shared folder beside the checkout")
    return SHARED


# Under pytest-xdist (`.ci/run` runs `-n 2 --dist loadgroup`): each test file stays on one worker,
# so its module-scoped packs and models are built once, and every test that needs a local control
# plane (the shared one or an end-to-end one, whose pods share this machine's network) or the built
# images runs on one worker, one at a time.
_SHARED_ONCE = ("kube_cluster", "e2e", "built_images", "prometheus_tools")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        shared = any(name in getattr(item, "fixturenames", ()) for name in _SHARED_ONCE)
        group = "cluster" if shared else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
