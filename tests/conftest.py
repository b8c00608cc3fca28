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


# `.ci/run` runs the suite as two pytest processes at once, one per core: `--part cluster` (every
# test that needs a local control plane, the shared one or an end-to-end one whose pods share this
# machine's network, or the built images: one at a time, as ever) and `--part rest` (the others).
_CLUSTER_FIXTURES = ("kube_cluster", "e2e", "built_images", "prometheus_tools")
# What each part runs last: tests that need more than the control plane itself (the add-ons, the GitOps
# engine, the images), which `.ci/run` is still building when the first tests start. `e2e_images`
# (the quickstart inside the images) runs in the rest part, beside the cluster part's control planes.
_LATE_FIXTURES = ("e2e", "built_images", "prometheus_tools", "e2e_images")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--part",
        choices=("cluster", "rest"),
        default=None,
        help="run only the tests that need a control plane or the images (cluster), or only the others "
        "(rest) (default: all)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = config.getoption("part")
    if part is None:
        return
    keep, drop = [], []
    for item in items:
        cluster = any(name in getattr(item, "fixturenames", ()) for name in _CLUSTER_FIXTURES)
        (keep if cluster == (part == "cluster") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = _late_modules_last(keep)


def _late_modules_last(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with every module that has a test needing a late build after the others, each module
    kept whole (a module-scoped control plane starts once) and otherwise in collection order."""
    late = {
        item.module.__name__
        for item in items
        if isinstance(item, pytest.Function) and any(name in item.fixturenames for name in _LATE_FIXTURES)
    }
    return sorted(items, key=lambda item: getattr(getattr(item, "module", None), "__name__", "") in late)
