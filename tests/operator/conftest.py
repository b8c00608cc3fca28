"""Fixtures of the operator tests: fresh manifests (a test may edit its copy), and the cluster ones."""

from __future__ import annotations

import copy
from typing import Any

import pytest

# The control plane, the CRDs and the operator process, for every test module here that takes them.
from cluster_operator import api, crds, namespace, operator, operator_kubeconfig  # noqa: F401
from operator_fixtures import PACKJOB, SFTJOB


@pytest.fixture
def packjob() -> dict[str, Any]:
    return copy.deepcopy(PACKJOB)


@pytest.fixture
def sftjob() -> dict[str, Any]:
    return copy.deepcopy(SFTJOB)
