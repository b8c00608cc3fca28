"""Operator log lines that name their object: `[Kind namespace/name] …` as text, an `object` field as JSON.

kopf tags the lines it logs for an object with a reference (`k8s_ref`); the operator's own
lines pass the same with `extra=ref(...)`, so every line about a resource says which one.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf
from kopf._core.actions.loggers import ObjectJsonFormatter, ObjectTextFormatter

LOG_FORMATS = ("plain", "full", "json")


def ref(kind: str, namespace: str | None, name: str) -> dict[str, Any]:
    """`extra=` for a log call about one object (the shape kopf's own object logger uses)."""
    return {"k8s_ref": {"kind": kind, "namespace": namespace, "name": name}}


class _Prefixing(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        target = getattr(record, "k8s_ref", None)
        if target:
            where = (
                f"{target.get('namespace')}/{target.get('name')}"
                if target.get("namespace")
                else target.get("name")
            )
            record = copy.copy(record)
            record.msg = f"[{target.get('kind')} {where}] {record.msg}"
        return super().format(record)


class TextFormatter(_Prefixing, ObjectTextFormatter):
    """kopf's text formatter with the object's kind in the prefix."""


def configure(log_format: str, verbose: bool) -> None:
    """kopf's logging with our formatter: plain/full text prefixed `[Kind ns/name]`, or JSON with `object`."""
    kopf.configure(
        verbose=verbose, log_format=kopf.LogFormat.JSON if log_format == "json" else kopf.LogFormat.FULL
    )
    formatter: logging.Formatter
    if log_format == "json":
        formatter = ObjectJsonFormatter(refkey="object")
    else:
        fmt = kopf.LogFormat.PLAIN.value if log_format == "plain" else kopf.LogFormat.FULL.value
        formatter = TextFormatter(fmt)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
