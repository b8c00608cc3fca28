"""Packing planner: which samples share a fixed-length sequence.

The planner sees only integer token lengths (over-long samples were handled
before) and never splits a sample. Its output is a partition of the sample
indices into bins of total length <= `max_length`, in a deterministic order.

The default `bfd` is best-fit-decreasing computed over a length histogram:
lengths are integers <= `max_length`, so samples of one length are placed as a
group (k samples of length L fill a bin with remaining r by r // L at a time)
and open bins are kept as buckets keyed by remaining capacity. The Python loop
then runs per distinct length and per bucket visited, not per sample; per-sample
work is a handful of numpy passes. That keeps 10^8 samples in a few GiB of int
arrays and makes the planner far faster than per-item heuristics.

The baselines reproduce what other trainers ship, so benchmarks compare like
with like: `next_fit` (dataset order), `swift` (ms-swift: the `binpacking`
library over chunks of 1000 samples, the last bin carried into the next chunk)
and `knapsack` (LLaMA-Factory's greedy knapsack over its 1000-sample
preprocessing batches).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from typing import get_args

import numpy as np
import numpy.typing as npt
from packtrain.packer.config import Algorithm

ALGORITHMS: tuple[str, ...] = get_args(Algorithm)

# ms-swift's PackingDataset feeds binpacking 1000 samples at a time.
SWIFT_CHUNK = 1000
# LLaMA-Factory packs inside `datasets.map` batches (`preprocessing_batch_size`, default 1000).
KNAPSACK_CHUNK = 1000

LengthsLike = npt.ArrayLike
Plan = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]


def lower_bound(lengths: LengthsLike, max_length: int) -> int:
    """ceil(total tokens / max_length): no packing can use fewer sequences."""
    total = int(np.asarray(lengths).sum(dtype=np.int64))
    return -(-total // max_length)


def lower_bound_l2(lengths: LengthsLike, max_length: int) -> int:
    """Martello-Toth L2 bound: also counts samples that cannot share a sequence.

    `lower_bound` is loose when many samples exceed max_length / 2 (each needs
    its own sequence); L2 tightens it, which tells planner waste from waste no
    packing can avoid. For every K <= max_length / 2: samples longer than
    max_length - K sit alone, those in (max_length/2, max_length - K] each open a
    sequence, and those in [K, max_length/2] must fit in what the latter leave.
    """
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return 0
    hist = np.bincount(arr, minlength=max_length + 1)
    count_at_most = np.cumsum(hist)
    sum_at_most = np.cumsum(hist * np.arange(max_length + 1))
    half = max_length // 2
    k = np.arange(0, half + 1)
    big = count_at_most[-1] - count_at_most[max_length - k]  # length > max_length - K
    mid_n = count_at_most[max_length - k] - count_at_most[half]  # half < length <= max_length - K
    mid_sum = sum_at_most[max_length - k] - sum_at_most[half]
    small_sum = sum_at_most[half] - np.where(
        k > 0, sum_at_most[np.maximum(k - 1, 0)], 0
    )  # K <= length <= half
    spill = small_sum - (mid_n * max_length - mid_sum)
    extra = np.where(spill > 0, -(-spill // max_length), 0)
    return max(int((big + mid_n + extra).max()), lower_bound(arr, max_length))


def fill_ratio(lengths: LengthsLike, n_bins: int, max_length: int) -> float:
    """Share of the `n_bins * max_length` token slots that hold real tokens (1.0 = no padding)."""
    if n_bins == 0:
        return 1.0
    return int(np.asarray(lengths).sum(dtype=np.int64)) / (n_bins * max_length)


def pack_lengths(
    lengths: LengthsLike,
    max_length: int,
    algorithm: str = "bfd",
    seed: int | None = 0,
    partial_threshold: int | None = None,
) -> list[list[int]]:
    """Partition sample indices into sequences of total length <= `max_length`.

    Returns one list of indices into `lengths` per sequence, sequences in
    creation order. Same inputs give the same output; `seed` only decides which
    of several equal-length samples goes where (bfd; None keeps index order),
    the baselines are deterministic as published. Samples at least
    `partial_threshold` long get a sequence of their own.
    """
    order, offsets = plan_bins(lengths, max_length, algorithm, seed, partial_threshold)
    flat = order.tolist()
    bounds = offsets.tolist()
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def plan_bins(
    lengths: LengthsLike,
    max_length: int,
    algorithm: str = "bfd",
    seed: int | None = 0,
    partial_threshold: int | None = None,
) -> Plan:
    """Memory-lean form of `pack_lengths`: a CSR pair `(order, bin_offsets)`.

    Bin `b` holds the samples `order[bin_offsets[b]:bin_offsets[b + 1]]`; this is
    what the packer stores, and it costs 8 bytes per sample instead of a Python
    list per sequence (10^8 samples stay within a few GiB).
    """
    arr = _validate(lengths, max_length, algorithm, partial_threshold)
    solo_from = max_length + 1 if partial_threshold is None else partial_threshold
    if algorithm == "bfd":
        return _bfd(arr, max_length, seed, solo_from)
    solo = np.flatnonzero(arr >= solo_from)
    if solo.size == 0:
        return _BASELINES[algorithm](arr, max_length)
    rest = np.flatnonzero(arr < solo_from)
    order, offsets = _BASELINES[algorithm](arr[rest], max_length)
    return (
        np.concatenate([solo, rest[order]]).astype(np.int64, copy=False),
        np.concatenate([np.arange(solo.size, dtype=np.int64), offsets + solo.size]),
    )


def _validate(
    lengths: LengthsLike, max_length: int, algorithm: str, partial_threshold: int | None
) -> npt.NDArray[np.integer]:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    if isinstance(max_length, bool) or not isinstance(max_length, int | np.integer) or max_length < 1:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    if partial_threshold is not None and (
        isinstance(partial_threshold, bool)
        or not isinstance(partial_threshold, int | np.integer)
        or partial_threshold < 1
    ):
        raise ValueError(f"partial_threshold must be a positive integer or None, got {partial_threshold!r}")
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 1:
        at = int(np.argmin(arr))
        raise ValueError(f"lengths must be >= 1: lengths[{at}] = {low}")
    if high > max_length:
        at = int(np.argmax(arr))
        raise ValueError(
            f"lengths must be <= max_length ({max_length}): lengths[{at}] = {high}; "
            "drop or truncate over-long samples before planning"
        )
    return arr


def _empty() -> Plan:
    return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)


def _sort_decreasing(
    arr: npt.NDArray[np.integer], max_length: int, seed: int | None
) -> npt.NDArray[np.int64]:
    """Indices by decreasing length; ties in index order, or shuffled by `seed`.

    The key `max_length - length` fits 16 bits for every practical max_length,
    and numpy's stable argsort is then a radix sort: O(n).
    """
    key_type = np.uint16 if max_length < 2**16 else np.int32
    key = np.subtract(max_length, arr, dtype=np.int64).astype(key_type)
    if seed is None:
        return np.argsort(key, kind="stable")
    perm = np.random.default_rng(seed).permutation(arr.size)
    return perm[np.argsort(key[perm], kind="stable")]


class _Ops:
    """Placement log: `count` consecutive bins from `start` each take the next `per_bin` sorted samples."""

    def __init__(self) -> None:
        self.start: list[int] = []
        self.count: list[int] = []
        self.per_bin: list[int] = []

    def add(self, start: int, count: int, per_bin: int) -> None:
        self.start.append(start)
        self.count.append(count)
        self.per_bin.append(per_bin)


def _bfd(arr: npt.NDArray[np.integer], max_length: int, seed: int | None, solo_from: int) -> Plan:
    """Best-fit-decreasing over the length histogram.

    Open bins live in `buckets[remaining]` as runs of consecutive bin ids;
    `keys` is the sorted list of non-empty remainders. For a length L, best fit
    is the smallest remainder r >= L, and once a bin is chosen it stays the best
    fit until it holds r // L samples of that length, so whole runs are filled at
    once. A visited bucket drops below L (r mod L < r / 2), so each run is moved
    O(log max_length) times in total.
    """
    n = arr.size
    if n == 0:
        return _empty()
    counts = np.bincount(arr, minlength=max_length + 1)
    distinct = np.flatnonzero(counts)[::-1].tolist()
    smallest = distinct[-1]
    keys: list[int] = []
    buckets: dict[int, deque[tuple[int, int]]] = {}
    ops = _Ops()
    next_bin = 0
    for length in distinct:
        k = int(counts[length])
        if length >= solo_from:
            ops.add(next_bin, k, 1)
            next_bin += k
            continue
        moves: list[tuple[int, int, int]] = []  # (new remainder, first bin, bins), applied after this length
        i = bisect.bisect_left(keys, length)
        while k and i < len(keys):
            remaining = keys[i]
            fit = remaining // length
            runs = buckets[remaining]
            while k and runs:
                first, size = runs[0]
                if size * fit <= k:
                    runs.popleft()
                    ops.add(first, size, fit)
                    moves.append((remaining - fit * length, first, size))
                    k -= size * fit
                    continue
                full, rest = divmod(k, fit)
                if full:
                    ops.add(first, full, fit)
                    moves.append((remaining - fit * length, first, full))
                if rest:
                    ops.add(first + full, 1, rest)
                    moves.append((remaining - rest * length, first + full, 1))
                    full += 1
                if full == size:
                    runs.popleft()
                else:
                    runs[0] = (first + full, size - full)
                k = 0
            if runs:
                i += 1
            else:
                del buckets[remaining]
                keys.pop(i)
        if k:
            fit = max_length // length
            full, rest = divmod(k, fit)
            if full:
                ops.add(next_bin, full, fit)
                moves.append((max_length - fit * length, next_bin, full))
                next_bin += full
            if rest:
                ops.add(next_bin, 1, rest)
                moves.append((max_length - rest * length, next_bin, 1))
                next_bin += 1
        for remaining, first, size in moves:
            if remaining < smallest:
                continue  # no sample left can use it: the bin is closed
            runs = buckets.get(remaining)
            if runs is None:
                buckets[remaining] = deque([(first, size)])
                bisect.insort(keys, remaining)
            else:
                runs.append((first, size))
    return _materialise(_sort_decreasing(arr, max_length, seed), ops, next_bin)


def _materialise(sorted_idx: npt.NDArray[np.int64], ops: _Ops, n_bins: int) -> Plan:
    """Turn the placement log into CSR, each bin's samples in placement order."""
    op_start = np.asarray(ops.start, dtype=np.int64)
    op_count = np.asarray(ops.count, dtype=np.int64)
    op_per_bin = np.asarray(ops.per_bin, dtype=np.int64)
    # One entry per (op, bin): the bin id and how many consecutive sorted samples it takes.
    entry_op = np.repeat(np.arange(op_start.size), op_count)
    entry_bin = op_start[entry_op] + (
        np.arange(entry_op.size) - np.repeat(_exclusive_cumsum(op_count), op_count)
    )
    entry_take = op_per_bin[entry_op]
    del entry_op
    entry_src = _exclusive_cumsum(entry_take)
    by_bin = np.argsort(entry_bin, kind="stable")
    bin_sizes = np.bincount(entry_bin, weights=entry_take, minlength=n_bins).astype(np.int64)
    del entry_bin
    take = entry_take[by_bin]
    shift = entry_src[by_bin] - _exclusive_cumsum(take)
    del by_bin, entry_src
    gather = np.repeat(shift, take)
    gather += np.arange(gather.size, dtype=np.int64)
    order = sorted_idx[gather]
    offsets = np.zeros(n_bins + 1, dtype=np.int64)
    np.cumsum(bin_sizes, out=offsets[1:])
    return order, offsets


def _exclusive_cumsum(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    out = np.zeros(values.size, dtype=np.int64)
    if values.size > 1:
        np.cumsum(values[:-1], out=out[1:])
    return out


def _from_lists(bins: Sequence[Sequence[int]], n: int) -> Plan:
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bins], out=offsets[1:])
    order = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=n)
    return order, offsets


def _next_fit(arr: npt.NDArray[np.integer], max_length: int) -> Plan:
    """Dataset order; a new sequence whenever the next sample does not fit (streaming packers)."""
    n = arr.size
    if n == 0:
        return _empty()
    prefix = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(arr, out=prefix[1:])
    starts = [0]
    at = 0
    while at < n:
        # Largest j with prefix[j] - prefix[at] <= max_length: samples at..j-1 share a sequence.
        at = int(np.searchsorted(prefix, prefix[at] + max_length, side="right")) - 1
        starts.append(at)
    return np.arange(n, dtype=np.int64), np.asarray(starts, dtype=np.int64)


def _swift(arr: npt.NDArray[np.integer], max_length: int) -> Plan:
    """ms-swift's `PackingDataset.create_packed_idx`.

    `binpacking.to_constant_volume` on `(index, length)` pairs, 1000 new samples
    at a time; unless the data is exhausted, the last bin goes back into the
    next chunk's input.
    """
    try:
        import binpacking
    except ImportError as err:
        raise ImportError(
            "algorithm='swift' needs the `binpacking` library (pip install binpacking, "
            "or the packtrain[test] extra); it is a baseline, the default 'bfd' needs nothing"
        ) from err
    n = arr.size
    data = list(enumerate(arr.tolist()))
    bins: list[list[int]] = []
    pending: list[tuple[int, int]] = []
    at = 0
    while True:
        pending += data[at : at + SWIFT_CHUNK]
        if not pending:
            break
        at += SWIFT_CHUNK
        groups = binpacking.to_constant_volume(pending, max_length, weight_pos=1)
        if groups and at < n:
            groups, pending = groups[:-1], groups[-1]
        else:
            pending = []
        bins.extend([i for i, _ in group] for group in groups)
    return _from_lists(bins, n)


def _greedy_knapsack(lengths: list[int], capacity: int) -> list[list[int]]:
    """LLaMA-Factory's greedy knapsack: fill one sequence at a time with the largest length that fits."""
    pool = sorted(lengths)
    knapsacks: list[list[int]] = []
    while pool:
        knapsack: list[int] = []
        room = capacity
        while True:
            at = bisect.bisect_right(pool, room)
            if at == 0:
                break
            room -= pool[at - 1]
            knapsack.append(pool.pop(at - 1))
        knapsacks.append(knapsack)
    return knapsacks


def _knapsack(arr: npt.NDArray[np.integer], max_length: int) -> Plan:
    """LLaMA-Factory's packed SFT: greedy knapsack per preprocessing batch.

    Samples of a knapsack are mapped back to indices through a per-length stack
    (`length2indexes[length].pop()`), as LLaMA-Factory does.
    """
    n = arr.size
    values = arr.tolist()
    bins: list[list[int]] = []
    for base in range(0, n, KNAPSACK_CHUNK):
        chunk = values[base : base + KNAPSACK_CHUNK]
        by_length: dict[int, list[int]] = {}
        for offset, length in enumerate(chunk):
            by_length.setdefault(length, []).append(base + offset)
        bins.extend(
            [by_length[length].pop() for length in knapsack]
            for knapsack in _greedy_knapsack(chunk, max_length)
        )
    return _from_lists(bins, n)


_BASELINES: dict[str, Callable[[npt.NDArray[np.integer], int], Plan]] = {
    "next_fit": _next_fit,
    "swift": _swift,
    "knapsack": _knapsack,
}
