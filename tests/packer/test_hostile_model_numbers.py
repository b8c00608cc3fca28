"""A model folder's processor numbers are untrusted input too, and its family is its config.json's.

The packer counts vision tokens with the folder's preprocessor settings: a merge size of 0 divided
by zero inside the built-in probe, and a minimum of 10^12 pixels upscaled the probe image until the
kernel killed the run (22 GiB after a minute, no message). Each is now exit 2 with one line naming
the setting, before anything is decoded. And a PackJob spec (`pack … -c`, `packtrain run`, a
cluster's pods) that leaves model.family out packs for the family the folder's config.json names,
as `pack run --model` did, instead of defaulting to qwen2-vl and failing; one that contradicts
the folder is exit 2.

Every case runs the real `packtrain pack run` in a subprocess, measured by a parent of its own.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.measure import one_line, run_measured
from support.paths import DATASETS, DEMO, MODELS

PACKTRAIN = str(Path(sys.executable).parent / "packtrain")


def hostile_folder(tmp: Path, file: str, change: dict[str, Any], family: str = "qwen2-vl") -> Path:
    folder = tmp / "model"
    shutil.copytree(MODELS / family, folder)
    config = json.loads((folder / file).read_text())
    config.update(change)
    (folder / file).write_text(json.dumps(config))
    return folder


def pack_run(tmp: Path, *args: str) -> list[str]:
    return [PACKTRAIN, "pack", "run", "-o", str(tmp / "out"), "--no-progress", "--workers", "1", *args]


IMAGES = ["--input", str(DEMO / "mllm_demo.json"), "--media-root", str(DEMO)]

PROCESSOR = [
    ({"merge_size": 0}, "merge_size 0"),
    ({"patch_size": -14}, "patch_size -14"),
    ({"temporal_patch_size": 10**6}, "temporal_patch_size 1000000"),
    (
        {"min_pixels": 10**12, "size": {"min_pixels": 10**12, "max_pixels": 10**12}},
        "min_pixels 1000000000000",
    ),
    ({"max_pixels": 10**15, "size": {"max_pixels": 10**15}}, "max_pixels 1000000000000000"),
    ({"image_std": [0.0, 0.0, 0.0]}, "image_std [0.0, 0.0, 0.0]"),
    ({"image_mean": [0.5] * 100_000}, "image_mean / image_std"),
    ({"rescale_factor": float("inf")}, "rescale_factor inf"),
    ({"merge_size": "two"}, "not a number"),
]


@pytest.mark.parametrize("change,named", PROCESSOR)
def test_hostile_processor_numbers_are_refused_before_any_decode(tmp_path: Path, change, named: str):
    folder = hostile_folder(tmp_path, "preprocessor_config.json", change)
    code, _, err, seconds, peak = run_measured(pack_run(tmp_path, *IMAGES, "--model", str(folder)))
    line = one_line(code, err)
    assert line.startswith("packtrain pack run: configuration error:") and named in line, line
    assert str(folder) in line and "preprocessor_config.json" in line, line
    assert seconds < 30 and peak < 1024, (seconds, peak)  # before: 22 GiB and a kill for 10^12 pixels
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_hostile_video_processor_numbers_are_refused(tmp_path: Path) -> None:
    folder = hostile_folder(tmp_path, "video_preprocessor_config.json", {"fps": -2.0}, "qwen3-vl")
    code, _, err, _, _ = run_measured(pack_run(tmp_path, *IMAGES, "--model", str(folder)))
    assert "fps -2.0" in one_line(code, err)


def _pack_spec(tmp: Path, model: Path, family: str | None = None) -> Path:
    chats = next((DATASETS / "text-sft" / "fastchat").glob("*.json"))
    spec: dict[str, Any] = {
        "source": {"paths": [str(chats)]},
        "model": {"path": str(model), **({"family": family} if family else {})},
        "packing": {"maxLength": 2048, "maxRejectedFraction": 1.0},
    }
    path = tmp / "pack.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "packtrain.dev/v1alpha1", "kind": "PackJob", "spec": spec}))
    return path


def test_a_spec_without_family_packs_for_the_folders_family(tmp_path: Path) -> None:
    """`pack run -c` (the pods' and `packtrain run`'s way) with model.family left out: a Qwen3.5 folder
    packs as qwen3.5 (before: qwen2-vl, then exit 2 on the mismatch)."""
    code, _, err, _, _ = run_measured(pack_run(tmp_path, "-c", str(_pack_spec(tmp_path, MODELS / "qwen3.5"))))
    assert code == 0, err[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["family"] == "qwen3.5" and manifest["config"]["model"]["family"] == "qwen3.5"
    assert manifest["counts"]["packed"] > 0


def test_a_family_that_contradicts_the_folder_is_refused(tmp_path: Path) -> None:
    spec = _pack_spec(tmp_path, MODELS / "qwen3.5", family="qwen3-vl")
    code, _, err, seconds, _ = run_measured(pack_run(tmp_path, "-c", str(spec)))
    line = one_line(code, err)
    assert "model.family is qwen3-vl" in line and "set model.family to qwen3.5" in line, line
    assert seconds < 30


def test_a_folder_without_config_json_still_packs_as_qwen2_vl(tmp_path: Path) -> None:
    """Nothing to tell the family from: the documented default (the tokenizer and processor files are
    a Qwen2-VL's)."""
    folder = tmp_path / "model"
    shutil.copytree(MODELS / "qwen2-vl", folder)
    (folder / "config.json").unlink()
    code, _, err, _, _ = run_measured(pack_run(tmp_path, "-c", str(_pack_spec(tmp_path, folder))))
    assert code == 0, err[-3000:]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["family"] == "qwen2-vl"
