"""Making a folder unwritable for real, as the full- and unwritable-output tests need."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def make_unwritable(folder: Path) -> None:
    """No new entries in `folder` for this user: mode 0500, or for root (whom modes do not stop) the
    immutable attribute, where the file system has one."""
    if os.getuid() != 0:
        folder.chmod(0o500)
        return
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(
            f"running as root, whom modes do not stop, and chattr +i is refused here "
            f"({done.stderr.strip()}): no way to make a folder unwritable"
        )


def make_writable(folder: Path) -> None:
    if os.getuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], check=False)
    folder.chmod(0o755)
