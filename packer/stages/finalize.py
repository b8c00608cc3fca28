"""Finalize (inside the last materialize worker): the manifest, once every shard is written.

Plan's counts, less the samples materialize rejected (their rejects merged into rejects.jsonl
in input order); sequences, tokens, lower bound and fill are those of the shards written.
Several workers may get here at once: the content is deterministic and the write atomic, so
whichever rename lands last leaves the same bytes.
"""

from __future__ import annotations

import json
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtrain.core.config import PackConfig
from packtrain.core.contract import ErrorReport, PackCounts, pack_outcome_error
from packtrain.core.layout import family_layout
from packtrain.core.model_spec import pack_family
from packtrain.core.pack.schema import FORMAT_VERSION, IGNORE_INDEX
from packtrain.core.pack.shards import (
    MANIFEST,
    REJECTS,
    atomic_write_json,
    atomic_writer,
    read_table,
    sha256_file,
)
from packtrain.packer.binpack import lower_bound
from packtrain.packer.stages.inputs import record_inputs
from packtrain.packer.stages.plan import fill
from packtrain.packer.stages.workdir import (
    REFUSED,
    SHARD_REJECTS,
    PackRefused,
    load_plan,
    reject_line,
    rejects_in_order,
    work_dir,
)

DUPLICATE_IDS = "duplicate_ids"  # manifest counts key: samples whose id an earlier sample already used


def finalize(cfg: PackConfig, out: Path) -> dict[str, Any] | None:
    """Write manifest.json once every shard is done; None while some are missing.

    Counts that make the pack useless (`pack_outcome_error`: nothing packed, more rejected than
    packing.maxRejectedFraction) publish no manifest: the refusal and the would-be manifest go to
    work/REFUSED and PackRefused is raised, the same on every re-run (the counts are deterministic).
    """
    plan_info, _ = load_plan(out)
    done = _shard_records(out, plan_info["summary"]["shards"])
    if done is None:
        return None
    entries, late = done
    manifest = _manifest(cfg, out, plan_info, entries, late)
    record_inputs(out, plan_info)  # before the manifest or refusal: a re-run tells what changed since
    return _publish(cfg, out, manifest)


def _shard_records(out: Path, shards: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """Every shard's done record (its manifest entry) and the samples materialize rejected; None
    while a shard is missing."""
    entries: list[dict[str, Any]] = []
    late: list[dict[str, Any]] = []  # materialize's rejects
    for s in range(shards):
        done = work_dir(out) / "shards" / f"{s:05d}.json"
        if not done.is_file():
            return None
        entry = json.loads(done.read_text())
        late.extend(entry.pop(SHARD_REJECTS, []))
        entries.append(entry)
    return entries, late


def _merge_late_rejects(
    out: Path,
    plan_info: dict[str, Any],
    late: list[dict[str, Any]],
    reasons: Counter[str],
    sources: dict[str, Any],
) -> str:
    """Merge materialize's rejects into rejects.jsonl (in input order), `reasons` and the per-source
    `sources` counts; the sha256 of the rejects file."""
    if not late:
        return plan_info["rejects_sha256"]
    with (
        rejects_in_order(work_dir(out), plan_info["convert_workers"], late) as rejects,
        atomic_writer(out / REJECTS) as f,
    ):
        for r in rejects:
            f.write(reject_line(r))
    rejects_sha256 = sha256_file(out / REJECTS)
    reasons.update(r["reason"] for r in late)
    entry_of = {i["name"]: i.get("entry", "") for i in plan_info["inputs"]}
    for r in late:
        counts = sources.get(entry_of.get(r["source"], ""))
        if counts is not None:
            counts["packed"] -= 1
            counts["rejected"] += 1
    return rejects_sha256


def _manifest(
    cfg: PackConfig,
    out: Path,
    plan_info: dict[str, Any],
    entries: list[dict[str, Any]],
    late: list[dict[str, Any]],
) -> dict[str, Any]:
    """The manifest: plan's counts less `late` (materialize's rejects), the written shards' stats."""
    p = cfg.packing
    summary = plan_info["summary"]
    reasons = Counter(summary["rejected_by_reason"])
    sources = json.loads(json.dumps(summary.get("sources", {})))
    rejects_sha256 = _merge_late_rejects(out, plan_info, late, reasons, sources)
    totals = np.array([_shard_totals(out, e) for e in entries], dtype=np.int64).reshape(-1, 2)
    tokens, label_tokens = (int(x) for x in totals.sum(axis=0))
    packed = summary["packed"] - len(late)
    sequences = sum(int(e["rows"]) for e in entries)
    fill_ratio, padding_saved = fill(tokens, sequences, packed, p.max_length)
    family = pack_family(cfg.model)
    return {
        "format": "packtrain-pack",
        "format_version": FORMAT_VERSION,
        "family": family.name,
        # How media are written into the ids, and by which transformers' rules: the trainer refuses a
        # pack whose layout its own processor would not write (`core/layout.py`).
        "layout": family_layout(family),
        "transformers": version("transformers"),
        "config": cfg.dump(),
        "config_hash": cfg.config_hash(),
        "inputs": plan_info["inputs"],
        "counts": {
            "input": summary["samples"],
            "packed": packed,
            "rejected": summary["rejected"] + len(late),
            "rejected_by_reason": dict(sorted(reasons.items())),
            DUPLICATE_IDS: summary.get("duplicate_ids", 0),
            "sources": sources,  # per source.paths entry: input = packed + rejected
        },
        "tokens": tokens,
        "label_tokens": label_tokens,
        "sequences": sequences,
        "lower_bound": lower_bound(totals[:, 0], p.max_length),
        "max_length": p.max_length,
        "algorithm": p.algorithm,
        "fill_ratio": fill_ratio,
        "padding_saved": padding_saved,
        "rejects": {"file": REJECTS, "sha256": rejects_sha256},
        "shards": entries,
    }


def _publish(cfg: PackConfig, out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write the manifest, or record the refusal and raise PackRefused when its counts make it useless."""
    counts = manifest["counts"]
    problem = pack_outcome_error(
        counts["input"], counts["packed"], counts["rejected_by_reason"], cfg.packing.max_rejected_fraction
    )
    if problem is not None:
        report: ErrorReport = {**problem, "stage": "materialize"}
        atomic_write_json(work_dir(out) / REFUSED, {"report": report, "manifest": manifest})
        (out / MANIFEST).unlink(missing_ok=True)
        raise PackRefused(report, manifest)
    (work_dir(out) / REFUSED).unlink(missing_ok=True)
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def pack_counts(manifest: dict[str, Any]) -> PackCounts:
    """The finished pack's counts from its manifest, under the stage summaries' keys."""
    c = manifest["counts"]
    return {
        "samples": c["input"],
        "packed": c["packed"],
        "rejected": c["rejected"],
        "rejected_by_reason": c["rejected_by_reason"],
        "sequences": manifest["sequences"],
        "tokens": manifest["tokens"],
        "lower_bound": manifest["lower_bound"],
        "fill_ratio": manifest["fill_ratio"],
        "padding_saved": manifest["padding_saved"],
    }


def _shard_totals(out: Path, entry: dict[str, Any]) -> tuple[int, int]:
    """A written shard's tokens and label tokens (its columns memory-mapped, summed without copying rows)."""
    table = read_table(out / entry["file"])
    tokens = int(pc.sum(table.column("seq_lens").combine_chunks().flatten()).as_py() or 0)
    labels = table.column("labels").combine_chunks().flatten()
    return tokens, int(pc.sum(pc.not_equal(labels, IGNORE_INDEX).cast(pa.int64())).as_py() or 0)
