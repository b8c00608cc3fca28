"""A second, pinned transformers for running a model family's upstream reference code.

Some families' released code (LLaVA-OneVision-1.5's remote modeling file) builds only with the
transformers it was written for (4.53.x), while the project runs a current one. Tests that compare
the project's own implementation with that code run it in a subprocess whose `PYTHONPATH` puts a
folder holding only the pinned packages first; everything else (torch, numpy, safetensors, regex,
requests, ...) comes from the main environment underneath.

The folder is built once by `pip install --target --no-deps` with exact pins and cached under
`~/.cache/packtrain-tests/`, keyed on the pins and the Python version: a cold machine with PyPI
access pays for it once (a few seconds, three wheels), later runs reuse it. `--no-deps` keeps pip
from pulling a second torch; the pins are the packages transformers 4.53.1 needs at versions the
main environment does not have (tokenizers < 0.22, huggingface-hub < 1.0).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TRANSFORMERS_4_53 = ("transformers==4.53.1", "tokenizers==0.21.4", "huggingface-hub==0.34.4")
_READY = "packtrain-reference-env.ok"


def cache_root() -> Path:
    """Where pinned environments live (XDG cache, or `~/.cache`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "packtrain-tests" / "reference-env"


def env_key(pins: tuple[str, ...]) -> str:
    """A folder name that changes with the pins and the interpreter (wheels are per Python)."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    digest = hashlib.sha256("\n".join((tag, *pins)).encode()).hexdigest()[:16]
    return f"{tag}-{digest}"


def reference_env(pins: tuple[str, ...] = TRANSFORMERS_4_53) -> Path:
    """The site folder holding `pins`, installed on first use (under a lock, published by rename
    so a half-finished install is never used)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / env_key(pins)
    if (target / _READY).is_file():
        return target
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _READY).is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=root))
        try:
            _pip_install(staging, pins)
            (staging / _READY).write_text("\n".join(pins) + "\n")
            if target.exists():  # a broken earlier attempt without the marker
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _pip_install(folder: Path, pins: tuple[str, ...]) -> None:
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary=:all:",
        "--target",
        str(folder),
        *pins,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install {' '.join(pins)}:\n{done.stderr[-4000:]}")


# Packages of the main environment that the pinned transformers would pick up and cannot import
# (`kernels` there is built for huggingface-hub 1.x): the child sees them as absent.
HIDDEN = ("kernels",)


def run_reference(
    script: Path, args: list[str], site: Path, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """Run `script` as `__main__` in a child Python that imports from `site` first and does not see
    `HIDDEN` (so transformers' optional-package probes find nothing there)."""
    boot = (
        "import runpy, sys\n"
        f"for name in {HIDDEN!r}:\n"
        "    sys.modules[name] = None\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    command = [sys.executable, "-c", boot, str(script), *args]
    return subprocess.run(command, env=subprocess_env(site), capture_output=True, text=True, timeout=timeout)


def subprocess_env(site: Path) -> dict[str, str]:
    """The environment of a child Python that imports the pinned packages before the main ones."""
    env = dict(os.environ)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(site) if not rest else f"{site}{os.pathsep}{rest}"
    env["PYTHONNOUSERSITE"] = "1"
    env["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    return env
