"""The tiny Qwen2-VL (its LM head tied to the embedding, or with `--untied` its own) trained by each rank
under torchrun, or by one process: 2 FSDP2 ranks each take one of a step's two batches, one process
takes both.

Exported first (fp32 and bf16, the untrained weights: the same bytes whatever the world size), with
every `DTensor.full_tensor` call recorded; then `--steps` SGD steps, recording each step's loss, the
first step's gradients and, on FSDP ranks, whether the embedding's weight was whole (gathered) as
each decoder layer ran its forward and its backward and as the lookup's backward started. Rank 0
saves it all, with the trained weights, to `OUT/world-N.pt`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from torch.distributed.tensor import DTensor  # noqa: E402
from vlm_fixtures import FOLDER, TINY  # noqa: E402

from packtrain.core.pack.schema import IGNORE_INDEX  # noqa: E402
from packtrain.trainer import distributed  # noqa: E402
from packtrain.trainer.data.batch import ModelInputs  # noqa: E402
from packtrain.trainer.model.build import VLMForTraining, build_model  # noqa: E402
from packtrain.trainer.model.init_weights import materialize  # noqa: E402
from packtrain.trainer.model.loss import micro_batch_objective  # noqa: E402
from packtrain.trainer.state import export  # noqa: E402

SHARD = 4_000_000  # bytes: the 39 MB tied embedding in a shard of its own, the rest around it
LENGTH = 48


def batch(index: int) -> ModelInputs:
    """A padded text row of random tokens, about two thirds of them labelled."""
    gen = torch.Generator().manual_seed(index)
    ids = torch.randint(0, 20_000, (1, LENGTH), generator=gen)
    labels = ids.clone()
    labels[torch.rand(1, LENGTH, generator=gen) < 0.3] = IGNORE_INDEX
    shift = torch.cat([labels[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
    positions = torch.arange(LENGTH).expand(3, 1, LENGTH)
    return ModelInputs(ids, labels, shift, positions, attention_mask=torch.ones(1, LENGTH, dtype=torch.long))


def label_tokens(inputs: ModelInputs) -> int:
    return int((inputs.shift_labels != IGNORE_INDEX).sum())


def probe_layers(hf: Any, seen: list[tuple[str, bool]]) -> None:
    """Record, as each decoder layer starts its forward and its backward and as the lookup's backward
    starts, whether the tied weight is whole on this rank (FSDP2 puts the gathered tensor in place
    of the sharded DTensor)."""
    embed = hf.model.language_model.embed_tokens

    def record(where: str) -> Any:
        return lambda *_: seen.append((where, not isinstance(embed.weight, DTensor)))

    for i, layer in enumerate(hf.model.language_model.layers):
        layer.register_forward_pre_hook(record(f"layer {i} forward"))
        layer.register_full_backward_pre_hook(record(f"layer {i} backward"))

    def on_lookup(_module: Any, _inputs: Any, out: torch.Tensor) -> None:
        out.register_hook(record("lookup backward"))

    embed.register_forward_hook(on_lookup)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--untied", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    env, device = distributed.environ(), torch.device("cpu")
    distributed.init(env, device)
    try:
        run(args, env, device)
    finally:
        distributed.shutdown()


def run(args: argparse.Namespace, env: distributed.DistEnv, device: torch.device) -> None:
    overrides = {**TINY["qwen2-vl"], "tie_word_embeddings": not args.untied}
    hf = build_model(FOLDER["qwen2-vl"], init="random", overrides=overrides, seed=0, empty=True)
    for p in hf.model.visual.parameters():  # text-only batches: the tower takes no step anywhere
        p.requires_grad_(False)
    fill = lambda m: materialize(m, device, weights=None, seed=0)  # noqa: E731
    model = distributed.parallelize(VLMForTraining(hf, "sdpa"), "fsdp", env, device, fill=fill)
    record: dict[str, Any] = {"tied": hf.lm_head.weight is hf.model.language_model.embed_tokens.weight}

    whole: list[tuple[int, ...]] = []  # every tensor gathered whole by the exports
    full_tensor = DTensor.full_tensor

    def recorded(self: DTensor, *a: Any, **k: Any) -> torch.Tensor:
        whole.append(tuple(self.shape))
        return full_tensor(self, *a, **k)

    DTensor.full_tensor = recorded  # type: ignore[method-assign]
    try:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            folder = args.out / f"export-{env.world_size}-{name}"
            export.save_hf(folder, model, hf, FOLDER["qwen2-vl"], env, dtype, shard_bytes=SHARD)
    finally:
        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
    record["gathered_whole"] = whole

    seen: list[tuple[str, bool]] = []
    if env.distributed:
        probe_layers(hf, seen)
    params = [p for p in model.parameters() if p.requires_grad]
    # Plain SGD: the weights move by the gradients themselves (AdamW's normalisation would blow up
    # the rounding noise of gradients that are zero in exact arithmetic, as the key biases').
    optimizer = torch.optim.SGD(params, lr=1.0)
    losses = []
    for step in range(args.steps):
        batches = [batch(2 * step + r) for r in range(2)]  # the step's global batch: one per rank
        mine = batches[env.rank : env.rank + 1] if env.distributed else batches
        tokens = sum(label_tokens(b) for b in batches)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for inputs in mine:
            result = model(inputs)
            micro_batch_objective(result["loss_sum"], tokens, env.world_size).backward()
            loss_sum += result["loss_sum"].detach().double()
        losses.append(distributed.all_reduce_sum(float(loss_sum), device) / tokens)
        if step == 0:
            record["grads"] = {name: full(p.grad) for name, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record |= {"losses": losses, "seen": seen}
    record["weights"] = {name: full(p) for name, p in model.named_parameters()}
    if env.is_main:
        torch.save(record, args.out / f"world-{env.world_size}.pt")


if __name__ == "__main__":
    main()
