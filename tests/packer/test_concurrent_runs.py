"""Concurrent and interrupted `pack run`s cannot destroy each other: one run per output folder (the
loser exits 2 naming the holder and touches nothing), workers die with their `pack run`, and a
folder that fills up or cannot be written ends in exit 2 naming it, then resumes to the same pack.

Every case runs the real `packtrain pack …` command in a subprocess and compares the pack with a
clean run of the same configuration.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from support.paths import MODELS
from support.unwritable import make_unwritable, make_writable

PACKTRAIN = str(Path(sys.executable).with_name("packtrain"))
QWEN2 = MODELS / "qwen2-vl"
ENV = os.environ | {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3000 short chats: a `pack run` of them takes a few seconds on 2 workers."""
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    with path.open("w") as f:
        for i in range(3000):
            user, answer = f"Count to {i}. " * 20, "Done. " * 30
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _config(folder: Path, data: Path, max_length: int, per_shard: int = 48) -> Path:
    spec = {
        "source": {"paths": [str(data)]},
        "model": {"path": str(QWEN2)},
        "packing": {"maxLength": max_length, "sequencesPerShard": per_shard},
    }
    path = folder / f"pack-{max_length}-{per_shard}.yaml"
    path.write_text(yaml.safe_dump({"kind": "PackJob", "metadata": {"name": "p"}, "spec": spec}))
    return path


def _pack_run(config: Path, out: Path, workers: int = 2, **popen: object) -> subprocess.Popen[str]:
    argv = [PACKTRAIN, "pack", "run", "-c", str(config), "-o", str(out), "--workers", str(workers)]
    return subprocess.Popen(
        [*argv, "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, **popen
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _one_line(code: int, err: str, want: int) -> str:
    """The one error line of a refused command: exit `want`, one stderr line, no traceback."""
    assert code == want, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]
    return err.strip()


def _pack(out: Path) -> dict[str, object]:
    """What a pack is: its manifest (shard checksums included) and its rejects; no temp file left."""
    left = [p.name for p in out.rglob(".*") if ".tmp-" in p.name or ".new-" in p.name]
    assert not left, left
    verify = subprocess.run([PACKTRAIN, "pack", "verify", str(out)], capture_output=True, text=True, env=ENV)
    assert verify.returncode == 0, verify.stderr[-3000:]
    return {
        "manifest": json.loads((out / "manifest.json").read_text()),
        "rejects": (out / "rejects.jsonl").read_bytes(),
    }


class _CleanRuns(dict[str, dict[str, object]]):
    """The packs of uninterrupted runs, by config file name, each made on first use."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def of(self, config: Path) -> dict[str, object]:
        if config.name not in self:
            out = self.root / config.stem
            code, err = _finish(_pack_run(config, out))
            assert code == 0, err[-3000:]
            self[config.name] = _pack(out)
        return self[config.name]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> _CleanRuns:
    return _CleanRuns(tmp_path_factory.mktemp("clean"))


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            found |= {int(child), *_descendants(int(child))}
    return found


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed orphan waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _wait_for(found: Callable[[], bool], proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not found():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run was not caught in the act"
        time.sleep(0.01)


@pytest.mark.slow
def test_two_pack_runs_on_one_folder_one_wins_the_other_touches_nothing(
    tmp_path: Path, data: Path, clean: _CleanRuns
) -> None:
    configs = [_config(tmp_path, data, 512), _config(tmp_path, data, 1024)]
    out = tmp_path / "out"
    start = time.monotonic()
    procs = [_pack_run(c, out) for c in configs]  # the same moment: no head start for either
    took: dict[int, float] = {}
    while len(took) < 2:  # when each ends (the loser must not wait for the winner)
        took |= {
            i: time.monotonic() - start for i, p in enumerate(procs) if p.poll() is not None and i not in took
        }
        time.sleep(0.01)
    results = [_finish(proc) for proc in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, err in results]
    won = next(i for i, (code, _) in enumerate(results) if code == 0)
    lost = 1 - won
    line = _one_line(*results[lost], 2)
    assert f"{out} is in use by `pack run` (pid {procs[won].pid} on {socket.gethostname()}" in line, line
    assert "nothing in" in line and "-o" in line
    # The winner's pack is exactly an uninterrupted run's: the loser deleted or changed nothing.
    assert _pack(out) == clean.of(configs[won])
    assert took[lost] < took[won], took
    print(f"winner {took[won]:.1f} s, refused loser {took[lost]:.1f} s")


@pytest.mark.slow
def test_a_stage_pod_and_a_pack_run_exclude_each_other(tmp_path: Path, data: Path) -> None:
    """A PackJob's stage commands share their folder; a `pack run` there is refused, and the reverse.
    The holder is stopped (SIGSTOP) while the other command tries, so it is caught holding the folder."""
    config = _config(tmp_path, data, 512)
    out = tmp_path / "a"
    argv = [PACKTRAIN, "pack", "convert", "-c", str(config), "-o", str(out), "--index", "0", "--count", "1"]
    stage = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    _wait_for(lambda: any((out / "work" / "convert").glob(".part-*")), stage)
    with _stopped(stage):
        line = _one_line(*_finish(_pack_run(config, out)), 2)
    assert f"{out} is in use by `pack convert` (pid {stage.pid}" in line, line
    assert stage.wait(120) == 0, stage.communicate()[1][-3000:]

    out = tmp_path / "b"
    runner = _pack_run(config, out, workers=1)
    _wait_for(lambda: any((out / "work" / "convert").glob(".part-*")), runner)
    with _stopped(runner):
        refused = subprocess.run(
            [PACKTRAIN, "pack", "plan", "-c", str(config), "-o", str(out)],
            capture_output=True,
            text=True,
            env=ENV,
        )
    line = _one_line(refused.returncode, refused.stderr, 2)
    assert f"{out} is in use by `pack run` (pid {runner.pid}" in line, line
    assert _finish(runner)[0] == 0


@contextlib.contextmanager
def _stopped(proc: subprocess.Popen[str]) -> Iterator[None]:
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_kill_9_of_pack_run_takes_its_workers_and_the_rerun_equals_a_clean_run(
    tmp_path: Path, data: Path, clean: _CleanRuns
) -> None:
    config, out = _config(tmp_path, data, 512), tmp_path / "out"
    proc = _pack_run(config, out)
    _wait_for(lambda: len(list((out / "work" / "convert").glob(".part-*.tmp-*"))) == 2, proc)
    workers = _descendants(proc.pid)
    assert len(workers) >= 2, workers
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    while any(_running(w) for w in workers) and time.monotonic() - killed < 5:
        time.sleep(0.01)
    alive = [w for w in workers if _running(w)]
    assert not alive, f"workers outlived their pack run: {alive}"
    print(f"workers gone {time.monotonic() - killed:.3f} s after the kill")
    # The rerun starts at once, without manual cleanup, and ends with the pack a clean run makes.
    code, err = _finish(_pack_run(config, out))
    assert code == 0, err[-3000:]
    assert _pack(out) == clean.of(config)


def _file_size_limit(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """32 records, each with its own 512x512 noise PNG (~790 KB): the convert parts hold only their
    paths and are small, the shards hold their bytes (two per shard) and are not."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    with (root / "chats.jsonl").open("w") as f:
        for i in range(32):
            Image.fromarray(rng.integers(0, 256, (512, 512, 3), dtype=np.uint8)).save(root / f"{i}.png")
            messages = [
                {"role": "user", "content": "<image>What is it?"},
                {"role": "assistant", "content": f"Noise number {i}."},
            ]
            f.write(json.dumps({"messages": messages, "images": [f"{i}.png"]}) + "\n")
    return root


@pytest.mark.slow
def test_a_full_disk_exits_2_naming_the_folder_and_the_rerun_resumes_to_the_same_pack(
    tmp_path: Path, images: Path, clean: _CleanRuns
) -> None:
    """A file-size limit (`ulimit -f`: a write past it fails with EFBIG, as one on a full disk fails
    with ENOSPC) that the convert parts fit under and the shards do not: the run stops in materialize."""
    spec = {
        "source": {"paths": [str(images / "chats.jsonl")], "mediaRoot": str(images)},
        "model": {"path": str(QWEN2)},
        "packing": {"maxLength": 1024},
    }
    config = tmp_path / "images.yaml"
    config.write_text(yaml.safe_dump({"kind": "PackJob", "metadata": {"name": "p"}, "spec": spec}))
    out = tmp_path / "out"
    # The clean pack first: it also remembers the processor probe's agreement, which the limited run
    # could not write (its copy of the tokenizer files is over the limit).
    want = clean.of(config)
    start = time.monotonic()
    full = _pack_run(config, out, preexec_fn=lambda: _file_size_limit(1 << 20))
    line = _one_line(*_finish(full), 2)
    took = time.monotonic() - start
    assert f"cannot write to {out}: File too large; free space there" in line, line
    assert "-o" in line and "resumes" in line
    assert len(list((out / "work" / "convert").glob("summary-*"))) == 2  # convert was done
    assert (out / "work" / "plan.json").is_file() and not (out / "manifest.json").exists()
    code, err = _finish(_pack_run(config, out))
    assert code == 0, err[-3000:]
    assert _pack(out) == want
    print(f"full disk: exit 2 after {took:.1f} s: {line}")


@pytest.mark.slow
def test_an_unwritable_output_folder_exits_2_and_the_rerun_resumes_to_the_same_pack(
    tmp_path: Path, data: Path, clean: _CleanRuns
) -> None:
    config, out = _config(tmp_path, data, 512), tmp_path / "out"
    convert = subprocess.run(
        [PACKTRAIN, "pack", "convert", "-c", str(config), "-o", str(out), "--index", "0", "--count", "2"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert convert.returncode == 0, convert.stderr[-3000:]
    make_unwritable(out)
    try:
        line = _one_line(*_finish(_pack_run(config, out)), 2)
    finally:
        make_writable(out)
    assert f"cannot write to {out}: " in line and "make it writable for this user" in line, line
    assert f"uid {os.getuid()}" in line and "-o" in line
    print(line)
    code, err = _finish(_pack_run(config, out))
    assert code == 0, err[-3000:]
    assert _pack(out) == clean.of(config)


def test_a_fresh_output_folder_under_an_unwritable_one_exits_2(tmp_path: Path, data: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    make_unwritable(parent)
    try:
        line = _one_line(*_finish(_pack_run(_config(tmp_path, data, 512), parent / "out")), 2)
    finally:
        make_writable(parent)
    assert f"cannot write to {parent / 'out'}: " in line and "make it writable" in line, line
    assert not (parent / "out").exists()
    shutil.rmtree(parent)


def test_a_planted_lock_file_link_is_never_followed(tmp_path: Path, data: Path) -> None:
    """The lock file is the folder's, so anyone who can write there could plant it: a symlink there is
    refused, and what it points at is neither locked for nor written to."""
    out, target = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("keep me\n")
    (out / ".packtrain.lock").symlink_to(target)
    line = _one_line(*_finish(_pack_run(_config(tmp_path, data, 512), out)), 2)
    assert f"{out / '.packtrain.lock'} cannot be opened" in line and "plain file" in line, line
    assert target.read_text() == "keep me\n" and sorted(p.name for p in out.iterdir()) == [".packtrain.lock"]
