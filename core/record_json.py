"""JSON from a dataset: a record's own text, and JSON held in one of its string fields (`tools`, a
function call, its arguments), parsed only once its shape is within a record's limits.

Python's parser recurses once per nesting level and builds an object of some 60-100 bytes per
value, so both are measured on the text before `json.loads` builds anything (`untrusted.json_shape`:
no object is built): deeper than `MAX_NESTING_DEPTH` is `bad_json`, more than `MAX_RECORD_VALUES`
values `record_too_large`. A string field's JSON lies inside its record, so `MAX_RECORD_BYTES`
bounds its size too. The same bound for both: a string field is a record one level down.
"""

from __future__ import annotations

import json
from typing import Any

from packtrain.core.contract import MAX_NESTING_DEPTH, MAX_RECORD_VALUES, RejectReason
from packtrain.core.untrusted import json_shape

__all__ = ["RecordJSONError", "loads", "shape_error"]

# Prefixes scanned before the whole text: a text packed with values is refused after a few MiB.
_PREFIXES = (1 << 22, 1 << 24)


class RecordJSONError(ValueError):
    """JSON text over a record's limits; `reason` is the reject reason it is."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def shape_error(data: bytes, what: str) -> RecordJSONError | None:
    """Why the JSON text `data` is over a record's limits (`what` names it in the detail), or None.

    Counting `[`, `{` and `,` (inside strings too) bounds depth and values from above at C speed, so
    a text within both bounds is never scanned; any other is scanned on growing prefixes, each one a
    lower bound of the whole (a scan from the start counts only what lies outside strings)."""
    brackets = data.count(b"[") + data.count(b"{")
    if brackets <= MAX_NESTING_DEPTH and brackets + data.count(b",") < MAX_RECORD_VALUES:
        return None
    for end in (*(p for p in _PREFIXES if p < len(data)), len(data)):
        depth, values = json_shape(data if end == len(data) else data[:end], MAX_NESTING_DEPTH)
        if depth > MAX_NESTING_DEPTH:
            return RecordJSONError(
                RejectReason.BAD_JSON,
                f"{what}: nested {depth} levels deep, more than the {MAX_NESTING_DEPTH} a record may have",
            )
        if values > MAX_RECORD_VALUES:
            return RecordJSONError(
                RejectReason.RECORD_TOO_LARGE,
                f"{what}: holds {'over ' if end < len(data) else ''}{values} JSON values, more than the "
                f"{MAX_RECORD_VALUES} a record may have; not parsed",
            )
    return None


def loads(text: str, what: str) -> Any:
    """`json.loads` of JSON held in a record's string field; RecordJSONError when its shape is over a
    record's limits, `json.JSONDecodeError` (as `json.loads`) when it is not JSON."""
    error = shape_error(text.encode("utf-8", "surrogatepass"), what)
    if error is not None:
        raise error
    return json.loads(text)
