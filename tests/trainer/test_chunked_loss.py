"""The chunked LM head + cross-entropy is the full computation, without the full logits.

Reference: what a plain `transformers` forward does — logits of *every* token, upcast, then
cross-entropy with ignored positions. fp64 must agree to 1e-10 (relative). fp32 is held to the
standard rounding-error estimate of a length-k reduction, sqrt(k)·u with u = 2^-24 (k the longest
reduction: hidden size for a logit, vocabulary for a softmax sum or a hidden-state gradient,
label count for a weight gradient), with a factor 4 of margin; today's unchunked fp32 path is
checked against the same bound so the bound is not a loose one chosen to fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import vlm_fixtures as fx
from pydantic import ValidationError
from test_equivalence import _double_batch
from torch.utils._python_dispatch import TorchDispatchMode

from packtrain.core.pack.schema import IGNORE_INDEX
from packtrain.core.sft_config import LOSS_CHUNK_TOKENS, TrainingSpec
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.model.build import VLMForTraining, build_model
from packtrain.trainer.model.loss import per_sample_sums, token_losses

FP32_UNIT = 2.0**-24


class Toy(torch.nn.Module):
    """Embedding → a block → LM head, optionally tied to the embedding and with a bias."""

    def __init__(self, vocab: int, hidden: int, tied: bool, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(vocab + hidden)
        self.embed = torch.nn.Embedding(vocab, hidden, dtype=dtype)
        self.block = torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=bias, dtype=dtype)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab, hidden, generator=gen, dtype=dtype))
            self.block.weight.copy_(torch.randn(hidden, hidden, generator=gen, dtype=dtype) / hidden**0.5)
            if bias:
                self.lm_head.bias.copy_(torch.randn(vocab, generator=gen, dtype=dtype))
        if tied:
            self.lm_head.weight = self.embed.weight

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(self.embed(ids)))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        return token_losses(self.hidden(ids), self.lm_head, labels, chunk)[0]


def batch(
    vocab: int, rows: int, length: int, labelled: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    labels = torch.randint(0, vocab, (rows, length), generator=gen)
    labels[torch.rand(rows, length, generator=gen) >= labelled] = IGNORE_INDEX
    return ids, labels


def full_reference(model: Toy, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's logits, then cross-entropy with ignored positions (the Hugging Face way)."""
    logits = model.lm_head(model.hidden(ids))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    losses = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    )
    positions = torch.nonzero(labels.flatten() != IGNORE_INDEX).squeeze(-1)
    return losses.index_select(0, positions), positions


def run(
    model: Toy,
    ids: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Callable,
    weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Losses and every parameter's gradient of Σ weight_i·loss_i (weights: the mean by default)."""
    model.zero_grad(set_to_none=True)
    losses, positions = loss_fn(model, ids, labels)
    w = torch.full_like(losses, 1.0 / len(losses)) if weights is None else weights.to(losses.dtype)
    (losses * w).sum().backward()
    out = {"losses": losses.detach(), "positions": positions}
    out.update({name: p.grad.detach().clone() for name, p in model.named_parameters()})
    return out


def chunked(chunk: int) -> Callable:
    return lambda model, ids, labels: token_losses(model.hidden(ids), model.lm_head, labels, chunk)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CHUNKS = {
    "1": lambda n: 1,
    "7": lambda n: 7,
    "n-1": lambda n: n - 1,
    "n": lambda n: n,
    "n+1": lambda n: n + 1,
    "10n": lambda n: 10 * n,
}


@pytest.mark.parametrize("tied,bias", [(True, False), (False, False), (False, True), (True, True)])
@pytest.mark.parametrize("chunk", list(CHUNKS))
def test_fp64_equals_full_logits(chunk: str, tied: bool, bias: bool) -> None:
    model = Toy(97, 12, tied, bias, torch.float64)
    ids, labels = batch(97, 2, 40, labelled=0.6)
    n = int((labels != IGNORE_INDEX).sum())
    assert n % 7 != 0 and n > 8  # 7 does not divide the label count: a ragged last chunk
    weights = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = run(model, ids, labels, full_reference, weights)
    got = run(model, ids, labels, chunked(CHUNKS[chunk](n)), weights)
    assert torch.equal(got["positions"], ref["positions"])
    names = [name for name, _ in model.named_parameters()]
    assert ("lm_head.weight" in names) is not tied and ("lm_head.bias" in names) is bias
    for key in ["losses", *names]:
        assert rel(got[key], ref[key]) <= 1e-10, key


@pytest.mark.parametrize("tied", [True, False])
def test_fp32_within_rounding_error(tied: bool) -> None:
    vocab, hidden = 1000, 64
    model = Toy(vocab, hidden, tied, True, torch.float64)
    ids, labels = batch(vocab, 2, 120, labelled=0.7)
    truth = run(model, ids, labels, full_reference)
    n = len(truth["losses"])
    tol = 4 * math.sqrt(max(vocab, hidden, n)) * FP32_UNIT
    model32 = model.float()
    today = run(model32, ids, labels, chunked(0))
    for chunk in (1, 7, 64, n, 10 * n):
        got = run(model32, ids, labels, chunked(chunk))
        for key in truth:
            if key != "positions":
                assert got[key].dtype == torch.float32
                assert rel(today[key], truth[key]) <= tol, f"today's path {key}"
                assert rel(got[key], truth[key]) <= tol, (
                    f"chunk {chunk} {key}: {rel(got[key], truth[key]):.2e}"
                )


def test_bf16_autocast_matches_todays_path() -> None:
    """Under bf16 autocast the chunked matmuls run in bf16 like `lm_head(hidden)` and the softmax in
    fp32: its distance to the fp64 truth is that of today's path (same rounding, other order)."""
    vocab, hidden = 1000, 64
    model = Toy(vocab, hidden, True, False, torch.float64)
    ids, labels = batch(vocab, 2, 120, labelled=0.7)
    truth = run(model, ids, labels, full_reference)
    model32 = model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        today = run(model32, ids, labels, chunked(0))
        got = run(model32, ids, labels, chunked(7))
    assert got["losses"].dtype == torch.float32 and got["embed.weight"].dtype == torch.float32
    for key in ("losses", "embed.weight", "block.weight"):
        err_today, err = rel(today[key], truth[key]), rel(got[key], truth[key])
        assert err <= 1.5 * err_today + 2.0**-10, f"{key}: chunked {err:.2e}, today {err_today:.2e}"
        assert rel(got[key], today[key]) <= 2.0**-6, key


class LargestTensor(TorchDispatchMode):
    """Records the most elements any single op output has (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 8, 24])
def test_never_more_than_one_chunk_of_logits(chunk: int) -> None:
    """No tensor of the loss step, forward or backward, is larger than one chunk of logits or the
    head's weight (whose gradient must exist); all label rows at once (0) is, by far."""
    vocab, hidden = 512, 16
    model = Toy(vocab, hidden, True, False, torch.float32)
    ids, labels = batch(vocab, 1, 300, labelled=1.0)
    states = model.hidden(ids)
    with LargestTensor() as mode:
        losses, _ = token_losses(states, model.lm_head, labels, chunk)
        losses.mean().backward()
    allowed = max(chunk * vocab, vocab * hidden, states.numel())
    if chunk:
        assert mode.largest <= allowed
    else:
        assert mode.largest >= 300 * vocab > 10 * allowed


def test_per_sample_sums_of_chunked_losses() -> None:
    model = Toy(97, 12, True, False, torch.float64)
    ids, labels = batch(97, 2, 40, labelled=0.6)
    owner = torch.arange(80) // 20  # four sub-samples of 20 tokens
    ref, positions = full_reference(model, ids, labels)
    losses, got_positions = token_losses(model.hidden(ids), model.lm_head, labels, 3)
    expected = torch.zeros(4, dtype=torch.float64).index_add_(0, owner[positions], ref)
    assert torch.allclose(per_sample_sums(losses, got_positions, owner, 4), expected, rtol=1e-12)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_real_model_chunked_equals_unchunked(family: str, shared_dir) -> None:  # type: ignore[no-untyped-def]
    """The tiny random model on a packed micro-batch of the demo samples (text, images, video):
    chunks of 7 and 100 label rows give the losses and every gradient of all rows at once. With
    test_equivalence (default chunking = each sample alone) this makes chunked = each sample alone."""
    torch.set_num_threads(2)
    samples = fx.demo_samples(family)
    model = build_model(
        fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=torch.float64, seed=1
    )
    assert model.lm_head.weight is model.get_input_embeddings().weight  # Qwen's small models tie them
    rows = [fx.packed_row(samples[:2], family), fx.packed_row(samples[2:], family)]
    batch = _double_batch(collate_packed(rows, fx.spec(family)))
    results = {}
    for chunk in (0, 7, 100):
        out = VLMForTraining(model, "sdpa", loss_chunk_tokens=chunk)(batch.inputs)
        (out["loss_sum"] / batch.info.num_label_tokens).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results[chunk] = (out["token_losses"].detach(), out["positions"], grads)
    losses, positions, grads = results[0]
    assert len(losses) > 100 and len(losses) % 7 and len(losses) % 100  # ragged last chunks
    for chunk in (7, 100):
        got_losses, got_positions, got_grads = results[chunk]
        assert torch.equal(got_positions, positions)
        assert rel(got_losses, losses) <= 1e-10
        assert set(got_grads) == set(grads)
        assert max(rel(got_grads[k], grads[k]) for k in grads if grads[k].norm() > 0) <= 1e-10


FSDP_VOCAB, FSDP_HIDDEN, FSDP_WORLD = 97, 12, 2


def _fsdp_rank(rank: int, init_file: str, out: str, chunk: int) -> None:
    """One gloo rank: the toy sharded like the trainer's FSDP2 (a block per unit, embedding and
    head in the root group), the loss chunked inside the root's forward; saves the full grads."""
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=FSDP_WORLD)
    try:
        model = Toy(FSDP_VOCAB, FSDP_HIDDEN, True, False, torch.float64)
        fully_shard(model.block)
        fully_shard(model)
        ids, labels = batch(FSDP_VOCAB, 1, 40, labelled=0.6, seed=rank)
        losses = model(ids, labels, chunk)
        (losses.sum() * FSDP_WORLD / 100.0).backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}

        head_unit = Toy(FSDP_VOCAB, FSDP_HIDDEN, False, False, torch.float64)
        fully_shard(head_unit.lm_head)
        fully_shard(head_unit)
        try:
            head_unit(ids, labels, chunk)
            error = ""
        except ValueError as exc:
            error = str(exc)
        if rank == 0:
            torch.save({"grads": grads, "error": error}, out)
    finally:
        dist.destroy_process_group()


def test_fsdp2_root_group_head(tmp_path: Path) -> None:
    """Under FSDP2 (2 gloo ranks) the chunked loss, reading the head's weight inside the root's
    forward, gives the gradients of one process computing both ranks' batches all at once; a head
    sharded as its own unit is refused with a message saying what to change."""
    out = tmp_path / "grads.pt"
    mp.spawn(_fsdp_rank, args=(str(tmp_path / "init"), str(out), 7), nprocs=FSDP_WORLD, join=True)
    result = torch.load(out)
    model = Toy(FSDP_VOCAB, FSDP_HIDDEN, True, False, torch.float64)
    for rank in range(FSDP_WORLD):
        ids, labels = batch(FSDP_VOCAB, 1, 40, labelled=0.6, seed=rank)
        (full_reference(model, ids, labels)[0].sum() / 100.0).backward()  # FSDP averages over ranks
    for name, p in model.named_parameters():
        assert rel(result["grads"][name], p.grad) <= 1e-10, name
    assert "lossChunkTokens: 0" in result["error"] and "root module" in result["error"]


def test_loss_chunk_tokens_config() -> None:
    assert TrainingSpec().loss_chunk_tokens == LOSS_CHUNK_TOKENS > 0
    assert TrainingSpec.model_validate({"lossChunkTokens": 0}).loss_chunk_tokens == 0
    with pytest.raises(ValidationError, match="lossChunkTokens"):
        TrainingSpec.model_validate({"lossChunkTokens": -1})
