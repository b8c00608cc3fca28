"""JSON arrays are streamed item by item and every record's size is bounded before it is parsed.

A worker used to decode a whole JSON array (and every counting pass too), so N workers held the file
N times over, one bad byte or a cut-off tail lost every record of the file, and a single huge JSONL
line was read and parsed whole before anything could reject it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from packtrain.core.contract import MAX_NESTING_DEPTH
from packtrain.packer.sources import records
from packtrain.packer.sources.raw import SKIPPED, RawRecord
from packtrain.packer.sources.records import iter_records

# Measures the memory of processes it starts: they run with glibc's default malloc settings.
pytestmark = pytest.mark.measures_memory

MIXED: list[Any] = [
    {"messages": [{"role": "user", "content": 'quote " bracket ] brace } comma , colon :'}]},
    7,
    '"]}[{ a string item',
    {"escapes": 'back\\slash \\" \\\\" \\u0022 \n\t', "empty": "", "nested": [[[]], {}, [{"a": []}]]},
    [1, {"x": "y"}],
    {"unicode": "é€😀 日本語", "pair": "\U0001f600"},
    {"numbers": [0, -0, 1.5, -2e-3, 1e300, 12345678901234567890, -1], "flags": [True, False, None]},
    None,
    {"float_like": 1.0, "int_like": 10, "exp": 1e5},
    {"id": "last", "nan": float("nan"), "inf": float("-inf")},
]


def _read(path: Path, select: Callable[[int], bool] | None = None) -> list[RawRecord]:
    return list(iter_records([str(path)], select=select))


def _summary(raws: list[RawRecord]) -> list[tuple[int, str | None]]:
    return [(r.index, r.reason) for r in raws]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, records.READ_CHUNK_BYTES])
@pytest.mark.parametrize("indent", [None, 2])
def test_items_and_positions_equal_json_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, indent: int | None
) -> None:
    """Whatever chunk boundaries cut through (escapes, strings, multi-byte characters), every item
    is read as `json.loads` of the whole array reads it, at the same position, with the same types."""
    monkeypatch.setattr(records, "READ_CHUNK_BYTES", chunk)
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(MIXED, indent=indent, ensure_ascii=indent is None))
    expected = json.loads(path.read_text())
    raws = _read(path)
    assert [r.index for r in raws] == list(range(len(expected)))
    for raw, item in zip(raws, expected, strict=True):
        if isinstance(item, dict):
            assert raw.reason is None and repr(raw.record) == repr(item)  # repr: NaN != NaN, 1 vs 1.0
        else:
            assert raw.reason == "malformed_record" and raw.record is None
    assert type(raws[8].record["float_like"]) is float and type(raws[8].record["int_like"]) is int


def test_three_workers_cover_every_position_once_and_parse_only_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = [{"n": i, "text": f"sample-{i} [" + "x" * i} for i in range(10)]
    items = [json.dumps(r) for r in good[:4]] + ['{"n": 1 2}'] + [json.dumps(r) for r in good[4:]]
    path = tmp_path / "a.json"
    path.write_bytes(("[" + ",".join(items) + ',{"cut": ').encode())  # a bad item, then the file ends in one
    full = _read(path)
    assert _summary(full) == [(i, None) for i in range(4)] + [(4, "bad_json")] + [
        (i, None) for i in range(5, 11)
    ] + [(11, "bad_json")]

    parsed: list[str] = []
    real_loads = json.loads

    def watching_loads(text: str, *args: Any, **kwargs: Any) -> Any:
        parsed.append(text)
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(records.json, "loads", watching_loads)
    owner: dict[int, int] = {}
    for worker in range(3):
        mine = lambda p, w=worker: p % 3 == w  # noqa: E731
        parsed.clear()
        raws = _read(path, mine)
        assert [(r.source, r.index) for r in raws] == [(r.source, r.index) for r in full]
        for p, raw in enumerate(raws):
            if mine(p):
                assert raw == full[p]
                owner[p] = owner.get(p, 0) + 1
            else:
                assert raw.reason == SKIPPED and raw.record is None
        # Each worker json-parses only its own items, once each (the cut-off tail needs no parse).
        assert parsed == [text for p, text in enumerate(items) if mine(p)]
    assert owner == {p: 1 for p in range(12)}
    counted = _read(path, lambda _: False)
    assert len(counted) == 12 and {r.reason for r in counted} == {SKIPPED}


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice([0, -7, 3.25, -1e-9, 2**70, True, False, None])
    if kind in (1, 2, 3):
        return "".join(rng.choice('ab "\\/[]{},:\n\té€😀\u2028') for _ in range(rng.randrange(12)))
    if kind in (4, 5):
        return {rng.choice('kq]"{'): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_random_arrays_read_as_json_loads_reads_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(9)
    path = tmp_path / "r.json"
    for _ in range(150):
        monkeypatch.setattr(records, "READ_CHUNK_BYTES", rng.randrange(1, 40))
        items = [_random_value(rng) for _ in range(rng.randrange(6))]
        path.write_text(json.dumps(items, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1])))
        expected = json.loads(path.read_text())
        raws = _read(path)
        got = [r.record if isinstance(e, dict) else r.reason for r, e in zip(raws, expected, strict=True)]
        assert got == [e if isinstance(e, dict) else "malformed_record" for e in expected]


def test_damaged_arrays_never_raise_and_every_worker_agrees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes cut, inserted or dropped anywhere: each worker reads the file on its own, so each must
    find the same positions (and the counting pass the same number), or counts would not add up."""
    rng = random.Random(4)
    path = tmp_path / "d.json"
    for _ in range(150):
        monkeypatch.setattr(records, "READ_CHUNK_BYTES", rng.randrange(1, 30))
        data = bytearray(json.dumps([_random_value(rng) for _ in range(rng.randrange(1, 6))]).encode())
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data) + 1)
            choice = rng.randrange(3)
            if choice == 0:
                data.insert(at, rng.choice(b'"\\[]{},: x\xff'))
            elif choice == 1 and at < len(data):
                del data[at]
            else:
                del data[at:]
        path.write_bytes(b"[" + bytes(data[1:]))
        full = _read(path)
        assert [r.index for r in full] == list(range(len(full)))
        assert all((r.record is None) == (r.reason is not None) for r in full)
        for worker in range(3):
            some = _read(path, lambda p, w=worker: p % 3 == w)
            assert [r if p % 3 == worker else r.index for p, r in enumerate(some)] == [
                r if p % 3 == worker else p for p, r in enumerate(full)
            ]
        assert len(_read(path, lambda _: False)) == len(full)


@pytest.mark.parametrize(
    ("text", "expected", "where"),
    [
        ('[{"a": 1}, {"a": 2}, {"a": ', [None, None, "bad_json"], "byte 21: the file ends inside item 2"),
        ('[{"a": 1}, {"a": 2},', [None, None, "bad_json"], "byte 20: the file ends"),
        ('[{"a": 1} {"a": 2}]', [None, "bad_json"], "byte 10: found '{' after an item"),
        ('[{"a": 1}, ]', [None, "bad_json"], "byte 11: found ']' where an item should start"),
        ('[{"a": 1}] {"b": 2}', [None, "bad_json"], "byte 11: data follows the closing ']'"),
        ('[{"a": 1}}, {"a": 2}]', [None, "bad_json"], "byte 9: found '}' after an item"),
        ("[]", [], None),
        ("  \n[ \n ]\n", [], None),
    ],
)
def test_a_broken_array_keeps_the_records_before_the_break(
    tmp_path: Path, text: str, expected: list[str | None], where: str | None
) -> None:
    """The records read so far stay; the rest of the file is one `bad_json` at the next position,
    whose detail names the byte, and every worker and the counting pass see the same positions."""
    path = tmp_path / "t.json"
    path.write_text(text)
    raws = _read(path)
    assert [r.reason for r in raws] == expected
    assert [r.index for r in raws] == list(range(len(expected)))
    if where is not None:
        assert where in (raws[-1].error or "") and "rest of the file" in (raws[-1].error or "")
    assert len(_read(path, lambda _: False)) == len(expected)


def test_byte_order_mark_and_bad_utf8_in_one_item(tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    items = [json.dumps({"n": i, "t": "é"}).encode() for i in range(4)]
    items[2] = b'{"n": 2, "t": "\xff\xfe not utf-8"}'
    path.write_bytes(b"\xef\xbb\xbf \n[" + b",\n".join(items) + b"]\n")
    raws = _read(path)
    assert _summary(raws) == [(0, None), (1, None), (2, "bad_utf8"), (3, None)]
    assert raws[3].record == {"n": 3, "t": "é"}
    assert "item 2: not valid UTF-8" in (raws[2].error or "")


def test_lone_surrogate_escape_in_an_item_is_bad_utf8(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('[{"t": "\\ud800 alone"}, {"t": "\\ud83d\\ude00 pair"}]')
    raws = _read(path)
    assert _summary(raws) == [(0, "bad_utf8"), (1, None)]
    assert raws[1].record == {"t": "\U0001f600 pair"}


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_deep_nesting_is_one_bad_json_record(tmp_path: Path, suffix: str) -> None:
    """1000 levels (and 10^5) are one reject, decided by counting brackets: no RecursionError, and
    the neighbours are read; the deepest record still allowed is read as usual."""
    limit = MAX_NESTING_DEPTH
    deep = '{"tools": ' + "[" * 999 + "]" * 999 + "}"
    deeper = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    allowed = '{"a": ' + "[" * (limit - 1) + "]" * (limit - 1) + "}"
    lines = ['{"n": 0}', deep, deeper, allowed, '{"n": 4}']
    path = tmp_path / f"deep{suffix}"
    path.write_text("[" + ",".join(lines) + "]" if suffix == ".json" else "\n".join(lines) + "\n")
    raws = _read(path)
    assert _summary(raws) == [(0, None), (1, "bad_json"), (2, "bad_json"), (3, None), (4, None)]
    assert f"nested 1000 levels deep, more than the {limit}" in (raws[1].error or "")
    assert raws[3].record == json.loads(allowed)


@pytest.mark.parametrize("chunk", [7, 1 << 20])
@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_record_over_the_size_cap_is_rejected_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, chunk: int
) -> None:
    """The cap is exact (a record of exactly MAX_RECORD_BYTES is read), and a larger record is a
    `record_too_large` reject that is never decoded, wherever the chunks fall (a cap below the
    read chunk too, should the cap become configurable)."""
    monkeypatch.setattr(records, "MAX_RECORD_BYTES", 100)
    monkeypatch.setattr(records, "READ_CHUNK_BYTES", chunk)
    fits = '{"t": "' + "a" * 91 + '"}'
    assert len(fits) == 100
    over = '{"t": "' + "b" * 92 + '"}'
    huge = '{"t": "' + "\\u00e9" * 5000 + '"}'
    blank = " " * 500
    parts = ['{"n": 0}', fits, over, huge, '{"n": 4}']
    path = tmp_path / f"big{suffix}"
    if suffix == ".json":
        path.write_text("[" + ",".join(parts) + "]")
    else:
        path.write_text("\n".join([parts[0], fits, blank, over, huge, parts[4]]) + "\n")
    parsed: list[str] = []
    real_loads = json.loads
    monkeypatch.setattr(records.json, "loads", lambda t, *a, **k: parsed.append(t) or real_loads(t, *a, **k))
    raws = _read(path)
    too_large = [(2, "record_too_large"), (3, "record_too_large")]
    assert _summary(raws) == [(0, None), (1, None), *too_large, (4, None)]
    assert raws[1].record == json.loads(fits) and raws[4].record == {"n": 4}
    assert "more than the 100 a record may have" in (raws[3].error or "")
    assert all(len(t) <= 100 for t in parsed)
    assert len(_read(path, lambda _: False)) == 5
    if suffix == ".jsonl":  # the file ends in the over-long line
        path.write_text(f"{parts[0]}\n{over}")
        assert _summary(_read(path)) == [(0, None), (1, "record_too_large")]
    else:  # the file ends after an over-long item, or inside one
        path.write_text(f"[{parts[0]}, {over}")
        assert _summary(_read(path)) == [(0, None), (1, "record_too_large"), (2, "bad_json")]
        path.write_text(f"[{parts[0]}, {over[:-2]}")
        assert _summary(_read(path)) == [(0, None), (1, "bad_json")]


# Peak RSS from VmHWM: ru_maxrss would also count the forking test process's peak on Linux.
_CHILD = """
import json, re, sys
from pathlib import Path
from packtrain.packer.sources.records import iter_records
def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024
path, modulo = sys.argv[1], int(sys.argv[2])
before = hwm()
reasons = {}
for raw in iter_records([path], select=lambda p: p % modulo == 0):
    reasons[str(raw.reason)] = reasons.get(str(raw.reason), 0) + 1
print(json.dumps({"before_mib": before, "peak_mib": hwm(), "reasons": reasons}))
"""


def _peak_rss(path: Path, modulo: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(modulo)], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout)


def test_a_200_mb_array_read_by_one_of_three_workers_stays_small(tmp_path: Path) -> None:
    """Reading used to cost ~6x the file (bytes, text, every item's objects) in every worker."""
    record = json.dumps(
        {
            "messages": [
                {"role": "user", "content": 'Describe "this" \\ carefully: [1, {2}]\n' * 20},
                {"role": "assistant", "content": "Sure, é€😀. " * 60},
            ],
            "meta": {"tags": ["a", "b"], "score": 0.5},
        },
        ensure_ascii=False,
    ).encode()
    count = 200_000_000 // (len(record) + 2)
    path = tmp_path / "big.json"
    with path.open("wb") as f:
        f.write(b"[")
        block = b",\n".join([record] * 1000)
        for written in range(0, count, 1000):
            f.write((b",\n" if written else b"") + block)
        f.write(b"]\n")
    count = -(-count // 1000) * 1000
    size_mib = path.stat().st_size / 2**20
    assert size_mib > 190
    result = _peak_rss(path, 3)
    assert result["reasons"] == {"None": -(-count // 3), SKIPPED: count - -(-count // 3)}
    # Measured: ~2 MiB over the interpreter's own ~13 MiB (it used to be ~1.1 GB).
    assert result["peak_mib"] - result["before_mib"] < 32, result


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_100_mb_record_is_rejected_within_the_cap(tmp_path: Path, suffix: str) -> None:
    """One 100 MB line without a newline, or one 100 MB array item: a reject, and the worker holds at
    most about MAX_RECORD_BYTES of it (it used to read, decode and parse all of it: ~5x its size)."""
    path = tmp_path / f"huge{suffix}"
    piece = b'0123456789\\"[]{}' * (2**20 // 16)
    with path.open("wb") as f:
        f.write(b'[{"n": 0}, {"t": "' if suffix == ".json" else b'{"n": 0}\n{"t": "')
        for _ in range(100):
            f.write(piece)
        f.write(b'"}, {"n": 2}]' if suffix == ".json" else b'"}\n{"n": 2}')  # no final newline
    result = _peak_rss(path, 1)
    assert result["reasons"] == {"None": 2, "record_too_large": 1}
    cap_mib = records.MAX_RECORD_BYTES / 2**20
    assert result["peak_mib"] < result["before_mib"] + cap_mib + 24, result


def test_reader_reject_reasons_are_registered() -> None:
    """Every reason the reader gives is in the one reject registry (README table, manifest checks)."""
    from packtrain.core.contract import REJECT_REASONS

    assert {"bad_json", "bad_utf8", "malformed_record", "record_too_large"} <= REJECT_REASONS.keys()
