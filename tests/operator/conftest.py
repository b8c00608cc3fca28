"""Fixtures of the operator tests (fresh copies, so a test may edit its manifest)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from operator_fixtures import PACKJOB, SFTJOB


@pytest.fixture
def packjob() -> dict[str, Any]:
    return copy.deepcopy(PACKJOB)


@pytest.fixture
def sftjob() -> dict[str, Any]:
    return copy.deepcopy(SFTJOB)
