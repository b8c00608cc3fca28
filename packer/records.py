"""Reading dataset files: JSON arrays and JSONL, one `RawRecord` per record, never failing on bad data.

A bad line becomes a RawRecord with `error` set, so the convert stage turns it
into a reject and goes on; only configuration mistakes (a path that matches
nothing) stop the job.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator, Sequence
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


_GLOB_CHARS = frozenset("*?[")


def expand_paths(paths: Sequence[str], base_dir: Path | None = None) -> list[Path]:
    """Files named by `paths` (globs expanded, sorted within each pattern, first occurrence kept)."""
    found: list[Path] = []
    seen: set[Path] = set()
    for pattern in paths:
        full = Path(pattern).expanduser()
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


def iter_records(paths: Sequence[str], base_dir: Path | None = None) -> Iterator[RawRecord]:
    """Every record of every file, in a deterministic order; the format is detected from the content."""
    for path in expand_paths(paths, base_dir):
        yield from _read_file(path)


def _read_file(path: Path) -> Iterator[RawRecord]:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    if head.startswith(b"["):
        yield from _read_array(path)
    else:
        yield from _read_lines(path)


def _read_array(path: Path) -> Iterator[RawRecord]:
    """A JSON array: a syntax error loses the whole file, reported as one bad record."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        yield RawRecord(path, 0, None, f"{path.name}: not valid UTF-8 ({exc})", "bad_utf8")
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        yield RawRecord(path, 0, None, f"{path.name}: the JSON array does not parse ({exc})", "bad_json")
        return
    for index, item in enumerate(data):
        yield _as_record(path, index, item, f"item {index}")


def _read_lines(path: Path) -> Iterator[RawRecord]:
    """JSONL: blank lines are skipped; `index` counts records, the detail names the line."""
    index = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if not line:
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RawRecord(path, index, None, f"line {lineno}: not valid UTF-8 ({exc})", "bad_utf8")
            else:
                try:
                    item = json.loads(text)
                except json.JSONDecodeError as exc:
                    yield RawRecord(path, index, None, f"line {lineno}: not valid JSON ({exc})", "bad_json")
                else:
                    yield _as_record(path, index, item, f"line {lineno}")
            index += 1


def _as_record(path: Path, index: int, item: Any, where: str) -> RawRecord:
    if isinstance(item, dict):
        return RawRecord(path, index, item, None)
    return RawRecord(
        path, index, None, f"{where}: expected a JSON object, got {type(item).__name__}", "malformed_record"
    )
