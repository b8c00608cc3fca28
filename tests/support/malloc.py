"""glibc malloc settings for the processes the suite starts, and glibc's defaults for those whose
memory a test measures.

The suite's models are tiny but keep the real vocabularies (151,936 tokens), so every forward
allocates logits and their gradient of tens to hundreds of megabytes. glibc serves any block over
32 MiB (the most its mmap threshold rises to) with a mapping of its own and unmaps it when freed:
each forward faults in and zeroes those pages again. With no mmapped blocks (`MALLOC_MMAP_MAX_=0`)
and up to 1 GiB of free heap kept at its top, freed blocks are reused instead. Measured on this
suite's 2-core machine: `tests/trainer/test_equivalence.py` (in the pytest process) 42 -> 31 CPU-s,
kernel time 13.7 -> 4.5 s; `test_context_parallel.py` with `test_hostile_model_folder.py` (their
torchrun ranks and CLIs) 642 -> 598 CPU-s, kernel time 157 -> 101 s; `test_train.py`, `test_lora.py`
and `test_workers.py` on an idle machine, twice each way: 196 / 206 -> 178 / 188 CPU-s (-9%).

glibc reads the variables when a process starts: they reach the processes the tests start
(trainers, torchrun ranks, CLIs), and `in_this_process` applies them to a pytest process, one test
module at a time. The heap keeps what a process freed, which moves the peak a test reads: a module
that measures the memory of a process carries `pytest.mark.measures_memory` and runs with glibc's
defaults, as a user's processes do (`support.measure.run_measured` does the same for its command).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, Mapping, MutableMapping

SETTINGS = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def tune(environ: MutableMapping[str, str]) -> None:
    """Set the suite's settings where the environment does not already choose."""
    for key, value in SETTINGS.items():
        environ.setdefault(key, value)


def glibc_default(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the settings: a process started with it allocates as glibc does by default."""
    return {key: value for key, value in environ.items() if key not in SETTINGS}


# mallopt's parameters (malloc.h) and glibc's defaults for them.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536


@contextlib.contextmanager
def in_this_process() -> Iterator[None]:
    """The settings for this (already started) process while the block runs, through mallopt; after
    it, glibc's values again and the freed heap handed back (malloc_trim), so what one test module
    kept is not what the next one starts from. Nothing where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_MAX, int(SETTINGS["MALLOC_MMAP_MAX_"]))
    libc.mallopt(_M_TRIM_THRESHOLD, int(SETTINGS["MALLOC_TRIM_THRESHOLD_"]))
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        return None
    return ctypes.CDLL(None) if version and version.startswith("glibc") else None
