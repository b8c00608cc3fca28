"""`pack run --workers N`: workers forked once after the tokenizer is loaded (where a fork is safe),
serving convert and materialize; small packs split into several shards so materialize spreads over
the workers; the same pack whatever the worker count or start method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import DATASETS, DEMO, MODELS

from packtrain.core.config import PackConfig
from packtrain.core.errors import ConfigError
from packtrain.core.output_lock import LOCK_FILE
from packtrain.packer import local
from packtrain.packer.cli import main as pack_main
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import MIN_SHARD_SEQUENCES, plan, shard_size

TEXT = DATASETS / "text-sft"
QWEN2 = MODELS / "qwen2-vl"


def _config(**packing: object) -> PackConfig:
    return PackConfig.model_validate(
        {
            "source": {"paths": [str(DEMO / "mllm_demo.json"), str(TEXT / "glaive-toolcall" / "*.json")]},
            "model": {"path": str(QWEN2), "maxPixels": 200_000},
            "packing": {"maxLength": 1024, "maxRejectedFraction": 1.0, **packing},
        }
    )


def _files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.relative_to(out).parts[0] not in ("work", LOCK_FILE)  # `pack run`'s claim
    }


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("w1") / "pack"
    timings: dict = {}
    manifest = local.run_all(_config(), out, workers=1, show_progress=False, timings=timings)
    return out, timings | {"manifest": manifest}


def test_small_packs_get_several_shards_independent_of_workers() -> None:
    assert shard_size(3, 1024) == MIN_SHARD_SEQUENCES  # one shard: nothing to split
    assert shard_size(200, 1024) == 13  # 16 shards of at most 13
    assert shard_size(10**6, 1024) == 1024  # a large pack keeps sequencesPerShard
    assert shard_size(200, 2) == 2 and shard_size(0, 1024) >= 1


_FORKED_RUN = """
import importlib, json, os, sys
from pathlib import Path
from packtrain.packer import local
from packtrain.core.config import PackConfig

work = Path(sys.argv[1])
cfg = PackConfig.model_validate(json.loads((work / "cfg.json").read_text()))
import packtrain.packer.stages.convert as convert_module
real = convert_module.sample_tokenizer

def counted(c, out):  # a file per call, in whichever process calls it
    (work / "loads" / str(os.getpid())).touch()
    return real(c, out)

local.sample_tokenizer = convert_module.sample_tokenizer = counted  # `pack run`'s and a worker's
fork = local.fork_is_safe()
timings = {}
local.run_all(cfg, work / "pack", workers=2, show_progress=False, timings=timings)
print(json.dumps({"fork": fork, "pid": os.getpid(), "timings": timings}))
"""


def test_two_forked_workers_load_the_tokenizer_once_and_write_the_same_pack(
    one_worker: tuple[Path, dict], tmp_path: Path
) -> None:
    """In a fresh interpreter, as `pack run` is: this test runner may hold torch or threads, and
    then `local.fork_is_safe` rightly spawns instead (the next test covers spawned workers)."""
    out1, info = one_worker
    manifest1 = info["manifest"]
    assert len(manifest1["shards"]) > 2  # a one-full-shard pack, split for the workers
    (tmp_path / "loads").mkdir()
    (tmp_path / "cfg.json").write_text(json.dumps(_config().dump()))
    proc = subprocess.run(
        [sys.executable, "-c", _FORKED_RUN, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fork"] is True
    assert [p.name for p in (tmp_path / "loads").iterdir()] == [str(result["pid"])]  # never in a worker
    out2 = tmp_path / "pack"
    assert json.loads((out2 / "manifest.json").read_text()) == manifest1
    assert _files(out2) == _files(out1)
    timings = result["timings"]
    assert len(timings["stages"]["convert"]["worker_peak_rss_mib"]) == 2
    assert set(timings["stages"]) == {"load", "convert", "plan", "materialize"}
    assert (
        set(info["stages"]) == set(timings["stages"])
        and "worker_peak_rss_mib" not in info["stages"]["convert"]
    )


def test_fork_is_refused_where_torch_or_threads_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked worker of a process with torch's OpenMP pool hangs on its first parallel op (seen in
    this suite with resized media); another thread's lock would stay locked in the child."""
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(local.threading, "active_count", lambda: 1)
    assert local.fork_is_safe()
    monkeypatch.setattr(local.threading, "active_count", lambda: 2)
    assert not local.fork_is_safe()
    monkeypatch.setattr(local.threading, "active_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "torch", object())
    assert not local.fork_is_safe()


def test_materialize_splits_a_small_pack_between_workers(
    one_worker: tuple[Path, dict], tmp_path: Path
) -> None:
    out1, info = one_worker
    cfg = _config()
    out = tmp_path / "pack"
    for i in range(2):
        convert(cfg, out, i, 2)
    plan(cfg, out)
    first = materialize(cfg, out, 0, 2)
    second = materialize(cfg, out, 1, 2)
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
    rc = pack_main(
        [
            "run",
            "--input",
            str(DEMO / "mllm_demo.json"),
            "--model",
            str(QWEN2),
            "--max-length",
            "64",
            "--overlong",
            "error",
            "-o",
            str(tmp_path / "b"),
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 2 and "raise packing.maxLength" in capsys.readouterr().err


def test_pack_run_reports_stage_timings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = pack_main(
        [
            "run",
            "--input",
            str(DEMO / "mllm_demo.json"),
            "--model",
            str(QWEN2),
            "-o",
            str(tmp_path / "o"),
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    timings = summary["timings"]
    assert timings["workers"] == 2 and timings["peak_rss_mib"] > 0
    assert all(timings["stages"][s]["seconds"] >= 0 for s in ("load", "convert", "plan", "materialize"))
    assert summary["packed"] + summary["rejected"] == summary["samples"]
