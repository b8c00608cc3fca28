"""`packtrain` dispatcher: lazy subcommands, CRD generation, and no torch in the operator's import graph."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from packtrain.operator import cli, crdgen


def test_crds_subcommand_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["crds", "--out", str(tmp_path), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert cli.main(["crds", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "packtrain.dev_packjobs.yaml",
        "packtrain.dev_sftjobs.yaml",
    ]
    assert cli.main(["crds", "--out", str(tmp_path), "--check"]) == 0
    assert (tmp_path / "packtrain.dev_packjobs.yaml").read_text() == crdgen.render(crdgen.PackJob)


def test_delegates_pass_the_rest_of_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("fake_pack")
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "packtrain.packer.cli", fake)
    assert cli.main(["pack", "convert", "-c", "x.yaml", "--help"]) == 3
    assert seen == [["convert", "-c", "x.yaml", "--help"]]


def test_operator_arguments() -> None:
    args = cli.parser().parse_args(["operator", "-n", "ml", "-n", "team-*", "--metrics-port", "0"])
    assert args.namespace == ["ml", "team-*"] and args.metrics_port == 0 and args.peering is None
    assert cli.parser().parse_args(["operator"]).liveness == "http://0.0.0.0:8080/healthz"


def test_no_torch_in_the_operator_import_graph() -> None:
    code = (
        "import sys, packtrain.operator.cli, packtrain.operator.handlers, packtrain.operator.crdgen, "
        "packtrain.core.sft_config, packtrain.operator.local_run, packtrain.operator.render; "
        "bad = [m for m in ('torch', 'torchvision', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_import_is_light() -> None:
    code = (
        "import sys, packtrain.operator.cli; "
        "bad = [m for m in ('kopf', 'kubernetes', 'torch') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
