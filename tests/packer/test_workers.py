"""`pack run --workers N`: workers forked once after the tokenizer is loaded, serving convert and
materialize; small packs split into several shards so materialize spreads over the workers; the
same pack whatever the worker count or start method."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from packtrain.packer import local, stages
from packtrain.packer.cli import main as pack_main
from packtrain.packer.config import PackConfig
from packtrain.packer.records import ConfigError

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
DEMO = SHARED / "datasets" / "llamafactory-mllm-demo"
TEXT = SHARED / "datasets" / "text-sft"
QWEN2 = SHARED / "models" / "qwen2-vl"


def _config(**packing: object) -> PackConfig:
    return PackConfig.model_validate({
        "source": {"paths": [str(DEMO / "mllm_demo.json"), str(TEXT / "glaive-toolcall" / "*.json")]},
        "model": {"path": str(QWEN2), "maxPixels": 200_000},
        "packing": {"maxLength": 1024, **packing},
    })


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.relative_to(out).parts[0] != "work"}


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("w1") / "pack"
    timings: dict = {}
    manifest = local.run_all(_config(), out, workers=1, show_progress=False, timings=timings)
    return out, timings | {"manifest": manifest}


def test_small_packs_get_several_shards_independent_of_workers() -> None:
    assert stages.shard_size(3, 1024) == stages.MIN_SHARD_SEQUENCES  # one shard: nothing to split
    assert stages.shard_size(200, 1024) == 13  # 16 shards of at most 13
    assert stages.shard_size(10**6, 1024) == 1024  # a large pack keeps sequencesPerShard
    assert stages.shard_size(200, 2) == 2 and stages.shard_size(0, 1024) >= 1


def test_two_forked_workers_load_the_tokenizer_once_and_write_the_same_pack(
    one_worker: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out1, info = one_worker
    manifest1 = info["manifest"]
    assert len(manifest1["shards"]) > 2  # a one-full-shard pack, split for the workers
    loads = tmp_path / "loads"
    loads.mkdir()
    real = stages.sample_tokenizer

    def counted(cfg: PackConfig, out: Path) -> object:  # a file per call, in whichever process calls it
        (loads / str(os.getpid())).touch()
        return real(cfg, out)

    monkeypatch.setattr(stages, "sample_tokenizer", counted)
    out2 = tmp_path / "pack"
    timings: dict = {}
    manifest2 = local.run_all(_config(), out2, workers=2, show_progress=False, timings=timings)
    assert [p.name for p in loads.iterdir()] == [str(os.getpid())]  # loaded here only, never in a worker
    assert manifest2 == manifest1
    assert _files(out2) == _files(out1)
    assert len(timings["stages"]["convert"]["worker_peak_rss_mib"]) == 2
    assert set(timings["stages"]) == {"load", "convert", "plan", "materialize"}
    assert set(info["stages"]) == set(timings["stages"]) and "worker_peak_rss_mib" not in info["stages"]["convert"]


def test_materialize_splits_a_small_pack_between_workers(one_worker: tuple[Path, dict], tmp_path: Path) -> None:
    out1, info = one_worker
    cfg = _config()
    out = tmp_path / "pack"
    for i in range(2):
        stages.convert(cfg, out, i, 2)
    stages.plan(cfg, out)
    first = stages.materialize(cfg, out, 0, 2)
    second = stages.materialize(cfg, out, 1, 2)
    assert first["written"] > 0 and second["written"] > 0
    assert not first["manifest"] and second["manifest"]
    assert _files(out) == _files(out1)


def test_spawned_workers_where_fork_is_not_used_write_the_same_pack(
    one_worker: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out1, _ = one_worker
    monkeypatch.setattr(sys, "platform", "darwin")  # the start-method choice only: spawn, as on macOS
    out = tmp_path / "pack"
    local.run_all(_config(), out, workers=2, show_progress=False)
    assert _files(out) == _files(out1)


def test_a_worker_error_stops_the_run_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(maxLength=64, overlong="error")
    with pytest.raises(ConfigError, match="raise packing.maxLength"):
        local.run_all(cfg, tmp_path / "a", workers=2, show_progress=False)
    rc = pack_main(["run", "--input", str(DEMO / "mllm_demo.json"), "--model", str(QWEN2), "--max-length", "64",
                    "--overlong", "error", "-o", str(tmp_path / "b"), "--workers", "2", "--no-progress"])
    assert rc == 2 and "raise packing.maxLength" in capsys.readouterr().err


def test_pack_run_reports_stage_timings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = pack_main(["run", "--input", str(DEMO / "mllm_demo.json"), "--model", str(QWEN2), "-o", str(tmp_path / "o"),
                    "--workers", "2", "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    timings = summary["timings"]
    assert timings["workers"] == 2 and timings["peak_rss_mib"] > 0
    assert all(timings["stages"][s]["seconds"] >= 0 for s in ("load", "convert", "plan", "materialize"))
    assert summary["packed"] + summary["rejected"] == summary["samples"]
