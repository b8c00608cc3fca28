"""Hostile input, third round: a pack's manifest.json is untrusted too.

One reader (`read_manifest`) serves `pack verify`, `pack inspect`, the trainer and every other
reader: the file must be a regular one inside the pack, its size, nesting depth and number of
values are bounded before `json.loads` runs, and every key must be one the packer writes, with
its type. Each case runs the real CLIs as subprocesses and measures their peak memory and time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from pack_tamper import copy_pack, edit_manifest
from support.measure import run_measured
from support.pack_runner import run_in_process
from support.paths import MODELS

from packtrain.core.config import PackConfig
from packtrain.core.pack.shards import MANIFEST, MANIFEST_LIMITS

QWEN2 = MODELS / "qwen2-vl"
BIN = Path(sys.executable).parent
MiB = 1 << 20
# What a CLI that refuses a manifest may cost at most: the interpreter and its imports (the trainer
# imports torch: ~500 MiB), the capped bytes and the scan; the payloads below cost 2-5 GiB unbounded.
PEAK_MIB = {"verify": 400, "inspect": 400, "train": 1200}


def _chat(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Yes."}]
    }


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pack")
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(8)))
    cfg = PackConfig.model_validate(
        {
            "source": {"paths": [str(data)]},
            "model": {"path": str(QWEN2)},
            "packing": {"maxLength": 64, "sequencesPerShard": 2},
        }
    )
    run_in_process(cfg, tmp / "out")
    return tmp / "out"


def _with_extra(pack: Path, dst: Path, key: str, value_text: str) -> Path:
    """A copy of `pack` whose manifest has `key` holding `value_text` (raw JSON text), appended."""
    bad = copy_pack(pack, dst)
    text = (bad / MANIFEST).read_text().rstrip()
    (bad / MANIFEST).write_text(f"{text[:-1]}, {json.dumps(key)}: {value_text}}}")
    return bad


def _train_job(tmp: Path, pack: Path) -> Path:
    """A bare SFT spec over `pack` (the trainer reads the pack before it builds the model)."""
    spec = {
        "data": {"path": str(pack)},
        "model": {"path": str(QWEN2), "init": "random"},
        "training": {"maxSteps": 1, "outputDir": str(tmp / "train-out")},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _commands(tmp: Path, bad: Path) -> dict[str, list[str]]:
    return {
        "verify": [str(BIN / "packtrain"), "pack", "verify", str(bad)],
        "inspect": [str(BIN / "packtrain"), "pack", "inspect", str(bad)],
        "train": [str(BIN / "packtrain"), "train", "-c", str(_train_job(tmp, bad))],
    }


def _refused(
    tmp: Path, bad: Path, message: str, commands: tuple[str, ...] = ("verify", "inspect", "train")
) -> None:
    """Every reader exits 2 with one line holding `message`: no traceback, bounded memory and time."""
    for name, args in _commands(tmp, bad).items():
        if name not in commands:
            continue
        code, _, err, seconds, peak = run_measured(args)
        assert code == 2, (name, code, err[-2000:])
        assert "Traceback" not in err and message in err, (name, err[-2000:])
        assert len([line for line in err.splitlines() if line.strip()]) == 1, (name, err[-2000:])
        assert peak < PEAK_MIB[name], (name, peak)
        assert seconds < 60, (name, seconds)


NESTED = "[" * 100_000 + "]" * 100_000


def small_objects(size: int) -> str:
    return "[" + ",".join(["{}"] * (size // 3)) + "]"


@pytest.mark.parametrize(
    ("case", "text", "message"),
    [
        ("nested arrays", NESTED, f"nests over {MANIFEST_LIMITS.max_depth} levels deep"),
        (
            "80 MB of small objects",
            small_objects(80_000_000),
            f"over the {MANIFEST_LIMITS.max_bytes}-byte cap",
        ),
        (
            "60 MB of small objects",
            small_objects(60_000_000),
            f"over {MANIFEST_LIMITS.max_values} JSON values",
        ),
    ],
)
def test_a_costly_extra_key_is_refused_before_it_is_parsed(
    case: str, text: str, message: str, pack: Path, tmp_path: Path
) -> None:
    bad = _with_extra(pack, tmp_path / "bad", "extra", text)
    _refused(tmp_path, bad, message)


def test_the_same_payload_under_a_known_key_is_refused_by_depth(pack: Path, tmp_path: Path) -> None:
    bad = copy_pack(pack, tmp_path / "bad")
    text = (bad / MANIFEST).read_text()
    assert '"config": {' in text
    (bad / MANIFEST).write_text(text.replace('"config": {', f'"config": {{"x": {NESTED},', 1))
    _refused(tmp_path, bad, "levels deep", ("verify",))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(extra=1), "unknown key 'extra'"),
        (lambda m: m.update(max_length="4096"), "max_length is str, not int"),
        (lambda m: m.update(sequences=True), "sequences is bool, not int"),
        (lambda m: m["counts"].update(packed=[1]), "counts.packed is list, not int"),
        (lambda m: m["counts"].update(surplus=0), "unknown key 'counts.surplus'"),
        (lambda m: m["shards"][0].update(evil={"a": 1}), "unknown key 'shards[0].evil'"),
        (lambda m: m["inputs"][0].update(sha256=0), "inputs[0].sha256 is int, not str"),
        (lambda m: m.update(counts=[]), "counts is list, not dict"),
    ],
)
def test_unknown_keys_and_wrong_types_are_refused_naming_the_key(
    edit: Callable[[dict], None], message: str, pack: Path, tmp_path: Path
) -> None:
    bad = copy_pack(pack, tmp_path / "bad")
    edit_manifest(bad, edit)
    _refused(tmp_path, bad, message, ("verify", "inspect"))


def test_the_trainer_refuses_an_unknown_key(pack: Path, tmp_path: Path) -> None:
    bad = copy_pack(pack, tmp_path / "bad")
    edit_manifest(bad, lambda m: m.update(extra=[]))
    _refused(tmp_path, bad, "unknown key 'extra'", ("train",))


def test_a_manifest_that_is_a_fifo_or_a_link_out_of_the_pack_is_refused_at_once(
    pack: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_text((pack / MANIFEST).read_text())
    linked = copy_pack(pack, tmp_path / "linked")
    (linked / MANIFEST).unlink()
    (linked / MANIFEST).symlink_to(outside)
    _refused(tmp_path, linked, "outside", ("verify", "inspect"))
    fifo = copy_pack(pack, tmp_path / "fifo")
    (fifo / MANIFEST).unlink()
    os.mkfifo(fifo / MANIFEST)
    start = time.monotonic()
    _refused(tmp_path, fifo, "is not a regular file", ("verify", "inspect"))
    assert time.monotonic() - start < 60  # a reader that opened it for reading would wait forever


def test_a_refusal_record_is_read_within_the_same_bounds(pack: Path, tmp_path: Path) -> None:
    """A pack without a manifest is explained from work/refused.json: that file is bounded too."""
    bad = copy_pack(pack, tmp_path / "bad")
    (bad / MANIFEST).unlink()
    (bad / "work").mkdir()
    (bad / "work" / "refused.json").write_text('{"report": ' + NESTED + "}")
    _refused(tmp_path, bad, "levels deep", ("inspect",))


def test_a_manifest_at_the_caps_parses_within_bounded_memory(pack: Path, tmp_path: Path) -> None:
    """The worst a manifest under the caps can cost: 4 million values (empty objects, the costliest
    per value) under an unknown key: `inspect` exits 2 after parsing it, within the stated bound."""
    per_value = len("{},")
    values = MANIFEST_LIMITS.max_values // 2 - 1000  # an empty container counts twice
    bad = _with_extra(pack, tmp_path / "bad", "extra", small_objects(values * per_value))
    code, _, err, seconds, peak = run_measured(_commands(tmp_path, bad)["inspect"])
    assert code == 2 and "unknown key 'extra'" in err, err[-2000:]
    assert peak < PEAK_MIB["inspect"], peak


def test_a_sound_pack_still_verifies(pack: Path) -> None:
    code, _, err, _, _ = run_measured([str(BIN / "packtrain"), "pack", "verify", str(pack)])
    assert code == 0, err[-2000:]
