"""Run a command inside a locally built image's root filesystem, as a container runtime would.

`podman run` needs cgroups, which the test machines lack; this needs only root. The image's
layers (from the storage `images/build.sh` fills) are stacked read-only under a fresh writable
overlay in a private mount namespace; /proc, a minimal /dev (null, zero, random, …, a tmpfs
/dev/shm), a tmpfs /tmp and the host's /etc/hosts and /etc/resolv.conf are mounted, then the
caller's volumes are bind-mounted, and the command runs chrooted there, in the working dir, as
the user and groups given, with exactly the environment given (the image's ENV first, then the
container's). The host's network is shared: a pod on the test cluster reaches the API server and
its peers on loopback as before.

`container_argv(...)` returns the argv that does all this (a `unshare --mount` of this file), so
the caller starts, signals and waits for it like any process; the process the caller holds
becomes the container's command (exec), hence SIGTERM reaches it directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IMAGE_TAGS = {name: f"localhost/packtrain/{name}:dev" for name in ("operator", "packer", "trainer")}
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "images" / "build.sh"
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


def cache_dir() -> Path:
    """Where `images/build.sh` keeps the podman storage (same rule as the script)."""
    root = os.environ.get("PACKTRAIN_CACHE_DIR") or str(Path.home() / ".cache" / "packtrain")
    return Path(root) / "images"


class ImagesUnavailable(RuntimeError):
    """images/build.sh found building impossible on this machine (exit 3); the message says why."""


def ensure_built(timeout: float = 3600) -> dict[str, Image]:
    """Run images/build.sh (warm: seconds; cold: a Debian base and CUDA torch) and inspect the images.

    PACKTRAIN_IMAGES_PREBUILT=1 uses the local tags as they are, without building (whatever sources
    they were built from): for a machine whose disk cannot hold a rebuild of the trainer image.
    """
    if os.environ.get("PACKTRAIN_IMAGES_PREBUILT") == "1":
        return {name: inspect(tag) for name, tag in IMAGE_TAGS.items()}
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode == 3:
        marker = cache_dir() / "UNAVAILABLE"
        raise ImagesUnavailable(marker.read_text().strip() if marker.is_file() else proc.stderr.strip())
    if proc.returncode != 0:
        raise RuntimeError(f"images/build.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return {name: inspect(tag) for name, tag in IMAGE_TAGS.items()}


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    c = cache_dir()
    cmd = [
        "podman",
        "--root",
        str(c / "storage"),
        "--runroot",
        str(c / "run"),
        "--storage-driver",
        "overlay",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=120)


@dataclass(frozen=True)
class Image:
    """A local image: its read-only layers (top first) and the parts of its config a runtime uses."""

    ref: str
    layers: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    size: int = 0


class ImageNotFound(LookupError):
    pass


def inspect(ref: str) -> Image:
    proc = podman("image", "inspect", ref, check=False)
    if proc.returncode != 0:
        raise ImageNotFound(
            f"image {ref} is not in the local storage {cache_dir() / 'storage'}: "
            f"run `bash images/build.sh` ({proc.stderr.strip()})"
        )
    (info,) = json.loads(proc.stdout)
    data = info["GraphDriver"]["Data"]
    layers = [data["UpperDir"], *filter(None, (data.get("LowerDir") or "").split(":"))]
    cfg = info.get("Config") or {}
    env = dict(e.split("=", 1) for e in cfg.get("Env") or [])
    return Image(
        ref,
        tuple(layers),
        env,
        cfg.get("WorkingDir") or "/",
        cfg.get("User") or "",
        tuple(cfg.get("Entrypoint") or ()),
        tuple(cfg.get("Cmd") or ()),
        cfg.get("Labels") or {},
        int(info.get("Size") or 0),
    )


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False


def numeric_user(user: str) -> tuple[int, int]:
    """An image's USER as (uid, gid); names are not looked up (the chart needs numeric users)."""
    uid, _, gid = (user or "0").partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        raise ValueError(f"image USER {user!r} is not numeric")
    return int(uid), int(gid or 0)


def container_argv(
    image: Image,
    argv: Sequence[str],
    *,
    scratch: Path,
    env: dict[str, str],
    mounts: Sequence[Mount] = (),
    workdir: str | None = None,
    uid: int = 0,
    gid: int = 0,
    groups: Sequence[int] = (),
) -> list[str]:
    """The argv that runs `argv` in `image`'s root filesystem; `scratch` holds its writable layer."""
    scratch.mkdir(parents=True, exist_ok=True)
    spec = {
        "layers": list(image.layers),
        "argv": list(argv),
        "env": env,
        "workdir": workdir or image.workdir,
        "uid": uid,
        "gid": gid,
        "groups": sorted(set(groups)),
        "mounts": [[m.source, m.target, m.read_only] for m in mounts],
        "scratch": str(scratch),
    }
    spec_file = scratch / "spec.json"
    spec_file.write_text(json.dumps(spec))
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        sys.executable,
        str(Path(__file__).resolve()),
        str(spec_file),
    ]


def run(image: Image, argv: Sequence[str], *, timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run to completion in a temporary scratch folder; output captured."""
    with tempfile.TemporaryDirectory(prefix="rootfs-") as tmp:
        return subprocess.run(
            container_argv(image, argv, scratch=Path(tmp), **kw),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


# --- inside the new mount namespace (root, before chroot) ------------------------------------------


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _inside(root: Path, path: str) -> Path:
    """`path` resolved as the container sees it: symlinks in the image (Debian's /var/run -> /run)
    are followed relative to `root`, never out into the host (what runc's securejoin does)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = resolved[:-1]
            continue
        candidate = root.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise OSError(f"too many symbolic links under {path}")
            link = os.readlink(candidate)
            if link.startswith("/"):
                resolved = []
            parts = [p for p in link.split("/") if p not in ("", ".")] + parts
            continue
        resolved.append(part)
    return root.joinpath(*resolved)


def _target(root: Path, path: str, *, is_dir: bool) -> Path:
    target = _inside(root, path)
    if is_dir:
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch(exist_ok=True)
    return target


def _enter(spec: dict[str, Any]) -> None:
    scratch = Path(spec["scratch"])
    root, upper, work = scratch / "root", scratch / "upper", scratch / "work"
    for d in (root, upper, work):
        d.mkdir(exist_ok=True)
    _mount(
        "-t",
        "overlay",
        "overlay",
        "-o",
        f"lowerdir={':'.join(spec['layers'])},upperdir={upper},workdir={work}",
        str(root),
    )
    _mount("-t", "proc", "proc", str(_target(root, "/proc", is_dir=True)))
    dev = _target(root, "/dev", is_dir=True)
    _mount("-t", "tmpfs", "-o", "mode=755,nosuid", "tmpfs", str(dev))
    for name in DEV_NODES:
        _mount("--bind", f"/dev/{name}", str(_target(root, f"/dev/{name}", is_dir=False)))
    _mount(
        "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", str(_target(root, "/dev/shm", is_dir=True))
    )
    for link, to in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(to, dev / link)
    mounted = {m[1].rstrip("/") or "/" for m in spec["mounts"]}
    if "/tmp" not in mounted:
        _mount(
            "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", str(_target(root, "/tmp", is_dir=True))
        )
    for etc in ("/etc/hosts", "/etc/resolv.conf"):
        if Path(etc).is_file() and etc not in mounted:
            _mount("--bind", etc, str(_target(root, etc, is_dir=False)))
    # Shortest target first, so a mount inside another volume lands on top of it.
    for source, target, read_only in sorted(spec["mounts"], key=lambda m: len(m[1])):
        where = _target(root, target, is_dir=Path(source).is_dir())
        _mount("--bind", source, str(where))
        if read_only:
            _mount("-o", "remount,bind,ro", str(where))
    os.chroot(root)
    workdir = spec["workdir"] or "/"
    os.makedirs(workdir, exist_ok=True)  # a runtime creates a missing working dir, as root
    os.chdir(workdir)
    os.setgroups(spec["groups"])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    argv, env = spec["argv"], spec["env"]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"cannot start {argv[0]} in the image: {e}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    _enter(json.loads(Path(sys.argv[1]).read_text()))
