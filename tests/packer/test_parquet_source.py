"""Parquet input: the LLaVA-OneVision-Data and `datasets` image layouts, row groups as the unit of work,
embedded media under the same rules as files, and bad rows as rejects."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from parquet_layouts import (
    DEMO,
    DEMO_IMAGES,
    HF_SCHEMA,
    IMAGE,
    LLAVA_OV_SCHEMA,
    config,
    hf_rows,
    json_twin,
    llava_ov_rows,
    write,
)
from support.pack_runner import run_in_process

from packtrain.core.config import PackConfig
from packtrain.core.pack.shards import ShardReader, read_table
from packtrain.packer.sources.raw import SKIPPED
from packtrain.packer.sources.records import iter_records
from packtrain.packer.stages.workdir import PackRefused
from packtrain.packer.tools import unpack, verify


def _pack(tmp: Path, name: str, cfg: dict[str, Any], workers: int = 2) -> tuple[Path, dict[str, Any]]:
    out = tmp / name
    return out, run_in_process(PackConfig.model_validate(cfg), out, workers=workers)


def _samples(out: Path) -> dict[int, dict[str, Any]]:
    return {s["index"]: s for s in unpack(out)}


def _same_tokens(a: Path, b: Path) -> None:
    sa, sb = _samples(a), _samples(b)
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        assert sa[i]["input_ids"] == sb[i]["input_ids"], i
        assert sa[i]["labels"] == sb[i]["labels"], i
        assert [m["key"] for m in sa[i]["media"]] == [m["key"] for m in sb[i]["media"]], i
        assert [m["grid_h"] for m in sa[i]["media"]] == [m["grid_h"] for m in sb[i]["media"]], i


def _media_hash_to_keys(out: Path) -> set[str]:
    """Every media blob in the shards hashes to its key; returns the keys."""
    reader = ShardReader(out, verify_checksums=True)
    keys = set()
    for s in range(len(reader.manifest["shards"])):
        table = reader.media_table(s)
        for key, data in zip(table.column("key").to_pylist(), table.column("data").to_pylist(), strict=True):
            assert hashlib.sha256(data).hexdigest() == key
            keys.add(key)
    return keys


def test_llava_onevision_layout_packs_like_its_json_twin(tmp_path: Path) -> None:
    rows = llava_ov_rows(24)
    data = write(tmp_path / "ov" / "train-00000-of-00001.parquet", rows, LLAVA_OV_SCHEMA, row_group_size=5)
    assert pq.ParquetFile(data).metadata.num_row_groups == 5
    twin = tmp_path / "twin" / "train.jsonl"
    twin.parent.mkdir()
    twin.write_text("".join(json.dumps(r) + "\n" for r in json_twin(rows, twin.parent / "img")))

    out, manifest = _pack(tmp_path, "from-parquet", config([tmp_path / "ov" / "*.parquet"]))
    ref, ref_manifest = _pack(tmp_path, "from-json", config([twin]), workers=1)
    c = manifest["counts"]
    assert c["input"] == c["packed"] == 24 and c["rejected"] == 0
    assert c["sources"] == {
        str(tmp_path / "ov" / "*.parquet"): {"records": 24, "input": 24, "packed": 24, "rejected": 0}
    }
    assert manifest["tokens"] == ref_manifest["tokens"]
    _same_tokens(out, ref)
    assert [s["id"] for s in unpack(out)][:2] == [rows[0]["id"], rows[1]["id"]]  # the `id` column
    assert verify(out) == []
    demo_keys = {hashlib.sha256(p.read_bytes()).hexdigest() for p in DEMO_IMAGES}
    assert _media_hash_to_keys(out) == demo_keys
    # The embedded bytes were kept under their sha256 until materialize; the dataset's own names play no part.
    assert {p.name for p in (out / "work" / "embedded").rglob("*") if p.is_file()} == demo_keys


def test_datasets_image_layout_packs_like_the_json_demo(tmp_path: Path) -> None:
    data = write(tmp_path / "hf" / "data.parquet", hf_rows(), HF_SCHEMA, row_group_size=2)
    assert b"huggingface" in pq.read_schema(data).metadata
    out, manifest = _pack(tmp_path, "hf-pack", config([data]))
    ref, _ = _pack(tmp_path, "json-pack", config([DEMO / "mllm_demo.json"]), workers=1)
    assert manifest["counts"]["packed"] == 6
    _same_tokens(out, ref)
    assert verify(out) == []
    _media_hash_to_keys(out)


def test_row_groups_are_the_unit_of_work_and_results_do_not_depend_on_workers(tmp_path: Path) -> None:
    data = write(tmp_path / "d" / "ov.parquet", llava_ov_rows(12), LLAVA_OV_SCHEMA, row_group_size=4)
    asked: list[int] = []

    def select(unit: int) -> bool:
        asked.append(unit)
        return unit == 1

    raws = list(iter_records([str(data)], select=select))
    assert asked == [0, 1, 2]  # one question per row group, not per row
    assert [r.index for r in raws] == list(range(12))
    assert [r.reason == SKIPPED for r in raws] == [True] * 4 + [False] * 4 + [True] * 4

    shas = []
    for workers in (1, 2, 3):
        out, manifest = _pack(tmp_path, f"w{workers}", config([data]), workers=workers)
        shas.append([(s["sha256"], s["media_sha256"]) for s in manifest["shards"]])
        if workers == 2:  # worker 0 took row groups 0 and 2, worker 1 row group 1
            part = read_table(out / "work" / "convert" / "part-00001-of-00002.arrow")
            assert sorted(part.column("index").to_pylist()) == list(range(4, 8))
    assert shas[0] == shas[1] == shas[2]


def _row(conv: list[dict[str, str]] | None, image: dict[str, Any] | None, rid: str) -> dict[str, Any]:
    return {"id": rid, "image": image, "conversations": conv, "data_source": "test"}


def _conv(text: str = "<image>\nWhat is this?") -> list[dict[str, str]]:
    return [{"from": "human", "value": text}, {"from": "gpt", "value": "A picture."}]


def test_bad_rows_are_rejects_with_reasons_and_counts_add_up(tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "beside.jpg").write_bytes(DEMO_IMAGES[1].read_bytes())
    jpg = DEMO_IMAGES[0].read_bytes()
    rows = [
        _row(_conv(), {"bytes": jpg, "path": "ok.jpg"}, "ok"),
        _row(_conv(), {"bytes": b"not an image at all", "path": "x.jpg"}, "garbage"),
        _row(
            _conv(),
            {"bytes": (DEMO / "mllm_demo_data" / "1.mp4").read_bytes(), "path": "v.jpg"},
            "video-as-image",
        ),
        _row(_conv(), {"bytes": jpg[: len(jpg) // 3], "path": "cut.jpg"}, "truncated"),
        _row(None, None, "no-conversation"),
        _row(_conv("no placeholder"), {"bytes": jpg, "path": "p.jpg"}, "mismatch"),
        _row(_conv(), {"bytes": None, "path": "beside.jpg"}, "path-beside"),  # resolved like a JSON record's
        _row(_conv(), {"bytes": None, "path": "/etc/passwd"}, "outside"),
        _row(_conv(), {"bytes": None, "path": "../../../etc/hostname"}, "escape"),
        _row(_conv(), {"bytes": None, "path": "http://example.com/a.jpg"}, "url"),
        _row(_conv(), {"bytes": None, "path": None}, "no-bytes-no-path"),
    ]
    good = write(folder / "rows.parquet", rows, LLAVA_OV_SCHEMA, row_group_size=3)
    (folder / "text.parquet").write_text("this is not a parquet file\n")
    whole = pq.read_table(good)
    buf = pa.BufferOutputStream()
    pq.write_table(whole, buf)
    (folder / "cut.parquet").write_bytes(buf.getvalue().to_pybytes()[:-100])  # footer lost

    out, manifest = _pack(tmp_path, "out", config([folder / "*.parquet"]))
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r["reason"] for r in rejects if r["id"]}
    assert by_id == {
        "garbage": "corrupt_media",
        "video-as-image": "media_type_mismatch",
        "truncated": "corrupt_media",
        "no-conversation": "malformed_record",
        "mismatch": "placeholder_mismatch",
        "outside": "media_outside_root",
        "escape": "media_outside_root",
        "url": "remote_media",
        "no-bytes-no-path": "placeholder_mismatch",
    }
    whole_file = {r["source"]: r["reason"] for r in rejects if not r["id"]}
    assert whole_file == {"cut.parquet": "bad_parquet", "text.parquet": "bad_parquet"}
    assert sorted(s["id"] for s in unpack(out)) == ["ok", "path-beside"]
    c = manifest["counts"]
    assert c["input"] == c["packed"] + c["rejected"] == len(rows) + 2
    assert sum(c["rejected_by_reason"].values()) == c["rejected"]
    assert verify(out) == []


def test_a_row_group_that_does_not_decode_is_one_reject_per_row(tmp_path: Path) -> None:
    rows = llava_ov_rows(12, text_every=0)
    path = write(tmp_path / "d" / "ov.parquet", rows, LLAVA_OV_SCHEMA, row_group_size=4, compression="zstd")
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(1).column(2)  # conversations of rows 4..7: break its first page header
    raw = bytearray(path.read_bytes())
    start = col.data_page_offset
    raw[start : start + 32] = b"\xff" * 32
    path.write_bytes(bytes(raw))
    out, manifest = _pack(tmp_path, "out", config([path]))
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["index"], r["reason"]) for r in rejects] == [(i, "bad_parquet") for i in range(4, 8)]
    assert "row group 1" in rejects[0]["detail"]
    assert manifest["counts"]["packed"] == 8
    assert verify(out) == []


def test_embedded_media_meet_the_same_caps_as_files(tmp_path: Path) -> None:
    rows = llava_ov_rows(6, text_every=0)
    sizes = sorted({len(r["image"]["bytes"]) for r in rows})
    data = write(tmp_path / "d" / "ov.parquet", rows, LLAVA_OV_SCHEMA)
    cfg = config([data], maxImageBytes=sizes[1] - 1)
    out, manifest = _pack(tmp_path, "bytes-cap", cfg)
    reasons = Counter(json.loads(line)["reason"] for line in (out / "rejects.jsonl").read_text().splitlines())
    small = sum(len(r["image"]["bytes"]) < sizes[1] for r in rows)
    assert reasons == {"media_too_large": len(rows) - small} and manifest["counts"]["packed"] == small
    with pytest.raises(PackRefused, match="no sample was packed") as refused:  # every image over the cap
        _pack(tmp_path, "pixel-cap", config([data], maxImageSourcePixels=1000))
    assert refused.value.manifest["counts"]["rejected_by_reason"] == {"media_too_large": len(rows)}


def test_embedded_struct_in_typed_content_parts(tmp_path: Path) -> None:
    """`messages` with typed parts whose image part holds the struct (`{"type": "image", "image": {...}}`)."""
    part = pa.struct([("type", pa.string()), ("text", pa.string()), ("image", IMAGE)])
    schema = pa.schema(
        [("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(part))])))]
    )
    jpg = DEMO_IMAGES[2].read_bytes()
    rows = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": {"bytes": jpg, "path": None}},
                        {"type": "text", "text": "What is shown?"},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "A scene."}]},
            ]
        }
    ]
    data = write(tmp_path / "d" / "typed.parquet", rows, schema)
    out, manifest = _pack(tmp_path, "out", config([data]), workers=1)
    assert manifest["counts"]["packed"] == 1
    [sample] = unpack(out)
    assert [m["key"] for m in sample["media"]] == [hashlib.sha256(jpg).hexdigest()]


@pytest.mark.parametrize("name", ["data.PARQUET", "data.parquet"])
def test_format_is_told_by_the_extension(tmp_path: Path, name: str) -> None:
    data = write(tmp_path / name, hf_rows()[:2], HF_SCHEMA)
    assert sum(1 for r in iter_records([str(data)]) if r.record is not None) == 2


def test_a_footer_declaring_more_rows_than_bytes_is_one_reject(tmp_path: Path) -> None:
    """Rows cost no bytes when they are all null (run-length encoded): a tiny file could make every
    worker count millions of placeholders. More rows than bytes is refused as one reject."""
    conv = LLAVA_OV_SCHEMA.field("conversations").type
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"conversations": pa.nulls(200_000, conv)}), path)
    assert path.stat().st_size < 200_000
    raws = list(iter_records([str(path)]))
    assert [(r.index, r.reason) for r in raws] == [(0, "bad_parquet")]
    assert "declares 200000 rows" in (raws[0].error or "")


@pytest.mark.parametrize("storage", ["original", "resized"])
def test_embedded_videos_pack_like_the_json_video_demo(tmp_path: Path, storage: str) -> None:
    """The `datasets` `Video`-style struct: mp4 and AVI bytes measured from memory through the same
    allowed demuxers, and (resized) their sampled frames decoded from the kept bytes at materialize."""
    schema = pa.schema([("messages", HF_SCHEMA.field("messages").type), ("videos", pa.list_(IMAGE))])
    rows = [
        {
            "messages": r["messages"],
            "videos": [{"bytes": (DEMO / v).read_bytes(), "path": None} for v in r["videos"]],
        }
        for r in json.loads((DEMO / "mllm_video_demo.json").read_text())
    ]
    data = write(tmp_path / "v" / "videos.parquet", rows, schema, row_group_size=2)
    cfg, ref_cfg = (config([p]) for p in (data, DEMO / "mllm_video_demo.json"))
    for c in (cfg, ref_cfg):
        c["model"] |= {"videoMaxPixels": 50_000, "maxFrames": 8}
        c["packing"]["mediaStorage"] = storage
    out, manifest = _pack(tmp_path, "pq", cfg)
    ref, _ = _pack(tmp_path, "json", ref_cfg, workers=1)
    assert manifest["counts"]["packed"] == 3
    _same_tokens(out, ref)
    assert verify(out) == []
    if storage == "original":
        assert _media_hash_to_keys(out) == {
            hashlib.sha256((DEMO / v).read_bytes()).hexdigest()
            for r in json.loads((DEMO / "mllm_video_demo.json").read_text())
            for v in r["videos"]
        }


def test_columns_nested_deeper_than_records_may_be_are_one_reject(tmp_path: Path) -> None:
    """The JSON reader's nesting cap holds for Parquet schemas too (checked on the footer, before any row)."""
    t: pa.DataType = pa.int32()
    v: Any = 1
    for _ in range(70):
        t, v = pa.struct([("a", t)]), {"a": v}
    path = tmp_path / "deep.parquet"
    pq.write_table(pa.table({"conversations": pa.array([v, v], t)}), path)
    raws = list(iter_records([str(path)]))
    assert [(r.index, r.reason) for r in raws] == [(0, "bad_parquet")]
    assert "nest 70 levels" in (raws[0].error or "")
