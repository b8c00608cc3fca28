"""Every error packtrain raises on purpose, and the exit codes they map to: defined once.

A configuration error (exit 2) says what to fix; a damaged pack is bad input like a
configuration error; a media error is one sample's reject, never a failed job.
"""

from __future__ import annotations

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
