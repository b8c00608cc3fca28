"""What a benchmark rank reads of its own memory: /proc counters, the peak reset, and the training
state it holds (FSDP2's DTensors counted by their local shard). Shared by the memory benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path
from typing import Any


def status_kib(field: str, path: str = "/proc/self/status") -> int:
    """A `Field:` of /proc/self/status (or /proc/meminfo), in KiB."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux: writing 5 to clear_refs resets the peak resident set size)."""
    Path("/proc/self/clear_refs").write_text("5")


def hand_back() -> None:
    """Freed memory back to the system (glibc keeps freed heap pages resident: the next phase's
    peak would count them)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """This rank's parameters, the gradients a step holds (one per trainable parameter, in its
    dtype) and AdamW's state, in bytes (a tied weight once)."""
    params = {id(p): p for p in model.parameters()}.values()
    size = [(_local(p).numel() * _local(p).element_size(), p.requires_grad) for p in params]
    moments = [_local(v) for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return {
        "params": sum(n for n, _ in size),
        "grads": sum(n for n, trainable in size if trainable),
        "optimizer": sum(v.numel() * v.element_size() for v in moments),
    }
