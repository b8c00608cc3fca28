"""Hostile datasets: media confined to the job's roots, bounded reads and decodes, a bad record one reject.

Every case runs through the real `SampleTokenizer` (real Qwen2-VL tokenizer, real
PIL and PyAV) or the real convert stage.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import media_factory as mf
import pytest
from support.paths import MODELS, REPO

from packtrain.core.config import ModelConfig, PackConfig, PackingConfig, SourceConfig
from packtrain.core.contract import REJECT_REASONS, RejectReason
from packtrain.core.errors import MediaError
from packtrain.packer.media.access import open_regular
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.sources.records import iter_records
from packtrain.packer.stages.convert import convert
from packtrain.packer.tokenize import Reject, SampleTokenizer, TokenizedSample

# Measures the memory of processes it starts: they run with glibc's default malloc settings.
pytestmark = pytest.mark.measures_memory

QWEN2 = MODELS / "qwen2-vl"


def _ask(placeholder: str, key: str, path: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": placeholder + "Describe."},
            {"role": "assistant", "content": "OK."},
        ],
        key: [path],
    }


def _image(path: str) -> dict:
    return _ask("<image>", "images", path)


def _video(path: str) -> dict:
    return _ask("<video>", "videos", path)


def _tokenizer(**source: object) -> SampleTokenizer:
    return SampleTokenizer(
        SourceConfig(paths=["unused"], **source), ModelConfig(path=str(QWEN2)), PackingConfig()
    )


def _one(tok: SampleTokenizer, record: dict, dataset: Path) -> TokenizedSample | Reject:
    return tok(RawRecord(dataset, 0, record, None))


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """A dataset folder with its media, and an outside folder with a readable secret image."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    mf.image(data / "ok.png", 64, 48)
    mf.image(outside / "secret.png", 40, 30)
    (data / "link.png").symlink_to(outside / "secret.png")
    (data / "dangling.png").symlink_to(outside / "nothing-here.png")
    return {"data": data, "outside": outside, "dataset": data / "d.jsonl"}


def _reason(result: TokenizedSample | Reject) -> str | None:
    return result.reason if isinstance(result, Reject) else None


def test_paths_outside_the_roots_are_rejected_without_telling_if_they_exist(tree: dict[str, Path]) -> None:
    tok = _tokenizer()
    ds = tree["dataset"]
    assert isinstance(_one(tok, _image("ok.png"), ds), TokenizedSample)
    secret = tree["outside"] / "secret.png"
    cases = {
        "absolute": str(secret),
        "dotdot": "../outside/secret.png",
        "symlink": "link.png",
        "absolute-missing": str(tree["outside"] / "nothing-here.png"),
        "dangling-symlink": "dangling.png",
        "etc": "/etc/passwd",
    }
    results = {name: _one(tok, _image(ref), ds) for name, ref in cases.items()}
    assert {name: _reason(r) for name, r in results.items()} == dict.fromkeys(cases, "media_outside_root")
    # The detail is the reference as written (and, for an absolute one, the mediaPathMap line naming its
    # folder) plus fixed sentences: existing and missing read alike.
    shapes = {
        name: r.detail.replace(repr(cases[name]), "REF").replace(
            json.dumps(os.path.dirname(cases[name]) + "/"), "DIR"
        )
        for name, r in results.items()
        if isinstance(r, Reject)
    }
    assert len({shapes[n] for n in ("absolute", "absolute-missing", "etc")}) == 1, shapes
    assert len({shapes[n] for n in ("dotdot", "symlink", "dangling-symlink")}) == 1, shapes
    assert "secret" not in shapes["symlink"]  # the link's target is not revealed


def test_the_opened_file_is_checked_against_the_roots_again(tree: dict[str, Path]) -> None:
    """A folder swapped for a symlink after the path was resolved: the open descriptor tells where it went."""
    roots = frozenset({os.path.realpath(tree["data"])})
    with open_regular(tree["data"] / "ok.png", "image", 1 << 20, roots) as f:
        assert f.read(4) == b"\x89PNG"
    with pytest.raises(MediaError) as err:
        open_regular(tree["data"] / "link.png", "image", 1 << 20, roots)
    assert err.value.reason == "media_outside_root"


def test_media_path_map_targets_are_roots_the_config_names(tree: dict[str, Path]) -> None:
    ds = tree["dataset"]
    # A relative target inside the dataset folder: allowed, as before.
    inside = _tokenizer(media_path_map={"old/layout/": ""})
    assert isinstance(_one(inside, _image("old/layout/ok.png"), ds), TokenizedSample)
    # A target outside the dataset folder is allowed only because the job configuration names it.
    named = _tokenizer(media_path_map={"/mnt/old/": str(tree["outside"]) + "/"})
    assert isinstance(_one(named, _image("/mnt/old/secret.png"), ds), TokenizedSample)
    # ... and names only that folder: escaping it with ../ is outside again.
    escaped = _one(named, _image("/mnt/old/../data/../../etc/passwd"), ds)
    assert _reason(escaped) == "media_outside_root"
    assert (
        _reason(_one(_tokenizer(), _image(str(tree["outside"] / "secret.png")), ds)) == "media_outside_root"
    )


def test_media_root_is_a_root(tree: dict[str, Path], tmp_path: Path) -> None:
    elsewhere = tmp_path / "records" / "d.jsonl"
    tok = _tokenizer(media_root=str(tree["outside"]))
    assert isinstance(_one(tok, _image("secret.png"), elsewhere), TokenizedSample)
    assert isinstance(_one(tok, _image(str(tree["outside"] / "secret.png")), elsewhere), TokenizedSample)


@pytest.mark.parametrize(
    "ref",
    [
        "file:///etc/passwd",
        "http://169.254.169.254/latest/meta-data",
        "https://example.com/a.png",
        "s3://bucket/a.png",
        "data:image/png;base64,iVBORw0KGgo=",
    ],
)
def test_urls_are_remote_media(tree: dict[str, Path], ref: str) -> None:
    result = _one(_tokenizer(), _image(ref), tree["dataset"])
    assert _reason(result) == "remote_media"


def test_text_file_named_as_a_video_is_not_demuxed(tree: dict[str, Path]) -> None:
    (tree["data"] / "notes.mp4").write_text("username: admin\npassword: hunter2\n" * 50)
    (tree["data"] / "notes.txt").write_text("any text file\n" * 50)
    tok = _tokenizer()
    for name in ("notes.mp4", "notes.txt"):
        result = _one(tok, _video(name), tree["dataset"])
        assert _reason(result) == "corrupt_media", result
        assert "allowed container" in result.detail


@pytest.mark.timeout(60)
def test_fifo_and_devices_are_not_opened_as_media(tree: dict[str, Path]) -> None:
    os.mkfifo(tree["data"] / "pipe.png")
    (tree["data"] / "zero.png").symlink_to("/dev/zero")
    tok = _tokenizer()
    assert _reason(_one(tok, _image("pipe.png"), tree["dataset"])) == "unsupported_media"
    assert _reason(_one(tok, _video("pipe.png"), tree["dataset"])) == "unsupported_media"
    assert _reason(_one(tok, _image("zero.png"), tree["dataset"])) == "media_outside_root"
    # Even where the job names /dev as a root, a device is never read.
    dev = _tokenizer(media_root="/dev")
    zero = _one(dev, _image("zero"), tree["dataset"])
    assert _reason(zero) == "unsupported_media" and "regular file" in zero.detail


def test_size_caps_are_enforced(tree: dict[str, Path]) -> None:
    mf.noisy_jpeg(tree["data"] / "big.jpg", 200, 200)
    mf.video(tree["data"] / "clip.mp4", frames=9, fps=4)
    size = (tree["data"] / "big.jpg").stat().st_size
    tok = _tokenizer(max_image_bytes=size - 1, max_video_bytes=1000)
    big = _one(tok, _image("big.jpg"), tree["dataset"])
    assert _reason(big) == "media_too_large" and "source.maxImageBytes" in big.detail
    assert _reason(_one(tok, _video("clip.mp4"), tree["dataset"])) == "media_too_large"
    assert isinstance(
        _one(_tokenizer(max_image_bytes=size), _image("big.jpg"), tree["dataset"]), TokenizedSample
    )
    wide = _one(_tokenizer(max_image_source_pixels=64 * 48 - 1), _image("ok.png"), tree["dataset"])
    assert _reason(wide) == "media_too_large" and "source.maxImageSourcePixels" in wide.detail


def test_video_bomb_is_rejected_before_decoding(tree: dict[str, Path]) -> None:
    bomb = mf.video_bomb(tree["data"] / "bomb.mp4")
    assert bomb.stat().st_size < 64 * 1024  # a few KB on disk ...
    result = _one(_tokenizer(), _video("bomb.mp4"), tree["dataset"])
    assert _reason(result) == "video_too_large", result  # ... 120 sampled frames of 2048x2048 decoded
    assert "2048x2048 x 120 sampled frames" in result.detail
    allowed = _one(_tokenizer(max_video_source_pixels=2048 * 2048 * 120), _video("bomb.mp4"), tree["dataset"])
    assert isinstance(allowed, TokenizedSample)


def _chat(**extra: object) -> dict:
    return {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        **extra,
    }


def test_recursion_in_a_record_is_one_reject_and_the_worker_goes_on(tmp_path: Path) -> None:
    deep: list = []
    for _ in range(5000):  # built iteratively: a Python-side structure no JSON reader would give us
        deep = [deep]
    tok = _tokenizer()
    nested = _one(tok, _chat(tools=deep), tmp_path / "d.jsonl")
    assert _reason(nested) == "internal_error" and nested.detail.startswith("RecursionError: ")
    # A string-valued `tools` is parsed later, by the conversation reader, within a record's limits.
    path = tmp_path / "tools.jsonl"
    lines = [_chat(tools=mf.nested_tools(100_000)), _chat(), _chat(tools=mf.nested_tools(100_000)), _chat()]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    results = [tok(raw) for raw in iter_records([str(path)])]
    assert [_reason(r) for r in results] == ["bad_json", None, "bad_json", None]
    assert results[0].detail.startswith("tools: nested 100000 levels deep")


@pytest.mark.timeout(120)
def test_convert_stage_survives_a_hostile_file(tree: dict[str, Path], tmp_path: Path) -> None:
    """Through the convert stage: counts add up, every hostile record is a reject with its reason."""
    os.mkfifo(tree["data"] / "pipe.jpg")
    mf.video_bomb(tree["data"] / "bomb.mp4")
    (tree["data"] / "notes.avi").write_text("secret text\n" * 20)
    records = [
        (_image("ok.png"), None),
        (_image(str(tree["outside"] / "secret.png")), "media_outside_root"),
        (_image("../outside/secret.png"), "media_outside_root"),
        (_image("link.png"), "media_outside_root"),
        (_image("file:///etc/hostname"), "remote_media"),
        (_image("pipe.jpg"), "unsupported_media"),
        (_video("bomb.mp4"), "video_too_large"),
        (_video("notes.avi"), "corrupt_media"),
        (_chat(tools=mf.nested_tools(100_000)), "bad_json"),
        (_chat(), None),
    ]
    ds = tree["dataset"]
    ds.write_text("".join(json.dumps(r) + "\n" for r, _ in records))
    cfg = PackConfig.model_validate(
        {"source": {"paths": [str(ds)]}, "model": {"path": str(QWEN2)}, "packing": {"maxLength": 1024}}
    )
    out = tmp_path / "out"
    summary = convert(cfg, out, 0, 1)
    assert (summary["samples"], summary["converted"], summary["rejected"]) == (10, 2, 8)
    rejects = [
        json.loads(x)
        for x in next((out / "work" / "convert").glob("rejects-*.jsonl")).read_text().splitlines()
    ]
    got = {r["position"]: r["reason"] for r in rejects}
    assert got == {i: reason for i, (_, reason) in enumerate(records) if reason}


_RSS_PROBE = textwrap.dedent(
    """
    import json, resource, sys, time
    from pathlib import Path
    from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
    from packtrain.packer.sources.records import iter_records
    from packtrain.packer.tokenize import SampleTokenizer
    path, model = sys.argv[1], sys.argv[2]
    tok = SampleTokenizer(SourceConfig(paths=[path]), ModelConfig(path=model), PackingConfig(maxLength=4096))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    results = [tok(raw) for raw in iter_records([path])]
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"reasons": [getattr(r, "reason", None) for r in results],
                      "detail": getattr(results[0], "detail", ""), "before_kib": before, "after_kib": after,
                      "seconds": seconds}))
    """
)


@pytest.mark.timeout(300)
def test_an_18_mb_line_is_rejected_overlong_without_tokenizing_it(tmp_path: Path) -> None:
    words = "the quick brown fox jumps over the lazy dog and keeps on running "
    text = (words * (18_600_000 // len(words) + 1))[:18_600_000]
    path = tmp_path / "huge.jsonl"
    huge = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}
    path.write_text(json.dumps(huge) + "\n" + json.dumps(_chat()) + "\n")
    assert path.stat().st_size > 18_600_000
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(path), str(QWEN2)], capture_output=True, text=True, check=True
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["reasons"] == ["overlong", None]
    assert "not tokenized" in got["detail"]
    growth_mib = (got["after_kib"] - got["before_kib"]) / 1024
    # Parsing and rendering the line costs a few copies of 18.6 MB; tokenizing it whole cost ~2 GB.
    assert growth_mib < 400, got


def test_docs_reject_table_matches_the_registry() -> None:
    text = (REPO / "docs" / "rejects.md").read_text()  # the table users read (moved from the README)
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| (.+?) \| [^|]* \|$", text, flags=re.MULTILINE))
    assert rows == REJECT_REASONS
    assert list(REJECT_REASONS) == list(RejectReason)  # one description per reason, in the enum's order
    assert {
        "internal_error",
        "media_outside_root",
        "remote_media",
        "media_too_large",
        "video_too_large",
    } <= set(rows)
