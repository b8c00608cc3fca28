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
from support.paths import MODELS

from packtrain.core.config import PackConfig
from packtrain.core.errors import ConfigError, MediaError
from packtrain.packer.media.access import open_regular
from packtrain.packer.sources.records import expand_paths

# Measures the memory of processes it starts: they run with glibc's default malloc settings.
pytestmark = pytest.mark.measures_memory

QWEN2 = MODELS / "qwen2-vl"


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
            "packing": {"maxLength": 512, "maxRejectedFraction": 1.0},
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


# 5. A pack is read only inside its folder


@pytest.fixture(scope="module")
def small_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pack")
    mf.image(tmp / "data" / "a.png", 64, 48)
    dataset = _jsonl(tmp / "data" / "d.jsonl", [_chat("a.png"), _chat(), _chat()])
    manifest = run_in_process(_cfg([str(dataset)]), tmp / "out")
    _adds_up(manifest)
    return tmp / "out"


def _verify(pack: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from packtrain.packer.cli import main as pack_main

    rc = pack_main(["verify", str(pack)])
    return rc, capsys.readouterr().err


def _outside_copy(pack: Path, tmp_path: Path, key: str) -> tuple[Path, Path]:
    """A copy of the pack whose shard 0 `key` file lies in a folder beside it (the sha256 still matches)."""
    from pack_tamper import copy_pack

    bad = copy_pack(pack, tmp_path / "bad")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    manifest = json.loads((bad / "manifest.json").read_text())
    moved = elsewhere / "x.arrow"
    (bad / manifest["shards"][0][key]).rename(moved)
    return bad, moved


@pytest.mark.parametrize("key", ["file", "media_file"])
@pytest.mark.parametrize("spelling", ["relative", "absolute"])
def test_a_shard_named_outside_the_pack_is_refused_everywhere(
    key: str, spelling: str, small_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pack_tamper import edit_manifest

    from packtrain.core.errors import ShardFormatError
    from packtrain.core.pack.shards import ShardReader
    from packtrain.packer.export_energon import export_energon
    from packtrain.packer.tools import unpack

    bad, moved = _outside_copy(small_pack, tmp_path, key)
    name = "../elsewhere/x.arrow" if spelling == "relative" else str(moved)

    def point(m: dict) -> None:
        m["shards"][0][key] = name

    edit_manifest(bad, point)
    rc, err = _verify(bad, capsys)
    assert rc == 2 and "not a plain file name in the pack's shards/ folder" in err, err
    for read in (
        lambda: ShardReader(bad),
        lambda: ShardReader(bad, verify_checksums=False),
        lambda: export_energon(bad, tmp_path / "energon"),
        lambda: unpack(bad),
    ):
        with pytest.raises(ShardFormatError, match="not a plain file name"):
            read()


def test_a_device_or_proc_file_in_a_shards_place_is_refused_at_once(
    small_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import time

    from pack_tamper import copy_pack

    for target in ("/proc/self/pagemap", "/dev/zero"):
        bad = copy_pack(small_pack, tmp_path / Path(target).name)
        shard = bad / json.loads((bad / "manifest.json").read_text())["shards"][0]["file"]
        shard.unlink()
        shard.symlink_to(target)
        start = time.monotonic()
        rc, err = _verify(bad, capsys)
        assert rc == 2 and "not a regular file" in err, err
        assert time.monotonic() - start < 10


def test_a_sparse_file_of_the_wrong_size_is_not_hashed(
    small_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import time

    from pack_tamper import copy_pack

    bad = copy_pack(small_pack, tmp_path / "bad")
    shard = bad / json.loads((bad / "manifest.json").read_text())["shards"][0]["media_file"]
    with shard.open("r+b") as f:
        f.truncate(40 << 30)  # sparse: no blocks written
    start = time.monotonic()
    rc, err = _verify(bad, capsys)
    assert rc == 2 and f"has {40 << 30} bytes, the manifest records" in err, err
    assert time.monotonic() - start < 10
    assert "sha256" not in err.split("records")[0]  # no digest of what it found


# 6. The trainer refuses what `verify` refuses, before allocating


def _image_row(pack: Path) -> tuple[int, int]:
    from pack_tamper import first_row

    return first_row(pack, lambda row: bool(row["media"]))


def _dataset(pack: Path):  # noqa: ANN202 - the trainer's PackedDataset (torch imported lazily)
    from packtrain.core.model_spec import model_spec
    from packtrain.trainer.data.packed import PackedDataset

    return PackedDataset(pack, model_spec(QWEN2), vocab_size=151936)


def _seq(pack: Path, shard: int, row: int) -> int:
    shards = json.loads((pack / "manifest.json").read_text())["shards"]
    return sum(int(e["rows"]) for e in shards[:shard]) + row


def _lying_grid(row: dict) -> None:
    ref = row["media"][0]
    ref.update(height=28 * 4000, width=28 * 4000, grid_h=4000, grid_w=4000)


def _overlong(row: dict) -> None:
    extra = 600
    row["input_ids"] = row["input_ids"] + [198] * extra
    row["labels"] = row["labels"] + [198] * extra
    row["seq_lens"] = [*row["seq_lens"][:-1], row["seq_lens"][-1] + extra]


@pytest.mark.parametrize(
    ("edit", "verify_says", "trainer_says"),
    [
        (_lying_grid, "outside the pack's pixel cap", "outside the pack's pixel cap"),
        (_overlong, "tokens > max_length 512", "over the pack's max_length 512"),
    ],
    ids=["grid-lies-about-size", "row-over-max-length"],
)
def test_rows_verify_refuses_the_trainer_refuses_before_allocating(
    edit, verify_says: str, trainer_says: str, small_pack: Path, tmp_path: Path, capsys
) -> None:
    import resource

    from pack_tamper import copy_pack, tamper_row

    from packtrain.core.errors import PackIntegrityError

    bad = copy_pack(small_pack, tmp_path / "bad")
    shard, row = _image_row(bad)
    shard_file = tamper_row(bad, shard, row, edit)
    rc, err = _verify(bad, capsys)
    assert rc == 2 and f"{shard_file} row {row}: " in err and verify_says in err, err
    ds = _dataset(bad)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(PackIntegrityError, match=rf"{shard_file} row {row}: .*{trainer_says}"):
        ds._decoded_row(_seq(bad, shard, row), {})
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 << 10  # KiB: no GB buffers


def _media_blobs(pack: Path, shard: int, edit) -> None:  # noqa: ANN001
    """Apply `edit` to each blob of one media table and re-sign it, as an attacker would."""
    import pyarrow as pa

    from packtrain.core.pack.schema import MEDIA_SCHEMA
    from packtrain.core.pack.shards import canonical_json, read_table, write_table

    manifest = json.loads((pack / "manifest.json").read_text())
    entry = manifest["shards"][shard]
    path = pack / entry["media_file"]
    blobs = read_table(path).to_pylist()
    for blob in blobs:
        edit(blob)
    path.unlink()
    entry["media_sha256"] = write_table(path, pa.Table.from_pylist(blobs, schema=MEDIA_SCHEMA))
    entry["media_bytes"] = path.stat().st_size
    (pack / "manifest.json").write_bytes(canonical_json(manifest))


def _as_tga(renamed: dict[str, str]):  # noqa: ANN202
    """An edit re-encoding image blobs as TGA (re-keyed where the key is their sha256; `renamed` gets
    old key -> new key, for the rows)."""
    import hashlib
    import io

    from PIL import Image

    def edit(blob: dict) -> None:
        if blob["kind"] != "image":
            return
        with Image.open(io.BytesIO(blob["data"])) as img:
            out = io.BytesIO()
            img.save(out, format="TGA")
        blob["data"] = out.getvalue()
        if blob["encoding"] == "original":
            renamed[blob["key"]] = blob["key"] = hashlib.sha256(blob["data"]).hexdigest()

    return edit


def test_an_image_blob_in_a_format_outside_the_allow_list_neither_verifies_nor_trains(
    small_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pack_tamper import copy_pack, tamper_row

    from packtrain.core.errors import PackIntegrityError

    bad = copy_pack(small_pack, tmp_path / "bad")
    shard, row = _image_row(bad)
    renamed: dict[str, str] = {}
    _media_blobs(bad, shard, _as_tga(renamed))

    def rekey(r: dict) -> None:
        for ref in r["media"]:
            ref["key"] = renamed.get(ref["key"], ref["key"])

    tamper_row(bad, shard, row, rekey)
    rc, err = _verify(bad, capsys)
    assert rc == 2 and ("resized image is None" in err or "not an image of an allowed format" in err), err
    with pytest.raises(PackIntegrityError, match=rf"row {row}: media .* does not decode"):
        _dataset(bad)._decoded_row(_seq(bad, shard, row), {})


# 4. Cost bounded before the expensive step


def exif_bomb(rationals: int, orientation: int | None = None) -> bytes:
    """A big-endian TIFF/EXIF block holding `rationals` values: in the Orientation tag itself (what
    reading the orientation unpacks), or, given an `orientation`, in an XResolution tag beside it."""
    import struct

    header = b"MM\x00\x2a" + struct.pack(">I", 8)
    data_offset = 8 + 2 + 2 * 12 + 4
    if orientation is None:
        entries = struct.pack(">HHII", 0x0112, 5, rationals, data_offset)
        entries += struct.pack(">HHIHH", 0x0128, 3, 1, 2, 0)  # ResolutionUnit
    else:
        entries = struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0)
        entries += struct.pack(">HHII", 0x011A, 5, rationals, data_offset)
    ifd = struct.pack(">H", 2) + entries + struct.pack(">I", 0)
    return header + ifd + struct.pack(">II", 6, 1) * rationals


def _png_with_exif(path: Path, exif: bytes) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 48), (1, 2, 3)).save(path, exif=exif)
    return path


def test_an_exif_bomb_is_rejected_before_its_exif_is_parsed(tmp_path: Path) -> None:
    import time

    from packtrain.core.vision import MAX_IMAGE_METADATA_BYTES, probe_image

    small = _png_with_exif(tmp_path / "small.png", exif_bomb(4, orientation=6))
    assert probe_image(small.read_bytes()).width == 48  # orientation 6 still read: width and height swap
    bomb = _png_with_exif(tmp_path / "bomb.png", exif_bomb(MAX_IMAGE_METADATA_BYTES // 8 + 1))
    start = time.monotonic()
    with pytest.raises(MediaError, match="metadata .* not parsed") as exc:
        probe_image(bomb.read_bytes())
    assert exc.value.reason == "media_too_large"
    assert time.monotonic() - start < 2
    data = tmp_path / "data"
    (data / "bomb.png").parent.mkdir(parents=True, exist_ok=True)
    bomb.rename(data / "bomb.png")
    mf.image(data / "ok.png", 64, 48)
    dataset = _jsonl(data / "d.jsonl", [_chat("bomb.png"), _chat("ok.png")])
    manifest = run_in_process(_cfg([str(dataset)]), tmp_path / "out")
    _adds_up(manifest)
    assert manifest["counts"]["rejected_by_reason"] == {"media_too_large": 1}


def test_the_trainer_never_parses_an_exif_bomb_in_a_pack(tmp_path: Path) -> None:
    from packtrain.core.pixels import decode_rgb
    from packtrain.core.vision import MAX_IMAGE_METADATA_BYTES

    bomb = _png_with_exif(tmp_path / "bomb.png", exif_bomb(MAX_IMAGE_METADATA_BYTES // 8 + 1))
    with pytest.raises(MediaError, match="EXIF block of .* not parsed|metadata"):
        decode_rgb(bomb.read_bytes(), "white")


def _parquet(path: Path, rows: int, value_bytes: int, dictionary: bool) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = json.dumps(_chat()["messages"])
    big = "x" * value_bytes
    if dictionary:  # one value stored once, referenced by every row
        column = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([big]))
    else:
        column = pa.array([big] * rows)
    table = pa.table({"messages": pa.array([text] * rows), "pad": column})
    pq.write_table(table, path, compression="zstd", row_group_size=rows, use_dictionary=dictionary)
    return path


@pytest.mark.parametrize("dictionary", [False, True], ids=["footer-declares", "dictionary-expands"])
def test_parquet_rows_over_the_decoded_budget_are_rejected_before_decoding(
    dictionary: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from packtrain.packer.sources import parquet
    from packtrain.packer.sources.parquet import read_parquet

    monkeypatch.setattr(parquet, "BATCH_BYTES", 4 << 20)
    monkeypatch.setattr(parquet, "MAX_ROW_BYTES", 512 << 10)
    path = _parquet(tmp_path / "bomb.parquet", 64, 1 << 20, dictionary)
    assert path.stat().st_size < 64 << 10
    records = list(read_parquet(path, lambda: True))
    assert [r.index for r in records] == list(range(64))
    assert {r.reason for r in records} == {"record_too_large"}
    small = list(read_parquet(_parquet(tmp_path / "ok.parquet", 64, 1 << 10, dictionary), lambda: True))
    assert len(small) == 64 and all(r.error is None for r in small)


def test_parquet_batches_shrink_to_the_decoded_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from packtrain.packer.sources import parquet
    from packtrain.packer.sources.parquet import read_parquet

    sizes: list[int] = []
    real = parquet._budgeted

    def spy(batch, path, start):  # noqa: ANN001, ANN202
        sizes.append(batch.num_rows)
        return real(batch, path, start)

    monkeypatch.setattr(parquet, "BATCH_BYTES", 4 << 20)
    monkeypatch.setattr(parquet, "_budgeted", spy)
    path = _parquet(tmp_path / "big.parquet", 64, 1 << 20, dictionary=False)
    records = list(read_parquet(path, lambda: True))
    assert len(records) == 64 and all(r.error is None for r in records)
    assert max(sizes) <= 4 and sum(sizes) == 64


# mp4 index costs: boxes rewritten from a real clip, so only the declared counts differ.
_BOX_PARENTS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts"}


def _boxes(data: bytes) -> list[list]:
    """[type, payload bytes or child list] for each box; containers on the stbl/edts path are parsed."""
    import struct

    out, pos = [], 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        assert size >= 8, "the generated clips use 32-bit box sizes"
        payload = data[pos + 8 : pos + size]
        out.append([kind, _boxes(payload) if kind in _BOX_PARENTS else payload])
        pos += size
    return out


def _unbox(boxes: list[list]) -> bytes:
    import struct

    parts = []
    for kind, body in boxes:
        payload = _unbox(body) if isinstance(body, list) else body
        parts.append(struct.pack(">I4s", 8 + len(payload), kind) + payload)
    return b"".join(parts)


def _find(boxes: list[list], *path: bytes) -> list:
    node = next(b for b in boxes if b[0] == path[0])
    return node if len(path) == 1 else _find(node[1], *path[1:])


def _clip(tmp_path: Path) -> list[list]:
    clip = mf.video(tmp_path / "clip.mp4", frames=8)
    boxes = _boxes(clip.read_bytes())
    assert [b[0] for b in boxes].index(b"mdat") < [b[0] for b in boxes].index(b"moov")  # no offsets move
    return boxes


def sample_count_bomb(tmp_path: Path, samples: int = 85_000_000) -> bytes:
    """The clip with a constant-size stsz declaring `samples` samples: about 1.4 KB."""
    import struct

    boxes = _clip(tmp_path)
    _find(boxes, b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stsz")[1] = struct.pack(">III", 0, 1, samples)
    return _unbox(boxes)


def edit_list(tmp_path: Path, entries: int) -> bytes:
    """The clip with an edit list of `entries` one-tick edits (12 bytes each: 100,000 make 1.2 MB)."""
    import struct

    boxes = _clip(tmp_path)
    trak = _find(boxes, b"moov", b"trak")[1]
    elst = struct.pack(">II", 0, entries) + struct.pack(">IiHH", 1, 0, 1, 0) * entries
    trak[:] = [b for b in trak if b[0] != b"edts"]  # the encoder's own (one edit: its start delay)
    trak.insert(1, [b"edts", [[b"elst", elst]]])  # after tkhd
    return _unbox(boxes)


def test_an_mp4_declaring_85m_samples_is_refused_before_ffmpeg_opens_it(tmp_path: Path) -> None:
    import io
    import time

    from packtrain.core.mp4_index import MAX_SAMPLES
    from packtrain.core.vision import probe_video

    bomb = sample_count_bomb(tmp_path)
    assert len(bomb) < 4096
    start = time.monotonic()
    with pytest.raises(MediaError, match=f"declare 85000000 samples or more \\(stsz\\), over {MAX_SAMPLES}"):
        probe_video(io.BytesIO(bomb), format="mp4")
    assert time.monotonic() - start < 2  # FFmpeg's open took 3.1 GiB on this file
    data = tmp_path / "data"
    data.mkdir()
    (data / "bomb.mp4").write_bytes(bomb)
    mf.video(data / "ok.mp4", frames=8)
    turns = [{"role": "user", "content": "<video>Describe."}, {"role": "assistant", "content": "Gray."}]
    records = [{"messages": turns, "videos": [name]} for name in ("bomb.mp4", "ok.mp4")]
    manifest = run_in_process(_cfg([str(_jsonl(data / "d.jsonl", records))]), tmp_path / "out")
    _adds_up(manifest)
    assert manifest["counts"]["rejected_by_reason"] == {"media_too_large": 1}
    assert "over 1000000; not opened" in _rejects(tmp_path / "out")[0]["detail"]


def test_materialize_and_the_trainer_refuse_a_sample_count_bomb(tmp_path: Path) -> None:
    import io

    from packtrain.packer.media.store import check_frames
    from packtrain.trainer.data.media import decode_video_frames

    bomb = sample_count_bomb(tmp_path)
    with pytest.raises(MediaError) as exc:
        check_frames(io.BytesIO(bomb), [0, 1], "bomb.mp4")
    assert exc.value.reason == "media_too_large"
    with pytest.raises(MediaError) as exc:
        decode_video_frames(bomb, [0, 1])
    assert exc.value.reason == "media_too_large"


def test_an_mp4_with_100k_edits_is_refused_and_a_few_edits_are_not(tmp_path: Path) -> None:
    import io
    import time

    from packtrain.core.mp4_index import MAX_EDITS, check_mp4_index
    from packtrain.core.vision import probe_video

    attack = edit_list(tmp_path, 100_000)
    assert len(attack) > 1_200_000
    start = time.monotonic()
    with pytest.raises(
        MediaError, match=f"edit lists declare 100000 entries or more, over {MAX_EDITS}"
    ) as exc:
        probe_video(io.BytesIO(attack), format="mp4")
    assert exc.value.reason == "media_too_large"
    assert time.monotonic() - start < 2  # FFmpeg took 496 s and accepted it
    check_mp4_index(edit_list(tmp_path, MAX_EDITS))  # the cap itself is allowed
    with pytest.raises(MediaError, match="edit lists"):
        check_mp4_index(edit_list(tmp_path, MAX_EDITS + 1))
    assert probe_video(io.BytesIO(edit_list(tmp_path, 1)), format="mp4").total_frames == 8


def test_the_mp4_reader_accepts_real_clips_and_refuses_boxes_past_their_parent(tmp_path: Path) -> None:
    import io
    import struct

    from support.paths import DEMO

    from packtrain.core.mp4_index import check_mp4_index

    demos = sorted((DEMO / "mllm_demo_data").glob("*.mp4"))
    assert demos
    for path in demos:
        with path.open("rb") as f:
            f.seek(5)
            check_mp4_index(f)
            assert f.tell() == 5  # left where it was
        check_mp4_index(path.read_bytes())
    clip = _unbox(_clip(tmp_path))
    check_mp4_index(clip)
    moov = clip.index(b"moov") - 4
    with pytest.raises(MediaError, match="past the end of the file") as exc:
        check_mp4_index(clip[: moov + 100])  # a cut-off movie header
    assert exc.value.reason == "corrupt_media"
    stsz = clip.index(b"stsz") - 4
    (size,) = struct.unpack(">I", clip[stsz : stsz + 4])
    grown = clip[:stsz] + struct.pack(">I", size + 4096) + clip[stsz + 4 :]
    with pytest.raises(MediaError, match="past the end of its parent b'stbl'"):
        check_mp4_index(grown)
    with pytest.raises(MediaError, match="less than its header"):
        check_mp4_index(clip[:stsz] + struct.pack(">I", 4) + clip[stsz + 4 :])
    with pytest.raises(MediaError):
        check_mp4_index(io.BytesIO(sample_count_bomb(tmp_path)))
