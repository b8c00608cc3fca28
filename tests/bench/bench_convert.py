"""Convert throughput per core: the packer's record -> sample path beside the bare tokenizer.

For text-only, image and video samples (synthetic, from `support.synth`),
it times `SampleTokenizer` (parse, render the chat template, tokenize, place
labels, measure media from headers, hash media files) against the bare
tokenizer call `tokenizer(text)` on the same rendered strings, one by one:
once with one pad token per media item (the strings the packer tokenizes) and
once with the pads expanded (what the HF processor tokenizes). CPU time of this
process is measured, so other load on the machine does not skew the ratio;
the best of several interleaved rounds is kept. The target is a ratio of at
least 0.7 for text and image samples.

    python tests/bench/bench_convert.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
from packtrain.packer.sources.records import iter_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared test tooling
from support.paths import MODELS
from support.synth import generate_dataset

from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = MODELS / "qwen2-vl"
KINDS = {"text": (0.0, 0.0), "image": (1.0, 0.0), "video": (0.0, 1.0)}


def _cpu(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _texts(tok: SampleTokenizer, raws: list, samples: list[TokenizedSample]) -> tuple[list[str], list[str]]:
    """The rendered strings, with one pad per media item and with pads expanded to the token count."""
    m = tok.model
    compact, expanded = [], []
    for raw, sample in zip(raws, samples, strict=True):
        text = tok.render(tok._parser.parse(raw.record))
        compact.append(text)
        pieces = text.replace(m.family.video_pad, m.family.image_pad).split(m.family.image_pad)
        out = [pieces[0]]
        for media, piece in zip(sample.media, pieces[1:], strict=True):
            pad = m.family.image_pad if media.kind == "image" else m.family.video_pad
            out.append(pad * media.num_tokens + piece)
        expanded.append("".join(out))
    return compact, expanded


def bench_kind(kind: str, n: int, rounds: int, folder: Path) -> dict[str, Any]:
    image_frac, video_frac = KINDS[kind]
    path = generate_dataset(folder / kind, n, seed=1, image_frac=image_frac, video_frac=video_frac)
    source = SourceConfig(paths=[str(path)])
    model = ModelConfig(path=str(MODEL))
    raws = list(iter_records(source.paths))
    samples = [
        s
        for s in map(SampleTokenizer(source, model, PackingConfig()), raws)
        if isinstance(s, TokenizedSample)
    ]
    assert len(samples) == len(raws), "synthetic records must all convert"
    tok = SampleTokenizer(source, model, PackingConfig())
    compact, expanded = _texts(tok, raws, samples)
    hf = tok.model.tokenizer
    best = {"convert": float("inf"), "bare_compact": float("inf"), "bare_expanded": float("inf")}
    for _ in range(rounds):
        fresh = SampleTokenizer(source, model, PackingConfig())  # empty media cache: every file is measured
        for text in compact:  # warm its BPE cache, as in a long-running worker (the bare one is warm too)
            fresh.model.tokenizer(text)
        best["convert"] = min(best["convert"], _cpu(lambda t=fresh: [t(r) for r in raws]))
        best["bare_compact"] = min(best["bare_compact"], _cpu(lambda: [hf(t) for t in compact]))
        best["bare_expanded"] = min(best["bare_expanded"], _cpu(lambda: [hf(t) for t in expanded]))
    rate = {k: n / v for k, v in best.items()}
    return {
        "kind": kind,
        "samples": n,
        "tokens": sum(len(s.input_ids) for s in samples),
        "media": sum(len(s.media) for s in samples),
        "convert_per_s": rate["convert"],
        "bare_compact_per_s": rate["bare_compact"],
        "bare_expanded_per_s": rate["bare_expanded"],
        "ratio_vs_compact": rate["convert"] / rate["bare_compact"],
        "ratio_vs_expanded": rate["convert"] / rate["bare_expanded"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    args = ap.parse_args(argv)
    sizes = {"text": 60, "image": 30, "video": 6} if args.quick else {"text": 1000, "image": 400, "video": 40}
    rounds = 1 if args.quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_kind(kind, n, rounds, Path(tmp)) for kind, n in sizes.items()]
    header = (
        f"{'kind':<7}{'samples':>8}{'tok/sample':>11}{'convert/s':>11}{'bare/s':>9}{'ratio':>7}"
        f"{'bare exp/s':>11}{'ratio exp':>10}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['kind']:<7}{r['samples']:>8}{r['tokens'] / r['samples']:>11.0f}{r['convert_per_s']:>11.0f}"
            f"{r['bare_compact_per_s']:>9.0f}{r['ratio_vs_compact']:>7.2f}{r['bare_expanded_per_s']:>11.0f}"
            f"{r['ratio_vs_expanded']:>10.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {"quick": args.quick, "cpu_time": "process_time, best of rounds", "rows": rows}
    name = (
        "bench_convert.quick.json" if args.quick else "bench_convert.json"
    )  # a smoke run keeps the real numbers
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
