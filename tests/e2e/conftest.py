"""The `e2e` fixture: a control plane of its own whose node agent really runs every pod.

The suite's shared `kube_cluster` simulates pods unless they opt in; here every pod must run
(the quickstart is applied unchanged, so it carries no opt-in annotation), and the training-
operator would otherwise turn other tests' PyTorchJobs into pods too, so the e2e gets its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from cluster.controlplane import ClusterUnavailable, ControlPlane, locate_binaries
from e2e_harness import REPO, Harness


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def e2e(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    if os.environ.get("PACKTRAIN_SKIP_CLUSTER") == "1":
        if _in_ci():
            pytest.fail("PACKTRAIN_SKIP_CLUSTER=1, but CI must run the end-to-end tests")
        pytest.skip("cluster tests skipped because PACKTRAIN_SKIP_CLUSTER=1")
    try:
        bin_dir, crd_dir = locate_binaries()
    except ClusterUnavailable as e:
        if e.impossible and not _in_ci():
            pytest.skip(str(e))
        pytest.fail(str(e))
    if not (bin_dir / "training-operator").is_file():
        pytest.fail(f"no training-operator in {bin_dir}: run `bash tests/cluster/build.sh`")

    cp = ControlPlane(bin_dir, crd_dir, node_agent_args=["--run-all", "--workdir", str(REPO)])
    harness: Harness | None = None
    try:
        cp.start()
        harness = Harness(cp, tmp_path_factory.mktemp("e2e"))
        harness.start_training_operator()
        harness.install_chart()
        harness.start_operator()
    except Exception as e:
        if harness is not None:
            harness.close()
        cp.stop(keep_logs=True)
        pytest.fail(f"the end-to-end environment did not start: {e}\ncomponent logs: {cp.logs_dir}")
    yield harness
    harness.close()
    keep = request.session.testsfailed > 0 or os.environ.get("PACKTRAIN_KEEP_CLUSTER_LOGS") == "1"
    cp.stop(keep_logs=keep)
    if keep:
        print(f"\ne2e component logs kept in {cp.logs_dir}")
