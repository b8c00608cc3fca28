"""Writing and reading packed shards (see `shard_format` for the layout).

Writers go through `atomic_write`, so a crash leaves at most a `.NAME.tmp-*` file
that no reader looks at, never a half shard under its final name; the temp name
records the writer's process id and host, so the next run can tell a dead
writer's leftovers from a live one's (`remove_stale_temps`). Files are created
0666 less the umask, as `open()` would: the trainer may run as another user on
the shared volume. The reader is what the trainer uses: it memory-maps the
Arrow IPC files and checks their sha256 against the manifest before handing out
a single row.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc

from packtrain.core import untrusted
from packtrain.core.errors import ShardFormatError
from packtrain.core.pack.schema import FORMAT_VERSION, MEDIA_SCHEMA, SEQUENCE_SCHEMA
from packtrain.core.untrusted import JsonLimits

MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"


# A writer that does not own its file's slice publishes in one go (a manifest, a config claim):
# its temp file lives for milliseconds, so one this old has lost its writer.
SHORT_WRITE_STALE_S = 600
_TEMP = re.compile(r"^\.(?P<final>.+)\.(?:tmp|new)-(?P<writer>[^@]*(?:@[A-Za-z0-9.-]+)?)$")
_WRITER = re.compile(r"^[0-9a-f]+-(?P<pid>\d+)@(?P<host>[A-Za-z0-9.-]+)$")
SHARD_KEYS = ("file", "sha256", "rows", "media_file", "media_sha256")


def temp_path(path: Path, kind: str = "tmp") -> Path:
    """`.NAME.KIND-RANDOM-PID@HOST` next to `path`: hidden, unique, and naming its writer."""
    return path.with_name(f".{path.name}.{kind}-{secrets.token_hex(4)}-{os.getpid()}@{socket.gethostname()}")


def create_new(path: Path) -> int:
    """A new file's descriptor, mode 0666 less the umask (`mkstemp` would make it 0600)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)


def _writer_dead(writer: str) -> bool:
    """True only when the temp file's writer is provably gone: a process of this host that no longer runs."""
    m = _WRITER.match(writer)
    if m is None or m["host"] != socket.gethostname():
        return False
    pid = int(m["pid"])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, as another user
        return False
    return False


def remove_stale_temps(
    folder: Path, owned: Callable[[str], bool], short_write: Callable[[str], bool] = lambda _: False
) -> list[Path]:
    """Remove the temp files in `folder` that no live writer can still publish; returns them.

    A temp file for final name N goes when (1) N is `owned` by the caller (its slice has
    one writer: this process, so any other writer of N is a killed run), or (2) its
    writer ran on this host and its process is gone, or (3) N is a `short_write` file
    (written in one go) and the temp is older than SHORT_WRITE_STALE_S. A temp of
    another worker's slice written on another host stays: that worker may be running.
    """
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    now = time.time()
    for entry in os.scandir(folder):
        m = _TEMP.match(entry.name)
        if m is None or not entry.is_file(follow_symlinks=False):
            continue
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > SHORT_WRITE_STALE_S
        except FileNotFoundError:
            continue
        if owned(m["final"]) or _writer_dead(m["writer"]) or (short_write(m["final"]) and old):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


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
    tmp = temp_path(path)
    fd = create_new(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
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
    tmp = temp_path(path)
    fd = create_new(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            with pa.ipc.new_file(pa.PythonFile(f, mode="w"), table.schema) as writer:
                writer.write_table(table)
            f.flush()
            os.fsync(f.fileno())
        digest = sha256_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest


def read_table(path: Path) -> pa.Table:
    """Memory-map an Arrow IPC file: rows are sliced without copying or decoding."""
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def shard_paths(index: int) -> tuple[str, str]:
    return f"shards/{index:05d}.arrow", f"shards/{index:05d}.media.arrow"


def write_shard(
    out_dir: Path, index: int, rows: list[dict[str, Any]] | pa.Table, media: list[dict[str, Any]]
) -> dict[str, Any]:
    """Write one shard (sequences, as rows or a SEQUENCE_SCHEMA table, + its deduplicated media) and
    return its manifest entry."""
    seq_rel, media_rel = shard_paths(index)
    seq_table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=SEQUENCE_SCHEMA)
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
        "tokens": int(pc.sum(pc.list_value_length(seq_table.column("input_ids"))).as_py() or 0),
        "media_file": media_rel,
        "media_sha256": media_sha,
        "media_bytes": (out_dir / media_rel).stat().st_size,
        "media_rows": media_table.num_rows,
    }


MANIFEST_LIMITS = JsonLimits(max_bytes=64 << 20, max_depth=32, max_values=4_000_000)
"""What a manifest may cost before it is parsed. A shard's entry is some 380 bytes and 11 values, a
dataset file's under 5,000 bytes and 6, the rest a few kilobytes, nested 6 levels deep: 64 MiB and 4
million values hold over 150,000 shards (150 million sequences at the default 1,024 per shard) and
thousands of dataset files, and parse in under 400 MiB however the bytes are spent."""
_NUMBER = (int, float)
_MANIFEST_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "format_version": int,
    "family": str,
    "layout": dict,
    "transformers": str,
    "config": dict,
    "config_hash": str,
    "inputs": list,
    "counts": dict,
    "tokens": int,
    "label_tokens": int,
    "sequences": int,
    "lower_bound": int,
    "max_length": int,
    "algorithm": str,
    "fill_ratio": _NUMBER,
    "padding_saved": _NUMBER,
    "rejects": dict,
    "shards": list,
}
"""Every key finalize writes, with its type; a key outside it, or of another type, refuses the pack."""
_COUNTS_KEYS: dict[str, type | tuple[type, ...]] = {
    "input": int,
    "packed": int,
    "rejected": int,
    "rejected_by_reason": dict,
    "duplicate_ids": int,
    "sources": dict,
}
_INPUT_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "path": str,
    "entry": str,
    "bytes": int,
    "sha256": str,
}
_REJECTS_KEYS: dict[str, type | tuple[type, ...]] = {"file": str, "sha256": str}
_SHARD_OPTIONAL = {"index": int, "bytes": int, "tokens": int, "media_bytes": int, "media_rows": int}


def _manifest_error(mpath: Path) -> Callable[[str], Exception]:
    return lambda problem: ShardFormatError(
        f"{problem}; the pack's {MANIFEST} is damaged or edited: re-pack the data"
    )


def read_manifest(path: Path) -> dict[str, Any]:
    """A pack's manifest, the one reader of it: a regular file inside the pack, its size, depth and
    value count bounded (`MANIFEST_LIMITS`) before it is parsed, every key known and of its type."""
    mpath = Path(path) / MANIFEST
    if not os.path.lexists(mpath):
        raise ShardFormatError(
            f"{path} has no {MANIFEST}: it is not a finished pack. Run `packtrain pack run` "
            "(or wait for the PackJob to succeed) and point at its output folder."
        )
    manifest = untrusted.read_json(
        mpath, Path(os.path.realpath(path)), MANIFEST_LIMITS, _manifest_error(mpath)
    )
    if not isinstance(manifest, dict):
        raise ShardFormatError(f"{mpath} is not a JSON object: the pack is damaged; re-pack the data.")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ShardFormatError(
            f"{path}: pack format version {version!r}, this packtrain reads version {FORMAT_VERSION}. "
            "Re-pack the data with this packtrain version."
        )
    _check_keys(mpath, "", manifest, _MANIFEST_KEYS)
    _check_parts(mpath, manifest)
    _check_shard_entries(mpath, manifest.get("shards"))
    return manifest


def _check_keys(
    mpath: Path, where: str, obj: dict[str, Any], known: dict[str, type | tuple[type, ...]]
) -> None:
    """Every key of `obj` one of `known`, its value of the type listed (a bool is no number)."""
    for key, value in obj.items():
        want = known.get(key)
        name = f"{where}{key}"[:200]
        if want is None:
            raise ShardFormatError(
                f"{mpath}: unknown key {name!r} (a manifest holds {', '.join(known)}); the manifest was "
                "edited or damaged. Re-run `packtrain pack materialize` on the output folder, or re-pack."
            )
        if isinstance(value, bool) or not isinstance(value, want):
            raise ShardFormatError(
                f"{mpath}: {name} is {type(value).__name__}, not {_type_name(want)}; the manifest was "
                "edited or damaged. Re-run `packtrain pack materialize` on the output folder, or re-pack."
            )


def _type_name(want: type | tuple[type, ...]) -> str:
    return "number" if want == _NUMBER else getattr(want, "__name__", str(want))


def _check_parts(mpath: Path, manifest: dict[str, Any]) -> None:
    """The keys and types of the manifest's counts, dataset files and rejects file."""
    counts = manifest.get("counts", {})
    _check_keys(mpath, "counts.", counts, _COUNTS_KEYS)
    by_reason = counts.get("rejected_by_reason", {})
    _check_keys(mpath, "counts.rejected_by_reason.", by_reason, dict.fromkeys(by_reason, int))
    sources = counts.get("sources", {})
    _check_keys(mpath, "counts.sources.", sources, dict.fromkeys(sources, dict))
    for entry, source_counts in sources.items():
        _check_keys(mpath, f"counts.sources.{entry}.", source_counts, dict.fromkeys(source_counts, int))
    for i, entry in enumerate(manifest.get("inputs", [])):
        if not isinstance(entry, dict):
            raise ShardFormatError(f"{mpath}: inputs[{i}] is not an object; re-pack the data.")
        _check_keys(mpath, f"inputs[{i}].", entry, _INPUT_KEYS)
    _check_keys(mpath, "rejects.", manifest.get("rejects", {}), _REJECTS_KEYS)


def _check_shard_entries(mpath: Path, shards: Any) -> None:
    """Every key a reader relies on, with its type: a hand-edited manifest fails here, not in a KeyError."""
    if not isinstance(shards, list):
        raise ShardFormatError(f"{mpath}: `shards` is missing or not a list; re-pack the data.")
    for i, entry in enumerate(shards):
        missing = [k for k in SHARD_KEYS if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise ShardFormatError(
                f"{mpath}: shards[{i}] lacks {', '.join(missing)}; the manifest was edited or damaged. "
                "Re-run `packtrain pack materialize` on the output folder, or re-pack."
            )
        _check_keys(
            mpath, f"shards[{i}].", entry, {**dict.fromkeys(SHARD_KEYS, str), **_SHARD_OPTIONAL, "rows": int}
        )
        bad = [k for k in SHARD_KEYS if not isinstance(entry[k], int if k == "rows" else str)]
        if bad or entry["rows"] < 0:
            raise ShardFormatError(
                f"{mpath}: shards[{i}] has a wrong type or value for {', '.join(bad or ['rows'])}; "
                "re-run `packtrain pack materialize` on the output folder, or re-pack."
            )
        for key in ("file", "media_file"):
            if not _is_shard_name(entry[key]):
                raise ShardFormatError(
                    f"{mpath}: shards[{i}].{key} {entry[key][:200]!r} is not a plain file name in the pack's "
                    f"{SHARDS_DIR}/ folder; a pack is read only inside its folder. Re-pack the data."
                )
        for key in ("bytes", "media_bytes"):
            if key in entry and (not isinstance(entry[key], int) or entry[key] < 0):
                raise ShardFormatError(f"{mpath}: shards[{i}].{key} is not a byte count; re-pack the data.")


SHARDS_DIR = "shards"


def _is_shard_name(rel: str) -> bool:
    """`shards/NAME` with NAME a plain file name: no folder, `..`, absolute path, backslash or NUL."""
    folder, sep, name = rel.partition("/")
    return (
        folder == SHARDS_DIR
        and sep == "/"
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )


def sha256_shard(path: Path, size: int | None) -> str:
    """The sha256 of a shard file: opened only if it is a regular file (not a symlink, FIFO or device)
    of the manifest's `size` when it records one, compared before a byte is hashed."""
    try:
        fd = untrusted.open_recorded(path, size, "the manifest")
    except untrusted.FileProblem as exc:
        if exc.missing:
            raise ShardFormatError(
                f"{path} is listed in the manifest but missing; re-run materialize"
            ) from None
        raise ShardFormatError(
            f"{path} {exc.problem}: the pack was damaged or edited; re-pack the data"
        ) from None
    with os.fdopen(fd, "rb") as f:
        h = hashlib.sha256()
        while block := f.read(1 << 20):
            h.update(block)
        return h.hexdigest()


def check_regular(path: Path) -> None:
    """Refuse a shard path that is not a regular file itself (a symlink, FIFO, device)."""
    try:
        st = os.lstat(path)
    except OSError:
        return  # reading it reports the error
    if not stat.S_ISREG(st.st_mode):
        raise ShardFormatError(
            f"{path} is not a regular file: the pack was damaged or edited; re-pack the data"
        )


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
            for rel, want, size in (
                (entry["file"], entry["sha256"], entry.get("bytes")),
                (entry["media_file"], entry["media_sha256"], entry.get("media_bytes")),
            ):
                p = self.path / rel
                if sha256_shard(p, size) != want:
                    raise ShardFormatError(
                        f"{p}: its sha256 does not match the manifest ({want[:12]}…); "
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

    def table(self, shard: int) -> pa.Table:
        """Shard `shard`'s sequences, memory-mapped."""
        return self._table(shard)

    def media_table(self, shard: int) -> pa.Table:
        """Shard `shard`'s media blobs, memory-mapped."""
        return self._media_table(shard)

    def shard_file(self, shard: int) -> str:
        return str(self._entries[shard]["file"])

    def _table(self, shard: int) -> pa.Table:
        if shard not in self._tables:
            self._tables[shard] = self._open(self._entries[shard]["file"], SEQUENCE_SCHEMA)
        return self._tables[shard]

    def _media_table(self, shard: int) -> pa.Table:
        if shard not in self._media_tables:
            self._media_tables[shard] = self._open(self._entries[shard]["media_file"], MEDIA_SCHEMA)
        return self._media_tables[shard]

    def _open(self, rel: str, schema: pa.Schema) -> pa.Table:
        """A shard file, refused unless it is an Arrow file of exactly the format's schema."""
        path = self.path / rel
        check_regular(path)
        try:
            table = read_table(path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise ShardFormatError(f"{path} is not a readable Arrow file ({exc}); re-pack the data") from exc
        if not table.schema.equals(schema):
            raise ShardFormatError(
                f"{path}: columns {table.schema.names} are not those of pack format {FORMAT_VERSION}; "
                "the file was replaced or edited. Re-pack the data."
            )
        return table

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
