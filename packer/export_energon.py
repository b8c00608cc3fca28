"""Export a pack as a Megatron-Energon dataset, for Megatron-based trainers that read Energon.

Layout written (what `energon prepare` would leave, without its optional `index.sqlite`, which only
key lookups use; the loader reads the `.tar.idx` files)::

    OUT/shards/00000.tar ...      WebDataset tar shards, one per pack shard
    OUT/shards/00000.tar.idx      byte offset of every sample in its tar, then the end offset
    OUT/.nv-meta/dataset.yaml     CrudeWebdataset; subflavors name the layout
    OUT/.nv-meta/split.yaml       every shard in the "train" split
    OUT/.nv-meta/.info.json       samples per shard

One WebDataset sample per packed sequence (default) or per original sample (`samples=True`).
Its parts: `json` (ids, lengths, sources, media metadata: `grid_t/h/w`, `frames`, resized
size, which part holds the bytes), `input_ids.npy` and `labels.npy` (int32; labels -100 where
not trained) and the media, `media.N.EXT` (the file bytes the pack stores; a video stored
resized is its sampled frames, `media.N.fT.png`). Crude samples are meant to be cooked by the
trainer's task encoder. Pure Python: writing needs neither torch nor Energon.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from packtrain.core.errors import ConfigError
from packtrain.core.pack.shards import ShardReader, atomic_write, temp_path
from packtrain.core.pixels import SNIFF_BYTES, sniff_container

META = ".nv-meta"
LAYOUTS = ("packed", "samples")
_IMAGE_EXT = (
    (b"\xff\xd8\xff", "jpg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF8", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)
_VIDEO_EXT = {"mp4": "mp4", "matroska": "mkv", "avi": "avi", "ogg": "ogv", "flv": "flv", "mpegts": "ts"}


def media_extension(kind: str, data: bytes) -> str:
    """The file extension a WebDataset decoder dispatches on, from the bytes (never from a dataset's name)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    for magic, ext in _IMAGE_EXT:
        if data.startswith(magic):
            return ext
    if kind == "video":
        demuxer = sniff_container(data[:SNIFF_BYTES])
        if demuxer is not None:
            return _VIDEO_EXT.get(demuxer, "bin")
    return "bin"


def _npy(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, values.astype("<i4", copy=False), allow_pickle=False)
    return buf.getvalue()


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0  # fixed metadata: the same pack, the same bytes
    tar.addfile(info, io.BytesIO(data))


class _Media:
    """A pack shard's media blobs by key (read once per shard)."""

    def __init__(self, table: pa.Table) -> None:
        self._rows = {k: i for i, k in reversed(list(enumerate(table.column("key").to_pylist())))}
        self._table = table

    def files(self, key: str, kind: str, index: int) -> list[tuple[str, bytes]]:
        blob = self._table.slice(self._rows[key], 1).to_pylist()[0]
        if blob["frames"]:  # a video stored as its resized sampled frames
            return [(f"media.{index}.f{t}.png", frame) for t, frame in enumerate(blob["frames"])]
        return [(f"media.{index}.{media_extension(kind, blob['data'])}", blob["data"])]


def _sample_parts(
    key: str,
    meta: dict[str, Any],
    ids: np.ndarray,
    labels: np.ndarray,
    media: list[dict[str, Any]],
    store: _Media,
) -> Iterator[tuple[str, bytes]]:
    """The tar members of one WebDataset sample; media deduplicated within it."""
    parts: dict[str, list[str]] = {}
    files: list[tuple[str, bytes]] = []
    refs = []
    for m in media:
        if m["key"] not in parts:
            got = store.files(m["key"], m["kind"], len(parts))
            parts[m["key"]] = [name for name, _ in got]
            files.extend(got)
        ref = m | {"parts": parts[m["key"]]}
        if meta["layout"] == "samples":
            del ref["sample"]  # always 0: the sample is the whole WebDataset sample
        refs.append(ref)
    body = meta | {"media": refs}
    yield f"{key}.json", json.dumps(body, sort_keys=True, ensure_ascii=False).encode()
    yield f"{key}.input_ids.npy", _npy(ids)
    yield f"{key}.labels.npy", _npy(labels)
    for name, data in files:
        yield f"{key}.{name}", data


def _rows(table: pa.Table) -> Iterator[tuple[dict[str, Any], np.ndarray, np.ndarray]]:
    """Each sequence's metadata and its token ids and labels as int32 arrays (no Python int lists)."""
    cols = {c: table.column(c).combine_chunks() for c in ("input_ids", "labels")}
    flat = {c: a.flatten().to_numpy() for c, a in cols.items()}
    offsets = {c: a.offsets.to_numpy() - a.offsets[0].as_py() for c, a in cols.items()}
    meta = table.select(["seq_lens", "sample_ids", "sources", "indices", "media"]).to_pylist()
    for i, row in enumerate(meta):
        ids = flat["input_ids"][offsets["input_ids"][i] : offsets["input_ids"][i + 1]]
        labels = flat["labels"][offsets["labels"][i] : offsets["labels"][i + 1]]
        yield row, ids, labels


def _write_shard(tar_path: Path, table: pa.Table, store: _Media, shard: int, layout: str) -> int:
    """One tar and its `.tar.idx`; returns the number of samples."""
    offsets: list[int] = []
    tmp = temp_path(tar_path)
    try:
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for row_index, (row, ids, labels) in enumerate(_rows(table)):
                for key, meta, lo, hi, media in _split(row, shard, row_index, layout):
                    offsets.append(tar.offset)
                    for name, data in _sample_parts(key, meta, ids[lo:hi], labels[lo:hi], media, store):
                        _member(tar, name, data)
            offsets.append(tar.offset)
        tmp.replace(tar_path)
    finally:
        tmp.unlink(missing_ok=True)
    atomic_write(tar_path.with_suffix(".tar.idx"), np.asarray(offsets, "<u8").tobytes())
    return len(offsets) - 1


def _split(
    row: dict[str, Any], shard: int, row_index: int, layout: str
) -> Iterator[tuple[str, dict[str, Any], int, int, list[dict[str, Any]]]]:
    """(key, json metadata, token range, media) of each sample a packed row becomes."""
    lens = row["seq_lens"]
    base = f"s{shard:05d}r{row_index:05d}"
    if layout == "packed":
        meta = {
            "layout": "packed",
            "seq_lens": lens,
            "sample_ids": row["sample_ids"],
            "sources": row["sources"],
            "indices": row["indices"],
        }
        yield base, meta, 0, sum(lens), row["media"]
        return
    start = 0
    for sub, n in enumerate(lens):
        meta = {
            "layout": "samples",
            "sample_id": row["sample_ids"][sub],
            "source": row["sources"][sub],
            "index": row["indices"][sub],
            "length": n,
        }
        yield f"{base}n{sub:03d}", meta, start, start + n, [m for m in row["media"] if m["sample"] == sub]
        start += n


def _yaml(obj: Any) -> bytes:
    import yaml

    return yaml.safe_dump(obj, sort_keys=False).encode()


def export_energon(pack: Path, out: Path, layout: str = "packed") -> dict[str, Any]:
    """Write `pack` as an Energon dataset in `out` (a new or empty folder); returns a summary."""
    if layout not in LAYOUTS:
        raise ConfigError(f"export layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    reader = ShardReader(pack)  # checks every shard's sha256 against the manifest first
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder; export into a new folder")
    if out.resolve() == pack.resolve() or pack.resolve() in out.resolve().parents:
        raise ConfigError(f"{out} is inside the pack {pack}; export into a folder outside it")
    (out / "shards").mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    try:
        for s in range(reader.num_shards):
            name = f"shards/{s:05d}.tar"
            counts[name] = _write_shard(out / name, reader.table(s), _Media(reader.media_table(s)), s, layout)
        meta = out / META
        meta.mkdir(exist_ok=True)
        atomic_write(meta / ".info.json", json.dumps({"shard_counts": counts}, indent=2).encode())
        atomic_write(meta / "split.yaml", _yaml({"split_parts": {"train": list(counts)}}))
        # Written last: its presence says the dataset is whole.
        atomic_write(
            meta / "dataset.yaml",
            _yaml(
                {
                    "__module__": "megatron.energon",
                    "__class__": "CrudeWebdataset",
                    "subflavors": {
                        "packtrain_layout": layout,
                        "max_length": reader.manifest["max_length"],
                        "family": reader.manifest.get("family"),
                    },
                }
            ),
        )
    except BaseException:
        shutil.rmtree(out / "shards", ignore_errors=True)
        shutil.rmtree(out / META, ignore_errors=True)
        raise
    return {
        "output": str(out),
        "layout": layout,
        "shards": len(counts),
        "samples": sum(counts.values()),
        "sequences": reader.num_sequences,
        "packed": reader.manifest["counts"]["packed"],
    }
