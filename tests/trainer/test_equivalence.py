"""The key property: a packed batch trains exactly like each sample alone.

One packed micro-batch (two packed rows: text-only + single-image, then
multi-image + video, all from the shared demo data) through packtrain's
collator, pixel path and masked forward, against a plain `transformers` run of
each sample on its own with the Hugging Face processor's inputs. fp64 on CPU.
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


def _reference(model, samples, total_labels):
    """Each sample alone through the HF model (its own get_rope_index, no packing); returns the
    per-sample mean losses and leaves Σ_i sum_i / N's gradients in .grad."""
    losses = []
    for s in samples:
        inputs = _double({k: v for k, v in s.hf.items() if k != "attention_mask"})
        logits = model(**inputs).logits[0, :-1]
        targets = torch.tensor(s.labels[1:])
        token = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)
        (token.sum() / total_labels).backward()
        losses.append(token.sum() / (targets != -100).sum())
    return torch.stack(losses).detach()


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_packed_equals_each_sample_alone(family, shared_dir):
    torch.set_num_threads(2)
    samples = fx.demo_samples(family)
    assert [s.name for s in samples] == ["text", "single-image", "multi-image", "video"]
    model = build_model(
        fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=torch.float64, seed=1
    )
    batch = _double_batch(
        collate_packed(
            [fx.packed_row(samples[:2], family), fx.packed_row(samples[2:], family)], fx.spec(family)
        )
    )
    total = batch.info.num_label_tokens

    out = VLMForTraining(model, "sdpa")(batch.inputs)
    (out["loss_sum"] / total).backward()
    packed_grads = _grads(model)
    n = len(samples)
    sums = per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, n)
    counts = per_sample_sums(
        torch.ones_like(out["token_losses"]), out["positions"], batch.info.sample_index, n
    )
    packed_losses = (sums / counts).detach()

    ref_losses = _reference(model, samples, total)
    ref_grads = _grads(model)

    loss_rel = ((packed_losses - ref_losses).abs() / ref_losses.abs()).max().item()
    assert set(packed_grads) == set(ref_grads)
    llm = max(_rel(packed_grads[k], ref_grads[k]) for k in ref_grads if "visual" not in k)
    vision = max(_rel(packed_grads[k], ref_grads[k]) for k in ref_grads if "visual" in k)
    # Qwen3-VL's DeepStack mergers (features added inside the language model), apart.
    deepstack = [_rel(packed_grads[k], ref_grads[k]) for k in ref_grads if "deepstack" in k]
    print(
        f"{family}: max rel diff loss {loss_rel:.2e}, LLM grads {llm:.2e}, vision grads {vision:.2e}"
        + (f", DeepStack merger grads {max(deepstack):.2e}" if deepstack else "")
    )
    assert loss_rel <= TOL
    assert llm <= TOL
    assert vision <= TOL
    assert max(deepstack, default=0.0) <= TOL
    assert bool(deepstack) == (family == "qwen3-vl")
    assert any("visual" in k and ref_grads[k].norm() > 0 for k in ref_grads)


def test_restarting_positions_alone_leak_across_samples(shared_dir):
    """Without the block-diagonal mask (plain causal over the row) the second sample's loss
    changes: the isolation above is the mask's doing, not an accident of the data."""
    torch.set_num_threads(2)
    family = "qwen2-vl"
    samples = fx.demo_samples(family)[:2]
    model = build_model(
        fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=torch.float64, seed=1
    )
    batch = _double_batch(collate_packed([fx.packed_row(samples, family)], fx.spec(family)))
    with torch.no_grad():
        isolated = VLMForTraining(model, "sdpa")(batch.inputs)
        image = model.model.get_image_features(
            batch.inputs.pixel_values, batch.inputs.image_grid_thw, return_dict=True
        )
        hidden = model.model(
            input_ids=batch.inputs.input_ids,
            position_ids=batch.inputs.position_ids[1:],  # mRoPE restarts per sample, but no boundary info
            mm_encoder_outputs={"image": image},
        ).last_hidden_state
        logits = model.lm_head(hidden[0, :-1])
        targets = batch.inputs.shift_labels[0, :-1]
        leaky = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)
    second = batch.info.sample_index[:-1] == 1
    leaky_second = leaky[second & (targets != -100)].mean()
    isolated_second = isolated["token_losses"][batch.info.sample_index[isolated["positions"]] == 1].mean()
    # A random-init model is near uniform, so the leak is small, but far above fp64 noise (~1e-15).
    assert abs(leaky_second - isolated_second).item() / isolated_second.item() > 1e-7
