"""The root-filesystem runner's path and user rules (no image needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cluster import rootfs


def test_mount_targets_stay_inside_the_root(tmp_path: Path) -> None:
    """An image's symlinks are followed as the container sees them, never out into the host."""
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (root / "var").mkdir()
    os.symlink("/run", root / "var" / "run")  # Debian's, absolute
    os.symlink("../../../../../etc", root / "var" / "up")  # climbs past the root
    assert rootfs._inside(root, "/var/run/packtrain/kubeconfig") == root / "run" / "packtrain" / "kubeconfig"
    assert rootfs._inside(root, "/var/up/hosts") == root / "etc" / "hosts"
    assert rootfs._inside(root, "/../../a/./b/../c") == root / "a" / "c"
    os.symlink("loop", root / "loop")
    with pytest.raises(OSError, match="too many symbolic links"):
        rootfs._inside(root, "/loop/x")


def test_image_user_must_be_numeric() -> None:
    assert rootfs.numeric_user("65532:65532") == (65532, 65532)
    assert rootfs.numeric_user("") == (0, 0)
    assert rootfs.numeric_user("1000") == (1000, 0)
    with pytest.raises(ValueError, match="not numeric"):
        rootfs.numeric_user("packtrain")
