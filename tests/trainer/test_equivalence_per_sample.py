"""Packed == each sample alone, sample by sample: every sub-sample's own loss and its own gradient.

`test_equivalence` compares the batch loss's gradient; a leak that moved gradient between samples
but kept the sum could hide there. Here each sample's mean loss is differentiated on its own, in
one packed forward (text, single-image, multi-image and video samples in two packed rows), and
compared with a plain `transformers` run of that sample alone (the model's own `get_rope_index`,
the Hugging Face processor's pixels). Gradients are grouped into the language model, the vision
tower and, for Qwen3-VL, the DeepStack mergers, whose features the language model adds at the
sample's own visual positions. fp64 on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import vlm_fixtures as fx

from packtrain.trainer.data.batch import Batch
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.model.build import VLMForTraining, build_model
from packtrain.trainer.model.loss import per_sample_sums

TOL = 1e-6  # fp64; Qwen3.5 ~2e-7: its RMSNorms and delta rule compute in fp32 inside (transformers)


def _double(inputs: dict) -> dict:
    return {k: (v.double() if k.startswith("pixel_values") else v) for k, v in inputs.items()}


def _double_batch(batch: Batch) -> Batch:
    """The batch with its pixels in fp64, as the fp64 model computes."""
    return Batch(batch.inputs.to(torch.device("cpu"), torch.float64), batch.info)


def _group(name: str) -> str:
    if "deepstack" in name:
        return "deepstack"
    if "linear_attn" in name:  # Qwen3.5's Gated DeltaNet layers (conv1d, A_log, dt_bias, in_proj_*, ...)
        return "linear_attention"
    if "visual.merger" in name:
        return "merger"
    return "vision" if "visual" in name else "llm"


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _alone(model, sample) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs = _double({k: v for k, v in sample.hf.items() if k != "attention_mask"})
    logits = model(**inputs, use_cache=False).logits[0, :-1]
    loss = F.cross_entropy(logits, torch.tensor(sample.labels[1:]), ignore_index=-100)
    loss.backward()
    return loss.detach(), _grads(model)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_each_sample_loss_and_gradient_equal_the_sample_alone(family, shared_dir):
    torch.set_num_threads(2)
    samples = fx.demo_samples(family)
    model = build_model(
        fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=torch.float64, seed=2
    )
    rows = [fx.packed_row(samples[:2], family), fx.packed_row(samples[2:], family)]
    batch = _double_batch(collate_packed(rows, fx.spec(family)))
    out = VLMForTraining(model, "sdpa")(batch.inputs)
    n = len(samples)
    sums = per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, n)
    counts = per_sample_sums(
        torch.ones_like(out["token_losses"]), out["positions"], batch.info.sample_index, n
    )
    means = sums / counts

    worst: dict[str, float] = {"loss": 0.0}
    for k, sample in enumerate(samples):
        means[k].backward(retain_graph=k < n - 1)
        packed = _grads(model)
        ref_loss, ref = _alone(model, sample)
        assert set(ref) <= set(packed), f"{family} {sample.name}: parameters without a packed gradient"
        worst["loss"] = max(worst["loss"], abs(means[k].item() - ref_loss.item()) / abs(ref_loss.item()))
        for name, grad in packed.items():
            if name in ref:
                worst[_group(name)] = max(worst.get(_group(name), 0.0), _rel(grad, ref[name]))
            else:  # unused alone (a text sample's vision side): exactly no gradient from the other samples
                assert not grad.any(), f"{family} {sample.name}: {name} got gradient from another sample"
        if sample.media:  # the sample's own media reach the vision side (and DeepStack) in both runs
            assert any(_group(k) != "llm" and g.norm() > 0 for k, g in ref.items())
    print(f"{family}: max rel diff per sample " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    assert all(v <= TOL for v in worst.values()), worst
    assert {"llm", "vision", "merger"} <= set(worst)
    assert ("deepstack" in worst) == (family == "qwen3-vl")
    assert ("linear_attention" in worst) == (family == "qwen3.5")


def test_a_cache_turns_off_the_packed_detection_so_boundaries_stay_explicit(shared_dir):
    """Qwen3-VL's text model infers sample boundaries from a restarting text position row only when
    no KV cache exists; its default `use_cache=True` makes one, and the packed row then leaks
    across samples even with per-sample positions. The trainer passes `use_cache=False` *and*
    explicit boundaries; this shows what the second alone would not prevent."""
    torch.set_num_threads(2)
    family = "qwen3-vl"
    samples = fx.demo_samples(family)[:2]
    model = build_model(
        fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=torch.float64, seed=1
    )
    batch = _double_batch(collate_packed([fx.packed_row(samples, family)], fx.spec(family)))
    targets = batch.inputs.shift_labels[0, :-1]
    second = (batch.info.sample_index[:-1] == 1) & (targets != -100)

    def second_loss(**kwargs) -> float:
        with torch.no_grad():
            hidden = model.model(
                input_ids=batch.inputs.input_ids,
                position_ids=batch.inputs.position_ids,
                pixel_values=batch.inputs.pixel_values,
                image_grid_thw=batch.inputs.image_grid_thw,
                **kwargs,
            ).last_hidden_state
            logits = model.lm_head(hidden[0, :-1])
            return F.cross_entropy(logits[second], targets[second]).item()

    with torch.no_grad():
        isolated = VLMForTraining(model, "sdpa")(batch.inputs)
    owner = batch.info.sample_index[isolated["positions"]]
    want = isolated["token_losses"][owner == 1].mean().item()
    assert abs(second_loss(use_cache=False) - want) / want < 1e-12  # detected from the text positions
    # A random-init model is near uniform, so the leak is small, but far above fp64 noise (~1e-15).
    assert abs(second_loss(use_cache=True) - want) / want > 1e-7
