"""`packtrain train --score FILE`: every packed sample scored by the weights the run starts from.

The model is built as a training run builds it (`recipe.setup_scoring`: pretrained or the seeded
random init, LoRA, freezing, sharding), with no optimizer and no checkpoint, and runs in eval mode
without gradients over every sequence of the pack (held-out ones included), each rank its
round-robin share (`EvalDataset`). Each micro-batch goes through the training forward (`VLMForTraining`:
per-sample attention and positions, the label-token losses) and its token losses are summed per
sample by the row's sample boundaries (`loss.per_sample_sums`). Rank 0 gathers every rank's lines,
puts them in pack order (sequence, then sample within it), checks there is one per packed sample of
the manifest and writes FILE atomically: one JSON line per sample, `{"id", "loss_sum", "tokens"}`.
With `training.saveFinal` the starting weights are exported to `final/`, as a run's end exports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from packtrain.core.errors import PackIntegrityError
from packtrain.core.pack.shards import atomic_writer
from packtrain.core.sft_config import SFTSpecCore
from packtrain.trainer import distributed
from packtrain.trainer.data.packed import EvalDataset, loader
from packtrain.trainer.model.loss import per_sample_sums
from packtrain.trainer.recipe import Scoring, setup_scoring
from packtrain.trainer.state import export, output

# One scored sample: (sequence, sample within it) for the pack order, its id, Σ token losses, tokens.
Scored = tuple[int, int, str, float, int]


class ScoreSummary(TypedDict):
    """The JSON line `--score` prints last (rank 0)."""

    scores: str
    samples: int
    tokens: int
    loss: float  # Σ loss_sum / Σ tokens over the pack: the token-mean loss of the starting weights
    init: str
    final_model: str | None


def score(cfg: SFTSpecCore, path: Path) -> ScoreSummary:
    """Score the pack of `cfg` into `path` in this process (one rank); the summary (rank 0's is whole)."""
    env = distributed.environ()
    device = distributed.pick_device(env)
    distributed.init(env, device)
    try:
        if not cfg.training.save_final:  # nothing is written into the output folder: no claim
            return _score(cfg, path, env, device)
        with output.claimed(Path(cfg.training.output_dir), env, device):
            return _score(cfg, path, env, device)
    finally:
        distributed.shutdown()


def _score(cfg: SFTSpecCore, path: Path, env: distributed.DistEnv, device: torch.device) -> ScoreSummary:
    run = setup_scoring(cfg, env, device)
    data = cfg.data
    mine = score_samples(
        run.built.model, run.dataset, device, run.dtype, data.num_workers, data.prefetch_factor
    )
    scored = _gathered(mine, env)
    if env.is_main:
        _check_count(scored, run.dataset)
        write_scores(path, scored)
    final = _export(cfg, run, env)
    tokens = sum(s[4] for s in scored)
    return {
        "scores": str(path),
        "samples": len(scored),
        "tokens": tokens,
        "loss": sum(s[3] for s in scored) / max(tokens, 1),
        "init": run.init,
        "final_model": None if final is None else str(final),
    }


def score_samples(
    model: torch.nn.Module,
    dataset: EvalDataset,
    device: torch.device,
    dtype: torch.dtype,
    num_workers: int = 0,
    prefetch: int = 2,
) -> list[Scored]:
    """This rank's samples of `dataset`, each with its summed label-token loss and token count."""
    model.eval()
    out: list[Scored] = []
    with torch.no_grad():
        for batch in loader(dataset, num_workers, prefetch, device.type == "cuda"):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                result = model(batch.inputs.to(device, dtype))
            if not batch.info.counted:  # a repeat that only evens out the ranks' forwards
                continue
            info, n = batch.info, len(batch.info.seq_lens)
            losses, positions = result["token_losses"].double(), result["positions"]
            sums = per_sample_sums(losses, positions, info.sample_index, n).tolist()
            counts = per_sample_sums(torch.ones_like(losses), positions, info.sample_index, n).tolist()
            keys = _sample_keys(dataset, info.position[1] if info.position else -1)
            if len(keys) != n:
                raise ValueError(f"micro-batch holds {n} samples but its units name {len(keys)}")
            out += [
                (*k, sid, s, int(c)) for k, sid, s, c in zip(keys, info.sample_ids, sums, counts, strict=True)
            ]
    return out


def _sample_keys(dataset: EvalDataset, index: int) -> list[tuple[int, int]]:
    """(sequence, sample within it) of each sample of micro-batch `index`, in the order it collates."""
    keys = []
    for u in dataset.batches[index]:
        seq, sub = dataset.units[u]
        keys += [(seq, k) for k in range(len(dataset.seq_lens[seq]))] if sub < 0 else [(seq, sub)]
    return keys


def _gathered(mine: list[Scored], env: distributed.DistEnv) -> list[Scored]:
    """Every rank's samples at rank 0, in pack order (the other ranks get their own back)."""
    if not (env.distributed and dist.is_initialized()):
        return sorted(mine)
    parts: list[Any] | None = [None] * env.world_size if env.is_main else None
    dist.gather_object(mine, parts, dst=0)
    return sorted(s for part in parts for s in part) if parts is not None else mine


def _check_count(scored: list[Scored], dataset: EvalDataset) -> None:
    """One line per packed sample of the manifest, none twice."""
    packed = (dataset.manifest.get("counts") or {}).get("packed")
    keys = {(s[0], s[1]) for s in scored}
    if len(keys) != len(scored) or (isinstance(packed, int) and packed != len(scored)):
        raise PackIntegrityError(
            f"{dataset.path}: scored {len(scored)} samples ({len(keys)} distinct) but its manifest "
            f"counts {packed} packed: run `packtrain pack verify` on it"
        )


def write_scores(path: Path, scored: list[Scored]) -> None:
    """`path` written whole or not at all (temp file, fsync, rename): one JSON line per sample."""
    with atomic_writer(path) as f:
        for _, _, sid, loss_sum, tokens in scored:
            f.write((json.dumps({"id": sid, "loss_sum": loss_sum, "tokens": tokens}) + "\n").encode())


def _export(cfg: SFTSpecCore, run: Scoring, env: distributed.DistEnv) -> Path | None:
    """With training.saveFinal: the starting weights to `final/` (step 0), by the end-of-run export."""
    if not cfg.training.save_final:
        return None
    built = run.built
    return export.save_final(
        Path(cfg.training.output_dir),
        built.model,
        built.hf,
        built.adapter,
        cfg.model,
        env,
        run.dtype,
        pack=run.dataset.manifest,
        step=0,
    )
