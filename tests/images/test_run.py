"""Each built image's entrypoint runs inside its own root filesystem (chroot in a private mount namespace).

The operator image writes `packtrain crds` as the checkout does; the packer image packs the quickstart's
datasets (the shared folder mounted read-only at the same path) into a manifest byte-identical to the one
packed here by the checkout; the trainer image trains the tiny model two CPU steps on that pack,
with the command the operator builds for a pod.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import rootfs

from packtrain.operator.commands import train_command

from .conftest import REPO

QUICKSTART = REPO / "examples" / "quickstart.yaml"
PACKTRAIN = Path(sys.executable).with_name("packtrain")


def quickstart(kind: str) -> dict[str, Any]:
    doc: dict[str, Any] = next(
        d for d in yaml.safe_load_all(QUICKSTART.read_text()) if d and d["kind"] == kind
    )
    return doc


def in_image(
    image: rootfs.Image,
    argv: list[str],
    *,
    mounts: list[rootfs.Mount],
    workdir: str | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    uid, gid = rootfs.numeric_user(image.user)
    return rootfs.run(
        image, argv, env=image.env, mounts=mounts, workdir=workdir, uid=uid, gid=gid, timeout=timeout
    )


def writable_dir(path: Path) -> Path:
    """A folder the images' user (65532) can write, as a volume with fsGroup is."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


def test_operator_image_writes_the_crds(built_images: dict[str, rootfs.Image], tmp_path: Path) -> None:
    """`packtrain crds` in the operator image writes what the checkout writes, byte for byte."""
    image = built_images["operator"]
    out = writable_dir(tmp_path / "image")
    proc = in_image(
        image,
        [image.entrypoint[0], "crds", "--out", str(out)],
        mounts=[rootfs.Mount(str(out), str(out))],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    subprocess.run([str(PACKTRAIN), "crds", "--out", str(tmp_path / "host")], check=True, capture_output=True)
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(p.name for p in (tmp_path / "host").iterdir()) and written
    for name in written:
        assert (out / name).read_bytes() == (tmp_path / "host" / name).read_bytes(), name
    kinds = {yaml.safe_load((out / n).read_text())["spec"]["names"]["kind"] for n in written}
    assert kinds == {"PackJob", "SFTJob"}


@pytest.fixture(scope="module")
def packs(
    built_images: dict[str, rootfs.Image], shared_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The quickstart PackJob packed by the packer image, and by this checkout."""
    work = writable_dir(tmp_path_factory.mktemp("images-pack"))
    config = work / "packjob.yaml"
    config.write_text(yaml.safe_dump(quickstart("PackJob")))
    config.chmod(0o644)
    args = ["pack", "run", "-c", str(config), "--workers", "1", "--no-progress", "-o"]
    host = subprocess.run(
        [str(PACKTRAIN), *args, str(work / "host")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        check=False,
    )
    assert host.returncode == 0, host.stderr[-3000:]
    image = built_images["packer"]
    # The quickstart names ../shared: the image runs in a folder beside the shared one, as here.
    mounts = [
        rootfs.Mount(str(shared_dir), str(shared_dir), read_only=True),
        rootfs.Mount(str(work), str(work)),
    ]
    proc = in_image(
        image,
        [*image.entrypoint, *args, str(work / "image")],
        mounts=mounts,
        workdir=str(shared_dir.parent / REPO.name),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "image", work / "host"


def test_packer_image_packs_byte_identical_manifest(packs: tuple[Path, Path]) -> None:
    in_image_pack, host_pack = packs
    manifest = json.loads((in_image_pack / "manifest.json").read_text())
    assert manifest["counts"]["packed"] > 0
    assert (in_image_pack / "manifest.json").read_bytes() == (host_pack / "manifest.json").read_bytes()
    for shard in sorted((host_pack / "shards").iterdir()):
        assert (in_image_pack / "shards" / shard.name).read_bytes() == shard.read_bytes(), shard.name


def test_trainer_image_trains_two_cpu_steps(
    built_images: dict[str, rootfs.Image], packs: tuple[Path, Path], shared_dir: Path, tmp_path: Path
) -> None:
    pack = packs[0]
    work = writable_dir(tmp_path / "train")
    job = quickstart("SFTJob")
    job["spec"]["data"] = {"path": str(pack), "numWorkers": 1}
    config = work / "sftjob.yaml"
    config.write_text(yaml.safe_dump(job))
    out = writable_dir(work / "out")
    image = built_images["trainer"]
    argv = train_command(str(config), str(pack), str(out), 0, max_steps=2)
    mounts = [
        rootfs.Mount(str(shared_dir), str(shared_dir), read_only=True),
        rootfs.Mount(str(pack), str(pack), read_only=True),
        rootfs.Mount(str(work), str(work)),
    ]
    proc = in_image(image, argv, mounts=mounts, workdir=str(shared_dir.parent / REPO.name))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    summary = lines[-1]  # the trainer's summary line comes last
    assert summary["steps"] == 2, lines[-3:]
    assert (out / "checkpoints").is_dir() or any(out.iterdir())
