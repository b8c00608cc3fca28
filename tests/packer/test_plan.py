"""The packing planner: valid partitions, exact best-fit-decreasing, quality near the bound, baselines as
published."""

from __future__ import annotations

import sys
from functools import cache

import binpacking
import numpy as np
import pytest
from support.synth import synthetic_lengths

from packtrain.packer import binpack as plan
from packtrain.packer.binpack import (
    ALGORITHMS,
    KNAPSACK_CHUNK,
    SWIFT_CHUNK,
    fill_ratio,
    lower_bound,
    lower_bound_l2,
    pack_lengths,
    plan_bins,
)


def assert_valid(bins: list[list[int]], lengths: np.ndarray, max_length: int) -> None:
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths))), "every index exactly once"
    assert all(b for b in bins), "no empty bin"
    assert max(int(lengths[b].sum()) for b in bins) <= max_length


def loads(bins: list[list[int]], lengths: np.ndarray) -> list[int]:
    return sorted(int(lengths[b].sum()) for b in bins)


def itemwise_bfd_loads(lengths: list[int], max_length: int) -> list[int]:
    """Textbook best-fit-decreasing, one item at a time: the reference the grouped version must equal."""
    room: list[int] = []
    for length in sorted(lengths, reverse=True):
        fits = [b for b, r in enumerate(room) if r >= length]
        if fits:
            room[min(fits, key=lambda b: room[b])] -= length
        else:
            room.append(max_length - length)
    return sorted(max_length - r for r in room)


def optimum(lengths: tuple[int, ...], max_length: int) -> int:
    """Exact minimum number of bins by DP over subsets (tiny n only)."""
    n = len(lengths)

    @cache
    def best(mask: int) -> tuple[int, int]:
        # (bins used, load of the open bin) for the items in mask, lexicographically minimal
        if mask == 0:
            return (1, 0)
        options = []
        for i in range(n):
            if mask >> i & 1:
                bins, load = best(mask & ~(1 << i))
                options.append(
                    (bins, load + lengths[i]) if load + lengths[i] <= max_length else (bins + 1, lengths[i])
                )
        return min(options)

    return best((1 << n) - 1)[0]


def random_lengths(rng: np.random.Generator, n: int, max_length: int) -> np.ndarray:
    kind = rng.integers(0, 3)
    if kind == 0:
        return rng.integers(1, max_length + 1, n)
    if kind == 1:
        return np.clip(rng.lognormal(np.log(max_length / 6), 1.0, n).astype(np.int64), 1, max_length)
    return rng.integers(1, max_length // 3 + 2, n)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_gives_a_valid_partition(algorithm: str) -> None:
    rng = np.random.default_rng(1)
    for _ in range(10 if algorithm == "swift" else 25):  # the binpacking library is slow
        max_length = int(rng.integers(8, 3000))
        lengths = random_lengths(rng, int(rng.integers(1, 2500)), max_length)
        assert_valid(pack_lengths(lengths, max_length, algorithm), lengths, max_length)


def test_bfd_equals_itemwise_best_fit_decreasing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan, "EXACT_FILL_BUDGET", -(10**9))  # the histogram BFD alone
    rng = np.random.default_rng(2)
    for _ in range(150):
        max_length = int(rng.integers(4, 300))
        lengths = random_lengths(rng, int(rng.integers(1, 200)), max_length)
        bins = pack_lengths(lengths, max_length)
        assert_valid(bins, lengths, max_length)
        assert loads(bins, lengths) == itemwise_bfd_loads(lengths.tolist(), max_length)


def test_bfd_takes_the_exact_fill_only_when_it_saves_sequences() -> None:
    rng = np.random.default_rng(12)
    improved = 0
    for _ in range(150):
        max_length = int(rng.integers(4, 300))
        lengths = random_lengths(rng, int(rng.integers(1, 200)), max_length)
        bins = pack_lengths(lengths, max_length)
        assert_valid(bins, lengths, max_length)
        reference = itemwise_bfd_loads(lengths.tolist(), max_length)
        assert len(bins) <= len(reference)
        if len(bins) == len(reference):
            assert loads(bins, lengths) == reference
        improved += len(bins) < len(reference)
    assert improved > 0


def test_few_distinct_lengths_pack_to_the_lower_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # Templated data: 150 lengths, hundreds of samples each. BFD alone leaves a gap in
    # most sequences that no remaining sample fits; the exact fill closes them.
    rng = np.random.default_rng(13)
    lengths = rng.choice(rng.integers(48, 1300, 150), 100_000)
    bound = lower_bound(lengths, 4096)
    order, offsets = plan_bins(lengths, 4096)
    assert offsets.size - 1 == bound
    assert int(np.add.reduceat(lengths[order], offsets[:-1]).max()) <= 4096
    assert sorted(order.tolist()) == list(range(lengths.size))
    assert [lengths[b].tolist() for b in pack_lengths(lengths[:2000], 4096)] == [
        sorted(lengths[b].tolist(), reverse=True) for b in pack_lengths(lengths[:2000], 4096)
    ]
    monkeypatch.setattr(plan, "EXACT_FILL_BUDGET", -(10**9))
    assert len(plan_bins(lengths, 4096)[1]) - 1 > 1.001 * bound


@pytest.mark.parametrize("max_length", [2048, 4096, 16384])
def test_bfd_is_within_a_thousandth_of_the_lower_bound_on_mixes(max_length: int) -> None:
    rng = np.random.default_rng(max_length)
    mixes = [
        synthetic_lengths(30_000, seed=max_length, max_length=max_length),
        np.clip(rng.lognormal(np.log(max_length / 8), 1.2, 30_000).astype(np.int64), 1, max_length),
        rng.integers(1, max_length // 2, 30_000),
    ]
    for lengths in mixes:
        bound = lower_bound(lengths, max_length)
        assert len(pack_lengths(lengths, max_length)) <= max(1.001 * bound, bound + 1)


def test_bfd_never_needs_more_sequences_than_the_baselines() -> None:
    lengths = synthetic_lengths(5_000, seed=7, max_length=4096)
    counts = {a: len(plan_bins(lengths, 4096, a)[1]) - 1 for a in ALGORITHMS}
    assert counts["bfd"] == min(counts.values())
    assert counts["next_fit"] > counts["bfd"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_partial_threshold_gives_long_samples_their_own_sequence(algorithm: str) -> None:
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 1025, 3000)
    bins = pack_lengths(lengths, 1024, algorithm, partial_threshold=700)
    assert_valid(bins, lengths, 1024)
    long_ones = set(np.flatnonzero(lengths >= 700).tolist())
    solo = [b for b in bins if set(b) & long_ones]
    assert all(len(b) == 1 for b in solo)
    assert len(solo) == len(long_ones)
    first = [b[0] for b in bins[: len(solo)]]  # solo sequences come first
    assert sorted(first) == sorted(long_ones)
    if algorithm != "bfd":
        assert first == sorted(long_ones)  # baselines: in dataset order
    assert len(bins) < len(lengths)  # the others are still packed together


def test_partial_threshold_one_puts_every_sample_alone() -> None:
    lengths = np.array([3, 1, 2, 3])
    assert sorted(pack_lengths(lengths, 8, partial_threshold=1)) == [[0], [1], [2], [3]]


def test_bfd_bins_in_creation_order_longest_first() -> None:
    lengths = np.array([2, 9, 4, 6, 1, 5])
    bins = pack_lengths(lengths, 10, seed=None)
    # 9 opens bin 0 and takes the 1; 6 opens bin 1 and takes the 4; 5 opens bin 2 and takes the 2.
    assert bins == [[1, 4], [3, 2], [5, 0]]


def test_output_is_deterministic_and_seed_only_moves_equal_lengths() -> None:
    lengths = synthetic_lengths(20_000, seed=11, max_length=2048)
    first = pack_lengths(lengths, 2048, seed=5)
    assert pack_lengths(lengths, 2048, seed=5) == first
    other = pack_lengths(lengths, 2048, seed=6)
    assert other != first
    as_lengths = [sorted(lengths[b].tolist()) for b in first]
    assert as_lengths == [sorted(lengths[b].tolist()) for b in other]
    in_index_order = pack_lengths(lengths, 2048, seed=None)
    assert [sorted(lengths[b].tolist()) for b in in_index_order] == as_lengths
    for algorithm in ("next_fit", "swift", "knapsack"):
        assert pack_lengths(lengths[:3000], 2048, algorithm, seed=1) == pack_lengths(
            lengths[:3000], 2048, algorithm
        )


def test_each_bin_lists_its_samples_longest_first() -> None:
    lengths = np.random.default_rng(5).integers(1, 200, 5000)
    for b in pack_lengths(lengths, 512):
        assert lengths[b].tolist() == sorted(lengths[b].tolist(), reverse=True)


def test_plan_bins_is_the_csr_form_of_pack_lengths() -> None:
    lengths = np.random.default_rng(6).integers(1, 300, 4000).astype(np.int32)
    order, offsets = plan_bins(lengths, 600)
    assert order.dtype == np.int64 and offsets.dtype == np.int64
    assert offsets[0] == 0 and offsets[-1] == len(lengths)
    bins = pack_lengths(lengths, 600)
    assert [order[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)] == bins


def test_max_length_beyond_16_bits() -> None:
    lengths = np.random.default_rng(7).integers(1, 100_000, 2000)
    bins = pack_lengths(lengths, 100_000)
    assert_valid(bins, lengths, 100_000)
    assert loads(bins, lengths) == itemwise_bfd_loads(lengths.tolist(), 100_000)


def test_empty_and_list_inputs() -> None:
    for algorithm in ALGORITHMS:
        assert pack_lengths([], 16, algorithm) == []
    assert pack_lengths([16, 8, 8], 16, seed=None) == [[0], [1, 2]]
    assert pack_lengths(np.array([16, 8, 8], dtype=np.uint64), 16, seed=None) == [[0], [1, 2]]


@pytest.mark.parametrize(
    ("lengths", "max_length", "kwargs", "message"),
    [
        ([1, 0, 2], 8, {}, r"lengths\[1\] = 0"),
        ([1, -3], 8, {}, ">= 1"),
        ([1, 9, 2], 8, {}, r"<= max_length \(8\): lengths\[1\] = 9"),
        ([1.5, 2.0], 8, {}, "integers"),
        ([True, False], 8, {}, "integers"),
        ([[1, 2]], 8, {}, "one-dimensional"),
        ([1], 0, {}, "max_length"),
        ([1], 8.0, {}, "max_length"),
        ([1], 8, {"algorithm": "ffd"}, "unknown packing algorithm 'ffd'"),
        ([1], 8, {"partial_threshold": 0}, "partial_threshold"),
        ([1], 8, {"partial_threshold": True}, "partial_threshold"),
    ],
)
def test_validation_errors(lengths: list, max_length: int, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_lengths(lengths, max_length, **kwargs)


def test_lower_bound_and_fill_ratio() -> None:
    assert lower_bound([4, 4, 1], 4) == 3
    assert lower_bound([6, 6, 6], 10) == 2
    assert lower_bound_l2([6, 6, 6], 10) == 3  # no two fit together
    assert lower_bound([6, 6, 6, 5, 5], 10) == 3
    assert lower_bound_l2([6, 6, 6, 5, 5], 10) == 4  # a 5 fits beside no 6
    assert lower_bound_l2([], 10) == 0
    assert lower_bound(np.array([4, 4], dtype=np.int32), 4) == 2
    assert lower_bound([], 4) == 0
    assert fill_ratio([4, 4, 1], 3, 4) == pytest.approx(0.75)
    assert fill_ratio([], 0, 4) == 1.0
    big = np.full(10, 2**31 - 1, dtype=np.int32)  # sums past int32 without overflow
    assert lower_bound(big, 2**31 - 1) == 10


def test_next_fit_keeps_dataset_order() -> None:
    lengths = np.array([5, 4, 2, 7, 1, 1, 8])
    assert pack_lengths(lengths, 10, "next_fit") == [[0, 1], [2, 3, 4], [5, 6]]


def test_swift_is_binpacking_per_chunk_with_the_last_bin_carried() -> None:
    rng = np.random.default_rng(8)
    small = rng.integers(1, 500, SWIFT_CHUNK - 1)
    direct = binpacking.to_constant_volume(list(enumerate(small.tolist())), 1024, weight_pos=1)
    assert pack_lengths(small, 1024, "swift") == [[i for i, _ in b] for b in direct]

    # Two chunks and a tail: each chunk's last bin goes back into the next chunk's input.
    lengths = rng.integers(1, 500, 2 * SWIFT_CHUNK + 10)
    items = list(enumerate(lengths.tolist()))
    expected: list[list[int]] = []
    pending: list[tuple[int, int]] = []
    for start in (0, SWIFT_CHUNK, 2 * SWIFT_CHUNK):
        groups = binpacking.to_constant_volume(
            pending + items[start : start + SWIFT_CHUNK], 1024, weight_pos=1
        )
        pending = groups.pop() if start < 2 * SWIFT_CHUNK else []
        expected += [[i for i, _ in g] for g in groups]
    bins = pack_lengths(lengths, 1024, "swift")
    assert_valid(bins, lengths, 1024)
    assert bins == expected


def test_swift_without_binpacking_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "binpacking", None)
    with pytest.raises(ImportError, match="pip install binpacking"):
        pack_lengths([1, 2], 8, "swift")
    assert pack_lengths([1, 2], 8) == [[1, 0]]  # the default needs no baseline library


def test_knapsack_follows_llamafactory() -> None:
    # Sorted [2, 3, 5, 5, 7, 8]: largest fit first gives [8, 2], [7, 3], [5, 5]; equal lengths pop from
    # the end.
    assert pack_lengths([3, 7, 5, 5, 2, 8], 10, "knapsack") == [[5, 4], [1, 0], [3, 2]]
    lengths = np.random.default_rng(9).integers(1, 300, 2 * KNAPSACK_CHUNK + 7)
    bins = pack_lengths(lengths, 1000, "knapsack")
    assert_valid(bins, lengths, 1000)
    assert all(len({i // KNAPSACK_CHUNK for i in b}) == 1 for b in bins)  # batches never mix
