"""Reading dataset files: JSON arrays and JSONL, one `RawRecord` per record, never failing on bad data.

A bad line becomes a RawRecord with `error` set, so the convert stage turns it
into a reject and goes on; only configuration mistakes (a path that matches
nothing) stop the job.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration error that stops the job; the message says what to fix."""


@dataclass(frozen=True)
class RawRecord:
    """One input record, or why it could not be read (`reason` is the reject code)."""

    source: Path
    index: int
    record: dict[str, Any] | None
    error: str | None
    reason: str | None = None
    name: str = ""  # the source's name in rejects and shards (see `source_names`); default: the file name

    @property
    def source_name(self) -> str:
        return self.name or self.source.name


_GLOB_CHARS = frozenset("*?[")


def expand_paths(paths: Sequence[str], base_dir: Path | None = None) -> list[Path]:
    """Files named by `paths` (globs expanded, sorted within each pattern, first occurrence kept)."""
    found: list[Path] = []
    seen: set[Path] = set()
    for pattern in paths:
        try:
            full = Path(pattern).expanduser()
        except RuntimeError as exc:  # "~someone/…" naming an unknown user
            raise ConfigError(f"source.paths: {pattern!r}: {exc}") from exc
        if base_dir is not None and not full.is_absolute():
            full = base_dir / full
        if _GLOB_CHARS & set(pattern):
            matches = [Path(m) for m in sorted(glob.glob(str(full), recursive=True)) if Path(m).is_file()]
        else:
            matches = [full] if full.is_file() else []
        if not matches:
            what = "glob matches no file" if _GLOB_CHARS & set(pattern) else "no such file"
            raise ConfigError(f"source.paths: {pattern!r}: {what} (looked in {full.parent})")
        for m in matches:
            resolved = m.resolve()
            if resolved not in seen:
                seen.add(resolved)
                found.append(m)
    return found


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


SKIPPED = "skipped"
"""`RawRecord.reason` of a record `iter_records(select=...)` did not read (it is not a reject)."""

Want = Callable[[], bool]


def iter_records(
    paths: Sequence[str], base_dir: Path | None = None, select: Callable[[int], bool] | None = None
) -> Iterator[RawRecord]:
    """Every record of every file, in a deterministic order; the format is detected from the content.

    With `select`, a record whose global position it refuses is yielded as a placeholder
    (reason `SKIPPED`) without decoding or parsing it, so a convert worker parses only its
    own share of a JSONL file; positions stay those of the full iteration.
    """
    files = expand_paths(paths, base_dir)
    want: Want | None = None
    if select is not None:
        positions = itertools.count()
        want = lambda: select(next(positions))  # noqa: E731  (called once per record, in order)
    for path, name in zip(files, source_names(files), strict=True):
        for raw in _read_file(path, want):
            yield raw if name == path.name else dataclasses.replace(raw, name=name)


def _skipped(path: Path, index: int) -> RawRecord:
    return RawRecord(path, index, None, None, SKIPPED)


def _read_file(path: Path, want: Want | None = None) -> Iterator[RawRecord]:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    if head.startswith(b"["):
        yield from _read_array(path, want)
    else:
        yield from _read_lines(path, want)


def _read_array(path: Path, want: Want | None = None) -> Iterator[RawRecord]:
    """A JSON array: a syntax error loses the whole file, reported as one bad record."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        error = RawRecord(path, 0, None, f"{path.name}: not valid UTF-8 ({exc})", "bad_utf8")
        yield error if want is None or want() else _skipped(path, 0)
        return
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, too-long ints, too-deep nesting
        error = RawRecord(path, 0, None, f"{path.name}: the JSON array does not parse ({exc})", "bad_json")
        yield error if want is None or want() else _skipped(path, 0)
        return
    escapes = "\\ud" in text or "\\uD" in text
    for index, item in enumerate(data):
        if want is None or want():
            yield _as_record(path, index, item, f"item {index}", escapes)
        else:
            yield _skipped(path, index)


def _read_lines(path: Path, want: Want | None = None) -> Iterator[RawRecord]:
    """JSONL: blank lines are skipped; `index` counts records, the detail names the line."""
    index = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if not line:
                continue
            if want is not None and not want():
                yield _skipped(path, index)
                index += 1
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RawRecord(path, index, None, f"line {lineno}: not valid UTF-8 ({exc})", "bad_utf8")
            else:
                try:
                    item = json.loads(text)
                except (ValueError, RecursionError) as exc:  # also too-long ints, too-deep nesting
                    yield RawRecord(path, index, None, f"line {lineno}: not valid JSON ({exc})", "bad_json")
                else:
                    yield _as_record(path, index, item, f"line {lineno}", _has_surrogate_escape(line))
            index += 1


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
                    path, index, None, f"{where}: contains an unpaired UTF-16 surrogate escape, "
                    "which is not valid Unicode text", "bad_utf8"
                )
        return RawRecord(path, index, item, None)
    return RawRecord(
        path, index, None, f"{where}: expected a JSON object, got {type(item).__name__}", "malformed_record"
    )
