"""Polling the local control plane until something happens (for every test folder that uses it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    what: str,
    probe: Callable[[], Any],
    timeout: float = 60,
    every: float = 0.5,
    diagnostics: Callable[[], str] | None = None,
) -> Any:
    """Poll until ``probe`` returns something truthy and return that.

    On timeout fail with the last value ``probe`` returned and, when given, ``diagnostics()``.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    extra = f"\n{diagnostics()}" if diagnostics else ""
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r}){extra}")
