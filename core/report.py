"""Reporting a stage's outcome to whoever runs it.

On Kubernetes the operator reads each pod's termination message, so workload
pods need no API permissions to report their stats; locally the same JSON is
printed to stdout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from packtrain.core.config import DEFAULT_MAX_REJECTED_FRACTION
from packtrain.core.contract import reject_fixes

TERMINATION_LOG = "/dev/termination-log"
LIMIT = 4096  # the kubelet keeps at most 4 KiB of a termination message


def write_line(text: str, stream: TextIO | None = None) -> None:
    """Write `text` and its newline in one write, then flush.

    `print` writes the text and the newline separately when Python runs unbuffered
    (PYTHONUNBUFFERED=1, common in containers and CI), so lines of processes sharing one pipe
    (torchrun's ranks) could interleave as `{...}{...}`; one write of a line under the pipe's
    4 KiB atomic limit cannot be split.
    """
    out = sys.stdout if stream is None else stream
    out.write(text + "\n")
    out.flush()


def termination_log_path() -> Path | None:
    env = os.environ.get("PACKTRAIN_TERMINATION_LOG")
    if env:
        return Path(env)
    default = Path(TERMINATION_LOG)
    return default if default.exists() and os.access(default, os.W_OK) else None


def compact(summary: dict[str, Any]) -> str:
    """JSON under the kubelet's 4 KiB limit: drops the bulkiest optional keys first."""
    text = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    if len(text.encode()) <= LIMIT:
        return text
    slim = {k: v for k, v in summary.items() if not isinstance(v, (dict, list))}
    slim["truncated"] = True
    text = json.dumps(slim, separators=(",", ":"), sort_keys=True)
    # Still too long (a long error, or one whose characters JSON escapes to 6 bytes each): shorten
    # the longest strings rather than cut the JSON, which the operator could then not parse.
    while len(text.encode()) > LIMIT:
        key = max(
            (k for k, v in slim.items() if isinstance(v, str) and v), key=lambda k: len(slim[k]), default=None
        )
        if key is None:
            return json.dumps({"truncated": True})
        value = slim[key]
        slim[key] = value[: len(value) * LIMIT // len(text.encode()) * 9 // 10]
        text = json.dumps(slim, separators=(",", ":"), sort_keys=True)
    return text


def report(summary: dict[str, Any]) -> None:
    text = compact(summary)
    write_line(text)
    path = termination_log_path()
    if path is not None:
        path.write_text(text)


def rejects_warning(counts: dict[str, Any], out: Path) -> str | None:
    """A loud line for a pack that rejected samples: the share, the top reasons and what to change."""
    samples, rejected = counts.get("input") or 0, counts.get("rejected") or 0
    if not rejected:
        return None
    top = sorted((counts.get("rejected_by_reason") or {}).items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    reasons = ", ".join(f"{reason} {n}" for reason, n in top)
    fixes = reject_fixes(top)
    return (
        f"{rejected} of {samples} samples ({rejected / max(samples, 1):.1%}) were rejected and are not in "
        f"the pack (top reasons: {reasons}); each is listed in {out / 'rejects.jsonl'}"
        + (f". Fix: {fixes}" if fixes else "")
        + ". A pack that loses more than packing.maxRejectedFraction (default "
        f"{DEFAULT_MAX_REJECTED_FRACTION:g}) is refused."
    )
