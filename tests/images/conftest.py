"""The `built_images` fixture: the three images, built (or found up to date) by images/build.sh.

Building needs root, podman and mmdebstrap (the script installs the last two with apt) and PyPI;
where that is impossible the script says why (exit 3) and the image tests are skipped with that
reason, except in CI, where they must run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cluster import rootfs
from cluster.fixture import in_ci

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def built_images() -> dict[str, rootfs.Image]:
    if os.environ.get("PACKTRAIN_SKIP_IMAGES") == "1" and not in_ci():
        pytest.skip("image tests skipped because PACKTRAIN_SKIP_IMAGES=1")
    try:
        return rootfs.ensure_built()
    except rootfs.ImagesUnavailable as e:
        if in_ci():
            pytest.fail(f"CI must build the images, but: {e}")
        pytest.skip(f"SKIPPED LOUDLY: the images cannot be built on this machine: {e}")
