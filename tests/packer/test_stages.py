"""End-to-end packing of the real demo sets through the three stages and the tools."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.pack_runner import run_in_process
from support.paths import DATASETS, DEMO, MODELS

from packtrain.core.config import PackConfig
from packtrain.core.errors import ShardFormatError
from packtrain.core.pack.shards import MANIFEST, ShardReader
from packtrain.packer.cli import main as pack_main
from packtrain.packer.sources.records import iter_records
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample
from packtrain.packer.tools import unpack, verify

TEXT = DATASETS / "text-sft"
QWEN2 = MODELS / "qwen2-vl"


def _config(tmp_path: Path, **packing: object) -> PackConfig:
    # v1_multimodal_demo.jsonl names media as data/mllm_demo_data/x.jpg: give it that root.
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True, exist_ok=True)
    link = root / "data" / "mllm_demo_data"
    if not link.exists():
        link.symlink_to(DEMO / "mllm_demo_data")
    return PackConfig.model_validate(
        {
            "source": {
                "paths": [
                    str(DEMO / "mllm_demo.json"),
                    str(DEMO / "mllm_video_demo.json"),
                    str(TEXT / "glaive-toolcall" / "*.json"),
                ]
            },
            "model": {"path": str(QWEN2), "maxPixels": 200_000, "videoMaxPixels": 50_000, "maxFrames": 8},
            "packing": {"maxLength": 2048, "sequencesPerShard": 16, "maxRejectedFraction": 1.0, **packing},
        }
    )


_run = run_in_process


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[PackConfig, Path, dict]:
    tmp = tmp_path_factory.mktemp("pack")
    cfg = _config(tmp)
    out = tmp / "out"
    return cfg, out, _run(cfg, out, workers=2)


def test_counts_add_up_and_verify_passes(packed: tuple[PackConfig, Path, dict]) -> None:
    cfg, out, manifest = packed
    n_inputs = sum(1 for _ in iter_records(cfg.source.paths))
    c = manifest["counts"]
    assert c["input"] == n_inputs == c["packed"] + c["rejected"]
    assert c["packed"] > 300
    assert verify(out) == []
    assert manifest["sequences"] >= manifest["lower_bound"]
    assert 0 < manifest["fill_ratio"] <= 1


def test_no_sequence_over_max_length_and_boundaries(packed: tuple[PackConfig, Path, dict]) -> None:
    _, out, manifest = packed
    reader = ShardReader(out)
    assert reader.num_sequences == manifest["sequences"]
    for i in range(reader.num_sequences):
        row = reader.sequence(i)
        assert len(row["input_ids"]) == sum(row["seq_lens"]) <= manifest["max_length"]
        for m in row["media"]:
            blob = reader.media(m["key"], row["shard"])
            assert blob["kind"] == m["kind"] and blob["data"]


def test_unpack_equals_direct_tokenization(packed: tuple[PackConfig, Path, dict]) -> None:
    cfg, out, _ = packed
    tok = SampleTokenizer(cfg.source, cfg.model, cfg.packing)
    direct = {}
    for raw in iter_records(cfg.source.paths):
        s = tok(raw)
        if isinstance(s, TokenizedSample) and len(s.input_ids) <= cfg.packing.max_length:
            direct[s.sample_id] = s
    unpacked = unpack(out)
    assert len(unpacked) == len(direct)
    for u in unpacked:
        d = direct[u["id"]]
        assert u["input_ids"] == d.input_ids
        assert u["labels"] == d.labels
        assert [m["key"] for m in u["media"]] == [m.key for m in d.media]


def test_same_result_for_any_worker_count_and_byte_identical(
    packed: tuple[PackConfig, Path, dict], tmp_path: Path
) -> None:
    cfg, out, manifest = packed
    out3 = tmp_path / "out3"
    manifest3 = _run(cfg, out3, workers=3)
    assert manifest3["shards"] == manifest["shards"]
    for entry in manifest["shards"]:
        assert (out / entry["file"]).read_bytes() == (out3 / entry["file"]).read_bytes()
    assert (out / MANIFEST).read_bytes() == (out3 / MANIFEST).read_bytes()


def test_rerun_is_noop_and_crash_leftovers_are_ignored(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    out = tmp_path / "out"
    first = _run(cfg, out, workers=1)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert _run(cfg, out, workers=1) == first
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert {p: t for p, t in after.items() if p.name != MANIFEST} == {
        p: t for p, t in before.items() if p.name != MANIFEST
    }
    # A killed writer leaves only a temp file: a damaged shard is detected and rewritten.
    shard = out / first["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:100])
    (shard.parent / f".{shard.name}.tmp-crash").write_bytes(b"half")
    with pytest.raises(ShardFormatError, match="has 100 bytes, the manifest records"):
        ShardReader(out)
    materialize(cfg, out, 0, 1)
    assert ShardReader(out).num_sequences == first["sequences"]


def test_output_folder_refuses_a_different_config(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    out = tmp_path / "out"
    convert(cfg, out, 0, 1)
    other = _config(tmp_path, maxLength=4096)
    with pytest.raises(ValueError, match="different configuration"):
        convert(other, out, 0, 1)


def test_cli_run_with_flags_and_resized_media(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = pack_main(
        [
            "run",
            "--input",
            str(DEMO / "mllm_demo.json"),
            "--model",
            str(QWEN2),
            "--max-length",
            "4096",
            "--media-storage",
            "resized",
            "-o",
            str(out),
            "--workers",
            "1",
            "--no-progress",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["packed"] + summary["rejected"] == summary["samples"] == 6
    reader = ShardReader(out)
    row = reader.sequence(0)
    blob = reader.media(row["media"][0]["key"])
    assert blob["encoding"] == "resized" and blob["data"][:4] == b"\x89PNG"
    assert pack_main(["verify", str(out)]) == 0
    assert pack_main(["inspect", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_config_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = pack_main(
        [
            "convert",
            "--input",
            str(tmp_path / "nothing-*.json"),
            "--model",
            str(QWEN2),
            "-o",
            str(tmp_path / "o"),
        ]
    )
    assert rc == 2
    assert "configuration error" in capsys.readouterr().err


def test_termination_message_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("PACKTRAIN_TERMINATION_LOG", str(log))
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    out = tmp_path / "out"
    src = tmp_path / "d.json"
    shutil.copy(DEMO / "mllm_demo.json", src)
    (tmp_path / "mllm_demo_data").symlink_to(DEMO / "mllm_demo_data")
    assert (
        pack_main(["convert", "--input", str(src), "--model", str(QWEN2), "-o", str(out), "--count", "2"])
        == 0
    )
    msg = json.loads(log.read_text())
    assert msg["stage"] == "convert" and msg["index"] == 1 and msg["count"] == 2
    assert msg["samples"] == 3


def test_media_path_map_packs_both_demo_layouts(tmp_path: Path) -> None:
    """mllm_demo.json and v1_multimodal_demo.jsonl name the same media differently; one job packs both."""
    cfg = PackConfig.model_validate(
        {
            "source": {
                "paths": [str(DEMO / "mllm_demo.json"), str(DEMO / "v1_multimodal_demo.jsonl")],
                "mediaPathMap": {"data/mllm_demo_data/": "mllm_demo_data/"},
            },
            "model": {"path": str(QWEN2), "maxPixels": 100_000},
            "packing": {"maxLength": 4096, "maxRejectedFraction": 1.0},
        }
    )
    manifest = _run(cfg, tmp_path / "out", workers=1)
    per_source = {"records": 6, "input": 6, "packed": 6, "rejected": 0}
    assert manifest["counts"] == {
        "input": 30,
        "packed": 30,
        "rejected": 0,
        "rejected_by_reason": {},
        "duplicate_ids": 0,
        "sources": {
            str(DEMO / "mllm_demo.json"): per_source,
            str(DEMO / "v1_multimodal_demo.jsonl"): {k: v * 4 for k, v in per_source.items()},
        },
    }
    without_map = cfg.model_copy(update={"source": cfg.source.model_copy(update={"media_path_map": {}})})
    manifest = _run(without_map, tmp_path / "out2", workers=1)
    assert manifest["counts"]["rejected_by_reason"].get("missing_media", 0) > 0
