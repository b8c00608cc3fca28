"""The `e2e` fixture: a control plane of its own whose node agent really runs every pod.

The suite's shared `kube_cluster` simulates pods unless they opt in; here every pod must run
(the quickstart is applied unchanged, so it carries no opt-in annotation), and the training-
operator would otherwise turn other tests' PyTorchJobs into pods too, so the e2e gets its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from cluster.controlplane import ControlPlane
from e2e_harness import REPO, Harness, control_plane_binaries, in_ci, running


@pytest.fixture(scope="module")
def e2e(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    if os.environ.get("PACKTRAIN_SKIP_CLUSTER") == "1":
        if in_ci():
            pytest.fail("PACKTRAIN_SKIP_CLUSTER=1, but CI must run the end-to-end tests")
        pytest.skip("cluster tests skipped because PACKTRAIN_SKIP_CLUSTER=1")
    bin_dir, crd_dir = control_plane_binaries()
    if not (bin_dir / "training-operator").is_file():
        pytest.fail(f"no training-operator in {bin_dir}: run `bash tests/cluster/build.sh`")
    cp = ControlPlane(bin_dir, crd_dir, node_agent_args=["--run-all", "--workdir", str(REPO)])
    yield from running(request, tmp_path_factory.mktemp("e2e"), cp, Harness)
