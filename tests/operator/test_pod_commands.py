"""The one place pod commands come from (shared by the operator and `packtrain run`)."""

from __future__ import annotations

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
