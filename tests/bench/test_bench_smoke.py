"""The benchmark scripts run end to end at tiny sizes, so a broken bench fails CI rather than the report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_fill_quick(shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load("bench_fill").main(["--quick", "--n", "3000", "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_fill.json").read_text())
    assert result["meta"]["lengths"] == "Qwen2-VL tokenizer"
    mixes = {row["mix"] for row in result["rows"]}
    assert {"fastchat", "glaive-toolcall", "llava-instruct-100", "synthetic mix"} <= mixes
    assert all(row["sequences"]["bfd"] >= row["lower_bound"] for row in result["rows"])
    assert "Sequences / lower bound" in capsys.readouterr().out


def test_bench_planner_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("bench_planner")
    args = ["--sizes", "2000", "10000", "20000", "--baseline-max", "5000", "--results-dir", str(tmp_path)]
    assert bench.main(["--quick", *args]) in (0, 1)  # rates at tiny n are noise; the run must complete
    rows = json.loads((tmp_path / "bench_planner.json").read_text())["rows"]
    assert [row["n"] for row in rows] == [2000, 10000, 20000]
    assert rows[2]["swift"]["measured_on"] == 5000 and rows[2]["speedup_vs_swift"] > 1
    assert "extrapolated" in capsys.readouterr().out
    assert rows[2]["swift"]["seconds"] == rows[1]["swift"]["seconds"]  # one timing of the shared prefix

    assert bench.main(["--huge", "--huge-n", "50000", "--results-dir", str(tmp_path)]) in (0, 1)
    result = json.loads((tmp_path / "bench_planner_huge.json").read_text())["result"]
    assert result["valid"] and result["n"] == 50000 and result["peak_rss_gib_after_plan"] > 0


def test_bench_shard_format_quick(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("bench_shard_format")
    assert bench.main(["--quick"]) == 0
    rows = json.loads((bench.RESULTS / "bench_shard_format.json").read_text())["rows"]
    assert rows[0]["format"].startswith("arrow-ipc") and rows[0]["size_vs_ipc"] == 1.0
    assert {r["format"].split()[0] for r in rows} == {"arrow-ipc", "parquet"}
    assert "random read time/ipc" in capsys.readouterr().out


def test_bench_convert_scaling_quick(shared_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("bench_convert_scaling")
    assert bench.main(["--quick", "--samples", "60", "--workers", "1", "2"]) == 0
    rows = json.loads((bench.RESULTS / "bench_convert_scaling.quick.json").read_text())["rows"]
    assert [r["workers"] for r in rows] == [1, 2] and rows[0]["speedup"] == pytest.approx(1.0)
    assert "efficiency" in capsys.readouterr().out
