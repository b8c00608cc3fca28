"""Reading a file that someone else wrote: a model folder's files, a pack's manifest.

A folder (a model folder, a pack) is trusted only inside itself and only with what is sane, so
every file our code reads from one goes through here: its path must resolve (symlinks followed)
inside the folder, it must be a regular file (never a FIFO that blocks the reader, a device or a
/proc file), it is opened non-blocking and never read past its byte cap, and a JSON file's nesting
depth and number of values are measured on its bytes before `json.loads` builds a single object
(Python's parser recurses once per level, and costs some 60-100 bytes of memory per value).

The one exception to "inside itself" is a Hugging Face hub cache snapshot
(`models--ORG--NAME/snapshots/REVISION`), whose files are links into the repository's
`blobs/` folder: its files may resolve anywhere inside `models--ORG--NAME`.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from packtrain.core.errors import ConfigError

__all__ = [
    "FileProblem",
    "open_recorded",
    "JsonLimits",
    "check_file",
    "check_json_shape",
    "confinement_root",
    "json_shape",
    "loads",
    "open_file",
    "read_bytes",
    "read_json",
    "resolve_inside",
]

Error = Callable[[str], Exception]
"""Builds the exception a refusal raises: ConfigError for a model folder, ShardFormatError for a pack."""

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
_SCAN_CHUNK = 1 << 22  # bytes scanned at a time: the scan's memory is some 30 bytes per byte of this


class FileProblem(Exception):
    """Why a listed file cannot be opened as recorded; `missing` tells a file never written (a stage
    to re-run) from one damaged or replaced."""

    def __init__(self, problem: str, missing: bool = False) -> None:
        super().__init__(problem)
        self.problem, self.missing = problem, missing


def open_recorded(path: Path, size: int | None, recorder: str) -> int:
    """A descriptor of `path` if it is a regular file (checked on the open descriptor: a FIFO does
    not block, a symlink is not followed) of the `size` bytes `recorder` records, when given;
    FileProblem otherwise."""
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise FileProblem("is missing", missing=True) from None
    except OSError as exc:  # ELOOP: a symlink
        raise FileProblem(f"is not a regular file ({exc.strerror})") from None
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif size is not None and st.st_size != size:
        problem = f"has {st.st_size} bytes, {recorder} records {size}"
    if problem is not None:
        os.close(fd)
        raise FileProblem(problem)
    return fd


@dataclass(frozen=True)
class JsonLimits:
    """What one JSON file may cost: bytes on disk, levels of nesting, values (containers counted)."""

    max_bytes: int
    max_depth: int
    max_values: int


def confinement_root(folder: Path) -> Path:
    """The folder whose inside `folder`'s files must resolve to: `folder` itself (resolved), or the
    repository folder of a Hugging Face hub cache snapshot."""
    real = Path(os.path.realpath(folder))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        return real.parent.parent
    return real


def resolve_inside(path: Path, root: Path, error: Error) -> Path:
    """`path` resolved; refused unless it lies inside `root` (itself resolved)."""
    real = Path(os.path.realpath(path))
    if real != root and root not in real.parents:
        raise error(
            f"{path} resolves to {real}, outside {root}: a folder's files are read only inside it (copy the "
            "file in rather than link to it)"
        )
    return real


def _refuse_kind(path: Path, st: os.stat_result, max_bytes: int | None, error: Error) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise error(
            f"{path} is not a regular file (a FIFO, device, socket or folder); put the file itself there"
        )
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{path} has {st.st_size} bytes, over the {max_bytes}-byte cap for such a file")


def check_file(path: Path, root: Path, max_bytes: int | None, error: Error = ConfigError) -> os.stat_result:
    """Refuse `path` unless it resolves inside `root`, is a regular file and holds at most `max_bytes`
    (None: any size); for files another library opens by name. Nothing is opened."""
    real = resolve_inside(path, root, error)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"{path}: cannot read it ({exc.strerror})") from exc
    _refuse_kind(path, st, max_bytes, error)
    return st


def open_file(path: Path, root: Path, max_bytes: int | None, error: Error = ConfigError) -> int:
    """A descriptor of `path` (checked as `check_file` does, on the opened file itself: the check
    holds for what is read); the caller closes it. A missing file raises FileNotFoundError."""
    real = resolve_inside(path, root, error)
    try:
        fd = os.open(real, _FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"{path}: cannot open it ({exc.strerror})") from exc
    try:
        _refuse_kind(path, os.fstat(fd), max_bytes, error)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: Path, root: Path, max_bytes: int, error: Error = ConfigError) -> bytes:
    """The bytes of `path` (checked as `open_file` does), never more than `max_bytes` read: a file
    whose size the file system misreports (procfs says 0) cannot grow past the cap."""
    fd = open_file(path, root, max_bytes, error)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{path} holds over {max_bytes} bytes, the cap for such a file")
    return data


@cache
def _tables() -> tuple[Any, Any, Any]:
    """Per byte value: structural outside strings (,[]{}), its step in nesting level ([{ +1, ]} -1),
    and whether it starts a value (,[{)."""
    import numpy as np

    structural, step, value = np.zeros(256, bool), np.zeros(256, np.int8), np.zeros(256, bool)
    structural[list(b",[]{}")] = True
    step[list(b"[{")], step[list(b"]}")] = 1, -1
    value[list(b",[{")] = True
    return structural, step, value


def _scan_chunk(codes: Any, carry: tuple[int, int, int]) -> tuple[int, int, tuple[int, int, int]]:
    """(deepest level, values, carry) of one chunk of a JSON text; `carry` is (nesting level, 1 when
    inside a string, backslashes ending the previous chunk)."""
    import numpy as np

    structural, step, value = _tables()
    level, in_string, slashes = carry
    quotes = np.flatnonzero(codes == 0x22)
    backslash = codes == 0x5C
    plain = np.flatnonzero(~backslash) if slashes or backslash.any() else None
    if plain is not None and len(quotes):  # a quote after an odd run of backslashes is escaped
        before = np.searchsorted(plain, quotes) - 1
        run = np.where(before >= 0, quotes - plain[np.maximum(before, 0)] - 1, quotes + slashes)
        quotes = quotes[run % 2 == 0]
    marks = np.flatnonzero(structural[codes])
    kinds = codes[marks[(np.searchsorted(quotes, marks) + in_string) % 2 == 0]]
    levels = np.cumsum(step[kinds].astype(np.int32), dtype=np.int32)  # within +-len(codes): no overflow
    deepest, after = (level + int(levels.max()), level + int(levels[-1])) if len(levels) else (level, level)
    last_plain = -1 - slashes if plain is None or not len(plain) else int(plain[-1])
    tail = 0 if plain is None else len(codes) - 1 - last_plain  # backslashes ending the chunk
    return deepest, int(np.count_nonzero(value[kinds])), (after, (in_string + len(quotes)) % 2, tail)


def json_shape(
    data: bytes, max_depth: int, max_values: int | None = None, chunk: int = _SCAN_CHUNK
) -> tuple[int, int]:
    """(depth, values) of a JSON text, from its bytes, in a few vectorized passes (no object is
    built, memory is a fixed few bytes per byte of a chunk): quotes not escaped by an odd run of
    backslashes open and close strings, and outside them brackets nest and commas and openers count.
    `values` bounds the containers and elements from above (an empty container counts twice; object
    keys not at all: their bytes bound them). Text that is not JSON still gets finite numbers
    (`json.loads` then refuses it); the scan stops at the first chunk past `max_depth` or
    `max_values`."""
    import numpy as np

    codes = np.frombuffer(data, np.uint8)
    carry, deepest, values = (0, 0, 0), 0, 1
    for start in range(0, len(codes), chunk):
        chunk_deepest, chunk_values, carry = _scan_chunk(codes[start : start + chunk], carry)
        deepest, values = max(deepest, chunk_deepest), values + chunk_values
        if deepest > max_depth or (max_values is not None and values > max_values):
            break
    return deepest, values


def check_json_shape(data: bytes, limits: JsonLimits, name: str | Path, error: Error = ConfigError) -> None:
    """Refuse a JSON text over `limits` (for one another library parses: nothing is built here)."""
    if len(data) > limits.max_bytes:
        raise error(f"{name} has {len(data)} bytes, over the {limits.max_bytes}-byte cap for such a file")
    depth, values = json_shape(data, limits.max_depth, limits.max_values)
    if depth > limits.max_depth:
        raise error(f"{name} nests over {limits.max_depth} levels deep, deeper than any such file")
    if values > limits.max_values:
        raise error(f"{name} holds over {limits.max_values} JSON values, more than any such file")


def loads(data: bytes, limits: JsonLimits, name: str | Path, error: Error = ConfigError) -> Any:
    """`json.loads` of `data` once its size, depth and value count are within `limits`."""
    check_json_shape(data, limits, name, error)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise error(f"{name} is not readable JSON ({exc})") from exc


def read_json(path: Path, root: Path, limits: JsonLimits, error: Error = ConfigError) -> Any:
    """A JSON file of a folder, read as `read_bytes` reads and parsed as `loads` parses."""
    return loads(read_bytes(path, root, limits.max_bytes, error), limits, path, error)
