"""Editing a finished pack as an attacker with write access to the volume would: rewrite a shard's
rows, then the manifest's sha256 for it, so checksums alone cannot tell."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from packtrain.core.pack.schema import SEQUENCE_SCHEMA
from packtrain.core.pack.shards import MANIFEST, canonical_json, read_table, sha256_file, write_table

Row = dict[str, Any]


def copy_pack(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("work"))
    return dst


def edit_manifest(pack: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((pack / MANIFEST).read_text())
    edit(manifest)
    (pack / MANIFEST).write_bytes(canonical_json(manifest))


def tamper_row(pack: Path, shard: int, row: int, edit: Callable[[Row], None]) -> str:
    """Apply `edit` to one row of one shard, re-sign the shard in the manifest; returns the shard file."""
    manifest = json.loads((pack / MANIFEST).read_text())
    entry = manifest["shards"][shard]
    rows = read_table(pack / entry["file"]).to_pylist()
    edit(rows[row])
    path = pack / entry["file"]
    path.unlink()
    entry["sha256"] = write_table(path, pa.Table.from_pylist(rows, schema=SEQUENCE_SCHEMA))
    entry["bytes"] = path.stat().st_size
    assert entry["sha256"] == sha256_file(path)
    (pack / MANIFEST).write_bytes(canonical_json(manifest))
    return str(entry["file"])


def first_row(pack: Path, want: Callable[[Row], bool]) -> tuple[int, int]:
    """(shard, row) of the first row satisfying `want`."""
    manifest = json.loads((pack / MANIFEST).read_text())
    for s, entry in enumerate(manifest["shards"]):
        for r, row in enumerate(read_table(pack / entry["file"]).to_pylist()):
            if want(row):
                return s, r
    raise AssertionError("no such row in the pack")


# The edits the trainer must refuse (each leaves lengths consistent, so only content checks catch it).
def all_labels_ignored(row: Row) -> None:
    row["labels"] = [-100] * len(row["labels"])


def labels_to_eos(row: Row, eos: int = 151645) -> None:
    row["labels"] = [eos if x != -100 else x for x in row["labels"]]


def id_outside_vocab(row: Row, vocab: int = 151936) -> None:
    row["input_ids"][0] = vocab + 7


ROW_EDITS: dict[str, tuple[Callable[[Row], None], str]] = {
    "labels all -100": (all_labels_ignored, "no label token"),
    "labels rewritten to EOS": (labels_to_eos, "neither -100 nor the input id"),
    "id outside the vocabulary": (id_outside_vocab, "outside the vocabulary"),
}
