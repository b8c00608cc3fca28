"""The project's LLaVA-OneVision-1.5 equals the upstream reference code, weights and names included.

The reference (the released remote modeling file, in the shared model folder) runs under the
transformers it was written for (4.53.1, `support.reference_env`) in a subprocess. On one set of
random fp64 weights (a tiny model derived from the 8B config.json) both give the same logits and
the same gradient of every parameter for a text-only, a one-image and a two-image sample (the last
exercises upstream's class-token offset). The reference loads the folder the project's model
saved (export compatibility), and the project's model loads the folder the reference saved
(released names `visual.*`, `model.layers.*`). The broken control: the project's model with the
class-token offset "fixed" disagrees on two images.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file
from support.paths import DEMO, MODELS
from support.reference_env import reference_env, run_reference
from transformers import Qwen2_5_VLProcessor

from packtrain.trainer.model.llava_onevision import (
    LlavaOneVision15Config,
    LlavaOneVision15ForConditionalGeneration,
    RiceVisionModel,
)

FOLDER = MODELS / "llava-onevision-1.5"
TOLERANCE = 1e-10
CASES = ("text", "one_image", "two_images")

REFERENCE_SCRIPT = """
import importlib, json, sys, types
import torch, torch.nn.functional as F
from safetensors.torch import load_file, save_file

code, weights, inputs_path, out_path, save_dir = sys.argv[1:6]
package = types.ModuleType("llava_reference")
package.__path__ = [code]
sys.modules["llava_reference"] = package
modeling = importlib.import_module("llava_reference.modeling_llavaonevision1_5")
model, info = modeling.LLaVAOneVision1_5_ForConditionalGeneration.from_pretrained(
    weights, torch_dtype=torch.float64, attn_implementation="sdpa", output_loading_info=True
)
inputs = load_file(inputs_path)
result = {}
for case in json.loads(sys.argv[6]):
    kwargs = {"input_ids": inputs[case + "/input_ids"]}
    if case + "/pixel_values" in inputs:
        kwargs["pixel_values"] = inputs[case + "/pixel_values"]
        kwargs["image_grid_thw"] = inputs[case + "/image_grid_thw"]
    model.zero_grad(set_to_none=True)
    logits = model(**kwargs, use_cache=False).logits
    F.cross_entropy(logits[0], inputs[case + "/labels"][0]).backward()
    result[case + "/logits"] = logits.detach()
    for name, param in model.named_parameters():
        grad = torch.zeros_like(param) if param.grad is None else param.grad
        result[case + "/grad/" + name] = grad.detach().clone()
if "grouped/weights" in inputs:  # each sample's images through the tower alone, as upstream calls it
    model.zero_grad(set_to_none=True)
    features = torch.cat([
        model.visual(inputs[f"grouped/pixel_values/{s}"], grid_thw=inputs[f"grouped/image_grid_thw/{s}"])
        for s in ("a", "b")
    ])
    (features * inputs["grouped/weights"]).sum().backward()
    result["grouped/features"] = features.detach()
    for name, param in model.visual.named_parameters():
        result["grouped/grad/visual." + name] = param.grad.detach().clone()
save_file(result, out_path)
model.save_pretrained(save_dir)
print(json.dumps({key: sorted(value) for key, value in info.items() if key != "error_msgs"}))
"""


def tiny_config() -> LlavaOneVision15Config:
    """The 8B config.json with every size shrunk (token ids, vocabulary, patch geometry kept)."""
    raw = json.loads((FOLDER / "config.json").read_text())
    for key in ("auto_map", "architectures", "model_type", "transformers_version", "torch_dtype"):
        raw.pop(key, None)
    raw["text_config"].update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["full_attention"] * 2,
        max_window_layers=2,
    )
    raw["vision_config"].update(
        depth=2, embed_dim=32, hidden_size=32, num_heads=2, intermediate_size=64, text_hidden_size=64
    )
    return LlavaOneVision15Config(**raw)


def random_model() -> LlavaOneVision15ForConditionalGeneration:
    """fp64, every parameter moved off its init (norm weights off 1, biases off 0)."""
    torch.manual_seed(0)
    model = LlavaOneVision15ForConditionalGeneration(tiny_config()).to(torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def case_inputs() -> dict[str, torch.Tensor]:
    """Token ids, pixels and grids from the folder's real processor and chat template, on demo
    photos shrunk to a few merge windows (grids 1x4x6 and 1x6x4); labels are the next tokens."""
    processor = Qwen2_5_VLProcessor.from_pretrained(FOLDER, trust_remote_code=False)
    photos = [
        Image.open(DEMO / "mllm_demo_data" / name).convert("RGB").resize(size)
        for name, size in (("1.jpg", (84, 56)), ("2.jpg", (56, 84)))
    ]
    out: dict[str, torch.Tensor] = {}
    for case, count in zip(CASES, (0, 1, 2), strict=True):
        content: list[dict[str, Any]] = [{"type": "image"}] * count
        messages = [
            {"role": "user", "content": [*content, {"type": "text", "text": "What is shown here?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A photo, seen by a tiny model."}]},
        ]
        text = processor.apply_chat_template(messages, tokenize=False)
        batch = processor(text=[text], images=photos[:count] or None, return_tensors="pt")
        ids = batch["input_ids"]
        out[f"{case}/input_ids"] = ids
        out[f"{case}/labels"] = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        if count:
            out[f"{case}/pixel_values"] = batch["pixel_values"].to(torch.float64)
            out[f"{case}/image_grid_thw"] = batch["image_grid_thw"]
    return out


GROUPED_SIZES = {"a": ((84, 56), (56, 56)), "b": ((56, 84), (112, 56))}


def grouped_inputs() -> dict[str, torch.Tensor]:
    """Two samples of two images each (the demo photos at four sizes), pixels and grids per sample,
    and fixed random weights over the four images' merged features (a loss that reaches them all)."""
    processor = Qwen2_5_VLProcessor.from_pretrained(FOLDER, trust_remote_code=False)
    out: dict[str, torch.Tensor] = {}
    rows = 0
    for sample, sizes in GROUPED_SIZES.items():
        photos = [
            Image.open(DEMO / "mllm_demo_data" / name).convert("RGB").resize(size)
            for name, size in zip(("1.jpg", "2.jpg"), sizes, strict=True)
        ]
        batch = processor.image_processor(images=photos, return_tensors="pt")
        out[f"grouped/pixel_values/{sample}"] = batch["pixel_values"].to(torch.float64)
        out[f"grouped/image_grid_thw/{sample}"] = batch["image_grid_thw"]
        rows += int(batch["image_grid_thw"].prod(-1).sum()) // 4
    generator = torch.Generator().manual_seed(3)
    out["grouped/weights"] = torch.randn(rows, 64, generator=generator, dtype=torch.float64)
    return out


def run_grouped(
    model: LlavaOneVision15ForConditionalGeneration,
    inputs: dict[str, torch.Tensor],
    group_sizes: list[int] | None,
) -> dict[str, torch.Tensor]:
    """The four images in ONE tower call, grouped by `group_sizes` (None: one group)."""
    pixels = torch.cat([inputs[f"grouped/pixel_values/{s}"] for s in GROUPED_SIZES])
    grids = torch.cat([inputs[f"grouped/image_grid_thw/{s}"] for s in GROUPED_SIZES])
    visual = model.model.visual
    visual.zero_grad(set_to_none=True)
    features = visual(pixels, grid_thw=grids, group_sizes=group_sizes).pooler_output
    (features * inputs["grouped/weights"]).sum().backward()
    result = {"grouped/features": features.detach()}
    for name, param in visual.named_parameters():
        assert param.grad is not None, name
        result[f"grouped/grad/visual.{name}"] = param.grad.detach().clone()
    return result


def run_project(
    model: LlavaOneVision15ForConditionalGeneration, inputs: dict[str, torch.Tensor], case: str
) -> dict[str, torch.Tensor]:
    kwargs: dict[str, Any] = {"input_ids": inputs[f"{case}/input_ids"]}
    if f"{case}/pixel_values" in inputs:
        kwargs["pixel_values"] = inputs[f"{case}/pixel_values"]
        kwargs["image_grid_thw"] = inputs[f"{case}/image_grid_thw"]
    model.zero_grad(set_to_none=True)
    logits = model(**kwargs, use_cache=False).logits
    F.cross_entropy(logits[0], inputs[f"{case}/labels"][0]).backward()
    result = {f"{case}/logits": logits.detach()}
    for name, param in model.named_parameters():
        grad = torch.zeros_like(param) if param.grad is None else param.grad  # the tower, text only
        result[f"{case}/grad/{name}"] = grad.detach().clone()
    return result


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| over max |theirs| (a tensor of zeros compares absolutely)."""
    scale = theirs.abs().max().item() or 1.0
    return (ours - theirs).abs().max().item() / scale


class FixedOffsetVision(RiceVisionModel):
    """The broken control: each segment's own patches (its class token skipped at its real place)."""

    def drop_class_tokens(self, x: torch.Tensor, lengths: Any, groups: Any = None) -> torch.Tensor:
        keep, start = [], 0
        for length in lengths:
            keep.append(x[start + 1 : start + 1 + length])
            start += length + 1
        return torch.cat(keep)


@pytest.fixture(scope="module")
def exchange(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Save the project's model, run the reference on that folder in 4.53.1, collect both sides."""
    work = tmp_path_factory.mktemp("llava_reference")
    model = random_model()
    model.save_pretrained(work / "project")
    inputs = case_inputs() | grouped_inputs()
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(work / "inputs.safetensors"))
    script = work / "reference.py"
    script.write_text(REFERENCE_SCRIPT)
    args = [str(FOLDER), str(work / "project"), str(work / "inputs.safetensors")]
    args += [str(work / "reference_out.safetensors"), str(work / "reference"), json.dumps(CASES)]
    done = run_reference(script, args, reference_env())
    assert done.returncode == 0, done.stderr[-6000:]
    loading = json.loads(done.stdout.strip().splitlines()[-1])
    yield {
        "model": model,
        "inputs": inputs,
        "reference": load_file(str(work / "reference_out.safetensors")),
        "loading": loading,
        "work": work,
    }


def test_reference_loads_the_project_folder_without_gaps(exchange: dict[str, Any]) -> None:
    assert exchange["loading"] == {"missing_keys": [], "mismatched_keys": [], "unexpected_keys": []}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_every_gradient_equal_the_reference(exchange: dict[str, Any], case: str) -> None:
    ours = run_project(exchange["model"], exchange["inputs"], case)
    theirs = {k: v for k, v in exchange["reference"].items() if k.startswith(f"{case}/")}
    assert theirs
    assert sorted(ours) == sorted(theirs)
    worst = {key: relative(ours[key], theirs[key]) for key in theirs}
    assert max(worst.values()) <= TOLERANCE, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    # Every gradient is really exercised (no all-zero tensor compares trivially).
    grads = [k for k in theirs if "/grad/" in k and (case != "text" or ".visual." not in k)]
    assert all(theirs[k].abs().max() > 0 for k in grads), [k for k in grads if theirs[k].abs().max() == 0]


def test_fixed_class_token_offset_is_a_different_model(exchange: dict[str, Any]) -> None:
    """The broken control: same weights, class tokens dropped at their real places. One image
    is unaffected; two images disagree with the reference far beyond the tolerance."""
    model = exchange["model"]
    reference = exchange["reference"]
    model.model.visual.__class__ = FixedOffsetVision
    try:
        one = run_project(model, exchange["inputs"], "one_image")
        two = run_project(model, exchange["inputs"], "two_images")
    finally:
        model.model.visual.__class__ = RiceVisionModel
    assert relative(one["one_image/logits"], reference["one_image/logits"]) <= TOLERANCE
    assert relative(two["two_images/logits"], reference["two_images/logits"]) > 1e-3


def test_project_loads_the_reference_folder_by_released_names(exchange: dict[str, Any]) -> None:
    """The reference's save_pretrained (4.53.1) writes `visual.*` and `model.layers.*`; the project's
    model loads them all, to the same tensors and the same logits."""
    folder = exchange["work"] / "reference"
    names = set(load_file(str(folder / "model.safetensors")))
    assert any(n.startswith("visual.") for n in names) and "model.embed_tokens.weight" in names
    loaded, info = LlavaOneVision15ForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float64, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    original = exchange["model"].state_dict()
    assert all(torch.equal(tensor, original[name]) for name, tensor in loaded.state_dict().items())
    ours = run_project(loaded, exchange["inputs"], "two_images")
    assert relative(ours["two_images/logits"], exchange["reference"]["two_images/logits"]) <= TOLERANCE


def test_saved_folder_uses_released_names(exchange: dict[str, Any]) -> None:
    names = set(load_file(str(exchange["work"] / "project" / "model.safetensors")))
    assert "visual.class_embedding" in names and "model.layers.0.self_attn.q_norm.weight" in names
    assert not any(n.startswith(("model.visual.", "model.language_model.")) for n in names)


def test_grouped_call_equals_each_sample_alone(exchange: dict[str, Any]) -> None:
    """Two samples of two images each in ONE tower call, grouped per sample (what the trainer sends
    for a packed row), give the features and tower gradients of upstream's tower called once per
    sample. The broken control: the same call as one group (the class-token offset then runs
    across the samples) moves the second sample's features."""
    theirs = {k: v for k, v in exchange["reference"].items() if k.startswith("grouped/")}
    ours = run_grouped(exchange["model"], exchange["inputs"], [2, 2])
    assert sorted(ours) == sorted(theirs)
    worst = {key: relative(ours[key], theirs[key]) for key in theirs}
    print(f"grouped tower call vs upstream per sample, fp64: max rel diff {max(worst.values()):.2e}")
    assert max(worst.values()) <= TOLERANCE, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    assert all(theirs[k].abs().max() > 0 for k in theirs), [k for k in theirs if theirs[k].abs().max() == 0]

    one_group = run_grouped(exchange["model"], exchange["inputs"], None)
    first = int(exchange["inputs"]["grouped/image_grid_thw/a"].prod(-1).sum()) // 4
    features, reference = one_group["grouped/features"], theirs["grouped/features"]
    assert relative(features[:first], reference[:first]) <= TOLERANCE  # the first sample is unaffected
    assert relative(features, reference) > 1e-3
