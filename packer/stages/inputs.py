"""What a pack was made from, and whether a re-run may keep it.

Before the manifest, finalize records in work/INPUTS_RECORD every dataset file and every media file a
sample stored (size, modification time, sha256: a MediaItem's key is the sha256 of its bytes), and
the media files that rejects named as missing or unreadable. A re-run of a finished pack (`pack run`,
and `pack refresh`, which `packtrain run` calls before convert) compares: one stat per file, a file
re-hashed only where its size or time changed (a `touch` keeps the pack). Changed inputs clear the
pack so the stages rebuild it; unchanged ones keep it. Either way the run says which, in one line.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from packtrain.core.config import PackConfig
from packtrain.core.errors import ConfigError
from packtrain.core.pack.shards import (
    MANIFEST,
    REJECTS,
    SHARDS_DIR,
    atomic_write,
    canonical_json,
    read_manifest,
    read_table,
    sha256_file,
)
from packtrain.packer.media.access import EMBEDDED_DIR
from packtrain.packer.sources.records import source_files
from packtrain.packer.stages.workdir import (
    MISSING_MEDIA_KEY,
    check_output_config,
    part_name,
    refusal,
    rejects_in_order,
    work_dir,
)

INPUTS_RECORD = "inputs.json"
"""Under work/: the dataset and media files the pack was made from (see the module docstring)."""
SHOWN_CHANGES = 3  # changes named in the rebuild line; the check stops looking after these


def record_inputs(out: Path, plan_info: dict[str, Any]) -> None:
    """Write work/INPUTS_RECORD for the pack plan described (its inputs, its convert workers' files)."""
    work = work_dir(out)
    datasets = {i["path"]: {**_stat(i["path"]), "sha256": i["sha256"]} for i in plan_info["inputs"]}
    media = {path: {**_stat(path), "sha256": key} for path, key in _stored_media(out, plan_info).items()}
    with rejects_in_order(work, plan_info["convert_workers"]) as rejects:
        missing = sorted({r[MISSING_MEDIA_KEY] for r in rejects if r.get(MISSING_MEDIA_KEY)})
    data = canonical_json({"datasets": datasets, "media": media, "missing_media": missing})
    path = work / INPUTS_RECORD
    if not (path.is_file() and path.read_bytes() == data):  # a re-run that changed nothing writes nothing
        atomic_write(path, data)


def _stored_media(out: Path, plan_info: dict[str, Any]) -> dict[str, str]:
    """Each media file the converted samples name (path -> sha256), less those embedded in a dataset
    file (kept in the work folder: the dataset file's own record covers them)."""
    work, count = work_dir(out), plan_info["convert_workers"]
    embedded = os.path.realpath(work / EMBEDDED_DIR) + os.sep
    found: dict[str, str] = {}
    for i in range(count):
        media = pc.list_flatten(read_table(work / "convert" / f"part-{part_name(i, count)}.arrow")["media"])
        paths, keys = pc.struct_field(media, "path"), pc.struct_field(media, "key")
        found.update(zip(paths.to_pylist(), keys.to_pylist(), strict=True))
    return {
        p: k
        for p, k in found.items()
        if EMBEDDED_DIR not in p or not os.path.realpath(p).startswith(embedded)
    }


def _stat(path: str) -> dict[str, int | None]:
    try:
        st = os.stat(path)
    except OSError:
        return {"bytes": None, "mtime_ns": None}
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _changed(path: str, was: dict[str, Any]) -> str | None:
    """How a recorded file differs now ("modified", "removed"), or None: its bytes are the same."""
    now = _stat(path)
    if now["bytes"] is None:
        return None if was["bytes"] is None else "removed"
    if was["bytes"] is None:
        return "added"
    if now == {"bytes": was["bytes"], "mtime_ns": was["mtime_ns"]}:
        return None
    if not os.path.isfile(path):  # now a folder, FIFO or device: changed, and never opened
        return "modified"
    try:
        return None if sha256_file(Path(path)) == was["sha256"] else "modified"
    except OSError:
        return "unreadable"


def _changes(cfg: PackConfig, record: dict[str, Any]) -> Iterator[str]:
    """What differs from the record: dataset files (the globs matched anew), stored media, and the
    missing media that are now there."""
    datasets: dict[str, Any] = record["datasets"]
    now = [str(f.path) for f in source_files(cfg.source.paths)]
    yield from (f"{p} added" for p in now if p not in datasets)
    yield from (f"{p} removed" for p in datasets if p not in now)
    for path, was in (*datasets.items(), *record["media"].items()):
        how = _changed(path, was)
        if how is not None:
            yield f"{path} {how}"
    for path in record["missing_media"]:
        if os.path.isfile(path):
            yield f"{path} added (a reject named it missing)"


def refresh(cfg: PackConfig, out: Path) -> str | None:
    """Keep a finished pack in `out` whose inputs are unchanged, or clear it for a rebuild when they
    changed; the one line that says which (None: nothing finished to keep, the stages start or resume).

    A folder claimed by another configuration, or whose manifest another one made, is left alone:
    ConfigError, saying how to start fresh."""
    check_output_config(cfg, out)
    manifest = out / MANIFEST
    if manifest.is_file():
        made_by = read_manifest(out).get("config_hash")
        if made_by != cfg.config_hash():
            raise ConfigError(
                f"{manifest} was made with another configuration (hash {str(made_by)[:12]}…); it is not "
                "rebuilt over. Use a new output folder, or delete this one to re-pack."
            )
    elif refusal(out) is None:
        return None
    path = work_dir(out) / INPUTS_RECORD
    if not path.is_file():
        if not manifest.is_file():
            return None
        return (
            f"kept: {manifest} (made before packs recorded their inputs, so changes cannot be told; delete "
            f"{out} to re-pack)"
        )
    record = json.loads(path.read_text())
    changes = []
    for change in _changes(cfg, record):
        changes.append(change)
        if len(changes) == SHOWN_CHANGES:
            break
    if changes:
        _clear(out)
        return f"inputs changed since the pack was made ({'; '.join(changes)}): rebuilding {out}"
    if not manifest.is_file():
        return None  # a refused pack of the same inputs: finalize refuses it again, saying why
    counted = len(record["datasets"]) + len(record["media"]) + len(record["missing_media"])
    return f"kept: {manifest} is up to date with its {counted} inputs"


def _clear(out: Path) -> None:
    """Remove a finished pack's files (the manifest first: a pack interrupted here never looks whole)."""
    try:
        (out / MANIFEST).unlink(missing_ok=True)
        (out / REJECTS).unlink(missing_ok=True)
        for folder in (out / SHARDS_DIR, work_dir(out)):
            if folder.exists():
                shutil.rmtree(folder)
    except OSError as exc:
        raise ConfigError(
            f"the inputs of the pack in {out} changed, but it cannot be cleared for the rebuild ({exc}); "
            "delete the folder (or use a new one) and run again"
        ) from exc
