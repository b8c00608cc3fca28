"""Reading dataset files (JSON arrays, JSONL, Parquet): one `RawRecord` per record, never failing on bad data.

A bad line, array item or Parquet row becomes a RawRecord with `error` set, so the
convert stage turns it into a reject and goes on; only configuration mistakes (a path
that matches nothing) stop the job. Files are streamed: memory holds one record (at
most `MAX_RECORD_BYTES` of JSON text) and one read chunk, or one batch of a Parquet
row group (`parquet_source`), never a whole file. The format is told by the file
name: `.parquet` is Parquet, anything else JSON or JSONL (told from the content).
A `source.paths` glob matches only inside the folder it names (`confined_glob`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, cast

from packtrain.core.contract import MAX_NESTING_DEPTH, MAX_RECORD_BYTES, RejectReason
from packtrain.core.errors import ConfigError, relative_note
from packtrain.core.record_json import shape_error
from packtrain.packer.sources.raw import Copies, RawRecord, Times, Want, skipped

_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class SourceFile:
    """One dataset file of a job: its path, its name in samples (`source_names`) and the
    `source.paths` entry that named it first (mixture weights and per-source counts use it)."""

    path: Path
    name: str
    entry: str


def source_files(paths: Sequence[str], base_dir: Path | None = None) -> list[SourceFile]:
    """Every file of the job, in reading order, with its name and `source.paths` entry."""
    found = _expand(paths, base_dir)
    names = source_names([p for p, _ in found])
    return [SourceFile(p, name, entry) for (p, entry), name in zip(found, names, strict=True)]


def expand_paths(paths: Sequence[str], base_dir: Path | None = None) -> list[Path]:
    """Files named by `paths` (globs expanded, sorted within each pattern, first occurrence kept)."""
    return [p for p, _ in _expand(paths, base_dir)]


def _expand(paths: Sequence[str], base_dir: Path | None) -> list[tuple[Path, str]]:
    found: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for pattern in paths:
        try:
            full = Path(pattern).expanduser()
        except RuntimeError as exc:  # "~someone/…" naming an unknown user
            raise ConfigError(f"source.paths: {pattern!r}: {exc}") from exc
        if base_dir is not None and not full.is_absolute():
            full = base_dir / full
        if _GLOB_CHARS & set(pattern):
            matches = sorted(confined_glob(full, pattern))
        else:
            matches = [full] if full.is_file() else []
        if not matches:
            what = "glob matches no file" if _GLOB_CHARS & set(pattern) else "no such file"
            where = relative_note(pattern) if base_dir is None else ""
            raise ConfigError(f"source.paths: {pattern!r}: {what} (looked in {full.parent}){where}")
        for m in matches:
            resolved = m.resolve()
            if resolved not in seen:
                seen.add(resolved)
                found.append((m, pattern))
    return found


def confined_glob(full: Path, pattern: str) -> Iterator[Path]:
    """The files a glob matches (`glob.glob(recursive=True)` rules: `**` spans folders, `*` and `**`
    skip hidden names), confined to the folder it names: its part before the first glob character.

    Symlinks are followed only where their target stays inside that folder; one leading out (a
    file, or a folder `**` would walk into) is a ConfigError naming it, so a dataset cannot make
    the job read, or take media from, another folder. Each real folder is walked once, so
    symlink loops end.
    """
    parts = full.parts
    first = next(i for i, part in enumerate(parts) if _GLOB_CHARS & set(part))
    named = Path(*parts[:first])
    if not named.is_dir():
        return
    walk = _ConfinedWalk(pattern, named, os.path.realpath(named))
    yield from walk.match(named, parts[first:])


class _ConfinedWalk:
    def __init__(self, pattern: str, named: Path, real: str) -> None:
        self.pattern, self.named, self.real = pattern, named, real
        self.walked: set[str] = set()  # real folders `**` went through

    def inside(self, path: Path, is_dir: bool) -> bool:
        """Whether `path` (a symlink, or below one) stays inside the named folder; else ConfigError."""
        real = os.path.realpath(path)
        if real == self.real or real.startswith(self.real.rstrip(os.sep) + os.sep):
            return True
        what = "folder" if is_dir else "file"
        raise ConfigError(
            f"source.paths: {self.pattern!r}: the {what} {path} is a symlink leading outside {self.named}, "
            "the folder this entry names; copy the data there or name the folder it leads to"
        )

    def match(self, folder: Path, rest: tuple[str, ...]) -> Iterator[Path]:
        part, last = rest[0], len(rest) == 1
        if part == "**":
            yield from self._recursive(folder, rest[1:])
            return
        if _GLOB_CHARS & set(part):
            names = [n for n in _names(folder) if fnmatch.fnmatchcase(n, part) and _shown(n, part)]
        else:
            names = [part]
        for name in sorted(names):
            path = folder / name
            if last:
                if path.is_file() and (not path.is_symlink() or self.inside(path, False)):
                    yield path
            elif path.is_dir() and (not path.is_symlink() or self.inside(path, True)):
                yield from self.match(path, rest[1:])

    def _recursive(self, folder: Path, rest: tuple[str, ...]) -> Iterator[Path]:
        """`**`: `folder` and every folder below it (hidden ones skipped), each real folder once."""
        real = os.path.realpath(folder)
        if real in self.walked:
            return
        self.walked.add(real)
        if not rest:  # a trailing `**` matches folders, never files
            return
        yield from self.match(folder, rest)
        for name in sorted(_names(folder)):
            path = folder / name
            if _shown(name, "*") and path.is_dir() and (not path.is_symlink() or self.inside(path, True)):
                yield from self._recursive(path, rest)


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _shown(name: str, part: str) -> bool:
    """Glob rules: a name starting with `.` is matched only by a pattern starting with `.`."""
    return not name.startswith(".") or part.startswith(".")


def source_names(files: Sequence[Path]) -> list[str]:
    """The name each file's samples carry (`source`, default sample ids): the file name, unless
    several files share it; those get their path relative to their common folder, so every
    (source, index) pair and every default sample id stays unique."""
    names = [p.name for p in files]
    clashes: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        clashes.setdefault(name, []).append(i)
    for idx in clashes.values():
        if len(idx) > 1:
            full = [os.path.abspath(files[i]) for i in idx]
            common = os.path.commonpath(full)
            for i, f in zip(idx, full, strict=True):
                names[i] = Path(os.path.relpath(f, common)).as_posix()
    return names


Weigh = Callable[[list[SourceFile]], list[Copies]]


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() == ".parquet"


def iter_records(
    paths: Sequence[str],
    base_dir: Path | None = None,
    select: Callable[[int], bool] | None = None,
    weigh: Weigh | None = None,
) -> Iterator[RawRecord]:
    """Every record of every file, in a deterministic order; the format is detected per file.

    Records are read in units: one JSON record, or one Parquet row group. With `select`, a
    unit whose global number it refuses is not read: its records are yielded as placeholders
    (reason `SKIPPED`), so a convert worker parses only its own share of a file and positions
    (the order of yielded records) stay those of the full iteration. `weigh` gives how many
    times each record is taken (`mixture.weigher`): a record taken k times is yielded k times
    (`copy` 0..k-1), one taken 0 times not at all.
    """
    files = source_files(paths, base_dir)
    copies = weigh(files) if weigh is not None else [None] * len(files)
    units = itertools.count()

    def unit_wanted() -> bool:
        return select is None or select(next(units))

    for sf, times in zip(files, copies, strict=True):
        for raw in _read_source(sf.path, unit_wanted, times, select is None and times is None):
            n = 1 if times is None else _times(times, raw.index)
            if n == 1 and sf.name == sf.path.name:
                yield raw
                continue
            for k in range(n):
                yield dataclasses.replace(raw, name=sf.name, copy=k)


def _times(times: Times, index: int) -> int:
    return int(times[index]) if index < len(times) else 0  # a file grown since it was counted: not sampled


def _read_source(path: Path, unit_wanted: Want, times: Copies, everything: bool) -> Iterator[RawRecord]:
    if is_parquet(path):
        from packtrain.packer.sources.parquet import read_parquet  # pyarrow.parquet: only for Parquet jobs

        yield from read_parquet(path, unit_wanted, times)
        return
    records = itertools.count()

    def want() -> bool:  # one JSON record is one unit; a record the mixture does not take is not parsed
        wanted, index = unit_wanted(), next(records)
        return wanted and (times is None or _times(times, index) > 0)

    yield from _read_file(path, None if everything else want)


def count_records(path: Path) -> int:
    """How many records `iter_records` yields for a file (a Parquet file's footer; a JSON file is scanned)."""
    if is_parquet(path):
        from packtrain.packer.sources.parquet import parquet_rows

        rows = parquet_rows(path)
        return 1 if rows is None else sum(rows)  # an unreadable file is one reject
    return sum(1 for _ in _read_file(path, lambda: False))


def _read_file(path: Path, want: Want | None = None) -> Iterator[RawRecord]:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(_BOM):
        head = head[3:].lstrip()
    if head.startswith(b"["):
        yield from _read_array(path, want)
    else:
        yield from _read_lines(path, want)


READ_CHUNK_BYTES = 1 << 20
"""Bytes read at a time while streaming a JSON array (and discarding an over-long line)."""

_BOM = b"\xef\xbb\xbf"


class _MatchesEmpty(Protocol):
    """A compiled pattern that matches the empty string, so `match` never returns None."""

    def match(self, string: bytes | bytearray, pos: int = 0, /) -> re.Match[bytes]: ...


def _matches_empty(pattern: bytes, flags: int = 0) -> _MatchesEmpty:
    return cast(_MatchesEmpty, re.compile(pattern, flags))


# Each pattern below matches the empty string: `.match()` never returns None.
_WS = _matches_empty(rb"[ \t\n\r]*")
# A string's content, unrolled. Greedy, not possessive (`*+`): Debian 12's Python 3.11.2 (3.11.7 does not)
# matched possessive repeats of groups wrongly here and lost the records after an escape. Each
# pattern is only ever matched as far as it goes, so greedy repeats backtrack at most through one cut-off
# string: still linear.
_CHARS = rb'[^"\\]*(?:\\.[^"\\]*)*'
_STRING_BODY = _matches_empty(_CHARS, re.DOTALL)  # up to the closing quote
# Up to the next bracket, past whole strings: one regex call per bracket, not per string.
_TO_BRACKET = _matches_empty(rb'[^"\[\]{}]*(?:"' + _CHARS + rb'"[^"\[\]{}]*)*', re.DOTALL)
_OPENERS = _matches_empty(rb"[\[{]*")
_CLOSERS = _matches_empty(rb"[\]}]*")
_SCALAR = _matches_empty(rb'[^ \t\n\r,:"\[\]{}]*')  # a number, true, false, null (or junk json rejects)
_QUOTE, _OPEN, _COMMA, _CLOSE = 0x22, b"[{", 0x2C, 0x5D


def _scan(
    buf: bytes | bytearray, pos: int, depth: int, deepest: int, in_string: bool
) -> tuple[int, int, int, bool, bool]:
    """Follow strings and brackets from `pos` until the value being scanned closes.

    Returns (pos, depth, deepest, in_string, done); not done means `buf` ended first, and the
    scan resumes from the returned state once more bytes are appended. Regexes do the per-byte
    work and nothing is decoded, so skipping a record costs no Python objects. Only ASCII bytes
    are structural, and UTF-8 never uses them inside a multi-byte character, so the scan is exact
    for valid UTF-8 and deterministic for anything else.
    """
    end = len(buf)
    while True:
        if in_string:
            pos = _STRING_BODY.match(buf, pos).end()
            if pos == end or buf[pos] != _QUOTE:  # cut off, at most by a trailing backslash
                return pos, depth, deepest, True, False
            pos += 1
            in_string = False
            if depth == 0:
                return pos, depth, deepest, False, True
        pos = _TO_BRACKET.match(buf, pos).end()
        if pos == end:
            return pos, depth, deepest, False, False
        c = buf[pos]
        if c == _QUOTE:  # a string the buffer cuts off
            pos += 1
            in_string = True
        elif c in _OPEN:  # a run of brackets is one step, so "[[[[..." costs no more than text
            run = _OPENERS.match(buf, pos).end() - pos
            pos += run
            depth += run
            deepest = max(deepest, depth)
        else:
            run = _CLOSERS.match(buf, pos).end() - pos
            if run >= depth:
                return pos + max(depth, 1), 0, deepest, False, True
            pos += run
            depth -= run


@dataclass(frozen=True)
class _Item:
    """Where one array item lies, and its bytes when they were kept."""

    start: int  # file offset of its first byte
    size: int  # bytes of JSON text
    deepest: int
    data: bytes | None  # None: not wanted, or larger than MAX_RECORD_BYTES


class _ArrayReader:
    """Finds the items of a JSON array in a file read chunk by chunk.

    Memory holds one chunk plus the item being kept (at most MAX_RECORD_BYTES); an item that is
    not wanted is scanned without being kept. Every worker runs this same scan over the whole
    file, so all agree on every item's position, also where the file breaks.
    """

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.buf = bytearray()
        self.base = 0  # file offset of buf[0]
        self.pos = 0  # scan position in buf
        self.eof = False

    @property
    def offset(self) -> int:
        return self.base + self.pos

    def more(self, keep_from: int) -> bool:
        """Append a chunk, first dropping the bytes before file offset `keep_from`; False at the end."""
        drop = keep_from - self.base
        if drop > 0:
            del self.buf[:drop]  # cheap: a bytearray drops its head without copying the rest
            self.base += drop
            self.pos -= drop
        data = b"" if self.eof else self.f.read(READ_CHUNK_BYTES)
        self.eof = not data
        self.buf += data
        return bool(data)

    def peek(self) -> int | None:
        """The next byte that is not JSON whitespace (left unread), or None at the end of the file."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more(self.offset):
                return None

    def item(self, keep: bool) -> _Item | None:
        """Scan the value at the next byte; None when the file ends inside it."""
        start = self.offset
        first = self.buf[self.pos]
        scalar = first not in b'"[{'
        depth = deepest = 0
        in_string = first == _QUOTE
        self.pos += in_string
        while True:
            if scalar:
                self.pos = _SCALAR.match(self.buf, self.pos).end()
                done = self.pos < len(self.buf)
            else:
                state = _scan(self.buf, self.pos, depth, deepest, in_string)
                self.pos, depth, deepest, in_string, done = state
            if done:
                break
            keep = keep and self.offset - start <= MAX_RECORD_BYTES
            if not self.more(start if keep else self.offset):
                return None
        size = self.offset - start
        data = None
        if keep and size <= MAX_RECORD_BYTES:
            data = bytes(memoryview(self.buf)[start - self.base : self.pos])  # one copy
        return _Item(start, size, deepest, data)


def _read_array(path: Path, want: Want | None = None) -> Iterator[RawRecord]:
    """A JSON array, streamed: each item is one record, parsed only when wanted.

    An item that does not parse is one `bad_json` reject, like a bad JSONL line. Where the array
    itself breaks (the file ends early, a missing comma, data after the closing bracket) the rest
    of the file cannot be split into items: it becomes one `bad_json` reject at the next position,
    so the records read so far stay and every count still adds up.
    """
    index = 0
    with path.open("rb") as f:
        reader = _ArrayReader(f)
        reader.more(0)
        if reader.buf.startswith(_BOM):
            reader.pos = len(_BOM)
        if reader.peek() != ord("["):
            yield _broken(path, 0, reader.offset, "it does not start with '['", _wants(want))
            return
        reader.pos += 1
        if reader.peek() == _CLOSE:
            reader.pos += 1
        else:
            while True:
                c = reader.peek()
                if c is None or c in b",:]}":
                    what = "the file ends" if c is None else f"found {chr(c)!r} where an item should start"
                    yield _broken(path, index, reader.offset, what, _wants(want))
                    return
                wanted, start = _wants(want), reader.offset
                item = reader.item(wanted)
                if item is None:
                    yield _broken(path, index, start, f"the file ends inside item {index}", wanted)
                    return
                yield _array_record(path, index, item) if wanted else skipped(path, index)
                index += 1
                c = reader.peek()
                if c != _COMMA and c != _CLOSE:
                    what = "the file ends" if c is None else f"found {chr(c)!r} after an item"
                    yield _broken(path, index, reader.offset, f"{what}, expected ',' or ']'", _wants(want))
                    return
                reader.pos += 1
                if c == _CLOSE:
                    break
        if reader.peek() is not None:
            yield _broken(path, index, reader.offset, "data follows the closing ']'", _wants(want))


def _wants(want: Want | None) -> bool:
    return want is None or want()


def _broken(path: Path, index: int, offset: int, what: str, wanted: bool) -> RawRecord:
    """The rest of a JSON array that no longer splits into items, as one record at `index`."""
    if not wanted:
        return skipped(path, index)
    detail = (
        f"{path.name}: the JSON array breaks at byte {offset}: {what}; "
        "the rest of the file is this one reject"
    )
    return RawRecord(path, index, None, detail, RejectReason.BAD_JSON)


def _array_record(path: Path, index: int, item: _Item) -> RawRecord:
    where = f"item {index}"
    if item.data is None:
        return _too_large(path, index, f"{where} (at byte {item.start})", item.size)
    if item.deepest > MAX_NESTING_DEPTH:
        return _too_deep(path, index, where, item.deepest)
    return _parse(path, index, item.data, where)


def _read_lines(path: Path, want: Want | None = None) -> Iterator[RawRecord]:
    """JSONL: blank lines are skipped; `index` counts records, the detail names the line."""
    index = 0
    with path.open("rb") as f:
        for lineno, (raw, size) in enumerate(_lines(f), 1):
            line = None if raw is None else _line_content(raw, lineno)
            if line is not None and not line:
                continue
            if want is not None and not want():
                yield skipped(path, index)
            elif line is None:
                yield _too_large(path, index, f"line {lineno}", size)
            else:
                yield _parse(path, index, line, f"line {lineno}")
            index += 1


def _lines(f: BinaryIO) -> Iterator[tuple[bytes | None, int]]:
    """Each line of `f` and its size; None for a line longer than MAX_RECORD_BYTES (not counting
    its newline), which is read on in pieces and dropped, so no line is ever held whole beyond
    the cap; b"" for such a line that is only whitespace."""
    while piece := f.readline(READ_CHUNK_BYTES):
        first, size = piece, len(piece)
        kept: list[bytes] | None = [piece]
        blank = True  # the pieces after the first
        while len(piece) == READ_CHUNK_BYTES and not piece.endswith(b"\n"):  # a long line goes on
            piece = f.readline(READ_CHUNK_BYTES)
            size += len(piece)
            blank = blank and not piece.strip()
            if kept is not None:
                kept.append(piece)
                if size > MAX_RECORD_BYTES + 1:
                    kept = None
        if kept is not None and size - piece.endswith(b"\n") <= MAX_RECORD_BYTES:
            yield (first if len(kept) == 1 else b"".join(kept)), size
        else:
            yield (b"" if blank and not first.strip() else None), size


def _line_content(raw: bytes, lineno: int) -> bytes:
    line = raw.strip()
    if lineno == 1 and line.startswith(_BOM):
        line = line[len(_BOM) :]
    return line


def _too_large(path: Path, index: int, where: str, size: int) -> RawRecord:
    detail = f"{where}: {size} bytes of JSON, more than the {MAX_RECORD_BYTES} a record may have; not read"
    return RawRecord(path, index, None, detail, RejectReason.RECORD_TOO_LARGE)


def _too_deep(path: Path, index: int, where: str, deepest: int) -> RawRecord:
    detail = f"{where}: nested {deepest} levels deep, more than the {MAX_NESTING_DEPTH} a record may have"
    return RawRecord(path, index, None, detail, RejectReason.BAD_JSON)


def _parse(path: Path, index: int, data: bytes, where: str) -> RawRecord:
    """One record's JSON text, decoded as `json.loads` does once its shape is within a record's limits
    (`record_json`); any failure is a reject."""
    if (shape := shape_error(data, where)) is not None:
        return RawRecord(path, index, None, shape.detail, shape.reason)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRecord(path, index, None, f"{where}: not valid UTF-8 ({exc})", RejectReason.BAD_UTF8)
    try:
        item = json.loads(text)
    except (ValueError, RecursionError) as exc:  # also too-long ints
        return RawRecord(path, index, None, f"{where}: not valid JSON ({exc})", RejectReason.BAD_JSON)
    return _as_record(path, index, item, where, _has_surrogate_escape(data))


def _has_surrogate_escape(data: bytes) -> bool:
    """Whether JSON text may decode to a lone surrogate (`\\udXXX` escapes; pairs use them too)."""
    return b"\\ud" in data or b"\\uD" in data


def _as_record(path: Path, index: int, item: Any, where: str, escapes: bool = False) -> RawRecord:
    if isinstance(item, dict):
        if escapes:
            # A lone surrogate ("\\ud800" without its pair) is not text: the tokenizer, Arrow and
            # the rejects file all refuse it, so it would stop the worker. Pairs encode fine.
            try:
                json.dumps(item, ensure_ascii=False).encode("utf-8")
            except (ValueError, RecursionError):  # UnicodeEncodeError
                return RawRecord(
                    path,
                    index,
                    None,
                    f"{where}: contains an unpaired UTF-16 surrogate escape, which is not valid Unicode text",
                    RejectReason.BAD_UTF8,
                )
        return RawRecord(path, index, item, None)
    return RawRecord(
        path,
        index,
        None,
        f"{where}: expected a JSON object, got {type(item).__name__}",
        RejectReason.MALFORMED_RECORD,
    )
