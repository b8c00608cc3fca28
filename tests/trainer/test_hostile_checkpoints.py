"""Hostile checkpoints: a checkpoint folder is untrusted input (anyone who can write the volume can
plant files in it), so resuming must never unpickle, every value read back is checked against the
folder and the run, and a folder left incomplete falls back to the one before it.

Every case resumes a real run with the real CLI (`packtrain train`, a tiny random-init Qwen2-VL on
the demo pack) from checkpoints a real run wrote, then tampered with here. A planted pickle's
payload creates a marker file when unpickled: each test first shows the payload is live (the former
readers, `torch.load(weights_only=False)` and `pickle.load`, run it), then that the resume never does.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import job_spec, write_job
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torchrun_job import torchrun_two_processes

from packtrain.core.errors import ConfigError
from packtrain.core.sft_config import load_train_config
from packtrain.trainer import recipe
from packtrain.trainer.distributed import DistEnv
from packtrain.trainer.loop import train
from packtrain.trainer.state import checkpoint

# Measures the memory of processes it starts: they run with glibc's default malloc settings.
pytestmark = pytest.mark.measures_memory

PACKTRAIN = str(Path(sys.executable).parent / "packtrain")
STEPS = 3  # the runs train to step 3; resumed ones from copies of the straight run's step 1 and 2


class Payload:
    """Unpickling this creates `marker` (what an attacker's `os.system` would do, made visible)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    seconds: float
    peak_rss_mib: float


def _packtrain_train(job: Path, timeout: float = 300) -> Result:
    """`packtrain train -c JOB` as a separate process: exit code, output, wall time and the peak RSS
    of that process alone (its own rusage, from wait4)."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(job.with_suffix(".out"), "w+") as out, open(job.with_suffix(".err"), "w+") as err:
        start = time.monotonic()
        proc = subprocess.Popen([PACKTRAIN, "train", "-c", str(job)], stdout=out, stderr=err, env=env)
        try:
            status, usage = _wait(proc, timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        return Result(code, out.read(), err.read(), seconds, usage.ru_maxrss / 1024)


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, resource.struct_rusage]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return status, usage
        time.sleep(0.05)
    raise AssertionError(f"packtrain train did not finish in {timeout} s")


def _one_line(result: Result, code: int) -> str:
    """The error line of a refused run: the documented exit code, no traceback."""
    assert result.code == code, (result.code, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("packtrain train:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def straight(pack_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A straight run of 3 steps, checkpoints at steps 1, 2 and 3 (the output folder), by the CLI as
    the resumed runs are (the same threads: the same floating-point sums)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    spec = job_spec(pack_dir, out, maxSteps=STEPS, checkpointEvery=1, keepCheckpoints=5, saveFinal=False)
    result = _packtrain_train(write_job(out.parent / "job.yaml", spec))
    assert result.code == 0, result.stderr[-3000:]
    return out


def _resume_job(pack_dir: Path, straight: Path, tmp_path: Path, steps: tuple[int, ...] = (1, 2)) -> Path:
    """A job training to step 3 into a new output folder holding copies of the straight run's
    checkpoints `steps`."""
    out = tmp_path / "run"
    for n in steps:
        shutil.copytree(_step(straight, n), _step(out, n))
    spec = job_spec(pack_dir, out, maxSteps=STEPS, checkpointEvery=1, keepCheckpoints=5, saveFinal=False)
    return write_job(tmp_path / "job.yaml", spec)


def _step(root: Path, n: int) -> Path:
    return root / "checkpoints" / f"step-{n:08d}"


def _edit(folder: Path, change: Any) -> None:
    """trainer.json of `folder` passed through `change` (a dict -> None), written back as JSON."""
    doc = json.loads((folder / checkpoint.DONE).read_text())
    change(doc)
    (folder / checkpoint.DONE).write_text(json.dumps(doc))


def _resumed_from(result: Result, out: Path, step: int) -> None:
    """The run exited 0 having resumed from checkpoint `step` and trained on to step 3."""
    assert result.code == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["resumed_from"] == str(_step(out, step)), summary
    assert summary["steps"] == STEPS and summary["steps_this_run"] == STEPS - step, summary
    assert checkpoint.read_saved(_step(out, STEPS)).step == STEPS


# -- 1. Pickles: folders of the former formats, and pickles planted beside a checkpoint -----------


def _former_format(folder: Path, markers: Path, scratch: Path) -> dict[str, Path]:
    """`folder` as the former formats wrote it, every file a live payload: trainer.pt and
    rng-00000.pt (read on every resume), model.pt and optimizer.pt (the full-state format), DCP's
    `.metadata` (pickle.load) and a `.distcp` holding a bytes item (an optimizer setting, read with
    torch.load(weights_only=False)). Returns file name -> the marker its payload creates."""
    folder.mkdir(parents=True)
    planted = {}
    for name in ("trainer.pt", "rng-00000.pt", "model.pt", "optimizer.pt"):
        planted[name] = markers / f"ran-{name}"
        torch.save({"step": 2, "scheduler": Payload(planted[name])}, folder / name)
    planted[".metadata"] = markers / "ran-.metadata"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(planted[".metadata"])))
    planted["__0_0.distcp"] = markers / "ran-bytes-item"
    state = {
        "model": {"w": torch.zeros(2)},
        "optim": {"param_groups": [{"lr": Payload(planted["__0_0.distcp"])}]},
    }
    with warnings.catch_warnings():  # that one process saves without a process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=scratch, no_dist=True)  # DCP's own format: its .metadata is genuine
    shutil.copy(scratch / "__0_0.distcp", folder / "__0_0.distcp")
    return planted


def _payloads_are_live(folder: Path, planted: dict[str, Path], scratch: Path) -> None:
    """The former readers run every planted payload (so a resume that did would be seen)."""
    for name in ("trainer.pt", "rng-00000.pt", "model.pt", "optimizer.pt"):
        torch.load(folder / name, weights_only=False)
    pickle.loads((folder / ".metadata").read_bytes())
    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=dcp.FileSystemReader(scratch),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    assert all(marker.exists() for marker in planted.values()), planted


def test_a_folder_of_a_former_format_is_refused_unread(pack_dir, straight, tmp_path):
    """The newest checkpoint is of a former (pickled) format: exit 2, one line saying why and what to
    do, and none of its payloads ran. Not skipped for an older one: that would quietly drop the run
    those checkpoints hold (and pruning would then delete the new run's checkpoints first)."""
    job = _resume_job(pack_dir, straight, tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    planted = _former_format(_step(tmp_path / "run", 3), markers, tmp_path / "dcp")
    line = _one_line(_packtrain_train(job), 2)
    assert "step-00000003 was written by an earlier packtrain in a format that cannot be read safely" in line
    assert "train into a new folder" in line and f"delete {tmp_path / 'run' / 'checkpoints'}" in line
    assert not any(marker.exists() for marker in planted.values())
    _payloads_are_live(_step(tmp_path / "run", 3), planted, tmp_path / "dcp")


def test_pickles_beside_or_before_a_checkpoint_are_never_read(pack_dir, straight, tmp_path):
    """Pickles planted beside the newest checkpoint's files (under every name a former format read),
    and an older folder of a former format: the resume reads neither, and trains on from step 2."""
    job = _resume_job(pack_dir, straight, tmp_path, steps=(2,))
    markers = tmp_path / "markers"
    markers.mkdir()
    older = _former_format(_step(tmp_path / "run", 1), markers, tmp_path / "dcp")
    beside = _step(tmp_path / "run", 2)
    names = ("trainer.pt", "rng-00000.pt", "model.pt", "optimizer.pt", ".metadata", "__0_0.distcp")
    for name in names:
        (beside / name).write_bytes(pickle.dumps(Payload(markers / f"beside-{name}")))
    result = _packtrain_train(job)
    _resumed_from(result, tmp_path / "run", 2)
    assert sorted(p.name for p in markers.iterdir()) == []
    _payloads_are_live(_step(tmp_path / "run", 1), older, tmp_path / "dcp")
    for name in names:  # each runs under the former readers (torch then finds no tensors in it)
        with contextlib.suppress(RuntimeError):
            torch.load(beside / name, weights_only=False)
    assert len(list(markers.glob("beside-*"))) == len(names)


@pytest.mark.parametrize("name", ["tensors.json", "rng-00000.json"])
def test_a_checkpoint_file_replaced_by_a_pickle_is_refused_unread(pack_dir, straight, tmp_path, name):
    """The table of contents or the RNG state replaced by a pickle of the same size (pickle ignores
    what follows its end, so the former reader would run it): not JSON, exit 2 naming the file."""
    job = _resume_job(pack_dir, straight, tmp_path)
    marker = tmp_path / "ran"
    target = _step(tmp_path / "run", 2) / name
    payload = pickle.dumps(Payload(marker))
    target.write_bytes(payload + b" " * (target.stat().st_size - len(payload)))
    line = _one_line(_packtrain_train(job), 2)
    assert f"{target} is not complete JSON" in line, line
    assert not marker.exists()
    pickle.loads(target.read_bytes())
    assert marker.exists()


def test_a_tensor_file_holding_a_pickle_is_read_as_numbers_only(pack_dir, straight, tmp_path):
    """A pickle planted as the tensor file, of its size: the resume's setup reads it as the bytes of
    tensors and never unpickles it (the values are then the attacker's, as any bytes written there
    would be: the trust boundary is code, not values)."""
    job = _resume_job(pack_dir, straight, tmp_path, steps=(2,))
    target, marker = _step(tmp_path / "run", 2) / "tensors-00000.bin", tmp_path / "ran"
    payload = pickle.dumps(Payload(marker))
    target.write_bytes(payload + b"\0" * (target.stat().st_size - len(payload)))
    run = recipe.setup(load_train_config(job), DistEnv(), torch.device("cpu"))
    assert isinstance(run, recipe.Run) and run.step == 2 and run.resumed_from == _step(tmp_path / "run", 2)
    assert not marker.exists()
    with pytest.raises(RuntimeError):  # the former reader: the payload runs, then torch finds no tensors
        torch.load(target, weights_only=False)
    assert marker.exists()


# -- 2. The step and the data position against the folder and the run -----------------------------


def _set(*path: str | int, value: Any) -> Any:
    def change(doc: dict[str, Any]) -> None:
        for key in path[:-1]:
            doc = doc[key]  # type: ignore[index]
        doc[path[-1]] = value  # type: ignore[index]

    return change


CLI_CASES = {
    "negative step": (_set("step", value=-1), "step -1 is not the step of the folder's name (step-00000002)"),
    "huge step": (_set("step", value=10**15), "step 1000000000000000 is not the step of the folder's name"),
    "step of another folder": (_set("step", value=1), "step 1 is not the step of the folder's name"),
    "data position past its epoch": (
        _set("state", "data", "next", value=10**9),
        "data position epoch 0, micro-batch 1000000000 is out of range",
    ),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_a_step_or_position_that_cannot_be_right_exits_2(pack_dir, straight, tmp_path, case):
    change, message = CLI_CASES[case]
    job = _resume_job(pack_dir, straight, tmp_path)
    _edit(_step(tmp_path / "run", 2), change)
    line = _one_line(_packtrain_train(job), 2)
    assert message in line and "damaged or edited" in line and f"delete {_step(tmp_path / 'run', 2)}" in line
    assert not _step(tmp_path / "run", 3).exists()


IN_PROCESS_CASES = {
    "negative epoch": (_set("state", "data", "epoch", value=-1), "data position epoch -1, micro-batch"),
    "epoch past the step": (_set("state", "data", "epoch", value=3), "out of range (epoch 0..2 at step 2"),
    "negative micro-batch": (_set("state", "data", "next", value=-4), "micro-batch -4 is out of range"),
    "float micro-batch": (_set("state", "data", "next", value=1.5), "micro-batch 1.5 is out of range"),
    "zero ranks": (_set("state", "data", "world_size", value=0), "world_size, units_per_micro_batch"),
    "another pack": (_set("state", "data", "num_units", value=10**6), "data position for num_units 1000000"),
    "another seed": (_set("state", "data", "seed", value=7), "data position for seed 7, this run has 0"),
    "no position": (_set("state", "data", value=[]), "state.data is not a data position"),
    "schedule at another step": (_set("scheduler", "last_epoch", value=7), "scheduler does not fit"),
    "schedule attribute": (
        _set("scheduler", "step", value=None),
        "scheduler does not fit this run's schedule",
    ),
    "schedule function state": (_set("scheduler", "lr_lambdas", value=[{"a": 1}]), "(lr_lambdas)"),
    "text learning rate": (_set("param_groups", 0, "lr", value="1e-3"), "param_groups[0]: lr not this"),
    "unknown optimizer setting": (_set("param_groups", 0, "hook", value=1), "param_groups[0]: hook not"),
    "other parameters": (_set("param_groups", 0, "params", value=["x"]), "groups are not this model's"),
    "settings unlike their hash": (_set("state", "config_hash", value="0" * 64), "do not match"),
    "not this version": (_set("version", value=1), "not a checkpoint of this version"),
    "a file outside": (_set("files", "../../x.json", value=1), "files must name this checkpoint's files"),
}


@pytest.mark.parametrize("case", sorted(IN_PROCESS_CASES))
def test_every_value_read_back_is_checked(pack_dir, straight, tmp_path, case):
    """The same refusals as above for every other value of trainer.json (in this process: the CLI
    turns each ConfigError into the one line and exit 2 shown above)."""
    change, message = IN_PROCESS_CASES[case]
    job = _resume_job(pack_dir, straight, tmp_path, steps=(2,))
    _edit(_step(tmp_path / "run", 2), change)
    with pytest.raises(ConfigError) as refused:
        train(load_train_config(job), log=lambda _: None)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert not _step(tmp_path / "run", 3).exists()


# -- 3. A checkpoint left incomplete --------------------------------------------------------------


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_cut_newest_checkpoint_falls_back_to_the_one_before(pack_dir, straight, tmp_path):
    """step-2's tensor file cut in half (a copy or a disk that ran out): one WARNING naming it, the run
    resumes from step 1, and its steps 2 and 3 are the straight run's bit for bit."""
    job = _resume_job(pack_dir, straight, tmp_path)
    broken = _step(tmp_path / "run", 2) / "tensors-00000.bin"
    size = broken.stat().st_size
    _cut(broken)
    result = _packtrain_train(job)
    _resumed_from(result, tmp_path / "run", 1)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING checkpoint")]
    assert warnings == [
        f"WARNING checkpoint {broken} has {size // 2} bytes, trainer.json records {size}: incomplete or "
        f"damaged, resuming from {_step(tmp_path / 'run', 1)} instead"
    ]
    for step in (2, 3):
        (model_a, optim_a), (model_b, optim_b) = (
            checkpoint.saved_state(_step(root, step)) for root in (straight, tmp_path / "run")
        )
        assert model_a.keys() == model_b.keys()
        assert all(torch.equal(model_a[k], model_b[k]) for k in model_a), step
        for name, state in optim_a["state"].items():
            assert all(torch.equal(v, optim_b["state"][name][k]) for k, v in state.items()), name


DAMAGE = {
    "trainer.json cut": (lambda f: _cut(f / "trainer.json"), "trainer.json is not complete JSON"),
    "tensors.json cut": (lambda f: _cut(f / "tensors.json"), "tensors.json has"),
    "rng cut": (lambda f: _cut(f / "rng-00000.json"), "rng-00000.json has"),
    "tensor file missing": (lambda f: (f / "tensors-00000.bin").unlink(), "tensors-00000.bin is missing"),
    "trainer.json missing": (lambda f: (f / "trainer.json").unlink(), "trainer.json is missing"),
    "a FIFO for the tensor file": (
        lambda f: ((f / "tensors-00000.bin").unlink(), os.mkfifo(f / "tensors-00000.bin")),
        "tensors-00000.bin is not a regular file",
    ),
    "a link for the tensor file": (
        lambda f: ((f / "tensors-00000.bin").unlink(), (f / "tensors-00000.bin").symlink_to("/dev/zero")),
        "tensors-00000.bin is not a regular file",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_any_incomplete_newest_checkpoint_is_passed_over(straight, tmp_path, capsys, case):
    """Whatever is incomplete in the newest folder (cut, missing, not a regular file: a FIFO is never
    opened, so nothing waits on it), the scan names it and picks the one before; with none before,
    the resume exits 2 naming it."""
    damage, detail = DAMAGE[case]
    for n in (1, 2):
        shutil.copytree(_step(straight, n), _step(tmp_path, n))
    damage(_step(tmp_path, 2))
    start = time.monotonic()
    assert checkpoint.latest(tmp_path) == _step(tmp_path, 1)
    assert time.monotonic() - start < 5
    warning = capsys.readouterr().err.strip()
    assert warning.startswith(f"WARNING checkpoint {_step(tmp_path, 2)}/") and detail in warning, warning
    assert warning.endswith(f"resuming from {_step(tmp_path, 1)} instead")
    shutil.rmtree(_step(tmp_path, 1))
    with pytest.raises(ConfigError, match="no complete checkpoint to resume from") as none:
        checkpoint.latest(tmp_path)
    assert detail in str(none.value) and f"delete {_step(tmp_path, 2)}" in str(none.value)


def test_with_no_complete_checkpoint_the_resume_exits_2_naming_it(pack_dir, straight, tmp_path):
    job = _resume_job(pack_dir, straight, tmp_path, steps=(2,))
    broken = _step(tmp_path / "run", 2) / "rng-00000.json"
    _cut(broken)
    line = _one_line(_packtrain_train(job), 2)
    assert f"no complete checkpoint to resume from: {broken} has" in line, line
    assert f"delete {_step(tmp_path / 'run', 2)}" in line


# -- 4. What reading a checkpoint may cost ---------------------------------------------------------


def test_oversized_json_is_refused_before_it_is_read(pack_dir, straight, tmp_path):
    """A 4 GiB trainer.json (sparse: no disk) is refused from its size: exit 2 within seconds, and
    the process's peak memory is that of any refused resume, not gigabytes."""
    job = _resume_job(pack_dir, straight, tmp_path, steps=(2,))
    done = _step(tmp_path / "run", 2) / "trainer.json"
    baseline_doc = done.read_text()
    _edit(_step(tmp_path / "run", 2), _set("step", value=-1))
    baseline = _packtrain_train(job)
    _one_line(baseline, 2)
    done.write_text(baseline_doc)
    with open(done, "r+b") as f:
        f.truncate(4 << 30)
    result = _packtrain_train(job)
    line = _one_line(result, 2)
    assert f"{done}: 4294967296 bytes, over the 16777216 bytes a checkpoint's trainer.json may have" in line
    print(
        f"refused resume: 4 GiB trainer.json {result.seconds:.1f} s, peak RSS {result.peak_rss_mib:.0f} MiB; "
        f"a refused step: {baseline.seconds:.1f} s, {baseline.peak_rss_mib:.0f} MiB"
    )
    assert result.peak_rss_mib < baseline.peak_rss_mib + 64


def _toc_edit(folder: Path, change: Any) -> None:
    """tensors.json of `folder` passed through `change`, with trainer.json's record of its size kept
    true (so that only the table's content is hostile)."""
    path = folder / "tensors.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    _edit(folder, _set("files", "tensors.json", value=path.stat().st_size))


def _first(doc: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    return next(v for k, v in doc["tensors"].items() if k.startswith(prefix) and len(v["size"]) == 2)


def _share_bytes(doc: dict[str, Any]) -> None:
    """The second tensor's chunk moved onto the first's bytes."""
    first, second = [t["chunks"][0] for t in doc["tensors"].values() if t["chunks"]][:2]
    second[1] = first[1]


TOC_CASES = {
    "a huge tensor": (lambda d: _first(d).update(size=[1 << 40, 1 << 40]), "do not add up to its size"),
    "a huge chunk": (
        lambda d: _first(d).update(size=[1 << 40, 1], chunks=[[0, 0, [0, 0], [1 << 40, 1]]]),
        "past the end of tensors-00000.bin",
    ),
    "a chunk outside its tensor": (
        lambda d: _first(d)["chunks"][0].__setitem__(2, [5, 0]),
        "a chunk must be [file, byte offset, offsets, sizes] inside the tensor",
    ),
    "chunks sharing bytes": (_share_bytes, "overlap in tensors-00000.bin"),
    "an unknown dtype": (lambda d: _first(d).update(dtype="complex128"), "dtype 'complex128' is not one of"),
    "a list index in a path": (
        lambda d: _first(d).update(path=["optim", "state", 10**9]),
        "its path must be names joining to it",
    ),
    "a file outside": (
        lambda d: d.update(files=["../tensors-00000.bin"]),
        "files must be distinct tensors-RRRRR.bin",
    ),
    "deep nesting": (lambda d: _first(d).update(size=json.loads("[" * 30 + "]" * 30)), "nests over 8 levels"),
}


@pytest.mark.parametrize("case", sorted(TOC_CASES))
def test_a_hostile_table_of_contents_is_refused_before_any_allocation(straight, tmp_path, case):
    """Every field of tensors.json is checked before a tensor is allocated or a byte read: a declared
    size of 2^80 elements costs nothing (the inspect path, which allocates what the table declares,
    included)."""
    change, message = TOC_CASES[case]
    folder = tmp_path / "checkpoints" / "step-00000002"
    shutil.copytree(_step(straight, 2), folder)
    _toc_edit(folder, change)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError, match="damaged or edited") as refused:
        checkpoint.saved_state(folder)
    assert message in str(refused.value), str(refused.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB


def test_a_damaged_file_of_one_rank_stops_every_rank_together(pack_dir, tmp_path):
    """Two FSDP ranks under torchrun; rank 1's RNG file then edited. Every rank checks the files of
    all ranks before a tensor is read, so both refuse it at once: rank 0 does not go on to wait for
    rank 1 in a collective until the process group's timeout."""
    out = tmp_path / "run"
    spec = job_spec(pack_dir, out, maxSteps=2, strategy="fsdp", saveFinal=False)
    first = torchrun_two_processes(write_job(tmp_path / "a.yaml", spec))
    assert first.returncode == 0, first.stderr[-3000:]
    folder = _step(out, 2)
    path = folder / "rng-00001.json"
    doc = json.loads(path.read_text())
    doc["python"][1] = doc["python"][1][:10]
    path.write_text(json.dumps(doc))
    _edit(folder, _set("files", "rng-00001.json", value=path.stat().st_size))
    spec["spec"]["training"]["maxSteps"] = STEPS
    start = time.monotonic()
    again = torchrun_two_processes(write_job(tmp_path / "b.yaml", spec))
    seconds = time.monotonic() - start
    refusals = [
        line for line in again.stderr.splitlines() if f"{path}: python: not a generator state" in line
    ]
    assert again.returncode != 0 and len(refusals) == 2, again.stderr[-3000:]
    assert all(line.startswith("packtrain train: configuration error: ") for line in refusals)
    assert seconds < 200 and not _step(out, STEPS).exists()
