"""`inspect`, `verify` and `unpack`: looking into a finished pack."""

from __future__ import annotations

import glob
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from packtrain.core.errors import EXIT_CONFIG, EXIT_OK, ConfigError, ShardFormatError
from packtrain.core.pack.schema import IGNORE_INDEX
from packtrain.core.pack.shards import REJECTS, ShardReader, read_manifest
from packtrain.core.report import rejects_warning
from packtrain.packer.sources.records import iter_records

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from packtrain.core.config import PackConfig
    from packtrain.core.pack.integrity import Scan


def summary_line(manifest: dict[str, Any], out: Path) -> dict[str, Any]:
    c = manifest["counts"]
    return {
        "output": str(out),
        "samples": c["input"],
        "packed": c["packed"],
        "rejected": c["rejected"],
        "sequences": manifest["sequences"],
        "lower_bound": manifest["lower_bound"],
        "tokens": manifest["tokens"],
        "fill_ratio": manifest["fill_ratio"],
        "padding_saved": manifest["padding_saved"],
        "sources": c.get("sources", {}),
    }


def print_stats(manifest: dict[str, Any], out: Path, console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    c = manifest["counts"]
    t = Table(title=f"pack {out}", show_header=False)
    rows = [
        ("samples read", c["input"]),
        ("packed", c["packed"]),
        ("rejected", c["rejected"]),
        *((f"  rejected: {k}", v) for k, v in c["rejected_by_reason"].items()),
        *(
            (
                f"  source {k}",
                f"{v['input']} taken of {v['records']}: {v['packed']} packed, {v['rejected']} rejected",
            )
            for k, v in c.get("sources", {}).items()
        ),
        ("tokens", manifest["tokens"]),
        ("label tokens", manifest.get("label_tokens", "")),
        ("sequences", f"{manifest['sequences']} (lower bound {manifest['lower_bound']})"),
        ("max length", manifest["max_length"]),
        ("fill ratio", f"{manifest['fill_ratio']:.4f}"),
        ("sequences saved vs 1 sample/seq", f"{manifest['padding_saved']:.2%}"),
        ("shards", len(manifest["shards"])),
        ("bytes", sum(s["bytes"] + s["media_bytes"] for s in manifest["shards"])),
        ("media blobs (deduplicated per shard)", sum(s["media_rows"] for s in manifest["shards"])),
        ("algorithm", manifest["algorithm"]),
    ]
    t.add_column(overflow="fold")  # paths whole, folded rather than cut at the terminal's width
    t.add_column(overflow="fold")
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)
    warning = rejects_warning(c, out)
    if warning:
        console.print(Text.assemble(("WARNING ", "bold yellow"), warning), soft_wrap=True)


def inspect_cmd(path: Path, plot: str | None, as_json: bool) -> int:
    manifest = read_manifest(path)
    if as_json:
        print(json.dumps(summary_line(manifest, path)))
    else:
        print_stats(manifest, path, Console())
    if plot:
        write_plot(path, Path(plot))
        # Where to look: after the table, or beside the JSON line without breaking it.
        print(f"plot written to {Path(plot).resolve()}", file=sys.stderr if as_json else sys.stdout)
    return EXIT_OK


def write_plot(path: Path, png: Path) -> None:
    """Sample-length histogram and per-sequence fill, for a glance at packing quality."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError(
            "--plot needs matplotlib, which the packer image leaves out: "
            "`pip install 'packtrain[plot]'`, or run inspect without --plot"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reader = ShardReader(path, verify_checksums=False)
    fig = fill_figure(reader.seq_lens(), reader.manifest["max_length"], path.name)
    fig.savefig(png, dpi=100)
    plt.close(fig)


LOG_LENGTHS_FROM = 100
"""Sample lengths are drawn on a log axis when maxLength is at least this many times the shortest
sample: in 131072-token rows a 60-token chat and a 100k-token video share one histogram, and linear
bins of maxLength / 100 tokens would put every chat in the first bin."""


def fill_figure(seq_lens: list[list[int]], max_length: int, name: str) -> Figure:
    """The figure `inspect --plot` writes: sample lengths against the maxLength line, and each
    sequence's fill, sorted."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    lengths = [x for row in seq_lens for x in row]
    fills = sorted((sum(row) / max_length for row in seq_lens), reverse=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    shortest = max(1, min(lengths, default=1))
    if max_length >= LOG_LENGTHS_FROM * shortest:
        a.hist(lengths, bins=np.geomspace(shortest, max_length, 61))
        a.set_xscale("log", base=2)
        a.set_xticks(_power_ticks(shortest, max_length))
        a.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    else:
        a.hist(lengths, bins=min(100, max(10, len(lengths) // 5)))
    a.set(title="sample lengths", xlabel="tokens", ylabel="samples")
    a.axvline(max_length, color="red", linestyle="--", label=f"maxLength {max_length}")
    a.yaxis.set_major_locator(MaxNLocator(integer=True))
    a.legend()
    b.plot(range(len(fills)), fills, marker="o" if len(fills) <= 50 else None)
    b.set(title="per-sequence fill (sorted)", xlabel="sequence", ylabel="fill", ylim=(0, 1.02))
    b.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{name}: {len(lengths)} samples in {len(fills)} sequences of maxLength {max_length}")
    fig.tight_layout()
    return fig


def _power_ticks(low: int, high: int, most: int = 8) -> list[int]:
    """At most `most` powers of two from `low` to `high`, evenly spaced, counted down from the largest
    (maxLength is most often a power of two: it gets a tick)."""
    top, bottom = high.bit_length() - 1, (low - 1).bit_length()
    step = max(1, -(-(top - bottom) // (most - 1)))
    return sorted(2**e for e in range(top, bottom - 1, -step))


def _tokens_label(value: float, _pos: object = None) -> str:
    """A power-of-two token count as an axis label: 512, 4k, 128k."""
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def _rejects(path: Path, problems: list[str]) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate((path / REJECTS).read_text(encoding="utf-8").splitlines(), 1):
        try:
            r = json.loads(line) if line else None
        except ValueError:
            r = None
        if line and (
            not isinstance(r, dict)
            or not isinstance(r.get("source"), str)
            or not isinstance(r.get("index"), int)
        ):
            problems.append(f"{REJECTS} line {n}: not a reject record (JSON with source, index, reason)")
        elif r is not None:
            out.append(r)
    return out


def refused_message(path: Path) -> str | None:
    """Why `path` has no manifest when finalize refused the pack (its counts made it useless), else None."""
    from packtrain.core.pack.shards import MANIFEST
    from packtrain.packer.stages.workdir import refusal

    refused = None if (path / MANIFEST).exists() else refusal(path)
    if refused is None:
        return None
    r = refused["report"]
    return (
        f"{path} is a refused pack with no {MANIFEST} ({r.get('reason', 'refused')}: {r['error']}); nothing "
        "may train on it. Fix the dataset or the config, then re-pack into a new (or emptied) output folder."
    )


def verify(path: Path, notes: list[str] | None = None) -> list[str]:
    """Every problem found, as messages; empty means the pack is sound. What could not be checked
    (a model folder that is not readable here) goes to `notes`."""
    from packtrain.core.config import PackConfig
    from packtrain.core.pack.integrity import model_facts, scan_rows

    problems: list[str] = []
    try:
        reader = ShardReader(path, verify_checksums=True)
    except ShardFormatError as exc:
        return [refused_message(path) or str(exc)]
    m = reader.manifest
    try:
        cfg = PackConfig.model_validate(m.get("config"))
    except ValidationError as exc:
        return [f"manifest config is not a valid pack configuration: {exc}"]
    problems.extend(_check_header(path, m, cfg))
    facts, note = model_facts(cfg.model.path)
    if note and notes is not None:
        notes.append(note)
    found = scan_rows(reader, facts, cfg.packing.max_length)
    problems.extend(found.problems)
    seen = found.seen
    rejects = _rejects(path, problems) if (path / REJECTS).is_file() else []
    for r in rejects:
        seen[(r["source"], r["index"])] += 1
    dupes = [k for k, v in seen.items() if v > 1]
    if dupes and not any((e.weight or 0) > 1 for e in cfg.source.mixture):  # else: repeats, checked below
        problems.append(f"{len(dupes)} samples appear more than once, e.g. {dupes[:3]}")
    problems.extend(_check_totals(reader, found, rejects))
    problems.extend(_check_source_counts(m.get("counts") or {}))
    problems.extend(_check_inputs(m, seen, cfg))
    return problems


def _check_header(path: Path, m: dict[str, Any], cfg: PackConfig) -> list[str]:
    """The manifest against its own config (hash, max_length) and the rejects file's sha256."""
    from packtrain.core.pack.integrity import stored_config_hash
    from packtrain.core.pack.shards import sha256_file

    problems: list[str] = []
    if (got := stored_config_hash(m.get("config"))) != m.get("config_hash"):
        problems.append(
            f"config_hash {str(m.get('config_hash'))[:12]}… is not the hash of the manifest's config "
            f"({got[:12]}…): the manifest was edited"
        )
    max_length = cfg.packing.max_length
    if m.get("max_length") != max_length:
        problems.append(f"max_length {m.get('max_length')} differs from the config's maxLength {max_length}")
    rejects_file = path / REJECTS
    want_sha = (m.get("rejects") or {}).get("sha256")
    if not rejects_file.is_file() or sha256_file(rejects_file) != want_sha:
        problems.append(f"{REJECTS}: missing, or its sha256 does not match the manifest's rejects.sha256")
    return problems


def _check_totals(reader: ShardReader, found: Scan, rejects: list[dict[str, Any]]) -> list[str]:
    """The manifest's counts, sequences, tokens and duplicate ids against what the shards hold."""
    from packtrain.packer.stages.finalize import DUPLICATE_IDS
    from packtrain.packer.stages.plan import count_duplicate_ids

    m = reader.manifest
    c = m.get("counts") or {}
    problems: list[str] = []
    if (
        found.packed != c.get("packed")
        or len(rejects) != c.get("rejected")
        or (found.packed + len(rejects) != c.get("input"))
    ):
        problems.append(
            f"counts do not add up: manifest {c}, found packed={found.packed} rejected={len(rejects)}"
        )
    if reader.num_sequences != m.get("sequences"):
        problems.append(f"manifest says {m.get('sequences')} sequences, shards hold {reader.num_sequences}")
    if found.tokens != m.get("tokens"):
        problems.append(f"manifest says {m.get('tokens')} tokens, shards hold {found.tokens}")
    if found.label_tokens != m.get("label_tokens"):
        problems.append(
            f"manifest says {m.get('label_tokens')} label tokens, shards hold {found.label_tokens}"
        )
    if DUPLICATE_IDS in c:
        ids = [*found.sample_ids, *(r["id"] for r in rejects if isinstance(r.get("id"), str))]
        duplicates, _ = count_duplicate_ids([pa.array(ids, pa.string())])
        if duplicates != c[DUPLICATE_IDS]:
            problems.append(f"counts.{DUPLICATE_IDS} is {c[DUPLICATE_IDS]}, the pack holds {duplicates}")
    return problems


def _check_source_counts(counts: dict[str, Any]) -> list[str]:
    """Per source: input = packed + rejected, and the sources add up to the pack's counts."""
    sources = counts.get("sources")
    if not isinstance(sources, dict) or not sources:
        return []  # a pack made before per-source counts
    problems = [
        f"counts.sources[{entry!r}]: input {s.get('input')} != packed {s.get('packed')} "
        f"+ rejected {s.get('rejected')}"
        for entry, s in sources.items()
        if not isinstance(s, dict) or s.get("input") != (s.get("packed") or 0) + (s.get("rejected") or 0)
    ]
    for key in ("input", "packed", "rejected"):
        total = sum(s.get(key) or 0 for s in sources.values() if isinstance(s, dict))
        if total != counts.get(key):
            problems.append(f"counts.sources add up to {total} {key}, counts.{key} is {counts.get(key)}")
    return problems


def _check_inputs(manifest: dict[str, Any], seen: Counter[tuple[str, int]], cfg: PackConfig) -> list[str]:
    """Re-read the inputs, when still reachable, to prove no sample went missing (and, with a
    mixture, that each record was taken as many times as the seeded draw says)."""
    from packtrain.core.pack.shards import sha256_file
    from packtrain.packer.sources.mixture import weigh_files
    from packtrain.packer.sources.records import SourceFile

    paths = [Path(i["path"]) for i in manifest["inputs"]]
    if not all(p.is_file() for p in paths):
        return []
    problems = [
        f"input {p} changed since packing (sha256 differs)"
        for p, i in zip(paths, manifest["inputs"], strict=True)
        if sha256_file(p) != i["sha256"]
    ]
    # Escaped: these are file names, not patterns. Only (source, index) is needed, so nothing is parsed.
    files = [
        SourceFile(p, i["name"], i.get("entry", "")) for p, i in zip(paths, manifest["inputs"], strict=True)
    ]
    copies = weigh_files(files, cfg.source.mixture, cfg.packing.seed)
    records = iter_records(
        [glob.escape(str(p)) for p in paths], select=lambda _: False, weigh=lambda _: copies
    )
    expected = Counter((raw.source_name, raw.index) for raw in records)
    missing = expected - seen
    extra = seen - expected
    if missing:
        problems.append(
            f"{len(missing)} input samples neither packed nor rejected, e.g. {sorted(missing)[:3]}"
        )
    if extra:
        problems.append(f"{len(extra)} packed/rejected samples not in the inputs, e.g. {sorted(extra)[:3]}")
    return problems


def verify_cmd(path: Path) -> int:
    """EXIT_OK when the pack is sound, EXIT_CONFIG when anything is wrong (a damaged or edited pack is
    bad input, like a configuration error)."""
    notes: list[str] = []
    problems = verify(path, notes)
    for n in notes:
        print(f"NOTE {n}", file=sys.stderr)
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    if problems:
        return EXIT_CONFIG
    m = read_manifest(path)
    c = m["counts"]
    print(
        f"OK {path}: {m['sequences']} sequences, "
        f"{c['packed']} packed + {c['rejected']} rejected = {c['input']}"
    )
    return EXIT_OK


def unpack(path: Path, only: set[str] | None = None) -> list[dict[str, Any]]:
    """Split every sequence back into its samples, in input order."""
    reader = ShardReader(path, verify_checksums=False)
    order = {i["name"]: n for n, i in enumerate(reader.manifest["inputs"])}
    samples = []
    for i in range(reader.num_sequences):
        row = reader.sequence(i)
        start = 0
        for sub, n in enumerate(row["seq_lens"]):
            sid = row["sample_ids"][sub]
            if only is None or sid in only:
                samples.append(
                    {
                        "id": sid,
                        "source": row["sources"][sub],
                        "index": row["indices"][sub],
                        "input_ids": row["input_ids"][start : start + n],
                        "labels": row["labels"][start : start + n],
                        "media": [
                            {k: v for k, v in m.items() if k != "sample"}
                            for m in row["media"]
                            if m["sample"] == sub
                        ],
                    }
                )
            start += n
    samples.sort(key=lambda s: (order.get(s["source"], len(order)), s["index"]))
    return samples


TRAINED = ("⟦", "⟧")  # `unpack --text` wraps the tokens a sample trains on (labels kept) in these


def sample_decoder(path: Path) -> Callable[[list[int], list[int]], str]:
    """The decoded text of a pack's samples, with the pack's own tokenizer (its config's model.path):
    vision pad runs collapsed to e.g. `<|image_pad|>×64`, trained spans wrapped in TRAINED."""
    from packtrain.core.config import ModelConfig
    from packtrain.core.model_spec import load_model

    try:
        loaded = load_model(ModelConfig.model_validate(read_manifest(path)["config"]["model"]))
    except (ConfigError, ValidationError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"decoding needs the tokenizer of the pack's model folder (manifest config.model.path): {exc}; "
            "run where that folder is, or unpack without --text/--json"
        ) from exc
    names = loaded.family.token_names
    pads = {loaded.ids.image_pad: names["image_pad"], loaded.ids.video_pad: names["video_pad"]}

    def decode(ids: list[int], labels: list[int]) -> str:
        out, start, trained = [], 0, False
        while start < len(ids):
            pad, train = pads.get(ids[start]), labels[start] != IGNORE_INDEX
            end = start + 1
            while end < len(ids) and pads.get(ids[end]) == pad and (labels[end] != IGNORE_INDEX) == train:
                end += 1
            if train != trained:
                out.append(TRAINED[0] if train else TRAINED[1])
                trained = train
            out.append(f"{pad}×{end - start}" if pad else loaded.tokenizer.decode(ids[start:end]))
            start = end
        return "".join(out) + (TRAINED[1] if trained else "")

    return decode


def unpack_cmd(path: Path, only: list[str] | None, show: str = "lines") -> int:
    """Every sample (or only the ids asked for) as JSON lines (`show` "json": with the decoded text;
    "text": the decoded text alone, under a header line); an id asked for that was rejected prints
    its reject record, one that is neither packed nor rejected is an error (exit 2)."""
    found = set()
    decode = sample_decoder(path) if show != "lines" else None
    for s in unpack(path, set(only) if only else None):
        found.add(s["id"])
        if decode is None:
            print(json.dumps(s, separators=(",", ":")))
        elif show == "json":
            print(json.dumps({**s, "text": decode(s["input_ids"], s["labels"])}, separators=(",", ":")))
        else:
            trained = sum(label != IGNORE_INDEX for label in s["labels"])
            where = f"{s['source']} #{s['index']}"
            print(f"=== {s['id']} ({where}): {len(s['input_ids'])} tokens, {trained} trained")
            print(decode(s["input_ids"], s["labels"]))
    if not only:
        return EXIT_OK
    wanted = [i for i in dict.fromkeys(only) if i not in found]
    if wanted and (path / REJECTS).is_file():
        for r in _rejects(path, []):
            if r.get("id") in wanted:
                found.add(r["id"])
                print(json.dumps({**r, "rejected": True}, separators=(",", ":")))
    unknown = [i for i in wanted if i not in found]
    if unknown:
        print(
            f"packtrain pack unpack: no sample {', '.join(map(repr, unknown))} in {path} "
            "(neither packed nor rejected); ids are the `id` fields of `pack unpack` lines and rejects.jsonl",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    return EXIT_OK
