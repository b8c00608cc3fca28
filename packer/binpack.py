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
arrays and makes the planner far faster than per-item heuristics. When lengths
take few distinct values, BFD's small per-sequence gaps add up, and an
exact-fill (minimum bin slack) pass over the same histogram, whose cost grows
with the number of distinct lengths rather than with n, is tried as well.

The baselines reproduce what other trainers ship, so benchmarks compare like
with like: `next_fit` (dataset order), `swift` (ms-swift: the `binpacking`
library over chunks of 1000 samples, the last bin carried into the next chunk)
and `knapsack` (LLaMA-Factory's greedy knapsack over its 1000-sample
preprocessing batches).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, get_args

import numpy as np
import numpy.typing as npt

from packtrain.core.config import Algorithm

ALGORITHMS: tuple[str, ...] = get_args(Algorithm)

# ms-swift's PackingDataset feeds binpacking 1000 samples at a time.
SWIFT_CHUNK = 1000
# LLaMA-Factory packs inside `datasets.map` batches (`preprocessing_batch_size`, default 1000).
KNAPSACK_CHUNK = 1000

# `_exact_fill` runs while its work (bitset operations plus lengths scanned; measured at
# about 0.6 k^2 for k distinct lengths, 0.2-0.7 us each) stays under this plus n / 2:
# at most a second or two, and under half a microsecond per sample at scale.
EXACT_FILL_BUDGET = 2_000_000
EXACT_FILL_WORK_PER_KIND2 = 1

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
    packing can avoid.
    """
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return 0
    return _l2_from_histogram(np.bincount(arr, minlength=max_length + 1), max_length)


def _l2_from_histogram(hist: npt.NDArray[np.int64], max_length: int) -> int:
    """L2 over all K <= max_length / 2 at once.

    Samples longer than max_length - K sit alone; those in (max_length / 2,
    max_length - K] each open a sequence; those in [K, max_length / 2] must fit
    in what the latter leave, or open more.
    """
    count_at_most = np.cumsum(hist)
    if count_at_most[-1] == 0:
        return 0
    sum_at_most = np.cumsum(hist * np.arange(hist.size))
    half = max_length // 2
    k = np.arange(0, half + 1)
    big = count_at_most[-1] - count_at_most[max_length - k]
    mid_n = count_at_most[max_length - k] - count_at_most[half]
    mid_sum = sum_at_most[max_length - k] - sum_at_most[half]
    small_sum = sum_at_most[half] - np.where(k > 0, sum_at_most[np.maximum(k - 1, 0)], 0)
    spill = small_sum - (mid_n * max_length - mid_sum)
    extra = np.where(spill > 0, -(-spill // max_length), 0)
    plain = -(-int(sum_at_most[-1]) // max_length)
    return max(int((big + mid_n + extra).max()), plain)


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

    Bin `b` holds the samples `order[bin_offsets[b]:bin_offsets[b + 1]]`. At 8
    bytes per sample instead of a Python list per sequence, this is the form to
    use for large datasets (10^8 samples plan within a few GiB).
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
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8:
        return arr.astype(np.int64)  # np.bincount refuses uint64
    return arr


def _empty() -> Plan:
    return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)


def _sort_decreasing(
    arr: npt.NDArray[np.integer], max_length: int, seed: int | None
) -> npt.NDArray[np.int64]:
    """Indices by decreasing length; ties in index order, or spread by `seed`.

    The key `max_length - length` is sorted by `_stable_argsort` in O(n) radix
    passes. With a seed, ties follow the seeded bijection i -> (a * i + b) mod n
    instead of index order, so dataset neighbours of equal length land in
    different sequences; it costs one strided gather, where a random
    permutation costs two random ones (4x slower at 10^7).
    """
    n = arr.size
    key_type = np.uint16 if max_length < 2**16 else np.int32 if max_length < 2**31 else np.int64
    key = arr.astype(key_type)  # lengths are in [1, max_length], so this cast is exact
    np.subtract(key_type(max_length), key, out=key)
    if seed is None or n < 2:
        return _stable_argsort(key, max_length)
    a, b = (int(x) for x in np.random.default_rng(seed).integers(1, n, 2))
    while math.gcd(a, n) != 1:
        a = a % (n - 1) + 1
    spread = np.arange(n, dtype=np.int64)
    spread *= a
    spread += b
    spread %= n
    key = key[spread]
    del spread
    order = _stable_argsort(key, max_length)
    order *= a
    order += b
    order %= n
    return order


def _stable_argsort(key: npt.NDArray[Any], top: int) -> npt.NDArray[np.int64]:
    """Stable argsort of integer keys in [0, top).

    numpy radix-sorts integers of at most 16 bits and comparison-sorts wider
    ones (timsort), 3-4x slower at 10^7 keys. Keys below 2^16 (maxLength up to
    65536) take one radix pass; wider ones below 2^24 (131072-token rows, the
    config's ceiling) take two: the low 16 bits, then the high bits of that
    order, stably.
    """
    if top <= 2**16:
        return np.argsort(key.astype(np.uint16, copy=False), kind="stable")
    if top > 2**24:
        return np.argsort(key, kind="stable")
    order = np.argsort(np.bitwise_and(key, 0xFFFF).astype(np.uint16), kind="stable")
    high = np.right_shift(key, 16).astype(np.uint8)[order]
    return order[np.argsort(high, kind="stable")]


class _Ops:
    """Placement log, turned into CSR at the end by `_materialise`.

    Op i: `count[i]` consecutive bins from `start[i]` each take `per_bin[i]`
    samples of the decreasing-length order, bin j of the op from position
    `src[i] + j * per_bin[i]`.
    """

    def __init__(self) -> None:
        self.start: list[int] = []
        self.count: list[int] = []
        self.per_bin: list[int] = []
        self.src: list[int] = []
        self.bins = 0

    def add(self, start: int, count: int, per_bin: int, src: int) -> None:
        self.start.append(start)
        self.count.append(count)
        self.per_bin.append(per_bin)
        self.src.append(src)


def _bfd(arr: npt.NDArray[np.integer], max_length: int, seed: int | None, solo_from: int) -> Plan:
    """Best-fit-decreasing, with an exact-fill alternative when lengths take few values.

    BFD leaves each sequence a gap smaller than the shortest sample still
    unplaced: a few tokens in 10^4 with dense lengths, but ~0.1 % when samples
    take few distinct lengths (templated data, fixed-size images). So when BFD
    is above the L2 lower bound, `_exact_fill` (each sequence filled by
    subset-sum, then repeated) also runs if its cost, which grows with the
    number of distinct lengths and not with n, fits a budget; the plan with
    fewer sequences wins, BFD on ties.
    """
    if arr.size == 0:
        return _empty()
    counts = np.bincount(arr, minlength=max_length + 1)
    ops = _best_fit_decreasing(counts, max_length, solo_from)
    packed = counts.copy()
    packed[solo_from:] = 0
    n_solo = arr.size - int(packed.sum())
    if ops.bins > n_solo + _l2_from_histogram(packed, max_length):
        exact = _exact_fill(counts, max_length, solo_from, EXACT_FILL_BUDGET + arr.size // 2)
        if exact is not None and exact.bins < ops.bins:
            ops = exact
    return _materialise(_sort_decreasing(arr, max_length, seed), ops)


def _best_fit_decreasing(counts: npt.NDArray[np.int64], max_length: int, solo_from: int) -> _Ops:
    """Best-fit-decreasing over the length histogram.

    Open bins live in `buckets[remaining]` as runs of consecutive bin ids;
    `keys` is the sorted list of non-empty remainders. For a length L, best fit
    is the smallest remainder r >= L, and once a bin is chosen it stays the best
    fit until it holds r // L samples of that length, so whole runs are filled at
    once. A visited bucket drops below L (r mod L < r / 2), so each run is moved
    O(log max_length) times in total.
    """
    distinct = np.flatnonzero(counts)[::-1].tolist()
    fit = _BestFit(max_length, smallest=distinct[-1])
    for length in distinct:
        k = int(counts[length])
        if length >= solo_from:
            fit.place(fit.ops.bins, k, 1)
            fit.ops.bins += k
            continue
        moves: list[tuple[int, int, int]] = []  # (new remainder, first bin, bins), applied after this length
        k = fit.fill_open_bins(length, k, moves)
        if k:
            fit.open_bins(length, k, moves)
        fit.reopen(moves)
    return fit.ops


class _BestFit:
    """`_best_fit_decreasing`'s state: the ops so far, the samples placed and the open bins by remainder."""

    def __init__(self, max_length: int, smallest: int) -> None:
        self.max_length, self.smallest = max_length, smallest
        self.keys: list[int] = []
        self.buckets: dict[int, deque[tuple[int, int]]] = {}
        self.ops = _Ops()
        self.cursor = 0  # BFD takes the samples strictly in decreasing-length order

    def place(self, first: int, bins: int, per_bin: int) -> None:
        self.ops.add(first, bins, per_bin, self.cursor)
        self.cursor += bins * per_bin

    def fill_open_bins(self, length: int, k: int, moves: list[tuple[int, int, int]]) -> int:
        """Place up to `k` samples of `length` in the open bins, best fit first; the samples left."""
        keys, buckets = self.keys, self.buckets
        i = bisect.bisect_left(keys, length)
        while k and i < len(keys):
            remaining = keys[i]
            fit = remaining // length
            runs = buckets[remaining]
            while k and runs:
                first, size = runs[0]
                if size * fit <= k:
                    runs.popleft()
                    self.place(first, size, fit)
                    moves.append((remaining - fit * length, first, size))
                    k -= size * fit
                    continue
                full, rest = divmod(k, fit)
                if full:
                    self.place(first, full, fit)
                    moves.append((remaining - fit * length, first, full))
                if rest:
                    self.place(first + full, 1, rest)
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
        return k

    def open_bins(self, length: int, k: int, moves: list[tuple[int, int, int]]) -> None:
        """New bins for the `k` samples of `length` no open bin could take, filled as far as they go."""
        fit = self.max_length // length
        full, rest = divmod(k, fit)
        if full:
            self.place(self.ops.bins, full, fit)
            moves.append((self.max_length - fit * length, self.ops.bins, full))
            self.ops.bins += full
        if rest:
            self.place(self.ops.bins, 1, rest)
            moves.append((self.max_length - rest * length, self.ops.bins, 1))
            self.ops.bins += 1

    def reopen(self, moves: list[tuple[int, int, int]]) -> None:
        """The bins just filled, back among the open bins under their new remainders (if any fits)."""
        for remaining, first, size in moves:
            if remaining < self.smallest:
                continue  # no sample left can use it: the bin is closed
            runs = self.buckets.get(remaining)
            if runs is None:
                self.buckets[remaining] = deque([(first, size)])
                bisect.insort(self.keys, remaining)
            else:
                runs.append((first, size))


def _exact_fill(counts: npt.NDArray[np.int64], max_length: int, solo_from: int, budget: int) -> _Ops | None:
    """Minimum-bin-slack packing with pattern repetition (cutting-stock style).

    Each sequence gets the longest sample left plus the subset of the rest that
    fills it best (bounded subset-sum on a Python-int bitset, multiplicities
    split in powers of two, larger lengths preferred), and that pattern is
    repeated while every length in it lasts. Returns None when the work (in
    bitset operations, so deterministic) would exceed `budget`.
    """
    cnt = counts.tolist()
    distinct = np.flatnonzero(counts)[::-1].tolist()
    packed_kinds = sum(1 for length in distinct if length < solo_from)
    if EXACT_FILL_WORK_PER_KIND2 * packed_kinds * packed_kinds > budget:
        return None
    ptr = (np.cumsum(counts[::-1])[::-1] - counts).tolist()  # first position of each length in the order
    ops = _Ops()
    for length in distinct:
        if length >= solo_from:
            ops.add(ops.bins, cnt[length], 1, ptr[length])
            ops.bins += cnt[length]
    left = [length for length in distinct if length < solo_from]
    work = 0
    while left:
        longest = left[0]
        room = max_length - longest
        cnt[longest] -= 1
        mask = (1 << (room + 1)) - 1
        reach = 1
        pieces: list[
            tuple[int, int, int]
        ] = []  # (length, samples, reach before): multiplicities in powers of two
        for length in left:
            if length > room or not cnt[length]:
                continue
            bound, step = min(cnt[length], room // length), 1
            while bound:
                take = min(step, bound)
                pieces.append((length, take, reach))
                reach = (reach | (reach << (length * take))) & mask
                bound -= take
                step <<= 1
            if reach >> room:
                break  # an exact fill: shorter samples are not needed
        work += len(left) + len(pieces) * (1 + room // 4096)
        if work > budget:
            return None
        target = reach.bit_length() - 1
        use = {longest: 1}
        for length, take, before in reversed(pieces):
            if not before >> target & 1:  # this piece is needed to reach `target`
                target -= length * take
                use[length] = use.get(length, 0) + take
        cnt[longest] += 1
        repeat = min(cnt[length] // times for length, times in use.items())
        for length in sorted(use, reverse=True):
            ops.add(ops.bins, repeat, use[length], ptr[length])
            ptr[length] += repeat * use[length]
            cnt[length] -= repeat * use[length]
        ops.bins += repeat
        left = [length for length in left if cnt[length]]
    return ops


def _materialise(sorted_idx: npt.NDArray[np.int64], ops: _Ops) -> Plan:
    """Turn the placement log into CSR, each bin's samples in placement order."""
    op_start = np.asarray(ops.start, dtype=np.int64)
    op_count = np.asarray(ops.count, dtype=np.int64)
    op_per_bin = np.asarray(ops.per_bin, dtype=np.int64)
    op_src = np.asarray(ops.src, dtype=np.int64)
    # One entry per (op, bin): the bin id, how many samples it takes and from where in sorted_idx.
    entry_op = np.repeat(np.arange(op_start.size), op_count)
    within = np.arange(entry_op.size) - np.repeat(_exclusive_cumsum(op_count), op_count)
    entry_bin = op_start[entry_op] + within
    entry_take = op_per_bin[entry_op]
    entry_src = op_src[entry_op] + within * entry_take
    del entry_op, within
    by_bin = np.argsort(entry_bin, kind="stable")
    bin_sizes = np.bincount(entry_bin, weights=entry_take, minlength=ops.bins).astype(np.int64)
    del entry_bin
    take = entry_take[by_bin]
    shift = entry_src[by_bin] - _exclusive_cumsum(take)
    del by_bin, entry_src
    gather = np.repeat(shift, take)
    gather += np.arange(gather.size, dtype=np.int64)
    order = sorted_idx[gather]
    offsets = np.zeros(ops.bins + 1, dtype=np.int64)
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
