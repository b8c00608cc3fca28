"""Reading a checkpoint's files as untrusted input: regular files only, sizes known before reading,
JSON capped and parsed strictly. Nothing here unpickles: a checkpoint volume others can write to
must not be a way to run code in the trainer.

Two kinds of refusal: `DamagedCheckpoint` (a file missing, cut short, of another size than recorded,
not a regular file, not JSON) is what an interrupted copy or a full disk leaves, so the newest
checkpoint's damage lets a resume fall back to an older one; any other `ConfigError` (a value out
of range or disagreeing with the folder, the run or the model) stops the resume.
"""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path
from typing import Any

from packtrain.core import untrusted
from packtrain.core.errors import ConfigError
from packtrain.core.untrusted import JsonLimits, check_json_shape


class DamagedCheckpoint(ConfigError):
    """A checkpoint file is missing, incomplete or not a regular file: the folder is not complete.
    `detail` names the file and what is wrong with it."""

    detail: str = ""


def fix(folder: Path) -> str:
    """What to do about a checkpoint folder that cannot be resumed."""
    return (
        f"delete {folder} (a resume then starts from the newest complete checkpoint before it, if any), "
        "or train into a new folder (`--output DIR` of `packtrain train` or `packtrain run`)"
    )


def refused(path: Path, problem: str) -> ConfigError:
    """A checkpoint file whose content cannot be right (damaged or edited)."""
    return ConfigError(f"{path}: {problem}: the checkpoint was damaged or edited; {fix(path.parent)}")


def damaged(path: Path, problem: str) -> DamagedCheckpoint:
    exc = DamagedCheckpoint(f"{path} {problem}: the checkpoint is incomplete or damaged; {fix(path.parent)}")
    exc.detail = f"{path} {problem}"
    return exc


def check_file(path: Path, size: int) -> None:
    """DamagedCheckpoint unless `path` is a regular file (not a symlink, FIFO or device) of `size`
    bytes; nothing is opened."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise damaged(path, "is missing") from None
    except OSError as exc:
        raise damaged(path, f"cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise damaged(path, "is not a regular file")
    if st.st_size != size:
        raise damaged(path, f"has {st.st_size} bytes, trainer.json records {size}")


def open_regular(path: Path, size: int | None = None) -> io.BufferedReader:
    """`path` opened for reading if it is a regular file (checked on the open descriptor: a FIFO
    does not block, a symlink is not followed) of `size` bytes when given."""
    try:
        return open(untrusted.open_recorded(path, size, "trainer.json"), "rb")
    except untrusted.FileProblem as exc:
        raise damaged(path, exc.problem) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def read_json(path: Path, limits: JsonLimits, size: int | None = None) -> Any:
    """The JSON document in `path`: refused unread when over `limits.max_bytes`, and before it is
    parsed when it nests deeper or holds more values than `limits` allow (the parser's memory is
    per value); NaN and Infinity are not numbers here."""
    cap = limits.max_bytes
    with open_regular(path, size) as f:
        length = os.fstat(f.fileno()).st_size
        if length > cap:
            raise refused(path, f"{length} bytes, over the {cap} bytes a checkpoint's {path.name} may have")
        data = f.read(cap + 1)
    if len(data) > cap:  # grew while open
        raise refused(path, f"over the {cap} bytes a checkpoint's {path.name} may have")
    check_json_shape(data, limits, path.name, lambda problem: refused(path, problem))
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise damaged(path, f"is not complete JSON ({str(exc)[:120]})") from None


def write_json(path: Path, value: Any) -> None:
    """`value` as compact, strict JSON (no NaN), flushed to disk before the folder is published."""
    data = json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def is_int(value: Any, low: int = 0, high: int = 1 << 62) -> bool:
    """An integer (not a bool) in [low, high]."""
    return type(value) is int and low <= value <= high
