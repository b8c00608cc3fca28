"""The shard-format and convert-scaling benchmarks run end to end at tiny sizes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_shard_format_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load("bench_shard_format")
    assert bench.main(["--quick"]) == 0
    rows = json.loads((bench.RESULTS / "bench_shard_format.json").read_text())["rows"]
    assert rows[0]["format"].startswith("arrow-ipc") and rows[0]["size_vs_ipc"] == 1.0
    assert {r["format"].split()[0] for r in rows} == {"arrow-ipc", "parquet"}
    assert "random read time/ipc" in capsys.readouterr().out


def test_bench_convert_scaling_quick(shared_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load("bench_convert_scaling")
    assert bench.main(["--quick", "--samples", "60", "--workers", "1", "2"]) == 0
    rows = json.loads((bench.RESULTS / "bench_convert_scaling.quick.json").read_text())["rows"]
    assert [r["workers"] for r in rows] == [1, 2] and rows[0]["speedup"] == pytest.approx(1.0)
    assert "efficiency" in capsys.readouterr().out
