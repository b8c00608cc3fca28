"""Fill quality of the packing planner: sequences needed, bfd against the baselines.

Every extra sequence is padding the GPUs compute on, so the measure is
sequences / lower bound (ceil(total tokens / max_length)); the Martello-Toth L2
bound is shown beside it because with many samples over max_length / 2 the
plain bound is not reachable by any packing. Mixes:

* the shared text-sft sets (FastChat, Glaive tool calls, LLaVA-Instruct), token
  lengths from the real Qwen2-VL tokenizer when `transformers` is installed
  (else characters / 3.5), each `<image>` counted as a 640x480 COCO image;
* those lengths resampled to a large set with a 10 % multiplicative jitter
  (smoothed bootstrap): a real set of that size has a length for nearly every
  integer, while a plain bootstrap of 900 samples has only ~340 distinct ones;
* the plain bootstrap too, as the few-distinct-lengths case (templated data,
  fixed-size images) where BFD alone leaves ~0.1 % waste and the planner's
  exact-fill pass is what meets the target;
* the synthetic heavy-tailed text/image/video mix (`packer.synth`).

Targets: bfd <= max(1.001 x LB, LB + 1) on every mix and length, and never more
sequences than swift. Prints a table, writes tests/bench/results/bench_fill.json,
exits 1 when a target is missed.

    python tests/bench/bench_fill.py [--quick] [--n N] [--proxy]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from packtrain.packer.binpack import ALGORITHMS, lower_bound, lower_bound_l2, plan_bins

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import DATASETS, MODELS
from support.synth import SYSTEM_TOKENS, TURN_OVERHEAD, image_tokens, synthetic_lengths

HERE = Path(__file__).resolve().parent
TEXT_SFT = DATASETS / "text-sft"
TOKENIZER = MODELS / "qwen2-vl"
RESULTS = HERE / "results"
MAX_LENGTHS = (4096, 8192, 16384)
COCO_IMAGE_TOKENS = image_tokens(480, 640)
CHARS_PER_TOKEN = 3.5


def conversation_texts(record: dict[str, Any]) -> tuple[list[str], int]:
    """The texts of a ShareGPT record that become tokens, and how many images it holds."""
    texts = [turn["value"] for turn in record["conversations"]]
    if record.get("tools"):
        texts.append(record["tools"] if isinstance(record["tools"], str) else json.dumps(record["tools"]))
    images = sum(text.count("<image>") for text in texts) or int(bool(record.get("image")))
    return [text.replace("<image>", "") for text in texts], images


def real_lengths(use_tokenizer: bool) -> tuple[dict[str, np.ndarray], str]:
    """Token lengths per shared text-sft set: template overhead + turn texts + image tokens."""
    encode, how = _encoder(use_tokenizer)
    sets: dict[str, np.ndarray] = {}
    for path in sorted(TEXT_SFT.glob("*/*.json")):
        records = json.loads(path.read_text())
        texts, owners, images = [], [], []
        for at, record in enumerate(records):
            record_texts, record_images = conversation_texts(record)
            texts += record_texts
            owners += [at] * len(record_texts)
            images.append(record_images)
        per_text = encode(texts)
        tokens = np.bincount(owners, weights=per_text + TURN_OVERHEAD, minlength=len(records))
        tokens += SYSTEM_TOKENS + COCO_IMAGE_TOKENS * np.asarray(images)
        sets[path.parent.name] = tokens.astype(np.int64)
    if not sets:
        raise SystemExit(f"no text-sft sets under {TEXT_SFT}: the shared fixture folder is missing")
    return sets, how


def _encoder(use_tokenizer: bool) -> tuple[Any, str]:
    if use_tokenizer:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            use_tokenizer = False
    if not use_tokenizer:
        return (lambda texts: np.ceil(np.array([len(t) for t in texts]) / CHARS_PER_TOKEN), "chars/3.5 proxy")
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))

    def encode(texts: list[str]) -> np.ndarray:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return np.array([len(i) for i in ids], dtype=np.float64)

    return encode, "Qwen2-VL tokenizer"


def measure(name: str, lengths: np.ndarray, max_length: int, algorithms: tuple[str, ...]) -> dict[str, Any]:
    kept = lengths[lengths <= max_length]  # the packer's default `overlong: drop`
    bound = lower_bound(kept, max_length)
    row: dict[str, Any] = {
        "mix": name,
        "max_length": max_length,
        "n": int(kept.size),
        "dropped_overlong": int(lengths.size - kept.size),
        "lower_bound": bound,
        "lower_bound_l2": lower_bound_l2(kept, max_length),
        "sequences": {},
        "seconds": {},
    }
    for algorithm in algorithms:
        start = time.perf_counter()
        _, offsets = plan_bins(kept, max_length, algorithm)
        row["seconds"][algorithm] = time.perf_counter() - start
        row["sequences"][algorithm] = int(offsets.size - 1)
    bfd = row["sequences"]["bfd"]
    row["bfd_fill_ratio"] = float(kept.sum()) / (bfd * max_length) if bfd else 1.0
    row["target_lb"] = bfd <= max(1.001 * bound, bound + 1)
    row["target_swift"] = "swift" not in row["sequences"] or bfd <= row["sequences"]["swift"]
    return row


def target_met(row: dict[str, Any]) -> bool:
    return bool(row["target_lb"] and row["target_swift"])


def print_table(rows: list[dict[str, Any]], algorithms: tuple[str, ...], title: str) -> None:
    table = Table(title=title)
    for header in ("mix", "max_len", "n", "LB", "L2/LB", *algorithms, "bfd fill", "target"):
        table.add_column(header, justify="left" if header == "mix" else "right")
    for row in rows:
        bound = row["lower_bound"]
        cells = [f"{row['sequences'][a] / bound:.5f}" if bound else "-" for a in algorithms]
        verdict = "ok" if target_met(row) else "MISSED"
        table.add_row(
            row["mix"],
            str(row["max_length"]),
            f"{row['n']:,}",
            f"{bound:,}",
            f"{row['lower_bound_l2'] / bound:.5f}" if bound else "-",
            *cells,
            f"{row['bfd_fill_ratio']:.4f}",
            verdict,
        )
    Console(width=None if sys.stdout.isatty() else 150).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument(
        "--n", type=int, help="samples of the large mixes (default 1,000,000; --quick 20,000)"
    )
    parser.add_argument("--proxy", action="store_true", help="characters/3.5 instead of the real tokenizer")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    n = args.n or (20_000 if args.quick else 1_000_000)

    sets, how = real_lengths(use_tokenizer=not args.proxy)
    combined = np.concatenate(list(sets.values()))
    rng = np.random.default_rng(0)
    bootstrap = rng.choice(combined, n)
    smoothed = np.maximum(1, np.rint(bootstrap * np.exp(rng.normal(0.0, 0.1, n)))).astype(np.int64)
    rows = []
    for max_length in MAX_LENGTHS:
        for name, lengths in sets.items():
            rows.append(measure(name, lengths, max_length, ALGORITHMS))
        rows.append(measure("text-sft (all 3)", combined, max_length, ALGORITHMS))
        rows.append(measure(f"text-sft resampled x{n:,}", smoothed, max_length, ALGORITHMS))
        rows.append(measure(f"text-sft bootstrap x{n:,}", bootstrap, max_length, ALGORITHMS))
        rows.append(measure("synthetic mix", synthetic_lengths(n, 0, max_length), max_length, ALGORITHMS))

    print_table(
        rows, ALGORITHMS, f"Sequences / lower bound (lengths: {how}; lower is better, 1.0 is perfect)"
    )
    missed = [f"{r['mix']} @ {r['max_length']}" for r in rows if not target_met(r)]
    print(
        "targets: bfd <= max(1.001 LB, LB + 1) and bfd <= swift:",
        "all met" if not missed else f"MISSED {missed}",
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / "bench_fill.json"
    meta = {"lengths": how, "n_large": n, "quick": args.quick, "python": platform.python_version()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
