"""The one place pod commands come from (shared by the operator and `packtrain run`)."""

from __future__ import annotations

from typing import Any

import pytest

from packtrain.operator.commands import pack_stage_command, train_command


def test_pack_stage_commands() -> None:
    assert pack_stage_command("plan", "/etc/p.yaml", "/out") == [
        "packtrain",
        "pack",
        "plan",
        "-c",
        "/etc/p.yaml",
        "-o",
        "/out",
    ]
    assert pack_stage_command("convert", "c.yaml", "o", count=4) == [
        "packtrain",
        "pack",
        "convert",
        "-c",
        "c.yaml",
        "-o",
        "o",
        "--count",
        "4",
    ]
    assert pack_stage_command("materialize", "c.yaml", "o", index=2, count=4)[-4:] == [
        "--index",
        "2",
        "--count",
        "4",
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": "shuffle"}, "unknown pack stage 'shuffle'"),
        ({"stage": "plan", "count": 2}, "runs as a single worker"),
        ({"stage": "convert", "index": 4, "count": 4}, "outside 0..3"),
        ({"stage": "convert", "count": 0}, "at least 1"),
    ],
)
def test_pack_stage_command_rejects_nonsense(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack_stage_command(config_path="c", output_dir="o", **kwargs)


def test_train_command_single_and_multi_node() -> None:
    single = train_command("/etc/packtrain/sftjob.yaml", "/data/p", "/ck/run", nproc_per_node=2)
    assert single == [
        "torchrun",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--standalone",
        "-m",
        "packtrain.trainer",
        "-c",
        "/etc/packtrain/sftjob.yaml",
        "--data",
        "/data/p",
        "--output",
        "/ck/run",
        "--log-format",
        "json",
    ]
    multi = train_command("c", "d", "o", nproc_per_node=8, nnodes=4, max_steps=10)
    assert multi[:5] == ["torchrun", "--nnodes", "4", "--nproc-per-node", "8"] and "--standalone" not in multi
    assert multi[-2:] == ["--max-steps", "10"]
    assert train_command("c", "d", "o", nproc_per_node=0)[4] == "1"  # CPU-only: one process
    with pytest.raises(ValueError, match="nnodes"):
        train_command("c", "d", "o", nproc_per_node=1, nnodes=0)


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "packtrain.trainer", "-c", "{missing}"],
        ["-m", "packtrain.operator.cli", "pack", "plan", "-c", "{missing}", "-o", "{out}"],
    ],
    ids=["trainer", "packer-plan"],
)
def test_a_pod_that_fails_leaves_its_error_in_the_termination_message(argv: list[str], tmp_path: Any) -> None:
    """What the operator reads once the pod is gone: the pods' real entry points, given a config that is not
    there."""
    import json
    import os
    import subprocess
    import sys

    term = tmp_path / "termination-log"
    args = [a.format(missing=tmp_path / "missing.yaml", out=tmp_path / "out") for a in argv]
    env = {**os.environ, "PACKTRAIN_TERMINATION_LOG": str(term)}
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    said = json.loads(term.read_text())
    assert "missing.yaml" in said["error"] and len(term.read_bytes()) <= 4096
