"""One run at a time in an output folder: a claim the kernel drops when its holder dies.

`pack run`, `train` and `packtrain run` hold an exclusive claim on their output folder for the whole
run; the pack stage commands a PackJob's pods run (`pack convert|plan|materialize|refresh`) hold a
shared one, so the pods of one job work side by side while a `pack run` on their folder is refused,
and the other way round. A refused command stops before it reads, sweeps or writes anything of the
folder's (ConfigError, exit 2, naming the holder).

The claim is `flock` on `FOLDER/.packtrain.lock`, not an `O_EXCL` claim file: the kernel releases a
lock with the last process that holds it (`kill -9` included), so a dead run never blocks the next
and nothing has to guess whether a holder on another host is still alive (an `O_EXCL` file can be
judged stale only by its pid on the same host, or by a heartbeat and clocks that agree). On NFS,
Linux turns flock into the protocol's byte-range locks (lockd for v3, v4's own), which the server
drops when a client's lease ends. The lock file says who holds it (command, pid, host, start) for
the refusal's message only, and is never deleted: a new file would be a second, separate lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from packtrain.core.errors import ConfigError, write_failure

if sys.platform != "win32":
    import fcntl

LOCK_FILE = ".packtrain.lock"
DEAD_HOLDER_WAIT_S = 10.0
"""How long a claim waits for a holder that died on this host: the lock lasts until its children
(a `pack run`'s workers, which die with it) have exited too."""
RECORD_WAIT_S = 1.0  # a holder writes who it is right after it locks: a loser waits this long to read it
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class FolderInUse(ConfigError):
    """Another run holds the output folder; nothing of it was read or changed."""


@contextlib.contextmanager
def claim_output(folder: Path, command: str, option: str, shared: bool = False) -> Iterator[None]:
    """Hold `folder` for `command` (e.g. "pack run") until the block ends; FolderInUse when another
    run holds it (exclusively, or at all when this claim is exclusive). `option`: how the user
    names another output folder (e.g. "-o"), for the messages."""
    if sys.platform == "win32":  # no flock: runs are not kept apart there
        yield
        return
    fd = _open_lock(folder, option)
    try:
        locked = _acquire(fd, folder, option, shared)
        if locked:
            _write_record(fd, command, shared)
        try:
            yield
        finally:
            if locked and not shared:  # a clean end: no holder to name (a killed one is told by its pid)
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _open_lock(folder: Path, option: str) -> int:
    """The lock file's descriptor, created 0666 less the umask; never a symlink or a non-file."""
    path = folder / LOCK_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        failure = write_failure(exc, folder, option)
        if failure is not None:
            raise failure from None
        if not folder.is_dir():
            raise ConfigError(f"{folder} is not a folder: choose another output folder ({option})") from None
        raise ConfigError(
            f"cannot claim {folder} for this run: {path} cannot be opened ({exc.strerror or exc}); "
            f"remove it if it is not a plain file, or choose another output folder ({option})"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(
            f"{path} is not a plain file: remove it, or choose another output folder ({option})"
        )
    return fd


def _acquire(fd: int, folder: Path, option: str, shared: bool) -> bool:
    """Lock `fd` (True), or False where the file system has no locks (a warning says what that
    leaves open); FolderInUse naming the holder when another run has it."""
    mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, mode)
            return True
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            print(
                f"WARNING {folder}: its file system does not support locks ({exc.strerror}); nothing "
                "keeps another run from using the folder at the same time",
                file=sys.stderr,
            )
            return False
        holder = _read_record(fd)
        waited = time.monotonic() - start
        dead = holder is not None and _gone(holder)
        if (dead and waited < DEAD_HOLDER_WAIT_S) or (holder is None and waited < RECORD_WAIT_S):
            time.sleep(0.1)
            continue
        raise FolderInUse(_in_use(folder, holder, dead, option))


def _write_record(fd: int, command: str, shared: bool) -> None:
    """Who holds the lock now, for a refused run's message (a shared holder replaces a killed
    exclusive holder's record, which no longer says anything true)."""
    record = {
        "command": command,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "shared": shared,
    }
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)


def _read_record(fd: int) -> dict[str, Any] | None:
    """The holder's record, or None (none yet, or one being written)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    # The file is the folder's, writable by whoever can write there: only short printable fields.
    return {k: "".join(c for c in str(v)[:120] if c.isprintable()) for k, v in record.items()}


def _gone(holder: dict[str, Any]) -> bool:
    """True only when the holder provably no longer runs: a process of this host that is gone."""
    if holder.get("host") != socket.gethostname() or not holder.get("pid", "").isdigit():
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, as another user
        return False
    return False


def _in_use(folder: Path, holder: dict[str, Any] | None, dead: bool, option: str) -> str:
    other = f"choose another output folder ({option}); nothing in {folder} was changed"
    if holder is None:
        return (
            f"{folder} is in use by another packtrain run (the stages of a PackJob, or a run that is "
            f"starting): wait for it to finish, or {other}"
        )
    who = f"`{holder.get('command', '?')}` (pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    if dead:
        return (
            f"{folder} is still held by processes that {who}, killed) started: stop them and run again, "
            f"or {other}"
        )
    return (
        f"{folder} is in use by {who}, since {holder.get('since', '?')}): wait for it to finish or stop "
        f"it, or {other}"
    )
