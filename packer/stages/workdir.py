"""The work folder's rules, shared by every stage: names, schemas, the config claim, refusals, rejects.

Every stage reads and writes only the output folder, publishes its results with
atomic renames and ends by writing a small "done" record, so a re-run of a
finished stage is a no-op and a killed worker leaves nothing that looks whole.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from packtrain.core import untrusted
from packtrain.core.config import PackConfig
from packtrain.core.contract import ErrorReport, MaterializeSummary
from packtrain.core.errors import ConfigError, ShardFormatError
from packtrain.core.pack.shards import (
    MANIFEST,
    MANIFEST_LIMITS,
    atomic_write,
    canonical_json,
    read_table,
    remove_stale_temps,
    temp_path,
)
from packtrain.packer.tokenize import Reject

WORK = "work"
CONFIG_CLAIM = "config.json"
REFUSED = "refused.json"  # under work/: why a finished pack got no manifest, and its final counts
SHARD_REJECTS = (
    "rejects"  # a shard's done record: the samples materialize dropped (media that does not decode)
)
Progress = Callable[[int], None]

PART_MEDIA = pa.struct(
    [
        ("kind", pa.string()),
        ("path", pa.string()),
        ("key", pa.string()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("grid_t", pa.int32()),
        ("grid_h", pa.int32()),
        ("grid_w", pa.int32()),
        ("frames", pa.list_(pa.int32())),
        ("second_per_grid", pa.float32()),
    ]
)
PART_SCHEMA = pa.schema(
    [
        ("position", pa.int64()),  # global position of the record over all input files
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("index", pa.int64()),
        ("length", pa.int32()),
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("media", pa.list_(PART_MEDIA)),
    ]
)
PLAN_SCHEMA = pa.schema(
    [
        ("shard", pa.int32()),
        ("parts", pa.list_(pa.int32())),
        ("rows", pa.list_(pa.int32())),
    ]
)


class PackRefused(ConfigError):
    """Every shard is written, but the final counts make the pack useless (NoSamples,
    TooManyRejected): finalize publishes no manifest, so nothing can train on it.

    `report`: the ErrorReport (reason, error); `manifest`: what the manifest would have been (its
    counts and stats, for the operator and `pack run`); `summary`: the materialize worker's summary,
    with the final counts in `pack`, when materialize raised it.
    """

    def __init__(
        self, report: ErrorReport, manifest: dict[str, Any], summary: MaterializeSummary | None = None
    ):
        super().__init__(report["error"])
        self.report, self.manifest, self.summary = report, manifest, summary

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a worker process, re-raised in `pack run`
        return type(self), (self.report, self.manifest, self.summary)


def refusal(out: Path) -> dict[str, Any] | None:
    """The refusal finalize recorded in `out` (REFUSED: the report and the would-be manifest), or None."""
    path = work_dir(out) / REFUSED
    if not path.is_file():
        return None
    damaged = lambda problem: ShardFormatError(f"{problem}; delete {path} and run the pack again")  # noqa: E731
    found = untrusted.read_json(path, Path(os.path.realpath(out)), MANIFEST_LIMITS, damaged)
    return found if isinstance(found, dict) else None


def part_name(index: int, count: int) -> str:
    """The name of worker `index` of `count`'s files (`part-…arrow`, `rejects-…jsonl`, `summary-…json`)."""
    return f"{index:05d}-of-{count:05d}"


def work_dir(out: Path) -> Path:
    return out / WORK


def check_output_config(cfg: PackConfig, out: Path, record: bool = False) -> None:
    """Refuse to mix two configs in one output folder (a re-run with the same config is fine).

    `record` claims a free folder for `cfg`: convert does it once its slice has converted, so a
    config error (a wrong model or path, `overlong: error`) does not lock the folder to the bad config.
    """
    path = work_dir(out) / CONFIG_CLAIM
    want: dict[str, Any] = {"config_hash": cfg.config_hash(), "config": cfg.dump()}
    if not path.is_file():
        if not record:
            return
        _create_once(path, canonical_json(want))
    existing = json.loads(path.read_text())
    if existing.get("config_hash") != want["config_hash"]:
        changed = ", ".join(changed_settings(existing.get("config"), want["config"])[:8]) or "?"
        raise ConfigError(
            f"{out} already holds a pack made with a different configuration "
            f"(hash {existing.get('config_hash', '?')[:12]}… vs {want['config_hash'][:12]}…; settings that "
            f"differ: {changed}). Use a new output folder, or delete this one to re-pack."
        )


_ABSENT = object()  # a setting one of two dumps lacks


def changed_settings(old: Any, new: Any, name: str = "") -> list[str]:
    """The dotted names of the settings two config dumps differ in, a key only one has included, so a
    refusal says what changed: e.g. `model.alpha` for a folder claimed by a packer from before that
    setting (its transparent images were made by another rule)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [name or "the whole configuration"]
    prefix = f"{name}." if name else ""
    return [
        changed
        for key in sorted(set(old) | set(new))
        for changed in changed_settings(old.get(key, _ABSENT), new.get(key, _ABSENT), prefix + key)
    ]


def _create_once(path: Path, data: bytes) -> None:
    """Publish `path` atomically unless it exists: of workers racing to create it, exactly one wins
    (a hard link fails on an existing name, where a rename would replace it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path, "new")
    atomic_write(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links: a rename (last writer wins) is the best left
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sweep(folder: Path, owned: Callable[[str], bool]) -> None:
    """Remove temp files a killed run of this stage left in `folder` (rule: `shards.remove_stale_temps`)."""
    remove_stale_temps(folder, owned, short_write=lambda final: final in (MANIFEST, CONFIG_CLAIM))


def load_plan(out: Path) -> tuple[dict[str, Any], pa.Table]:
    """Plan's record (summary, convert workers, inputs, rejects digest) and its table (PLAN_SCHEMA)."""
    work = work_dir(out)
    if not (work / "plan.json").is_file():
        raise ConfigError(f"no plan in {out}: run `packtrain pack plan` before materialize")
    return json.loads((work / "plan.json").read_text()), read_table(work / "plan.arrow")


MISSING_MEDIA_KEY = "media_path"
"""A convert reject's key for the media file it found missing or unreadable."""

REJECT_DETAIL_CHARS = 1000
"""Longest reject detail kept: a dataset's paths and messages are untrusted and may be huge."""


def reject_row(r: Reject, position: int) -> dict[str, Any]:
    """A reject as the work folder keeps it: with its global `position`, the key that orders them."""
    detail = r.detail if len(r.detail) <= REJECT_DETAIL_CHARS else r.detail[: REJECT_DETAIL_CHARS - 1] + "…"
    row: dict[str, Any] = {
        "position": position,
        "source": r.source,
        "index": r.index,
        "id": r.sample_id,
        "reason": r.reason,
        "detail": detail,
    }
    if r.media_path is not None:  # kept in the work folder only: the pack's input record reads it
        row[MISSING_MEDIA_KEY] = r.media_path
    return row


def reject_line(r: dict[str, Any]) -> bytes:
    """One `rejects.jsonl` line: the reject without its position (an internal ordering key)."""
    keep = {k: r[k] for k in ("source", "index", "id", "reason", "detail")}
    return (json.dumps(keep, ensure_ascii=False) + "\n").encode()


@contextlib.contextmanager
def rejects_in_order(
    work: Path, count: int, late: Sequence[dict[str, Any]] = ()
) -> Iterator[Iterator[dict[str, Any]]]:
    """Every reject in input order: each convert worker's file (already in position order) and
    materialize's `late` rejects, merged streaming. Global positions make the order independent of
    the number of workers."""
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context((work / "convert" / f"rejects-{part_name(i, count)}.jsonl").open("rb"))
            for i in range(count)
        ]
        streams = [(json.loads(line) for line in fh if line.strip()) for fh in files]
        yield heapq.merge(*streams, sorted(late, key=lambda r: r["position"]), key=lambda r: r["position"])
