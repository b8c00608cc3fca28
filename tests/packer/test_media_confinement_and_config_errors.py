"""Configuration errors exit 2, `/` is never a media root, the shard stage re-opens media only inside
the roots, a re-signed pack with edited media bytes or a resized-image bomb fails `pack verify`, and
reject details are bounded."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
from pack_tamper import copy_pack, edit_manifest
from PIL import Image
from support.pack_runner import run_in_process
from support.paths import MODELS

from packtrain.core.config import PackConfig
from packtrain.core.errors import ConfigError
from packtrain.core.pack.schema import MEDIA_SCHEMA
from packtrain.core.pack.shards import MANIFEST, read_table, write_table
from packtrain.packer.cli import main as pack_main
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan
from packtrain.packer.stages.workdir import REJECT_DETAIL_CHARS, PackRefused
from packtrain.trainer.cli import main as train_main

QWEN2 = MODELS / "qwen2-vl"


def _chat(image: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": "<image>What is it?"},
            {"role": "assistant", "content": "A picture."},
        ],
        "images": [image],
    }


def _png(path: Path, size: tuple[int, int] = (56, 56), colour: tuple[int, int, int] = (10, 20, 30)) -> Path:
    Image.new("RGB", size, colour).save(path)
    return path


def _cfg(data: Path, **source: object) -> PackConfig:
    return PackConfig.model_validate(
        {
            "source": {"paths": [str(data)], **source},
            "model": {"path": str(QWEN2), "maxPixels": 48 * 28 * 28},
            "packing": {"maxLength": 512},
        }
    )


@pytest.mark.parametrize(
    "content",
    [b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary", b"kind: PackJob\nspec: null\n", b"kind: PackJob\nspec: [1]\n"],
    ids=["binary", "null-spec", "list-spec"],
)
def test_broken_config_files_exit_2(
    content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_bytes(content)
    assert pack_main(["run", "-c", str(cfg), "-o", str(tmp_path / "out")]) == 2
    assert train_main(["-c", str(cfg), "--output", str(tmp_path / "sft")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert str(cfg) in err or "`spec` must be a mapping" in err


def test_a_folder_as_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pack_main(["run", "-c", str(tmp_path), "-o", str(tmp_path / "out")]) == 2
    assert "cannot read the configuration" in capsys.readouterr().err


@pytest.mark.parametrize(
    "source", [{"mediaRoot": "/"}, {"mediaPathMap": {"imgs/": "/"}}], ids=["root", "map"]
)
def test_filesystem_root_is_never_a_media_root(source: dict, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_chat("imgs/etc/passwd")) + "\n")
    with pytest.raises(ConfigError, match="resolves to `/`"):
        convert(_cfg(data, **source), tmp_path / "out", 0, 1)


def test_materialize_reopens_media_only_inside_the_roots(tmp_path: Path) -> None:
    """A media file swapped for a symlink to an identical file outside the roots between convert and
    materialize: the hash alone would pass; the re-open is confined like convert's."""
    inside = tmp_path / "data"
    inside.mkdir()
    image = _png(inside / "a.png")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    twin = outside / "a.png"
    twin.write_bytes(image.read_bytes())
    data = inside / "d.jsonl"
    data.write_text(json.dumps(_chat("a.png")) + "\n")
    cfg, out = _cfg(data), tmp_path / "out"
    convert(cfg, out, 0, 1)
    plan(cfg, out)
    image.unlink()
    os.symlink(twin, image)
    with pytest.raises(ConfigError, match="readable at convert time but not now"):
        materialize(cfg, out, 0, 1)


def test_reject_details_are_bounded(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_chat("x" * 5000 + ".png")) + "\n")
    cfg, out = _cfg(data), tmp_path / "out"
    with pytest.raises(PackRefused, match="no sample was packed"):  # its only sample rejected
        run_in_process(cfg, out)
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["reason"] == "missing_media"
    assert len(reject["detail"]) <= REJECT_DETAIL_CHARS


def _media_pack(tmp_path: Path, storage: str) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    _png(root / "a.png", (300, 200))
    data = root / "d.jsonl"
    data.write_text(json.dumps(_chat("a.png")) + "\n")
    cfg = _cfg(data)
    cfg.packing.media_storage = storage
    out = tmp_path / "out"
    run_in_process(cfg, out)
    return out


def _replace_blob(pack: Path, data: bytes) -> None:
    """Rewrite shard 0's only media blob and re-sign the manifest, as an attacker would."""
    manifest = json.loads((pack / MANIFEST).read_text())
    entry = manifest["shards"][0]
    rows = read_table(pack / entry["media_file"]).to_pylist()
    rows[0]["data"] = data
    path = pack / entry["media_file"]
    path.unlink()
    sha = write_table(path, pa.Table.from_pylist(rows, schema=MEDIA_SCHEMA))
    edit_manifest(pack, lambda m: m["shards"][0].update(media_sha256=sha, media_bytes=path.stat().st_size))


@pytest.mark.parametrize("storage", ["original", "resized"])
def test_edited_media_blobs_fail_verify(
    storage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pack = _media_pack(tmp_path, storage)
    assert pack_main(["verify", str(pack)]) == 0, capsys.readouterr().err
    bad = copy_pack(pack, tmp_path / "bad")
    buf = io.BytesIO()
    Image.new("RGB", (4000, 4000)).save(buf, format="PNG")  # another image; resized: a pixel bomb
    _replace_blob(bad, buf.getvalue())
    capsys.readouterr()
    assert pack_main(["verify", str(bad)]) == 2
    err = capsys.readouterr().err
    want = "do not hash to its key" if storage == "original" else "resized image is (4000, 4000)"
    assert want in err and ".media.arrow" in err
    assert hashlib.sha256(buf.getvalue()).hexdigest() not in err  # names the key, not the new bytes
