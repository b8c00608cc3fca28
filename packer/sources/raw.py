"""What every dataset reader yields: one `RawRecord` per record, readable or not.

Kept apart from the readers (`records` for JSON, `parquet`) so each imports it without
importing the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class RawRecord:
    """One input record, or why it could not be read (`reason` is the reject code)."""

    source: Path
    index: int
    record: dict[str, Any] | None
    error: str | None
    reason: str | None = None
    name: str = ""  # the source's name in rejects and shards (see `source_names`); default: the file name
    copy: int = 0  # which repeat of the record this is, when a mixture weight above 1 repeats it

    @property
    def source_name(self) -> str:
        return self.name or self.source.name


SKIPPED = "skipped"
"""`RawRecord.reason` of a record `iter_records(select=...)` did not read (it is not a reject)."""

Times = Sequence[int] | npt.NDArray[np.integer]
"""How many times each record of a file is taken (a mixture's sample is an array)."""
Copies = Times | None
"""A file's `Times`; None: each record once."""

Want = Callable[[], bool]
"""Asked once per unit of work (a JSON record, a Parquet row group): whether to read it."""


def skipped(path: Path, index: int) -> RawRecord:
    """The placeholder for a record not read (another worker's, or one the mixture does not take)."""
    return RawRecord(path, index, None, None, SKIPPED)
