"""Hostile input, third round: a model folder is read only inside itself, and only what is sane.

Every file a model folder names or holds that packtrain or transformers opens (weights and their
index, config.json, tokenizer, processor and template files) must resolve inside the folder, be a
regular file and be within its caps before it is read; a safetensors header is checked against
its file before safetensors maps a byte; and weights that are, or become, NaN or infinite stop
the run with exit 2 instead of training to a NaN loss and exporting it. Each case runs the real
CLIs (`packtrain train`, `packtrain pack convert`) on a tiny model saved by transformers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import vlm_fixtures as fx
from conftest import job_spec, write_job
from support.measure import one_line, run_measured
from test_first_hour import chats, one_line_error, packtrain

from packtrain.core.errors import ConfigError
from packtrain.core.model_folder import FILE_LIMITS
from packtrain.trainer.model.build import build_model
from packtrain.trainer.model.weights import INDEX, MAX_HEADER_BYTES, SINGLE, Checkpoint

FAMILY = "qwen2-vl"
SOURCE = fx.FOLDER[FAMILY]


def save_folder(out: Path, fill: Callable[[torch.Tensor], None] | None = None, shard: str = "5GB") -> Path:
    """A tiny random model saved by transformers (`fill` applied to every parameter first; several
    files with an index when `shard` is small), beside the family's tokenizer and processor files."""
    model = build_model(SOURCE, init="random", overrides=fx.TINY[FAMILY], seed=7)
    if fill is not None:
        with torch.no_grad():
            for p in model.parameters():
                fill(p)
    model.save_pretrained(out, max_shard_size=shard)
    for f in SOURCE.iterdir():
        if f.is_file() and not (out / f.name).exists():
            shutil.copyfile(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> Path:
    return save_folder(tmp_path_factory.mktemp("hf") / "single")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> Path:
    folder = save_folder(tmp_path_factory.mktemp("hf") / "sharded", shard="200KB")
    assert (folder / INDEX).is_file() and len(list(folder.glob("*.safetensors"))) > 1
    return folder


def _train(folder: Path, pack_dir: Path, tmp_path: Path, **training: Any) -> tuple[Any, Path]:
    """`packtrain train` of the model in `folder` (pretrained) on the shared pack."""
    spec = job_spec(pack_dir, tmp_path / "out", **{"maxSteps": 1, **training})
    spec["spec"]["model"] = {"path": str(folder), "init": "pretrained"}
    job = write_job(tmp_path / "job.yaml", spec)
    return packtrain("train", "-c", str(job), "--log-format", "json"), tmp_path / "out"


def _refused(result: Any, *parts: str) -> str:
    err = one_line_error(result, 2)
    assert len(err.strip().splitlines()) == 1, err
    for part in parts:
        assert part in err, err
    return err


def _copy(folder: Path, dst: Path) -> Path:
    """A writable copy of `folder` (the fixtures are read-only; modes are not copied)."""
    shutil.copytree(folder, dst, copy_function=shutil.copyfile)
    dst.chmod(0o755)
    return dst


def _index(folder: Path) -> dict[str, Any]:
    return json.loads((folder / INDEX).read_text())


def _point_first_tensor_at(folder: Path, name: str) -> None:
    index = _index(folder)
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = name
    (folder / INDEX).write_text(json.dumps(index))


# 1. Weights: every file the index names is a regular file inside the folder


@pytest.mark.parametrize("spelling", ["relative", "absolute"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(
    spelling: str, sharded: Path, pack_dir: Path, tmp_path: Path
) -> None:
    bad = _copy(sharded, tmp_path / "bad")
    moved = tmp_path / "outside.safetensors"  # a real checkpoint file, outside the folder
    first_file = next(iter(_index(bad)["weight_map"].values()))
    shutil.copy(bad / first_file, moved)
    _point_first_tensor_at(bad, "../outside.safetensors" if spelling == "relative" else str(moved))
    result, out = _train(bad, pack_dir, tmp_path)
    _refused(result, "model.path weights:", "outside.safetensors", f"outside {bad}")
    assert not (out / "final").exists()


def test_an_index_naming_a_fifo_is_refused_at_once(sharded: Path, pack_dir: Path, tmp_path: Path) -> None:
    bad = _copy(sharded, tmp_path / "bad")
    os.mkfifo(bad / "pipe.safetensors")
    _point_first_tensor_at(bad, "pipe.safetensors")
    start = time.monotonic()
    result, _ = _train(bad, pack_dir, tmp_path)  # a reader that opened it would wait for a writer
    _refused(result, "pipe.safetensors is not a regular file")
    assert time.monotonic() - start < 240


# 2. Hostile safetensors headers: exit 2 naming the file


def _rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def _a_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return header[next(k for k in header if k != "__metadata__")]


def test_a_header_declaring_2_to_the_62_bytes_exits_2_naming_the_file(
    single: Path, pack_dir: Path, tmp_path: Path
) -> None:
    bad = _copy(single, tmp_path / "bad")
    with (bad / SINGLE).open("r+b") as f:
        f.write((1 << 62).to_bytes(8, "little"))
    result, _ = _train(bad, pack_dir, tmp_path)
    _refused(result, f"{bad / SINGLE} declares a {1 << 62}-byte header", f"at most {MAX_HEADER_BYTES}")


def test_a_tensor_claiming_10_to_the_12_elements_exits_2_naming_it(
    single: Path, pack_dir: Path, tmp_path: Path
) -> None:
    bad = _copy(single, tmp_path / "bad")
    _rewrite_header(bad / SINGLE, lambda h: _a_tensor(h).update(shape=[10**6, 10**6]))
    result, _ = _train(bad, pack_dir, tmp_path)
    _refused(result, str(bad / SINGLE), "claims 1000000000000 elements")


def _spans_overlap(header: dict[str, Any]) -> None:
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    first, second = header[tensors[0]], header[tensors[1]]
    width = first["data_offsets"][1] - first["data_offsets"][0]
    second["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + width]
    second["shape"], second["dtype"] = first["shape"], first["dtype"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: _a_tensor(h).update(data_offsets=[0, 1 << 40]), "are not a span of the file's"),
        (lambda h: _a_tensor(h).update(data_offsets=[-8, 0]), "are not a span of the file's"),
        (lambda h: _a_tensor(h).update(dtype="F128"), "has dtype 'F128', not one of"),
        (lambda h: _a_tensor(h).update(dtype=["F32"]), "has dtype"),
        (lambda h: _a_tensor(h).update(shape=[2] * 9), "shape is not up to 8 whole numbers"),
        (lambda h: _a_tensor(h).update(shape=[True, 4]), "shape is not up to 8 whole numbers"),
        (lambda h: _a_tensor(h).update(extra=1), "not described by dtype, shape and data_offsets alone"),
        (_spans_overlap, "overlap or leave a gap"),
        (lambda h: h.update(x={"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}), None),
    ],
)
def test_every_header_entry_is_checked_against_its_file_before_it_is_mapped(
    edit: Callable[[dict[str, Any]], None], message: str | None, single: Path, tmp_path: Path
) -> None:
    bad = _copy(single, tmp_path / "bad")
    _rewrite_header(bad / SINGLE, edit)
    if message is None:  # an empty tensor is a valid span: the check is not stricter than the format
        assert "x" in Checkpoint.open(bad).files
        return
    with pytest.raises(ConfigError, match="model.path weights: .*" + message.replace("(", r"\(")):
        Checkpoint.open(bad)


def test_a_header_over_its_json_bounds_is_refused_before_it_is_parsed(single: Path, tmp_path: Path) -> None:
    bad = _copy(single, tmp_path / "bad")
    _rewrite_header(bad / SINGLE, lambda h: h.update(__metadata__={"x": [[[[]]]]}))  # too deep
    with pytest.raises(ConfigError, match="nests over 3 levels deep"):
        Checkpoint.open(bad)


def test_the_checked_folders_still_load_exactly(single: Path, sharded: Path) -> None:
    for folder in (single, sharded):
        checkpoint = Checkpoint.open(folder)
        name = next(iter(checkpoint.files))
        assert checkpoint.read(name, ()).shape == checkpoint.shape(name)


_OPEN_AND_READ = (
    "import sys\n"
    "from packtrain.core.errors import ConfigError\n"
    "from packtrain.trainer.model.weights import Checkpoint\n"
    "try:\n"
    "    c = Checkpoint.open(sys.argv[1])\n"
    "    for name in c.files:\n"
    "        c.read(name, ())\n"
    "except ConfigError as e:\n"
    "    print(e, file=sys.stderr)\n"
    "    sys.exit(2)\n"
)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("a 2^62-byte header", "declares a 4611686018427387904-byte header"),
        ("10^12 elements", "claims 1000000000000 elements"),
        ("a 2^40-byte span", "are not a span of the file's"),
    ],
)
def test_a_hostile_header_costs_what_a_good_folder_costs(
    case: str, message: str, single: Path, tmp_path: Path
) -> None:
    """Measured in a process of its own: refusing a hostile header costs no more memory than reading
    the good folder's every tensor, and seconds, not the gigabytes or hours the header declares."""
    bad = _copy(single, tmp_path / "bad")
    if case == "a 2^62-byte header":
        with (bad / SINGLE).open("r+b") as f:
            f.write((1 << 62).to_bytes(8, "little"))
    elif case == "10^12 elements":
        _rewrite_header(bad / SINGLE, lambda h: _a_tensor(h).update(shape=[10**6, 10**6]))
    else:
        _rewrite_header(bad / SINGLE, lambda h: _a_tensor(h).update(data_offsets=[0, 1 << 40]))
    code, _, _, _, good_mib = run_measured([sys.executable, "-c", _OPEN_AND_READ, str(single)])
    assert code == 0
    code, out, err, seconds, peak_mib = run_measured([sys.executable, "-c", _OPEN_AND_READ, str(bad)])
    assert message in one_line(code, err, out)
    print(f"{case}: refused in {seconds:.1f} s, peak {peak_mib:.0f} MiB (good folder: {good_mib:.0f} MiB)")
    assert peak_mib < good_mib + 16 and seconds < 60


@pytest.mark.parametrize("swap", ["other bytes", "a FIFO", "a link out of the folder"])
def test_a_weight_file_swapped_after_its_check_is_never_read(swap: str, single: Path, tmp_path: Path) -> None:
    """The file safetensors maps is the one whose header was checked: a name replaced between the
    check and the read (the weights are read after the model is built) is refused, and a FIFO put
    there does not hang the run."""
    folder = _copy(single, tmp_path / "folder")
    checkpoint = Checkpoint.open(folder)
    name = next(iter(checkpoint.files))
    path = folder / SINGLE
    if swap == "other bytes":
        swapped = tmp_path / "swapped.safetensors"
        shutil.copyfile(path, swapped)
        _rewrite_header(swapped, lambda h: h.setdefault("__metadata__", {}).update(edited="yes"))
        os.replace(swapped, path)
        message = "changed after its header was checked"
    elif swap == "a FIFO":
        path.unlink()
        os.mkfifo(path)
        message = "is not a regular file"
    else:
        outside = tmp_path / "outside.safetensors"
        shutil.copyfile(path, outside)
        path.unlink()
        path.symlink_to(outside)
        message = f"outside {folder}"
    start = time.monotonic()
    with pytest.raises(ConfigError, match=message):
        checkpoint.read(name, ())
    assert time.monotonic() - start < 30


def test_an_unchanged_file_is_mapped_once_and_reads_the_checked_bytes(single: Path) -> None:
    checkpoint = Checkpoint.open(single)
    names = list(checkpoint.files)
    first = checkpoint.read(names[0], ())
    assert len(checkpoint._open) == 1 and checkpoint.read(names[0], ()).equal(first)
    assert all(checkpoint.read(n, ()).shape == checkpoint.shape(n) for n in names)


# 3. Non-finite weights and steps stop the run (exit 2), and nothing is exported


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_stop_the_run_before_step_1(value: float, pack_dir: Path, tmp_path: Path) -> None:
    folder = save_folder(tmp_path / "model", fill=lambda p: p.fill_(value))
    result, out = _train(folder, pack_dir, tmp_path, maxNonFiniteSteps=3)
    _refused(result, "at step 0, where the run starts, parameter model.", "holds NaN or infinite values")
    assert not (out / "final").exists() and not (out / "checkpoints").exists()


def _steps(stdout: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "step"]


def test_a_step_that_overflows_stops_the_run_naming_it(single: Path, pack_dir: Path, tmp_path: Path) -> None:
    """A learning rate of 1e30 makes step 1's update overflow the model: step 2's loss is NaN."""
    result, out = _train(single, pack_dir, tmp_path, maxSteps=4, lr=1e30)
    err = _refused(result, "step 2: the loss is nan", "0 such steps skipped, training.maxNonFiniteSteps is 0")
    assert "parameter model." in err or "the gradient of model." in err
    assert not (out / "final").exists()


def test_up_to_max_non_finite_steps_are_skipped_then_the_run_stops(
    single: Path, pack_dir: Path, tmp_path: Path
) -> None:
    result, out = _train(single, pack_dir, tmp_path, maxSteps=8, lr=1e30, maxNonFiniteSteps=2)
    _refused(result, "step 4: the loss is nan", "2 such steps skipped, training.maxNonFiniteSteps is 2")
    losses = [s.get("loss") for s in _steps(result.stdout)]
    assert len(losses) == 3 and all(isinstance(x, float) for x in losses), result.stdout[-2000:]
    assert losses[0] == losses[0] and losses[1] != losses[1] and losses[2] != losses[2]  # finite, NaN, NaN
    assert not (out / "final").exists()


def test_a_run_that_ends_on_a_skipped_step_is_not_exported(
    single: Path, pack_dir: Path, tmp_path: Path
) -> None:
    result, out = _train(single, pack_dir, tmp_path, maxSteps=3, lr=1e30, maxNonFiniteSteps=5)
    _refused(result, "step 3, the last, had a loss of nan")
    assert not (out / "final").exists()


def test_a_finite_run_trains_and_exports(single: Path, pack_dir: Path, tmp_path: Path) -> None:
    result, out = _train(single, pack_dir, tmp_path, maxSteps=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "final" / "model.safetensors").is_file()


# 4. The folder's other files: tokenizer, processor, template, config


def _convert(folder: Path, tmp_path: Path) -> Any:
    data = tmp_path / "d.json"
    data.write_text(json.dumps(chats(2)))
    return packtrain(
        "pack", "convert", "--input", str(data), "--model", str(folder), "-o", str(tmp_path / "pack")
    )


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _link_out(path: Path, target: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def _outside(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.json"
    secret.write_text('{"model_max_length": 1}')
    return secret


def _sparse(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(FILE_LIMITS.max_bytes + 1)


@pytest.mark.parametrize(
    ("name", "plant", "message"),
    [
        ("tokenizer.json", lambda p, t: _link_out(p, _outside(t)), "outside"),
        ("tokenizer_config.json", lambda p, t: _fifo(p), "is not a regular file"),
        ("preprocessor_config.json", lambda p, t: _fifo(p), "is not a regular file"),
        ("chat_template.json", lambda p, t: _link_out(p, Path("/proc/self/environ")), "outside"),
        ("chat_template.jinja", lambda p, t: _fifo(p), "is not a regular file"),
        ("merges.txt", lambda p, t: _sparse(p), f"over the {FILE_LIMITS.max_bytes}-byte cap"),
        (
            "config.json",
            lambda p, t: p.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
            "levels deep",
        ),
        ("vocab.json", lambda p, t: p.write_text("[" + "{}," * 3_000_000 + "{}]"), "JSON values"),
        ("additional_chat_templates/x.jinja", lambda p, t: _fifo(p), "is not a regular file"),
    ],
)
def test_a_hostile_folder_file_is_refused_before_anyone_opens_it(
    name: str, plant: Callable[[Path, Path], None], message: str, tmp_path: Path, shared_dir: Path
) -> None:
    folder = _copy(SOURCE, tmp_path / "model")
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    plant(folder / name, tmp_path)
    start = time.monotonic()
    _refused(_convert(folder, tmp_path), "configuration error: model.path: ", name, message)
    assert time.monotonic() - start < 240


def test_the_trainer_refuses_a_hostile_tokenizer_file(single: Path, pack_dir: Path, tmp_path: Path) -> None:
    bad = _copy(single, tmp_path / "bad")
    _fifo(bad / "tokenizer_config.json")
    result, _ = _train(bad, pack_dir, tmp_path)
    _refused(result, "model.path: ", "tokenizer_config.json is not a regular file")


def test_a_hugging_face_cache_snapshot_may_link_into_its_blobs(tmp_path: Path, shared_dir: Path) -> None:
    """The hub cache's layout (`models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/HASH`) stays readable."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in SOURCE.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    result = _convert(snapshot, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


_OPENED = """
import sys, os
folder = sys.argv[1]
seen = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        path = os.path.abspath(os.fspath(args[0]))
        if path.startswith(folder + os.sep):
            seen.add(os.path.relpath(path, folder))
sys.addaudithook(hook)
import transformers
from packtrain.core.config import ModelConfig
from packtrain.core.model_spec import load_model
load_model(ModelConfig.model_validate({"path": folder}))
transformers.AutoProcessor.from_pretrained(folder, trust_remote_code=False)
print("\\n".join(sorted(seen)))
"""


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl", "qwen3.5"])
def test_every_file_the_tokenizer_and_processor_open_is_one_the_check_covers(
    family: str, shared_dir: Path
) -> None:
    """The files transformers opens from a folder (its Python-level opens; the Rust tokenizer reads
    tokenizer.json, which is listed) are all in FOLDER_FILES: a transformers that reads a new one
    fails here, not in production."""
    import subprocess
    import sys

    from packtrain.core.model_folder import FOLDER_FILES

    folder = str(fx.FOLDER[family].resolve())
    done = subprocess.run(
        [sys.executable, "-c", _OPENED, folder], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    opened = set(done.stdout.split())
    assert opened and "config.json" in opened, done.stdout
    assert opened <= set(FOLDER_FILES), opened - set(FOLDER_FILES)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_skip_and_stop_together(
    strategy: str, single: Path, pack_dir: Path, tmp_path: Path
) -> None:
    """Under torchrun (gloo), the loss and the gradient norm are the global ones, so every rank skips
    the same steps and stops at the same one (each scanning its own shards for the tensor to name);
    no rank is left waiting in a collective."""
    from torchrun_job import torchrun_two_processes

    spec = job_spec(pack_dir, tmp_path / "out", maxSteps=8, lr=1e30, maxNonFiniteSteps=1, strategy=strategy)
    spec["spec"]["model"] = {"path": str(single), "init": "pretrained"}
    err = torchrun_two_processes(write_job(tmp_path / "job.yaml", spec)).stderr
    # Both ranks say they stop at the same step. torchrun reports each rank's exit code, with one
    # traceback of its own; a rank still exiting when the first one has exited 2 is ended by torchrun
    # (SIGTERM, -15), which a loaded machine shows: either is a rank that stopped, not one left waiting
    # in a collective (that would be torchrun's timeout, another code). The ranks' lines may interleave.
    stop = "step 3: the loss is nan and the gradient norm nan ("
    assert err.count(stop) == 2 and err.count("1 such steps skipped") == 2, err[-3000:]
    codes = re.findall(r"exitcode  : (-?\d+)", err)
    assert "2" in codes and set(codes) <= {"2", "-15"} and len(codes) == 2, err[-3000:]
    assert err.count("Traceback") == 1, err[-3000:]
    assert not (tmp_path / "out" / "final").exists()
