"""Concurrent and interrupted trainings cannot destroy each other: one `train` per output folder (the
loser exits 2 naming the holder), `final/` published whole (a run killed while exporting leaves
only a temp folder, which the next run removes), a full or unwritable output folder ends in exit 2
naming it and resumes to the same model, and two `packtrain run`s at once both get a metrics port.

Every case runs the real command in a subprocess, on a tiny random model and the demo pack.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import job_spec, write_job
from safetensors.torch import load_file
from support.unwritable import make_unwritable, make_writable

PACKTRAIN = str(Path(sys.executable).with_name("packtrain"))
ENV = os.environ | {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def _train(job: Path, **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PACKTRAIN, "train", "-c", str(job), "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        **popen,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _one_line(code: int, err: str, want: int) -> str:
    assert code == want, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]
    return err.strip()


def _job(folder: Path, pack: Path, out: Path, name: str, **training: Any) -> Path:
    spec = job_spec(pack, out, saveFinal=True, **training)
    spec["spec"]["data"]["numWorkers"] = 0
    return write_job(folder / f"{name}.yaml", spec)


def _export(final: Path) -> dict[str, Any]:
    """A whole export: its step record, config and every weight (a half-written one fails here)."""
    record = json.loads((final / "packtrain_export.json").read_text())
    weights = load_file(final / "model.safetensors")
    config = json.loads((final / "config.json").read_text())
    return {"step": record["step"], "config": config, "weights": weights}


def _same_export(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["step"] == b["step"]
        and a["weights"].keys() == b["weights"].keys()
        and all(a["weights"][k].equal(b["weights"][k]) for k in a["weights"])
    )


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _staged(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith((".final.", ".final-merged."))]


def _writing(root: Path) -> bool:
    """An export's temp folder holds bytes (it, or a file in it, may be renamed as this looks)."""
    for folder in _staged(root):
        with contextlib.suppress(FileNotFoundError):
            if any(f.stat().st_size for f in folder.iterdir()):
                return True
    return False


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, pack_dir: Path) -> dict[str, Any]:
    """The export of an uninterrupted 2-step run: what every interrupted run below must end with."""
    root = tmp_path_factory.mktemp("clean")
    code, _, err = _finish(_train(_job(root, pack_dir, root / "out", "clean", maxSteps=2)))
    assert code == 0, err[-3000:]
    return _export(root / "out" / "final")


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory, pack_dir: Path) -> dict[str, Any]:
    """The export of a 1-step run continued to 2 steps (raised maxSteps), both uninterrupted."""
    root = tmp_path_factory.mktemp("grown")
    for steps in (1, 2):
        code, _, err = _finish(_train(_job(root, pack_dir, root / "out", f"s{steps}", maxSteps=steps)))
        assert code == 0, err[-3000:]
    return _export(root / "out" / "final")


@pytest.mark.slow
def test_two_trains_on_one_output_one_wins_the_other_touches_nothing(
    tmp_path: Path, pack_dir: Path, clean: dict[str, Any]
) -> None:
    out = tmp_path / "out"
    jobs = [_job(tmp_path, pack_dir, out, "a", maxSteps=2), _job(tmp_path, pack_dir, out, "b", lr=2e-3)]
    procs = [_train(job) for job in jobs]  # the same moment
    results = [_finish(p) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, _, err in results]
    won = next(i for i, (code, _, _) in enumerate(results) if code == 0)
    line = _one_line(results[1 - won][0], results[1 - won][2], 2)
    host = socket.gethostname()
    assert line.startswith("packtrain train: configuration error: "), line
    assert f"{out} is in use by `train` (pid {procs[won].pid} on {host}" in line, line
    assert "--output, or training.outputDir" in line and "nothing in" in line
    summary = json.loads(results[won][1].splitlines()[-1])
    assert summary["steps_this_run"] == 2 and summary["resumed_from"] is None
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]
    if won == 0:  # job a is the clean run's: the loser changed nothing of it
        assert _same_export(_export(out / "final"), clean)
    print(line)


@pytest.mark.slow
def test_kill_9_during_the_final_export_keeps_final_whole_and_the_next_run_cleans_up(
    tmp_path: Path, pack_dir: Path, grown: dict[str, Any]
) -> None:
    out = tmp_path / "out"
    first = _finish(_train(_job(tmp_path, pack_dir, out, "one", maxSteps=1)))
    assert first[0] == 0, first[2][-3000:]
    before = _digests(out / "final")
    assert _export(out / "final")["step"] == 1

    job = _job(tmp_path, pack_dir, out, "two", maxSteps=2)
    proc = _train(job)
    deadline = time.monotonic() + 600
    while not _writing(out):  # step 2's export has begun writing: kill it there
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = _staged(out)
    assert left, "the export was not caught in the act"
    size = sum(f.stat().st_size for p in left for f in p.rglob("*") if f.is_file())
    assert _digests(out / "final") == before  # the earlier export, whole and untouched

    code, stdout, err = _finish(_train(job))
    assert code == 0, err[-3000:]
    assert not _staged(out)
    assert _same_export(_export(out / "final"), grown)  # exported again: step 2, not the stale step 1
    assert json.loads(stdout.splitlines()[-1])["steps_this_run"] == 0
    print(f"killed export left {size / 1e6:.1f} MB in {[p.name for p in left]}; the next run removed it")


def _file_size_limit(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.slow
def test_a_full_disk_exits_2_naming_the_folder_and_the_rerun_ends_as_a_clean_run(
    tmp_path: Path, pack_dir: Path, clean: dict[str, Any]
) -> None:
    """`ulimit -f` 16 MiB: the step-2 checkpoint (model and AdamW state, ~120 MB) cannot be written
    (EFBIG, as ENOSPC on a full disk): the run stops, naming the folder; the rerun ends as a clean run."""
    out = tmp_path / "out"
    job = _job(tmp_path, pack_dir, out, "full", maxSteps=2)
    start = time.monotonic()
    code, _, err = _finish(_train(job, preexec_fn=lambda: _file_size_limit(16 << 20)))
    took = time.monotonic() - start
    line = _one_line(code, err, 2)
    assert line.startswith(
        f"packtrain train: configuration error: cannot write to {out}: File too large; free space there"
    ), line
    assert "--output, or training.outputDir" in line and "resumes" in line
    assert not (out / "final").exists()
    code, _, err = _finish(_train(job))
    assert code == 0, err[-3000:]
    assert _same_export(_export(out / "final"), clean)
    print(f"full disk: exit 2 after {took:.1f} s: {line}")


@pytest.mark.slow
def test_an_unwritable_output_folder_exits_2_and_the_rerun_exports_the_newest_step(
    tmp_path: Path, pack_dir: Path, grown: dict[str, Any]
) -> None:
    """Step 2 trains and is checkpointed (checkpoints/ is writable), but its export cannot be created
    beside final/: exit 2 naming the folder; once writable, the rerun exports step 2 (the step-1
    export left in final/ is not taken for it)."""
    out = tmp_path / "out"
    first = _finish(_train(_job(tmp_path, pack_dir, out, "one", maxSteps=1)))
    assert first[0] == 0, first[2][-3000:]
    job = _job(tmp_path, pack_dir, out, "two", maxSteps=2)
    make_unwritable(out)
    try:
        code, _, err = _finish(_train(job))
    finally:
        make_writable(out)
    line = _one_line(code, err, 2)
    assert line.startswith(f"packtrain train: configuration error: cannot write to {out}: "), line
    assert f"make it writable for this user (uid {os.getuid()})" in line, line
    assert _export(out / "final")["step"] == 1 and not _staged(out)
    print(line)
    code, stdout, err = _finish(_train(job))
    assert code == 0, err[-3000:]
    assert _same_export(_export(out / "final"), grown)
    assert json.loads(stdout.splitlines()[-1])["steps_this_run"] == 0


def _local_run(folder: Path, pack: Path, steps: int) -> Path:
    """An SFTJob manifest for `packtrain run` on `pack`, with the default spec.metricsPort."""
    spec = job_spec(pack, folder / "unused", maxSteps=steps)["spec"]
    spec = {k: spec[k] for k in ("data", "model", "training")}
    del spec["training"]["outputDir"]
    spec["data"]["numWorkers"] = 0
    volumes = {"checkpoints": {"claimName": "c"}, "data": {"claimName": "d"}}
    spec |= {"resources": {"nodes": 1, "gpusPerNode": 0}, "volumes": volumes}
    job = folder / f"sft-{steps}.yaml"
    job.write_text(yaml.safe_dump({"kind": "SFTJob", "metadata": {"name": "tiny"}, "spec": spec}))
    return job


def _run(job: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PACKTRAIN, "run", str(job), "--output", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


@pytest.mark.slow
def test_a_second_packtrain_run_on_one_output_is_refused(tmp_path: Path, pack_dir: Path) -> None:
    """Caught holding the folder (stopped while the second one tries): the second exits 2 naming it."""
    job, out = _local_run(tmp_path, pack_dir, 2), tmp_path / "out"
    first = _run(job, out)
    deadline = time.monotonic() + 120
    while not (out / ".packtrain.lock").is_file() or not (out / ".packtrain.lock").read_text():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)
    try:
        code, _, err = _finish(_run(job, out))
    finally:
        first.send_signal(signal.SIGCONT)
    line = _one_line(code, err, 2)
    assert f"{out} is in use by `packtrain run` (pid {first.pid}" in line and "--output" in line, line
    code, _, err = _finish(first)
    assert code == 0, err[-3000:]


@pytest.mark.slow
def test_two_packtrain_runs_at_once_both_get_a_metrics_port(tmp_path: Path, pack_dir: Path) -> None:
    """Both start with the default spec.metricsPort: the trainer binds first, and the one that finds
    it taken serves on a free port and says which (no check-then-bind race between them)."""
    job = _local_run(tmp_path, pack_dir, 40)
    runs = [_run(job, tmp_path / name) for name in ("a", "b")]
    results = [_finish(p) for p in runs]
    for code, _, err in results:
        assert code == 0, err[-3000:]
        assert "Address already in use" not in err
    logs = [(tmp_path / name / "logs" / "tiny-train.log").read_text() for name in ("a", "b")]
    served = []
    for log in logs:
        moved = [json.loads(line) for line in log.splitlines() if '"event": "metrics_port"' in line]
        served.append(moved[0]["port"] if moved else 9400)
    notes = [err for _, _, err in results if "(spec.metricsPort) is in use" in err]
    assert len(notes) == sum(port != 9400 for port in served), (served, notes)
    assert served[0] != served[1], served  # the two trainings overlapped: each had its own port
    print(f"metrics ports served: {served}")
