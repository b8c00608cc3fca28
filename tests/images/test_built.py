"""What the built images are: labelled, non-root, lean, holding exactly their locked packages."""

from __future__ import annotations

import json
import tomllib

import pytest
from cluster import rootfs
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# The chart's securityContext runs every pod as 65532.
USER = "65532:65532"
# Uncompressed sizes, as `podman image inspect` reports them. The packer and operator budgets
# keep them well under 1 GB (the operator's 611 MB holds numpy, which measures a JSON file's shape
# before it is parsed); the trainer's is CUDA torch.
SIZE_BUDGET_MB = {"operator": 650, "packer": 850, "trainer": 11000}
ENTRYPOINTS = {"operator": ("packtrain", "operator"), "packer": ("packtrain",), "trainer": ("torchrun",)}
# The environment the lock's markers are evaluated in: the images' interpreter on amd64.
MARKER_ENV = {
    "python_version": "3.11",
    "python_full_version": "3.11.2",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def locked(image: str) -> dict[str, str]:
    """name -> version the image's lock installs on linux/amd64."""
    text = (REPO / "images" / image / "requirements.txt").read_text()
    pins: dict[str, str] = {}
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" --hash")[0].strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(MARKER_ENV):
            (spec,) = req.specifier
            pins[canonicalize_name(req.name)] = spec.version
    return pins


# Run in the image as its user: which distributions the venv holds, and what must not be there.
PROBE = r"""
import importlib.metadata as md, importlib.util, json, os, shutil, sys
venv = [d for d in md.distributions(path=[p for p in sys.path if p.startswith("/opt/packtrain/")])]
leftovers = [p for p in ("/opt/tools", "/root/.cache", "/wheels", "/src", "/etc/pip.conf")
             if os.path.exists(p)]
# apt's package lists and downloaded .debs (its empty folders may stay, as in the slim images).
leftovers += [os.path.join(d, f) for top in ("/var/lib/apt/lists", "/var/cache/apt", "/mnt")
              for d, _, files in os.walk(top) for f in files if f != "lock"]
tools = [t for t in ("gcc", "cc", "g++", "make", "pip", "pip3", "git", "apt-get") if shutil.which(t)
         and shutil.which(t).startswith("/opt/")]
tools += [t for t in ("gcc", "cc", "make", "git") if shutil.which(t)]
print(json.dumps({
    "dists": {d.metadata["Name"]: d.version for d in venv},
    "pip_in_venv": importlib.util.find_spec("pip") is not None,
    "leftovers": leftovers, "tools": tools, "uid": os.getuid(), "gid": os.getgid(),
    "python": sys.executable, "version": sys.version.split()[0],
}))
"""


@pytest.mark.parametrize("name", sorted(rootfs.IMAGE_TAGS))
def test_image_config_is_labelled_and_non_root(built_images: dict[str, rootfs.Image], name: str) -> None:
    image = built_images[name]
    labels = image.labels
    assert labels["org.opencontainers.image.version"] == PYPROJECT["project"]["version"]
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]
    assert labels["org.opencontainers.image.source"].startswith("https://")
    assert labels["org.opencontainers.image.revision"]
    assert image.user == USER
    assert image.entrypoint == ENTRYPOINTS[name]
    assert image.env["PATH"].startswith("/opt/packtrain/bin:")


@pytest.mark.parametrize("name", sorted(rootfs.IMAGE_TAGS))
def test_image_size_within_budget(built_images: dict[str, rootfs.Image], name: str) -> None:
    size_mb = built_images[name].size / 1e6
    print(f"\n{name}: {size_mb:.0f} MB (budget {SIZE_BUDGET_MB[name]} MB)")
    assert size_mb <= SIZE_BUDGET_MB[name]


@pytest.mark.parametrize("name", sorted(rootfs.IMAGE_TAGS))
def test_image_holds_exactly_its_lock_and_no_build_tools(
    built_images: dict[str, rootfs.Image], name: str
) -> None:
    image = built_images[name]
    uid, gid = rootfs.numeric_user(image.user)
    proc = rootfs.run(image, ["python3", "-c", PROBE], env=image.env, uid=uid, gid=gid, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert (found["uid"], found["gid"]) == (65532, 65532)
    assert found["version"].startswith("3.11.")
    assert not found["pip_in_venv"], "pip is a build tool: the venv is made --without-pip"
    assert found["leftovers"] == [] and found["tools"] == []
    dists = {canonicalize_name(k): v for k, v in found["dists"].items()}
    assert dists.pop("packtrain") == PYPROJECT["project"]["version"]
    assert dists == locked(name)


def test_lock_parser_sees_markers() -> None:
    pins = locked("trainer")
    assert "torch" in pins and "nvidia-cublas" in pins  # Linux-only CUDA wheels apply on amd64
    assert "packtrain" not in pins
