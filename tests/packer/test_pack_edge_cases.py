"""Edge cases of inputs, stages and the CLI: odd file names, hostile records, racing workers and
configs, bad config files, bounded termination messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.pack_runner import run_in_process
from support.paths import MODELS

from packtrain.core.config import PackConfig
from packtrain.core.pack.shards import MANIFEST
from packtrain.packer.cli import main as pack_main
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan
from packtrain.packer.stages.workdir import check_output_config
from packtrain.packer.tools import unpack, verify

QWEN2 = MODELS / "qwen2-vl"


def _chat(i: int, with_id: bool = False) -> dict:
    rec: dict = {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
    if with_id:
        rec["id"] = f"s{i}"
    return rec


def _write_jsonl(path: Path, records: list[dict], bom: bool = False, crlf: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nl = "\r\n" if crlf else "\n"
    text = ("\ufeff" if bom else "") + "".join(json.dumps(r) + nl for r in records)
    path.write_bytes(text.encode())
    return path


def _cfg(paths: list[Path], **packing: object) -> PackConfig:
    return PackConfig.model_validate(
        {
            "source": {"paths": [str(p) for p in paths]},
            "model": {"path": str(QWEN2)},
            "packing": {"maxLength": 256, "sequencesPerShard": 2, "maxRejectedFraction": 1.0, **packing},
        }
    )


_run = run_in_process


def test_same_file_name_in_two_folders_is_accounted_for(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a" / "train.jsonl", [_chat(i) for i in range(3)])
    b = _write_jsonl(tmp_path / "b" / "train.jsonl", [_chat(10 + i) for i in range(3)], bom=True, crlf=True)
    out = tmp_path / "out"
    manifest = _run(_cfg([a, b]), out, workers=2)
    assert manifest["counts"]["input"] == manifest["counts"]["packed"] == 6
    assert verify(out) == []
    samples = unpack(out)
    ids = [s["id"] for s in samples]
    assert len(set(ids)) == 6, ids
    # Input order: a's three samples, then b's.
    assert [s["source"] for s in samples] == ["a/train.jsonl"] * 3 + ["b/train.jsonl"] * 3
    assert [s["index"] for s in samples] == [0, 1, 2, 0, 1, 2]
    assert {i["name"] for i in manifest["inputs"]} == {"a/train.jsonl", "b/train.jsonl"}


def test_verify_handles_input_file_names_with_glob_characters(tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "data[1].jsonl", [_chat(i) for i in range(2)])
    out = tmp_path / "out"
    import glob

    manifest = _run(_cfg([Path(glob.escape(str(src)))]), out, workers=1)
    assert manifest["counts"]["packed"] == 2
    assert verify(out) == []


@pytest.mark.parametrize("cmd", ["inspect", "unpack"])
def test_inspect_and_unpack_of_a_non_pack_exit_2_with_a_message(
    tmp_path: Path, cmd: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pack_main([cmd, str(tmp_path / "missing")]) == 2
    assert "not a finished pack" in capsys.readouterr().err


def test_run_with_zero_workers_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [_chat(0)])
    rc = pack_main(
        [
            "run",
            "--input",
            str(src),
            "--model",
            str(QWEN2),
            "-o",
            str(tmp_path / "o"),
            "--workers",
            "0",
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "--workers" in capsys.readouterr().err


def test_hostile_records_become_rejects_not_crashes(tmp_path: Path) -> None:
    ok = _chat(0)
    lines = [
        json.dumps(
            {
                **_chat(1),
                "conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}],
                "images": ["a\u0000b.png"],
            }
        ),
        json.dumps(
            {
                "conversations": [
                    {"from": "human", "value": "lone \ud800 surrogate"},
                    {"from": "gpt", "value": "y"},
                ]
            }
        ),
        json.dumps({**ok, "id": "id-\udc80"}),
        json.dumps({**ok, "id": "paired \U0001f600 emoji"}),  # ensure_ascii: a valid surrogate pair
        '{"id": ' + "1" * 5000 + "}",  # int beyond Python's conversion limit
        '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}",  # nesting beyond the recursion limit
        json.dumps(
            {
                "conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}],
                "images": ["~no-such-user-4711/p.png"],
            }
        ),
        json.dumps(ok),
    ]
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(lines) + "\n")
    arr = tmp_path / "a.json"
    arr.write_text("[" + json.dumps({**ok, "id": "x\ud800"}) + "," + json.dumps(ok) + "]")
    out = tmp_path / "out"
    manifest = _run(_cfg([src, arr]), out, workers=1)
    c = manifest["counts"]
    assert c["input"] == 10 and c["packed"] == 3
    assert c["rejected_by_reason"] == {"bad_json": 2, "bad_utf8": 3, "missing_media": 2}
    assert verify(out) == []
    assert "paired \U0001f600 emoji" in {s["id"] for s in unpack(out)}


def test_convert_streams_rows_in_batches_with_identical_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Convert must not keep a worker's whole output as Python lists (~80 bytes a token, and one
    Arrow batch holds 2^31 tokens at most): rows go to record batches as they come."""
    from packtrain.core.pack.shards import read_table, sha256_file

    src = _write_jsonl(tmp_path / "d.jsonl", [_chat(i) for i in range(40)])
    single = tmp_path / "single"
    _run(_cfg([src]), single, workers=1)
    monkeypatch.setattr("packtrain.packer.stages.convert.PART_BATCH_TOKENS", 50)
    batched = tmp_path / "batched"
    summary = convert(_cfg([src]), batched, 0, 1)
    part = read_table(batched / "work" / "convert" / "part-00000-of-00001.arrow")
    assert part.column("input_ids").num_chunks > 5
    assert summary["converted"] == 40 and summary["tokens"] == pc_sum(part.column("length"))
    plan(_cfg([src]), batched)
    materialize(_cfg([src]), batched, 0, 1)
    for rel in ("manifest.json", "shards/00000.arrow", "shards/00001.arrow"):
        assert sha256_file(single / rel) == sha256_file(batched / rel)
    assert verify(batched) == []


def pc_sum(column: object) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(column).as_py())


def test_write_table_streams_the_same_bytes_as_table_bytes(tmp_path: Path) -> None:
    import hashlib

    import pyarrow as pa

    from packtrain.core.pack.shards import table_bytes, write_table

    table = pa.table({"a": pa.array([[1, 2], [3]], pa.list_(pa.int32())), "b": ["x", "y"]})
    digest = write_table(tmp_path / "t.arrow", table)
    assert (tmp_path / "t.arrow").read_bytes() == table_bytes(table)
    assert digest == hashlib.sha256(table_bytes(table)).hexdigest()
    assert [p.name for p in tmp_path.iterdir()] == ["t.arrow"]


def test_convert_workers_parse_only_their_own_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of N convert workers used to json-parse every record of every file (N times the work)."""
    from packtrain.packer.sources import records
    from packtrain.packer.sources.raw import SKIPPED

    lines = [json.dumps(_chat(i)) for i in range(12)]
    lines[5] = "not json"
    src = tmp_path / "d.jsonl"
    src.write_text("\ufeff" + "\n\n".join(lines) + "\n")
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([_chat(i) for i in range(5)]))
    parsed: list[str] = []
    real_loads = json.loads

    def counting_loads(text: str, *args: object, **kwargs: object) -> object:
        if isinstance(text, str) and ("q0" in text or text == "not json"):  # not the model's JSON files
            parsed.append(text)
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(records.json, "loads", counting_loads)
    out = tmp_path / "out"
    cfg = _cfg([src, arr])
    for i in range(3):
        convert(cfg, out, i, 3)
    # Watched: JSONL line 0 and the bad line, and the JSON array's item 0: each parsed once,
    # by its own worker (arrays are streamed item by item, not decoded whole per worker).
    assert sorted(parsed, key=len)[:2] == ["not json", lines[0]]
    assert len(parsed) == 2 + 1
    monkeypatch.setattr(records.json, "loads", real_loads)
    raws = list(records.iter_records(cfg.source.paths))
    some = list(records.iter_records(cfg.source.paths, select=lambda p: p % 3 == 1))
    assert [(r.source, r.index) for r in raws] == [(r.source, r.index) for r in some]
    assert all((r.reason == SKIPPED) == (p % 3 != 1) for p, r in enumerate(some))
    assert [r for p, r in enumerate(some) if p % 3 == 1] == [r for p, r in enumerate(raws) if p % 3 == 1]
    plan(cfg, out)
    for i in range(3):
        materialize(cfg, out, i, 3)
    m = json.loads((out / MANIFEST).read_text())
    assert m["counts"]["input"] == 17 and m["counts"]["rejected_by_reason"] == {"bad_json": 1}
    assert verify(out) == []


@pytest.mark.parametrize("storage", ["original", "resized"])
def test_media_changed_between_convert_and_materialize_is_refused(
    tmp_path: Path, storage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shard would hold bytes whose size no longer matches the counted vision tokens."""
    import media_factory as mf

    mf.image(tmp_path / "p.png", 64, 64)
    src = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            {
                "conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}],
                "images": ["p.png"],
            }
        ],
    )
    out = tmp_path / "out"
    flags = ["--input", str(src), "--model", str(QWEN2), "-o", str(out), "--media-storage", storage]
    assert pack_main(["convert", *flags]) == 0
    assert pack_main(["plan", *flags]) == 0
    mf.image(tmp_path / "p.png", 640, 320)  # replaced by another picture
    capsys.readouterr()
    assert pack_main(["materialize", *flags]) == 2
    assert "changed since the convert stage" in capsys.readouterr().err
    assert not (out / MANIFEST).exists()
    (tmp_path / "p.png").unlink()
    assert pack_main(["materialize", *flags]) == 2
    assert "not now" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("kind: PackJob\nmetadata: {name: x\n", "not valid YAML"),
        ("- a\n- b\n", "must be a mapping"),
        (
            "apiVersion: packtrain.dev/v1alpha1\nkind: SFTJob\nmetadata: {name: s}\n"
            "spec: {data: {path: /x}}\n",
            "expected a PackJob manifest",
        ),
    ],
)
def test_bad_config_files_exit_2_with_a_message(
    tmp_path: Path, text: str, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(text)
    assert pack_main(["plan", "-c", str(cfg), "-o", str(tmp_path / "out")]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("error", ["é" * 3000, "x\n" * 1500, "a" * 3000])
def test_termination_message_stays_valid_json_under_the_limit(error: str) -> None:
    from packtrain.core.report import LIMIT, compact

    text = compact({"stage": "convert", "error": error, "detail": {"k": list(range(2000))}})
    assert len(text.encode()) <= LIMIT
    doc = json.loads(text)
    assert doc["stage"] == "convert" and doc["error"] and error.startswith(doc["error"])


def test_config_guard_holds_when_two_configs_race_for_one_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker A checks, finds no config.json, then worker B (another config) creates it before A
    writes: A used to overwrite B's record and go on mixing two configurations in one pack."""
    src = _write_jsonl(tmp_path / "d.jsonl", [_chat(0)])
    out = tmp_path / "out"
    check_output_config(_cfg([src], maxLength=512), out, record=True)  # B got there first
    real_is_file = Path.is_file
    monkeypatch.setattr(
        Path, "is_file", lambda self: False if self.name == "config.json" else real_is_file(self)
    )
    with pytest.raises(ValueError, match="different configuration"):
        check_output_config(_cfg([src], maxLength=256), out, record=True)
    monkeypatch.undo()
    check_output_config(_cfg([src], maxLength=512), out, record=True)
    assert sorted(p.name for p in (out / "work").iterdir()) == ["config.json"]


def test_unknown_user_in_a_config_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [_chat(0)])
    out = str(tmp_path / "out")
    assert (
        pack_main(["convert", "--input", "~no-such-user-4711/d.jsonl", "--model", str(QWEN2), "-o", out]) == 2
    )
    assert "source.paths" in capsys.readouterr().err
    rc = pack_main(
        [
            "convert",
            "--input",
            str(src),
            "--model",
            str(QWEN2),
            "-o",
            out,
            "--media-root",
            "~no-such-user-4711/media",
        ]
    )
    assert rc == 2
    assert "source.mediaRoot" in capsys.readouterr().err


def test_a_config_error_does_not_lock_the_output_folder(tmp_path: Path) -> None:
    """A first try with a wrong model folder or input path used to record its config in the
    folder, so the corrected config was then refused as 'a different configuration'."""
    src = _write_jsonl(tmp_path / "d.jsonl", [_chat(0), _chat(1)])
    out = tmp_path / "out"
    flags = ["-o", str(out), "--max-length", "256"]
    assert pack_main(["convert", "--input", str(src), "--model", str(tmp_path / "no-model"), *flags]) == 2
    assert pack_main(["convert", "--input", str(tmp_path / "typo.jsonl"), "--model", str(QWEN2), *flags]) == 2
    assert (
        pack_main(["plan", "--input", str(src), "--model", str(QWEN2), "--max-length", "512", "-o", str(out)])
        == 2
    )
    for stage in ("convert", "plan", "materialize"):
        assert pack_main([stage, "--input", str(src), "--model", str(QWEN2), *flags]) == 0
    assert verify(out) == []
    # The folder now belongs to that config.
    assert pack_main(["convert", "--input", str(src), "--model", str(QWEN2), "-o", str(out)]) == 2


def test_rejects_stream_in_input_order_whatever_the_worker_count(tmp_path: Path) -> None:
    """Convert streams its rejects to disk and plan merges the workers' files (no list of every
    reject in memory); the result is the same file for any worker count, in input order."""
    lines = [json.dumps(_chat(i)) if i % 3 else f"bad {i}" for i in range(30)]
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(lines) + "\n")
    texts = []
    for workers in (1, 4):
        out = tmp_path / f"out{workers}"
        manifest = _run(_cfg([src]), out, workers)
        assert manifest["counts"]["rejected_by_reason"] == {"bad_json": 10}
        texts.append((out / "rejects.jsonl").read_text())
        assert verify(out) == []
    assert texts[0] == texts[1]
    assert [json.loads(t)["index"] for t in texts[0].splitlines()] == list(range(0, 30, 3))


def test_overlong_error_does_not_lock_the_output_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long = {"conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "y"}]}
    src = _write_jsonl(tmp_path / "d.jsonl", [_chat(0), long])
    out = str(tmp_path / "out")
    base = ["convert", "--input", str(src), "--model", str(QWEN2), "-o", out, "--max-length", "256"]
    assert pack_main([*base, "--overlong", "error"]) == 2
    assert "packing.overlong" in capsys.readouterr().err
    assert pack_main([*base, "--overlong", "drop"]) == 0


def test_media_lookup_by_shard_is_not_quadratic(tmp_path: Path) -> None:
    """`ShardReader.media(key, shard)` (the trainer's per-item call) used to convert the shard's
    whole key column to Python and scan it on every call: O(media^2) per shard and epoch."""
    import time

    from packtrain.core.pack.schema import FORMAT_VERSION
    from packtrain.core.pack.shards import ShardReader, write_shard

    n = 20_000
    keys = [f"{i:064x}" for i in range(n)]
    media = [
        {"key": k, "kind": "image", "encoding": "original", "data": k[-4:].encode(), "frames": []}
        for k in keys
    ]
    row = {
        "input_ids": [1],
        "labels": [1],
        "seq_lens": [1],
        "sample_ids": ["s"],
        "sources": ["d"],
        "indices": [0],
        "media": [],
    }
    entry = write_shard(tmp_path, 0, [row], media)
    (tmp_path / MANIFEST).write_text(json.dumps({"format_version": FORMAT_VERSION, "shards": [entry]}))
    reader = ShardReader(tmp_path)
    start = time.perf_counter()
    for k in reversed(keys):
        assert reader.media(k, shard=0)["data"] == k[-4:].encode()
    assert time.perf_counter() - start < 5  # was ~1 ms a call here: tens of seconds
    with pytest.raises(KeyError):
        reader.media("f" * 64, shard=0)
