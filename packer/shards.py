"""Writing and reading packed shards (see `shard_format` for the layout).

Writers go through `atomic_write`, so a crash leaves at most a `*.tmp-*` file
that no reader looks at, never a half shard under its final name. The reader is
what the trainer uses: it memory-maps the Arrow IPC files and checks their
sha256 against the manifest before handing out a single row.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from .shard_format import FORMAT_VERSION, MEDIA_SCHEMA, SEQUENCE_SCHEMA

MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"


class ShardFormatError(RuntimeError):
    """The folder is not a complete pack this version can read."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """A binary file that appears at `path` (fsync + rename) only when the block ends without error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same folder + fsync + rename."""
    with atomic_writer(path) as f:
        f.write(data)


def canonical_json(obj: Any) -> bytes:
    """Stable JSON bytes (sorted keys), so equal content gives equal files."""
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write(path, canonical_json(obj))


def table_bytes(table: pa.Table) -> bytes:
    """Serialize a table as an Arrow IPC file; deterministic for equal tables."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def write_table(path: Path, table: pa.Table) -> str:
    """Atomically write an Arrow IPC file and return its sha256.

    Streams to the temp file (the same bytes as `table_bytes`) instead of building the
    file in memory: a convert part can hold gigabytes.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            with pa.ipc.new_file(pa.PythonFile(f, mode="w"), table.schema) as writer:
                writer.write_table(table)
            f.flush()
            os.fsync(f.fileno())
        digest = sha256_file(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest


def read_table(path: Path) -> pa.Table:
    """Memory-map an Arrow IPC file: rows are sliced without copying or decoding."""
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def shard_paths(index: int) -> tuple[str, str]:
    return f"shards/{index:05d}.arrow", f"shards/{index:05d}.media.arrow"


def write_shard(out_dir: Path, index: int, rows: list[dict[str, Any]], media: list[dict[str, Any]]) -> dict[str, Any]:
    """Write one shard (sequences + its deduplicated media) and return its manifest entry."""
    seq_rel, media_rel = shard_paths(index)
    seq_table = pa.Table.from_pylist(rows, schema=SEQUENCE_SCHEMA)
    media_table = pa.Table.from_pylist(media, schema=MEDIA_SCHEMA)
    # Media first: a sequence file under its final name implies its media exist.
    media_sha = write_table(out_dir / media_rel, media_table)
    seq_sha = write_table(out_dir / seq_rel, seq_table)
    return {
        "index": index,
        "file": seq_rel,
        "sha256": seq_sha,
        "bytes": (out_dir / seq_rel).stat().st_size,
        "rows": seq_table.num_rows,
        "tokens": sum(len(r["input_ids"]) for r in rows),
        "media_file": media_rel,
        "media_sha256": media_sha,
        "media_bytes": (out_dir / media_rel).stat().st_size,
        "media_rows": media_table.num_rows,
    }


def read_manifest(path: Path) -> dict[str, Any]:
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        raise ShardFormatError(
            f"{path} has no {MANIFEST}: it is not a finished pack. Run `packtrain pack run` "
            "(or wait for the PackJob to succeed) and point at its output folder."
        )
    manifest = json.loads(mpath.read_text())
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ShardFormatError(
            f"{path}: pack format version {version!r}, this packtrain reads version {FORMAT_VERSION}. "
            "Re-pack the data with this packtrain version."
        )
    return manifest


class ShardReader:
    """Random access to the packed sequences of a finished pack."""

    def __init__(self, path: str | Path, verify_checksums: bool = True) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self._entries: list[dict[str, Any]] = self.manifest["shards"]
        if verify_checksums:
            self.verify()
        self._offsets = [0]
        for entry in self._entries:
            self._offsets.append(self._offsets[-1] + int(entry["rows"]))
        self._tables: dict[int, pa.Table] = {}
        self._media_tables: dict[int, pa.Table] = {}
        self._media_index: dict[str, tuple[int, int]] | None = None
        self._media_rows: dict[int, dict[str, int]] = {}

    def verify(self) -> None:
        """Check every shard file against the manifest's sha256; raise on the first mismatch."""
        for entry in self._entries:
            for rel, want in ((entry["file"], entry["sha256"]), (entry["media_file"], entry["media_sha256"])):
                p = self.path / rel
                if not p.is_file():
                    raise ShardFormatError(f"{p} is listed in the manifest but missing; re-run materialize")
                got = sha256_file(p)
                if got != want:
                    raise ShardFormatError(
                        f"{p}: sha256 {got[:12]}… does not match the manifest ({want[:12]}…); "
                        "the file is corrupt or was modified. Re-run `packtrain pack materialize`."
                    )

    @property
    def num_sequences(self) -> int:
        return self._offsets[-1]

    @property
    def num_shards(self) -> int:
        return len(self._entries)

    def __len__(self) -> int:
        return self.num_sequences

    def _table(self, shard: int) -> pa.Table:
        if shard not in self._tables:
            self._tables[shard] = read_table(self.path / self._entries[shard]["file"])
        return self._tables[shard]

    def _media_table(self, shard: int) -> pa.Table:
        if shard not in self._media_tables:
            self._media_tables[shard] = read_table(self.path / self._entries[shard]["media_file"])
        return self._media_tables[shard]

    def locate(self, i: int) -> tuple[int, int]:
        """Global sequence index → (shard, row)."""
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"sequence {i} out of range (pack has {self.num_sequences})")
        shard = bisect.bisect_right(self._offsets, i) - 1
        return shard, i - self._offsets[shard]

    def sequence(self, i: int) -> dict[str, Any]:
        shard, row = self.locate(i)
        out = self._table(shard).slice(row, 1).to_pylist()[0]
        out["shard"] = shard
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.num_sequences):
            yield self.sequence(i)

    def seq_lens(self) -> list[list[int]]:
        """Sub-sample lengths of every sequence (cheap: one column), for cost-balancing samplers."""
        out: list[list[int]] = []
        for shard in range(self.num_shards):
            out.extend(self._table(shard).column("seq_lens").to_pylist())
        return out

    def media(self, key: str, shard: int | None = None) -> dict[str, Any]:
        """A media blob by sha256 key (looked up in `shard` when given, else across the pack)."""
        if shard is not None:
            rows = self._media_rows.get(shard)
            if rows is None:  # built once per shard: the trainer asks for every media item of a sample
                keys = self._media_table(shard).column("key").to_pylist()
                rows = self._media_rows[shard] = {k: i for i, k in reversed(list(enumerate(keys)))}
            if key in rows:
                return self._media_table(shard).slice(rows[key], 1).to_pylist()[0]
        if self._media_index is None:
            self._media_index = {}
            for s in range(self.num_shards):
                for row, k in enumerate(self._media_table(s).column("key").to_pylist()):
                    self._media_index.setdefault(k, (s, row))
        if key not in self._media_index:
            raise KeyError(f"media {key} not in pack {self.path}")
        s, row = self._media_index[key]
        return self._media_table(s).slice(row, 1).to_pylist()[0]
