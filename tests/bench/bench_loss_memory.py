"""Peak memory and time of the loss step (LM head + cross-entropy, forward and backward).

Three ways to get the token-mean loss of one 8192-token row from the decoder's last hidden
states, with the real Qwen vocabulary (151,936) and real hidden sizes (Qwen2-VL-2B: 1536,
Qwen2.5-VL-3B: 2048):

- `full`: logits of every token, upcast, then cross-entropy with ignored positions (what a plain
  Hugging Face `ForCausalLM` forward with `labels` computes; independent of the label fraction);
- `labels`: logits of label positions only, all at once (`token_losses(..., chunk_tokens=0)`);
- `chunked`: label positions, `--chunk` rows of logits at a time in forward and backward
  (`token_losses`, the trainer's default).

Each case runs in a fresh interpreter on CPU in fp32. Its peak is the kernel's VmHWM, reset just
before the step through /proc/self/clear_refs (torch's CPU allocations are invisible to
tracemalloc); "growth" is that peak minus the resident size before the step (weights, hidden
states and imports excluded, the weight gradient included). A case whose estimated peak exceeds
the memory available is skipped and says so.

    python tests/bench/bench_loss_memory.py [--tokens 8192] [--hidden 1536 2048] [--fractions 0.5 1.0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MIB = 1 << 20
QWEN_VOCAB = 151_936
METHODS = ("full", "labels", "chunked")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def estimate_bytes(method: str, tokens: int, labelled: int, vocab: int, hidden: int, chunk: int) -> int:
    """Rough fp32 peak growth: the weight gradient plus ~3 live (rows x vocab) buffers for the
    unchunked paths (logits or log-softmax, its gradient, the logits' gradient), ~2 for a chunk."""
    rows = {"full": tokens, "labels": labelled, "chunked": min(chunk, labelled)}[method]
    buffers = 2 if method == "chunked" else 3
    return 4 * (buffers * rows * vocab + 2 * vocab * hidden + 4 * tokens * hidden)


def _child(
    method: str, tokens: int, fraction: float, vocab: int, hidden: int, chunk: int, threads: int
) -> None:
    import torch
    import torch.nn.functional as F

    from packtrain.core.pack.schema import IGNORE_INDEX
    from packtrain.trainer.model.loss import token_losses

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=gen)
    states = torch.randn(1, tokens, hidden, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    labels[torch.rand(1, tokens, generator=gen) >= fraction] = IGNORE_INDEX
    labelled = int((labels != IGNORE_INDEX).sum())

    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    if method == "full":
        logits = head(states).float()
        loss = F.cross_entropy(logits.view(-1, vocab), labels.view(-1), ignore_index=IGNORE_INDEX)
        del logits
    else:
        losses, _ = token_losses(states, head, labels, chunk if method == "chunked" else 0)
        loss = losses.sum() / labelled
        del losses
    loss.backward()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    print(
        json.dumps(
            {
                "peak_kib": peak,
                "growth_kib": peak - before,
                "seconds": seconds,
                "labelled": labelled,
                "loss": loss.item(),
            }
        )
    )


def measure(
    method: str, tokens: int, fraction: float, vocab: int, hidden: int, chunk: int, threads: int
) -> dict:
    """One case in a fresh interpreter (so no earlier case's memory is reused or counted)."""
    args = [method, tokens, fraction, vocab, hidden, chunk, threads]
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{method} case failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1536, 2048])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--chunk", type=int, default=1024, help="lossChunkTokens of the chunked case")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument(
        "--memory-share",
        type=float,
        default=0.8,
        help="skip a case whose estimated peak exceeds this share of MemAvailable",
    )
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    rows: list[dict] = []
    print(
        f"{args.tokens} tokens, vocabulary {args.vocab}, chunk {args.chunk}, fp32 on CPU, "
        f"{args.threads} threads"
    )
    print(f"{'hidden':>6} {'labels':>6} {'method':>8} {'peak MiB':>9} {'growth MiB':>10} {'seconds':>8}")
    for hidden in args.hidden:
        for fraction in args.fractions:
            for method in args.methods:
                row = {
                    "hidden": hidden,
                    "fraction": fraction,
                    "method": method,
                    "tokens": args.tokens,
                    "vocab": args.vocab,
                    "chunk": args.chunk,
                }
                need = estimate_bytes(
                    method, args.tokens, round(fraction * args.tokens), args.vocab, hidden, args.chunk
                )
                if need > args.memory_share * _available_bytes():
                    row["skipped"] = (
                        f"needs ~{need / MIB:.0f} MiB, {_available_bytes() / MIB:.0f} MiB available"
                    )
                    print(f"{hidden:>6} {fraction:>6.2f} {method:>8}  skipped: {row['skipped']}")
                else:
                    row.update(
                        measure(method, args.tokens, fraction, args.vocab, hidden, args.chunk, args.threads)
                    )
                    print(
                        f"{hidden:>6} {fraction:>6.2f} {method:>8} {row['peak_kib'] / 1024:>9.0f} "
                        f"{row['growth_kib'] / 1024:>10.0f} {row['seconds']:>8.1f}",
                        flush=True,
                    )
                rows.append(row)
    _ratios(rows)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / "bench_loss_memory.json"
    out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


def _ratios(rows: list[dict]) -> None:
    """Growth of `full` and `labels` over `chunked`, per hidden size and label fraction."""
    print("growth ratio vs chunked:")
    for row in rows:
        if row["method"] != "chunked" or "skipped" in row:
            continue
        for other in rows:
            same = (other["hidden"], other["fraction"]) == (row["hidden"], row["fraction"])
            if same and other["method"] != "chunked" and "skipped" not in other:
                ratio = other["growth_kib"] / row["growth_kib"]
                row[f"growth_{other['method']}_over_chunked"] = ratio
                print(
                    f"  hidden {row['hidden']}, labels {row['fraction']:.2f}: {other['method']} / chunked "
                    f"= {ratio:.2f}x"
                )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        m, t, f, v, h, c, th = sys.argv[2:9]
        _child(m, int(t), float(f), int(v), int(h), int(c), int(th))
    else:
        sys.exit(main())
