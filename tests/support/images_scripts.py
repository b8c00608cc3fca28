"""images/'s scripts (lock.py, lock_layers.py) as modules: they are files run in builds, not a package."""

from __future__ import annotations

import importlib.util
from typing import Any

from support.paths import REPO


def images_script(name: str) -> Any:
    """images/`name`.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location(f"images_{name}", REPO / "images" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
