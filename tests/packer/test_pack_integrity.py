"""`pack verify` checks everything a trainer trusts, and a damaged pack or config exits 2 with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pack_tamper import ROW_EDITS, copy_pack, edit_manifest, first_row, tamper_row
from support.pack_runner import run_in_process
from support.paths import DEMO, MODELS

from packtrain.core.config import PackConfig
from packtrain.core.pack.integrity import model_facts, stored_config_hash
from packtrain.core.pack.shards import MANIFEST, REJECTS
from packtrain.packer.cli import main as pack_main

QWEN2 = MODELS / "qwen2-vl"


def _config(tmp: Path) -> PackConfig:
    # One record over maxLength, so the pack has a reject to tamper with.
    extra = tmp / "extra.jsonl"
    chats = [("hi " * 900, "ok"), ("What is 2+2?", "4"), ("Name a colour.", "Blue.")]
    extra.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            + "\n"
            for q, a in chats
        )
    )
    return PackConfig.model_validate(
        {
            "source": {
                "paths": [str(DEMO / "mllm_demo.json"), str(DEMO / "mllm_video_demo.json"), str(extra)]
            },
            "model": {
                "path": str(QWEN2),
                "maxPixels": 48 * 28 * 28,
                "videoMaxPixels": 16 * 28 * 28,
                "maxFrames": 8,
            },
            "packing": {"maxLength": 512, "sequencesPerShard": 2, "maxRejectedFraction": 1.0},
        }
    )


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("integrity")
    out = tmp / "out"
    manifest = run_in_process(_config(tmp), out)
    assert manifest["counts"]["rejected"] == 1
    return out


def _verify(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = pack_main(["verify", str(path)])
    return rc, capsys.readouterr().err


def test_an_untouched_pack_verifies(pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _verify(pack, capsys)
    assert rc == 0, err


@pytest.mark.parametrize("name", sorted(ROW_EDITS))
def test_tampered_rows_fail_naming_shard_and_row(
    name: str, pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit, message = ROW_EDITS[name]
    bad = copy_pack(pack, tmp_path / "bad")
    shard_file = tamper_row(bad, 0, 1, edit)
    rc, err = _verify(bad, capsys)
    assert rc == 2
    assert f"FAIL {shard_file} row 1: " in err and message in err


def test_sample_without_labels_after_a_seq_lens_split_fails(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = copy_pack(pack, tmp_path / "bad")

    def split_prompt_off(row: dict) -> None:  # a first sub-sample of only prompt tokens (labels -100)
        first_label = row["labels"].index(next(x for x in row["labels"] if x != -100))
        row["seq_lens"] = [first_label, row["seq_lens"][0] - first_label, *row["seq_lens"][1:]]
        row["sample_ids"].insert(0, "x")
        row["sources"].insert(0, row["sources"][0])
        row["indices"].insert(0, row["indices"][0])
        # the prompt keeps its media: only later sub-samples move up by one
        row["media"] = [{**m, "sample": m["sample"] + (m["sample"] > 0)} for m in row["media"]]

    shard, row = 0, 1
    shard_file = tamper_row(bad, shard, row, split_prompt_off)
    rc, err = _verify(bad, capsys)
    assert rc == 2 and f"{shard_file} row {row}: sub-sample 0 has no label token" in err


@pytest.mark.parametrize("edit", ["doubled grid", "repeated media ref"])
def test_media_grids_must_match_the_vision_tokens(
    edit: str, pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = copy_pack(pack, tmp_path / "bad")

    def change(row: dict) -> None:
        if edit == "doubled grid":
            row["media"][0]["grid_h"] *= 2
        else:
            row["media"].insert(0, dict(row["media"][0]))

    shard, row = first_row(bad, lambda r: bool(r["media"]))
    shard_file = tamper_row(bad, shard, row, change)
    rc, err = _verify(bad, capsys)
    assert rc == 2 and f"{shard_file} row {row}: sub-sample" in err and "media grids" in err


def test_edited_config_is_caught_by_its_hash(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = copy_pack(pack, tmp_path / "bad")

    def edit(m: dict) -> None:
        m["config"]["packing"]["maxLength"] = 4096
        m["max_length"] = 4096

    edit_manifest(bad, edit)
    rc, err = _verify(bad, capsys)
    assert rc == 2 and "config_hash" in err and "manifest was edited" in err


def test_edited_reject_reason_is_caught(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = copy_pack(pack, tmp_path / "bad")
    line = json.loads((bad / REJECTS).read_text())
    (bad / REJECTS).write_text(json.dumps({**line, "reason": "corrupt_media"}) + "\n")
    rc, err = _verify(bad, capsys)
    assert rc == 2 and f"{REJECTS}: missing, or its sha256 does not match" in err


def test_label_token_total_must_match(pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = copy_pack(pack, tmp_path / "bad")
    edit_manifest(bad, lambda m: m.update(label_tokens=m["label_tokens"] + 1))
    rc, err = _verify(bad, capsys)
    assert rc == 2 and "label tokens, shards hold" in err


def test_counts_must_add_up(pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = copy_pack(pack, tmp_path / "bad")
    edit_manifest(bad, lambda m: m["counts"].update(input=m["counts"]["input"] + 1))
    rc, err = _verify(bad, capsys)
    assert rc == 2 and "counts do not add up" in err


def test_truncated_manifest_exits_2(pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = copy_pack(pack, tmp_path / "bad")
    text = (bad / MANIFEST).read_text()
    (bad / MANIFEST).write_text(text[: len(text) // 2])
    rc, err = _verify(bad, capsys)
    assert rc == 2 and "not readable JSON" in err and "Traceback" not in err


def test_shard_entry_without_sha256_exits_2(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = copy_pack(pack, tmp_path / "bad")
    edit_manifest(bad, lambda m: m["shards"][0].pop("sha256"))
    rc, err = _verify(bad, capsys)
    assert rc == 2 and "shards[0] lacks sha256" in err


def test_model_facts_from_config_and_a_note_without_it(tmp_path: Path) -> None:
    facts, note = model_facts(QWEN2)
    assert (facts.vocab_size, facts.image_pad_id, facts.video_pad_id, facts.merge_size) == (
        151936,
        151655,
        151656,
        2,
    )
    assert note is None
    facts, note = model_facts(tmp_path / "gone")
    assert facts.vocab_size is None and note is not None and "not checked" in note


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not a readable UTF-8 Jinja chat template"),
        (b"{% for m in messages %}{{ m.content }", "chat template does not compile (line 1)"),
    ],
    ids=["binary file", "jinja syntax error"],
)
def test_bad_chat_template_exits_2_with_what_to_fix(
    content: bytes, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = tmp_path / "template.jinja"
    template.write_bytes(content)
    job = tmp_path / "job.yaml"
    job.write_text(
        json.dumps(
            {
                "source": {"paths": [str(DEMO / "mllm_demo.json")]},
                "model": {"path": str(QWEN2), "chatTemplate": str(template)},
            }
        )
    )
    rc = pack_main(["convert", "-c", str(job), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "model.chatTemplate" in err, err


def test_stored_config_hash_is_the_packers_config_hash(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert stored_config_hash(json.loads(json.dumps(cfg.dump()))) == cfg.config_hash()


def test_a_shard_with_other_columns_exits_2(
    pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow as pa

    from packtrain.core.pack.shards import read_table, write_table

    bad = copy_pack(pack, tmp_path / "bad")
    manifest = json.loads((bad / MANIFEST).read_text())
    entry = manifest["shards"][0]
    table = read_table(bad / entry["file"]).drop_columns(["labels"])
    (bad / entry["file"]).unlink()
    entry["sha256"] = write_table(bad / entry["file"], pa.table(table.to_pydict()))
    entry["bytes"] = (bad / entry["file"]).stat().st_size  # re-signed whole, as an attacker would
    edit_manifest(bad, lambda m: m["shards"].__setitem__(0, entry))
    rc, err = _verify(bad, capsys)
    assert rc == 2 and "are not those of pack format" in err and "Traceback" not in err
