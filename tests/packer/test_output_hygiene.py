"""A killed run's temp files are removed by the next run, output is readable by other users (umask
permitting), and duplicate sample ids are counted and warned about."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.pack_runner import run_in_process
from support.paths import MODELS

from packtrain.core.config import PackConfig
from packtrain.core.pack.shards import MANIFEST, remove_stale_temps
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.finalize import DUPLICATE_IDS
from packtrain.packer.tools import verify

QWEN2 = MODELS / "qwen2-vl"
PACKTRAIN = Path(sys.executable).with_name("packtrain")


def _chats(path: Path, n: int, ids: list[str] | None = None) -> Path:
    with path.open("w") as f:
        for i in range(n):
            rec = {
                "messages": [
                    {"role": "user", "content": f"Count to {i}."},
                    {"role": "assistant", "content": "Done."},
                ]
            }
            if ids:
                rec["id"] = ids[i]
            f.write(json.dumps(rec) + "\n")
    return path


def _cfg(paths: list[Path]) -> PackConfig:
    return PackConfig.model_validate(
        {
            "source": {"paths": [str(p) for p in paths]},
            "model": {"path": str(QWEN2)},
            "packing": {"maxLength": 512},
        }
    )


def test_a_sigkilled_convert_leaves_a_temp_file_the_next_run_removes(tmp_path: Path) -> None:
    data = _chats(tmp_path / "chats.jsonl", 20_000)
    job = tmp_path / "job.json"
    job.write_text(json.dumps(_cfg([data]).dump()))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [str(PACKTRAIN), "pack", "convert", "-c", str(job), "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    convert_dir = out / "work" / "convert"
    deadline = time.monotonic() + 120
    while (
        not list(convert_dir.glob(".rejects-*.tmp-*")) and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = list(convert_dir.glob(".*.tmp-*"))
    assert left, "the convert was not caught mid-run"
    assert all(f"-{proc.pid}@{socket.gethostname()}" in p.name for p in left)
    summary = convert(_cfg([data]), out, 0, 1)
    assert summary["samples"] == 20_000
    assert not [p for p in out.rglob(".*") if ".tmp-" in p.name or ".new-" in p.name]


def test_only_temp_files_of_provably_dead_writers_or_own_slice_are_removed(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    live_pid = os.getppid()
    files = {
        f".00001.arrow.tmp-ab12-{dead_pid}@{host}": False,  # another slice, writer gone on this host
        f".00003.arrow.tmp-ab12-{live_pid}@{host}": True,  # another slice, writer alive here
        ".00005.arrow.tmp-ab12-7@other-pod-x7k2q": True,  # another slice, on another host: may be running
        ".00002.arrow.tmp-k3j4l5": False,  # own slice, any writer (here an old-style name)
        ".manifest.json.tmp-ab12-7@other-pod-x7k2q": True,  # written in one go, but young
        "00001.arrow": True,  # not a temp file
    }
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    old = tmp_path / ".manifest.json.tmp-cd34-9@other-pod-x7k2q"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    files[old.name] = False
    remove_stale_temps(
        tmp_path, owned=lambda final: final.startswith("00002."), short_write=lambda final: final == MANIFEST
    )
    assert {name: (tmp_path / name).exists() for name in files} == files


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_output_files_are_created_0666_less_the_umask(umask: int, tmp_path: Path) -> None:
    data = _chats(tmp_path / "chats.jsonl", 5)
    previous = os.umask(umask)
    try:
        run_in_process(_cfg([data]), tmp_path / "out")
    finally:
        os.umask(previous)
    modes = {
        str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode)
        for p in (tmp_path / "out").rglob("*")
        if p.is_file()
    }
    assert "out/shards/00000.arrow" in modes and "out/manifest.json" in modes
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_duplicate_sample_ids_are_counted_and_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _chats(tmp_path / "chats.jsonl", 5, ids=["a", "b", "a", "c", "a"])
    manifest = run_in_process(_cfg([data]), tmp_path / "out")
    assert manifest["counts"][DUPLICATE_IDS] == 2
    err = capsys.readouterr().err
    assert "warning: 2 samples reuse an earlier sample's id" in err and "'a'" in err
    assert verify(tmp_path / "out") == []
