"""Hostile input, second round: folders as media, dataset files confined like media, hard links,
metadata and footer costs bounded before decoding, packs trusted only inside their folder.

Every input is generated here and goes through the real stages (real Qwen2-VL tokenizer, Pillow,
PyAV, pyarrow); every case checks that the counts add up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import media_factory as mf
import pytest
from support.pack_runner import run_in_process

from packtrain.packer.core.config import PackConfig
from packtrain.packer.core.errors import ConfigError, MediaError
from packtrain.packer.media.access import open_regular
from packtrain.packer.sources.records import expand_paths

REPO = Path(__file__).resolve().parents[2]
QWEN2 = REPO.parent / "shared" / "models" / "qwen2-vl"


def _chat(image: str | None = None) -> dict:
    user = ("<image>" if image else "") + "What is it?"
    record: dict = {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "A thing."}]
    }
    if image:
        record["images"] = [image]
    return record


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _cfg(paths: list[str], **source: object) -> PackConfig:
    return PackConfig.model_validate(
        {
            "source": {"paths": paths, **source},
            "model": {"path": str(QWEN2), "maxPixels": 48 * 28 * 28},
            "packing": {"maxLength": 512},
        }
    )


def _rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


def _adds_up(manifest: dict) -> None:
    counts = manifest["counts"]
    assert counts["input"] == counts["packed"] + counts["rejected"]
    assert sum(counts["rejected_by_reason"].values()) == counts["rejected"]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# 1. A folder used as media


def test_a_folder_as_media_is_unsupported_and_leaks_no_descriptor(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    before = _open_fds()
    for name in ("sub", "sub/", "."):
        for _ in range(200):
            with pytest.raises(MediaError) as exc:
                open_regular(tmp_path / name, "image", 1 << 20)
            assert exc.value.reason == "unsupported_media"
    assert _open_fds() == before


def test_folders_as_media_do_not_starve_later_valid_media(tmp_path: Path) -> None:
    import resource

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    mf.image(data / "ok.png", 64, 48)
    records = [_chat(name) for name in ("sub", "sub/", ".") for _ in range(1)]
    # Distinct spellings defeat the per-path cache: each would leak one descriptor before the fix.
    records += [_chat("sub/" + "./" * i) for i in range(300)]
    records += [_chat("ok.png")] * 3
    dataset = _jsonl(data / "d.jsonl", records)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, _open_fds() + 200), hard))
    try:
        manifest = run_in_process(_cfg([str(dataset)]), tmp_path / "out")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _adds_up(manifest)
    assert manifest["counts"]["packed"] == 3
    assert manifest["counts"]["rejected_by_reason"] == {"unsupported_media": len(records) - 3}


# 2. Dataset files confined to the folder a source.paths entry names


def test_a_symlinked_dataset_file_leading_outside_is_refused_naming_it(tmp_path: Path) -> None:
    data, outside = tmp_path / "data", tmp_path / "outside"
    _jsonl(data / "a.jsonl", [_chat()])
    _jsonl(outside / "secret.jsonl", [_chat()])
    (data / "b.jsonl").symlink_to(outside / "secret.jsonl")
    with pytest.raises(ConfigError, match=r"b\.jsonl is a symlink leading outside"):
        expand_paths([str(data / "*.jsonl")])
    (data / "b.jsonl").unlink()
    (data / "b.jsonl").symlink_to(data / "a.jsonl")  # a link that stays inside is fine
    assert [p.name for p in expand_paths([str(data / "*.jsonl")])] == ["a.jsonl"]  # same file once


def test_a_symlinked_folder_under_globstar_does_not_become_a_media_root(tmp_path: Path) -> None:
    data, outside = tmp_path / "data", tmp_path / "outside"
    _jsonl(data / "a.jsonl", [_chat()])
    mf.image(outside / "secret.png", 40, 30)
    _jsonl(outside / "evil.jsonl", [_chat("secret.png")])
    (data / "more").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"folder .*more is a symlink leading outside"):
        run_in_process(_cfg([str(data / "**" / "*.jsonl")]), tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_symlink_loops_under_globstar_terminate(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _jsonl(data / "deep" / "a.jsonl", [_chat()])
    (data / "self1").symlink_to(data)
    (data / "self2").symlink_to(data)
    (data / "deep" / "up").symlink_to(data)
    found = expand_paths([str(data / "**" / "*.jsonl")])
    assert [p.name for p in found] == ["a.jsonl"]


def test_confined_glob_matches_what_glob_matches_without_symlinks(tmp_path: Path) -> None:
    import glob

    data = tmp_path / "data"
    for rel in ("a.jsonl", "x/b.jsonl", "x/y/c.jsonl", ".hidden/d.jsonl", "x/.e.jsonl", "part-1.json"):
        _jsonl(data / rel, [_chat()])
    for pattern in ("*.jsonl", "**/*.jsonl", "x/**/*.jsonl", "*/b.jsonl", "part-[0-9].json", "**/.e.jsonl"):
        full = str(data / pattern)
        want = sorted(Path(m) for m in glob.glob(full, recursive=True) if Path(m).is_file())
        assert sorted(expand_paths([full])) == want, pattern


# 3. Hard links


def test_hard_linked_media_are_rejected_unless_allowed(tmp_path: Path) -> None:
    data, outside = tmp_path / "data", tmp_path / "outside"
    mf.image(outside / "secret.png", 40, 30)
    mf.image(data / "ok.png", 64, 48)
    os.link(outside / "secret.png", data / "twin.png")
    dataset = _jsonl(data / "d.jsonl", [_chat("ok.png"), _chat("twin.png")])
    manifest = run_in_process(_cfg([str(dataset)]), tmp_path / "out")
    _adds_up(manifest)
    assert manifest["counts"]["rejected_by_reason"] == {"hard_linked_media": 1}
    assert "source.allowHardLinks" in _rejects(tmp_path / "out")[0]["detail"]
    allowed = run_in_process(_cfg([str(dataset)], allowHardLinks=True), tmp_path / "out2")
    _adds_up(allowed)
    assert allowed["counts"]["packed"] == 2


def test_a_hard_linked_dataset_file_stops_the_job_unless_allowed(tmp_path: Path) -> None:
    data, outside = tmp_path / "data", tmp_path / "outside"
    _jsonl(outside / "secret.jsonl", [_chat(), _chat()])
    data.mkdir()
    os.link(outside / "secret.jsonl", data / "d.jsonl")
    with pytest.raises(ConfigError, match="hard links"):
        run_in_process(_cfg([str(data / "*.jsonl")]), tmp_path / "out")
    manifest = run_in_process(_cfg([str(data / "*.jsonl")], allowHardLinks=True), tmp_path / "out2")
    _adds_up(manifest)
    assert manifest["counts"]["packed"] == 2
