"""Weighted mixtures: how many times each record of each source is taken, deterministic from the seed.

A source is one `source.paths` entry (a file or a glob). `source.mixture` gives it a
`weight` (take round(weight x records)) and/or `maxSamples` (take at most that many).
The take is spread as evenly as the count allows: every record floor(take / records)
times, plus one more for a seeded sample, without replacement, of the remainder. So a
weight below 1 is a sample without replacement, a weight above 1 repeats every record
and samples the fraction, and the realised count is exact. The draw depends only on
`packing.seed`, the entry's text and its record count: every convert worker, and
`pack verify`, compute the same one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from packtrain.core.config import MixtureEntry, SourceConfig
from packtrain.core.contract import SourceCounts
from packtrain.packer.sources.raw import Copies
from packtrain.packer.sources.records import SourceFile, Weigh, count_records

R = TypeVar("R", bound=Any)  # a tokenized sample or a reject: dataclasses with a `sample_id`


def take(records: int, entry: MixtureEntry) -> int:
    """How many samples a source of `records` records contributes."""
    n = records if entry.weight is None else int(np.floor(records * entry.weight + 0.5))
    return n if entry.max_samples is None else min(n, entry.max_samples)


def draw(records: int, samples: int, seed: int, entry: str) -> np.ndarray:
    """Times each of `records` records is taken so that `samples` are taken in all."""
    copies = np.zeros(records, np.uint32)
    if records == 0:
        return copies
    whole, rest = divmod(samples, records)
    copies += whole
    if rest:
        tag = int.from_bytes(hashlib.sha256(entry.encode()).digest()[:8], "little")
        rng = np.random.default_rng(np.random.SeedSequence([seed % 2**64, tag]))
        copies[rng.choice(records, rest, replace=False)] += 1
    return copies


def weigh_files(files: Sequence[SourceFile], mixture: Sequence[MixtureEntry], seed: int) -> list[Copies]:
    """Times each record of each file is taken (None for files of sources without a mixture entry).

    Only the files of weighted sources are counted (a Parquet footer; a JSON file is scanned, not parsed).
    """
    copies: list[Copies] = [None] * len(files)
    for entry in mixture:
        members = [i for i, f in enumerate(files) if f.entry == entry.path]
        counts = [count_records(files[i].path) for i in members]
        total = sum(counts)
        drawn = draw(total, take(total, entry), seed, entry.path)
        start = 0
        for i, n in zip(members, counts, strict=True):
            copies[i] = drawn[start : start + n]
            start += n
    return copies


def weigher(source: SourceConfig, seed: int) -> Weigh | None:
    """The `iter_records(weigh=...)` of a job, or None when it has no mixture."""
    if not source.mixture:
        return None
    mixture = list(source.mixture)
    return lambda files: weigh_files(files, mixture, seed)


def repeat_id(sample_id: str, copy: int) -> str:
    """The id of a record's `copy`-th repeat: the first keeps the record's id, later ones say which repeat."""
    return sample_id if copy == 0 else f"{sample_id}#{copy}"


def repeat(result: R, copy: int) -> R:
    """A record's tokenized sample or reject as its `copy`-th repeat (tokenized once, counted each time)."""
    if copy == 0 or result.sample_id is None:
        return result
    return dataclasses.replace(result, sample_id=repeat_id(result.sample_id, copy))


def source_counts(
    files: Sequence[SourceFile],
    mixture: Sequence[MixtureEntry],
    packed: Mapping[str, int],
    rejected: Mapping[str, int],
) -> dict[str, SourceCounts]:
    """Per `source.paths` entry: records in its files, samples taken (`input`), packed and rejected.

    `packed` and `rejected` count samples by file name (`records.source_names`); `input` is their sum,
    so `input = packed + rejected` holds per source as it does for the pack.
    """
    weighted = {m.path for m in mixture}
    out: dict[str, SourceCounts] = {}
    for f in files:
        c = out.setdefault(f.entry, {"records": 0, "input": 0, "packed": 0, "rejected": 0})
        p, r = int(packed.get(f.name, 0)), int(rejected.get(f.name, 0))
        c["packed"] += p
        c["rejected"] += r
        c["input"] += p + r
        c["records"] += count_records(f.path) if f.entry in weighted else p + r
    return out
