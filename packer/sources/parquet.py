"""Reading Parquet datasets row group by row group, as Hugging Face `datasets` and LLaVA-OneVision write them.

Each row becomes the same record a JSON line would be (`to_pylist`: list and struct
columns become lists and dicts), so `source.fieldMap` names the conversation and
media columns as for JSON. An image or video stored inside the file, a
`{"bytes": ..., "path": ...}` struct (the `datasets` Image feature), becomes an
`EmbeddedMedia` reference: measured from its bytes under the same caps and decoder
allow-list as a file (`media.MediaAccess`), keyed by their sha256. A struct without
bytes names a path, resolved and confined like a JSON record's.

A row group is the unit of work (convert workers split by row groups) and is read in
batches of at most `BATCH_ROWS` rows and about `BATCH_BYTES` decoded bytes (see there), so
memory holds one batch, never a whole file. A file
is untrusted like any dataset: a footer that cannot be read is one `bad_parquet`
reject for the whole file, a row group that fails to decode one reject per row it
declares, so every count still adds up.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from packtrain.core.contract import MAX_NESTING_DEPTH, RejectReason
from packtrain.packer.sources.raw import Copies, RawRecord, Want, skipped

BATCH_ROWS = 64
"""Rows decoded at a time: a batch of images is what memory holds, whatever the row group size."""

BATCH_BYTES = 256 << 20
"""Budget of decoded bytes per batch. From the footer (each column chunk's uncompressed size) a row
group's batches get fewer rows so that one batch stays within it; where dictionaries would expand
past it (a value stored once, referenced by every row), the batch's rows are converted one at a time."""

MAX_ROW_BYTES = 2**31 - 1
"""Most decoded bytes of one row (its text and embedded media together: a shard row or media blob holds
less): a larger row is a `record_too_large` reject, found from the footer or the dictionaries before it
is decoded into Python objects."""

_EMBEDDED_FIELDS = frozenset({"bytes", "path"})


class EmbeddedMedia(str):
    """A media reference whose bytes are in the dataset file: a `str` (what the conversation
    parser pairs with placeholders) carrying `data`. Only the Parquet reader makes one, so a
    JSON record's string can never stand for another record's bytes."""

    data: bytes

    def __new__(cls, data: bytes, name: str | None) -> EmbeddedMedia:
        label = f"embedded {len(data)} bytes" + (f" ({name[:100]!r})" if name else "")
        ref = super().__new__(cls, label)
        ref.data = data
        return ref


def parquet_rows(path: Path) -> list[int] | None:
    """Rows of each row group, from the footer; None when the file cannot be used (see `_open`)."""
    opened = _open(path)
    return (
        None
        if isinstance(opened, str)
        else [opened.metadata.row_group(g).num_rows for g in range(opened.metadata.num_row_groups)]
    )


def _open(path: Path) -> pq.ParquetFile | str:
    """The file, or why it cannot be read: no footer, a schema nested deeper than records may be, or
    more rows declared than the file has bytes (a footer may claim anything; each row costs at least
    a byte of real data, and an unbounded count would keep a worker counting placeholders)."""
    try:
        pf = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
        # Byte-array columns stay dictionaries: expanding them is what a tiny file could make huge.
        leaves = [pf.schema.column(i) for i in range(pf.metadata.num_columns)]
        dicts = [c.path for c in leaves if c.physical_type == "BYTE_ARRAY"]
        if dicts:
            pf = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False, read_dictionary=dicts)
        meta = pf.metadata
        rows = meta.num_rows
        depth = max((_depth(pf.schema_arrow.field(i).type) for i in range(len(pf.schema_arrow))), default=0)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError or anything on a hostile footer
        return f"{path.name}: not a readable Parquet file ({type(exc).__name__}: {str(exc)[:200]})"
    size = path.stat().st_size
    if rows > size or any(meta.row_group(g).num_rows < 0 for g in range(meta.num_row_groups)):
        return f"{path.name}: the footer declares {rows} rows in a file of {size} bytes"
    if depth > MAX_NESTING_DEPTH:
        return (
            f"{path.name}: columns nest {depth} levels deep, more than the {MAX_NESTING_DEPTH} a record "
            "may have"
        )
    return pf


def _depth(t: pa.DataType) -> int:
    if pa.types.is_struct(t):
        return 1 + max((_depth(t.field(i).type) for i in range(t.num_fields)), default=0)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return 1 + _depth(t.value_type)
    if pa.types.is_map(t):
        return 2 + max(_depth(t.key_type), _depth(t.item_type))
    return 0


def read_parquet(path: Path, unit_wanted: Want, times: Copies = None) -> Iterator[RawRecord]:
    """Every row of one file, in order, as a RawRecord with `index` the row number.

    `unit_wanted` is asked once per row group (once for an unreadable file); a refused group,
    or one whose rows `times` takes none of, is not read and yields placeholders.
    """
    opened = _open(path)
    if isinstance(opened, str):
        yield (
            RawRecord(path, 0, None, opened, RejectReason.BAD_PARQUET) if unit_wanted() else skipped(path, 0)
        )
        return
    meta = opened.metadata
    start = 0
    for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        wanted = unit_wanted() and (times is None or any(times[start : start + rows]))
        if wanted:
            yield from _read_group(opened, path, g, start, rows)
        else:
            for i in range(start, start + rows):
                yield skipped(path, i)
        start += rows


def _read_group(pf: pq.ParquetFile, path: Path, group: int, start: int, rows: int) -> Iterator[RawRecord]:
    """Exactly `rows` records: the decoded rows, then one reject for each row that did not decode."""
    index = start
    end = start + rows
    declared = pf.metadata.row_group(group).total_byte_size  # uncompressed, from the footer
    per_row = math.ceil(declared / rows) if rows else 0
    if per_row > MAX_ROW_BYTES:
        detail = (
            f"{path.name}: row group {group} declares {declared} uncompressed bytes for {rows} rows, "
            f"over {MAX_ROW_BYTES} bytes a row may decode to; not decoded"
        )
        for i in range(start, end):
            yield RawRecord(path, i, None, detail, RejectReason.RECORD_TOO_LARGE)
        return
    batch_rows = max(1, min(BATCH_ROWS, BATCH_BYTES // max(per_row, 1)))
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[group], use_threads=False):
            for record in _budgeted(batch, path, index):
                if index == end:
                    return  # more rows than the footer declares: positions follow the footer
                yield record
                index += 1
    except Exception as exc:  # a corrupt page, a bad compression stream, an unsupported type
        detail = f"{path.name}: row group {group} does not decode ({type(exc).__name__}: {str(exc)[:200]})"
        for i in range(index, end):
            yield RawRecord(path, i, None, detail, RejectReason.BAD_PARQUET)
        return
    for i in range(index, end):
        detail = f"{path.name}: row group {group} holds fewer rows than its footer declares ({rows})"
        yield RawRecord(path, i, None, detail, RejectReason.BAD_PARQUET)


def _budgeted(batch: pa.RecordBatch, path: Path, start: int) -> Iterator[RawRecord]:
    """The batch's records, converted together when their decoded size is within BATCH_BYTES, else one
    at a time (a row over MAX_ROW_BYTES not at all), so memory never holds more than the budget or
    one row."""
    if batch.num_rows <= 1 or expanded_bytes(batch) <= BATCH_BYTES:
        yield from _batch_records(batch, path, start)
        return
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        size = expanded_bytes(row)
        if size > MAX_ROW_BYTES:
            detail = (
                f"{path.name}: row {start + i} decodes to {size} bytes, over {MAX_ROW_BYTES}; not decoded"
            )
            yield RawRecord(path, start + i, None, detail, RejectReason.RECORD_TOO_LARGE)
        else:
            yield from _batch_records(row, path, start + i)


def expanded_bytes(data: pa.RecordBatch | pa.Array) -> int:
    """About how many bytes `data` takes once its dictionaries are expanded (what `to_pylist` builds),
    computed from dictionary value lengths and indices without expanding anything."""
    if isinstance(data, pa.RecordBatch):
        return sum(expanded_bytes(column) for column in data.columns)
    t = data.type
    if pa.types.is_dictionary(t):
        values = data.dictionary
        if (
            pa.types.is_binary(values.type)
            or pa.types.is_string(values.type)
            or pa.types.is_large_binary(values.type)
            or pa.types.is_large_string(values.type)
        ):
            taken = pc.take(pc.binary_length(values), data.indices)
            return int(pc.sum(taken).as_py() or 0) + 8 * len(data)
        return values.nbytes // max(len(values), 1) * len(data) + 8 * len(data)
    if pa.types.is_struct(t):
        return sum(expanded_bytes(child) for child in data.flatten()) + 8 * len(data)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return expanded_bytes(data.flatten()) + 8 * len(data)
    if pa.types.is_map(t):  # its children unsliced: at most an overestimate
        return expanded_bytes(data.keys) + expanded_bytes(data.items) + 8 * len(data)
    return data.nbytes


def _batch_records(batch: pa.RecordBatch, path: Path, start: int) -> list[RawRecord]:
    """The batch's rows as records; when the batch does not convert as a whole, row by row, so one
    bad row (a string column that is not UTF-8) is one reject."""
    try:
        return [_record(path, start + i, row) for i, row in enumerate(batch.to_pylist())]
    except Exception:  # noqa: BLE001  (find the culprit rows below)
        pass
    out = []
    for i in range(batch.num_rows):
        try:
            out.append(_record(path, start + i, batch.slice(i, 1).to_pylist()[0]))
        except Exception as exc:
            reason = (
                RejectReason.BAD_UTF8 if isinstance(exc, UnicodeDecodeError) else RejectReason.BAD_PARQUET
            )
            detail = f"{path.name}: row {start + i} does not convert ({type(exc).__name__}: {str(exc)[:200]})"
            out.append(RawRecord(path, start + i, None, detail, reason))
    return out


def _record(path: Path, index: int, row: dict[str, Any]) -> RawRecord:
    return RawRecord(path, index, {k: _unwrap(v) for k, v in row.items()}, None)


def _unwrap(value: Any) -> Any:
    """Embedded media structs replaced by `EmbeddedMedia` (bytes present) or their path (bytes null)."""
    if isinstance(value, dict):
        data = value.get("bytes")
        if (
            value.keys() <= _EMBEDDED_FIELDS
            and "bytes" in value
            and (data is None or isinstance(data, bytes))
        ):
            name = value.get("path")
            name = name if isinstance(name, str) and name else None
            return EmbeddedMedia(data, name) if data is not None else name
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    return value
