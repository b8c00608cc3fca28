"""The chart refuses training-stall deadlines the operator would refuse at start, with what to change."""

from __future__ import annotations

import json

import helm_python
import pytest

from packtrain.operator.deadlines import Deadlines

from .helm import render


def deadlines_env(values: dict[str, object]) -> str:
    deployment = next(m for m in render(values) if m["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return next(e["value"] for e in env if e["name"] == "PACKTRAIN_DEADLINES")


def test_raising_only_the_stall_deadline_past_the_fail_deadline_fails_rendering() -> None:
    """Helm merges the default `trainingStallFailSeconds` (21600) under an admin's larger
    `trainingStallSeconds`."""
    with pytest.raises(
        helm_python.HelmError,
        match=(
            r"operator.deadlines.trainingStallFailSeconds \(21600\) must be longer than "
            r"trainingStallSeconds \(30000\): "
            r"raise trainingStallFailSeconds too"
        ),
    ):
        render({"operator": {"deadlines": {"trainingStallSeconds": 30000}}})
    with pytest.raises(helm_python.HelmError, match="must be longer than trainingStallSeconds"):
        render({"operator": {"deadlines": {"trainingStallSeconds": 600, "trainingStallFailSeconds": 600}}})


@pytest.mark.parametrize("fail", [0, 40000])
def test_a_longer_fail_deadline_or_never_renders_what_the_operator_accepts(fail: int) -> None:
    raw = json.loads(
        deadlines_env(
            {"operator": {"deadlines": {"trainingStallSeconds": 30000, "trainingStallFailSeconds": fail}}}
        )
    )
    parsed = Deadlines.from_dict(raw)
    assert parsed.training_stall == 30000 and parsed.training_stall_fail == (fail or None)
