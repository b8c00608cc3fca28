"""Pytest plugin with the session-scoped ``kube_cluster`` fixture.

Loaded for the whole suite from ``tests/conftest.py`` (``pytest_plugins = ["cluster.fixture"]``),
so any test folder can ask for a real control plane: it starts once per session, on first use.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from .controlplane import BUILD_SCRIPT, ClusterUnavailable, ControlPlane, ensure_addons, locate_binaries
from .prometheus import locate_prometheus

T = TypeVar("T")


def in_ci() -> bool:
    """A CI run (CI set and not false): there a test that cannot run must fail, never skip."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _shout(config: pytest.Config, message: str) -> None:
    """Print past pytest's output capture, so a skip or kept logs cannot go unnoticed."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    if tr is None:
        return
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        tr.write_line("")
        tr.write_line(f"!!! {message}", red=True, bold=True)


def built_or_skip(locate: Callable[[], T], what: str, config: pytest.Config | None = None) -> T:
    """`locate()`'s result. Where it raises ClusterUnavailable: a skip (loud, given `config`) if the
    build is impossible on this machine and this is not CI, else a failure saying what to run, so a
    missing build never passes for a skip."""
    try:
        return locate()
    except ClusterUnavailable as e:
        if e.impossible and not in_ci():
            if config is not None:
                _shout(config, f"{what} SKIPPED: {e}")
            pytest.skip(str(e))
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def kube_cluster(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """A running control plane: etcd, kube-apiserver, controller-manager, scheduler, node agent.

    Yields a ControlPlane: ``.kubeconfig``, ``.api_client()``, ``.kubectl(*args)``, ``.helm(*args)``,
    ``.env()``, ``.bin``, ``.server_version``, ``.logs_dir``. Logs are kept when a test failed
    (or with PACKTRAIN_KEEP_CLUSTER_LOGS=1); everything else is removed at the end.
    """
    config = request.config
    if os.environ.get("PACKTRAIN_SKIP_CLUSTER") == "1":
        msg = "cluster tests skipped because PACKTRAIN_SKIP_CLUSTER=1"
        if in_ci():
            pytest.fail(f"{msg}, but CI must run them: unset PACKTRAIN_SKIP_CLUSTER")
        _shout(config, msg.upper())
        pytest.skip(msg)
    bin_dir, crd_dir = built_or_skip(locate_binaries, "CLUSTER TESTS", config)

    cp = ControlPlane(bin_dir, crd_dir)
    try:
        cp.start()
    except Exception as e:
        cp.stop(keep_logs=True)
        pytest.fail(f"the local control plane did not start: {e}\ncomponent logs: {cp.logs_dir}")
    yield cp
    keep = request.session.testsfailed > 0 or os.environ.get("PACKTRAIN_KEEP_CLUSTER_LOGS") == "1"
    cp.stop(keep_logs=keep)
    if keep:
        _shout(config, f"control-plane component logs kept in {cp.logs_dir}")


@pytest.fixture(scope="session")
def prometheus_tools(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """(prometheus, promtool): Debian's Prometheus from the build cache (``build.sh`` fetches it)."""
    ensure_addons()
    bin_dir = Path(
        subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--print-bin-dir"], check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    return built_or_skip(lambda: locate_prometheus(bin_dir), "PROMETHEUS TESTS", request.config)
