"""Every error packtrain raises on purpose, and the exit codes they map to: defined once.

A configuration error (exit 2) says what to fix; a damaged pack is bad input like a
configuration error; a media error is one sample's reject, never a failed job.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Final

from packtrain.core.contract import RejectReason

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # anything not the user's input: see the log
EXIT_CONFIG: Final = 2  # a configuration error, or a damaged or edited pack: the message says what to fix
EXIT_INTERRUPTED: Final = 130  # Ctrl-C (128 + SIGINT), as shells report it


class ConfigError(ValueError):
    """A configuration error that stops the job; the message says what to fix."""


class ShardFormatError(RuntimeError):
    """The folder is not a complete pack this version can read."""


class PackIntegrityError(ShardFormatError):
    """A row breaks an invariant the packer guarantees: the pack was damaged or edited."""


class MediaError(Exception):
    """A media file that cannot be used; `reason` is a stable reject code. `path`: the file named as
    missing or unreadable, which the pack records so that a re-run rebuilds once it is there."""

    def __init__(self, reason: RejectReason, detail: str, path: str | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.path = path


def relative_note(path: str | Path) -> str:
    """For an error about a path that was not found: where a relative one was looked up (relative paths
    in a manifest resolve against the current directory, not the manifest's folder)."""
    if Path(path).expanduser().is_absolute():
        return ""
    return f" (relative paths resolve against the current directory, {Path.cwd()}, not the manifest's folder)"


_NO_SPACE: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_NO_WRITE: Final = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def write_failure(exc: BaseException, folder: Path, option: str) -> ConfigError | None:
    """The ConfigError for a write into `folder` that failed for lack of space or permission, found in
    `exc` or what it wraps (a worker's error, a checkpoint writer's per-rank failures), or None.

    Such a run stops as it would on Ctrl-C: what is published stays whole, so the same command
    resumes once there is room. `option`: how the user names another output folder (e.g. "-o")."""
    found = _os_error(exc)
    if found is None:
        return None
    where = Path(os.path.abspath(found.filename)) if isinstance(found.filename, (str, os.PathLike)) else None
    home = Path(os.path.abspath(folder))
    # The folder, a file in it, or a parent it could not be created in.
    inside = where is None or where == home or home in where.parents or where in home.parents
    reason = found.strerror or os.strerror(found.errno or 0)
    if found.errno in _NO_SPACE:
        return ConfigError(
            f"cannot write to {folder if inside else where}: {reason}; free space there (or raise the quota "
            f"or the file-size limit, `ulimit -f`), or choose another output folder ({option}); the same "
            "command then resumes where this one stopped"
        )
    if not inside:  # e.g. an unreadable dataset file: not the output folder's problem
        return None
    return ConfigError(
        f"cannot write to {folder}: {reason}; make it writable for this user (uid {os.getuid()}) or "
        f"choose another output folder ({option})"
    )


def _os_error(exc: BaseException) -> OSError | None:
    """The first OSError of a space or permission kind in `exc`, its causes and contexts, or the
    failures a torch.distributed.checkpoint CheckpointException carries per rank."""
    stack: list[object] = [exc]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno in _NO_SPACE | _NO_WRITE:
            return item
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [item.__context__, item.__cause__]
    return None
