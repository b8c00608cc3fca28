"""No stale packs: a re-run of `packtrain pack run` into a finished pack keeps it only while its inputs
(dataset files, stored media, media a reject named as missing) are unchanged, and says which in one
line; a pack of another configuration is never rebuilt over (exit 2)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml
from support.paths import DEMO
from test_first_hour import QWEN2, chats, image_record, one_line_error, packtrain

IMAGE = DEMO / "mllm_demo_data" / "1.jpg"


def _dataset(root: Path) -> Path:
    """4 chats, 1 image sample whose image is there and 1 whose image is missing (1 of 6 rejected)."""
    (root / "data").mkdir()
    shutil.copy(IMAGE, root / "data" / "here.jpg")
    records = [*chats(4), image_record("img-here", "here.jpg"), image_record("img-gone", "gone.jpg")]
    data = root / "data" / "train.json"
    data.write_text(json.dumps(records))
    return data


def _pack(data: Path, out: Path, *extra: str) -> str:
    result = packtrain(
        "pack", "run", "--input", str(data), "--model", str(QWEN2), "--max-length", "512", "-o", str(out),
        "--workers", "1", "--no-progress", "--max-rejected-fraction", "0.5", *extra,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stderr


def _lines(err: str, marker: str) -> list[str]:
    return [line for line in err.splitlines() if marker in line]


def _counts(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["counts"]


def test_a_rerun_keeps_an_unchanged_pack_and_rebuilds_an_edited_one(tmp_path: Path) -> None:
    data = _dataset(tmp_path)
    out = tmp_path / "pack"
    first = _pack(data, out)
    assert not _lines(first, "kept:") and not _lines(first, "rebuilding")
    assert (_counts(out)["packed"], _counts(out)["rejected"]) == (5, 1)

    kept = _lines(_pack(data, out), "kept:")
    assert kept == [f"packtrain pack run: kept: {out / 'manifest.json'} is up to date with its 3 inputs"]

    os.utime(data, ns=(0, 0))  # touched, same bytes: kept (re-hashed, not rebuilt)
    assert len(_lines(_pack(data, out), "kept:")) == 1

    records = json.loads(data.read_text())
    data.write_text(json.dumps(records[:3] + records[4:]))  # one chat less
    rebuilt = _lines(_pack(data, out), "rebuilding")
    assert rebuilt == [
        f"packtrain pack run: inputs changed since the pack was made ({data} modified): rebuilding {out}"
    ]
    assert (_counts(out)["input"], _counts(out)["packed"]) == (5, 4)


def test_adding_the_missing_image_rebuilds_and_packs_its_sample(tmp_path: Path) -> None:
    data = _dataset(tmp_path)
    out = tmp_path / "pack"
    _pack(data, out)
    assert [json.loads(line)["id"] for line in (out / "rejects.jsonl").read_text().splitlines()] == [
        "img-gone"
    ]

    shutil.copy(IMAGE, tmp_path / "data" / "gone.jpg")
    gone = (tmp_path / "data" / "gone.jpg").resolve()
    rebuilt = _lines(_pack(data, out), "rebuilding")
    assert len(rebuilt) == 1 and f"{gone} added (a reject named it missing)" in rebuilt[0], rebuilt
    assert (_counts(out)["packed"], _counts(out)["rejected"]) == (6, 0)
    assert (out / "rejects.jsonl").read_text() == ""


def test_an_edited_stored_image_rebuilds(tmp_path: Path) -> None:
    data = _dataset(tmp_path)
    out = tmp_path / "pack"
    _pack(data, out)
    here = tmp_path / "data" / "here.jpg"
    shutil.copy(DEMO / "mllm_demo_data" / "2.jpg", here)
    rebuilt = _lines(_pack(data, out), "rebuilding")
    assert len(rebuilt) == 1 and f"{here.resolve()} modified" in rebuilt[0], rebuilt


def test_a_pack_of_another_configuration_is_not_rebuilt_over(tmp_path: Path) -> None:
    data = _dataset(tmp_path)
    out = tmp_path / "pack"
    _pack(data, out)
    result = packtrain(
        "pack", "run", "--input", str(data), "--model", str(QWEN2), "--max-length", "1024", "-o", str(out),
        "--workers", "1", "--no-progress", "--max-rejected-fraction", "0.5",
    )  # fmt: skip
    err = one_line_error(result, 2)
    assert "packing.maxLength" in err and "Use a new output folder, or delete this one" in err
    assert len(err.strip().splitlines()) == 1
    assert (out / "manifest.json").is_file()  # left as it was


def test_packtrain_run_says_kept_then_rebuilding(tmp_path: Path) -> None:
    """`packtrain run` (the pack stages as pods run them) asks `pack refresh` first."""
    data = _dataset(tmp_path)
    job = tmp_path / "job.yaml"
    spec = {
        "source": {"paths": [str(data)]},
        "model": {"path": str(QWEN2)},
        "packing": {"maxLength": 512, "maxRejectedFraction": 0.5},
        "output": {"claimName": "local"},
    }
    doc = {"apiVersion": "packtrain.dev/v1alpha1", "kind": "PackJob", "metadata": {"name": "p"}, "spec": spec}
    job.write_text(yaml.safe_dump(doc))
    run = ("run", str(job), "--workers", "1", "--output", str(tmp_path / "runs"))
    first = packtrain(*run)
    assert first.returncode == 0, first.stderr[-3000:]
    second = packtrain(*run)
    assert second.returncode == 0, second.stderr[-3000:]
    pack = tmp_path / "runs" / "pack" / "p"
    assert _lines(second.stderr, "kept:") == [
        f"PackJob p: kept: {pack / 'manifest.json'} is up to date with its 3 inputs"
    ]
    shutil.copy(IMAGE, tmp_path / "data" / "gone.jpg")
    third = packtrain(*run)
    assert third.returncode == 0, third.stderr[-3000:]
    assert len(_lines(third.stderr, "rebuilding")) == 1 and "Traceback" not in third.stderr
    assert _counts(pack)["rejected"] == 0


def test_a_refused_pack_is_rebuilt_once_its_missing_image_is_added(tmp_path: Path) -> None:
    """1 of 6 rejected is over the 0.05 default: refused; the image added, the same command packs it."""
    data = _dataset(tmp_path)
    out = tmp_path / "pack"
    run = ("pack", "run", "--input", str(data), "--model", str(QWEN2), "--max-length", "512", "-o", str(out))
    refused = one_line_error(packtrain(*run, "--workers", "1", "--no-progress"), 2)
    assert "over packing.maxRejectedFraction 0.05" in refused
    shutil.copy(IMAGE, tmp_path / "data" / "gone.jpg")
    again = packtrain(*run, "--workers", "1", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(_lines(again.stderr, "rebuilding")) == 1 and "Traceback" not in again.stderr
    assert (_counts(out)["packed"], _counts(out)["rejected"]) == (6, 0)
