"""examples/llava-onevision-1.5.yaml end to end, as a user runs it: `packtrain run` packs the demo
images and text chats with Qwen2.5-VL's processor rules, trains the tiny random-init
LLaVA-OneVision-1.5 (the project's own implementation), and exports a folder in the released layout:
the project's class loads it (whole, and row by row as a sharded run does), and upstream's code,
run from the export's own copy under the transformers it was written for, computes the same logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.paths import DEMO, MODELS
from support.reference_env import reference_env, run_reference
from test_first_hour import packtrain
from transformers import Qwen2_5_VLProcessor

from packtrain.trainer.model.build import build_model
from packtrain.trainer.model.llava_onevision import LlavaOneVision15ForConditionalGeneration

REPO = Path(__file__).resolve().parents[2]
NAME = "llava-ov-quickstart"

REFERENCE_SCRIPT = """
import importlib, sys, types
import torch
from safetensors.torch import load_file, save_file

code, folder, inputs_path, out_path = sys.argv[1:5]
package = types.ModuleType("upstream")
package.__path__ = [code]
sys.modules["upstream"] = package
modeling = importlib.import_module("upstream.modeling_llavaonevision1_5")
model = modeling.LLaVAOneVision1_5_ForConditionalGeneration.from_pretrained(
    folder, torch_dtype=torch.float32, attn_implementation="sdpa"
)
with torch.no_grad():
    save_file({"logits": model(**load_file(inputs_path), use_cache=False).logits}, out_path)
"""


def test_the_llava_onevision_example_packs_trains_and_exports(shared_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = packtrain(
        "run",
        "examples/llava-onevision-1.5.yaml",
        "--output",
        str(out),
        "--max-steps",
        "4",
        cwd=REPO,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "pack" / NAME / "manifest.json").read_text())
    counts = manifest["counts"]
    assert counts["rejected"] == 0 and counts["packed"] == counts["input"] > 500, counts
    assert {ref["kind"] for ref in _media_refs(out / "pack" / NAME)} == {"image"}
    summary = json.loads((out / "logs" / f"{NAME}-train.termination.json").read_text())
    assert summary["steps"] == 4 and math.isfinite(summary["final_loss"]), summary

    final = out / "train" / NAME / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["LLaVAOneVision1_5_ForConditionalGeneration"]
    assert not list(
        final.glob("*.py")
    )  # an export carries no code: packtrain's class, or the serving stack's
    with safe_open(final / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "visual.class_embedding" in names and "model.layers.0.self_attn.q_norm.weight" in names
    assert not any(n.startswith(("model.visual.", "model.language_model.")) for n in names)

    model, info = LlavaOneVision15ForConditionalGeneration.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    sharded = build_model(final, init="pretrained")  # read row by row, as a sharded run loads it
    whole = model.state_dict()
    assert all(torch.equal(t, whole[n]) for n, t in sharded.state_dict().items())
    _same_logits_as_the_reference(model, final, tmp_path)


def _same_logits_as_the_reference(
    model: LlavaOneVision15ForConditionalGeneration, final: Path, work: Path
) -> None:
    """A sample with an image through the export's own processor, the project's model and upstream's
    code (the reference copy, transformers 4.53.1) loading the export: the same logits (fp32)."""
    processor = Qwen2_5_VLProcessor.from_pretrained(final, trust_remote_code=False)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Who is he?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    photo = Image.open(DEMO / "mllm_demo_data" / "2.jpg").convert("RGB")
    batch = processor(text=[text], images=[photo], return_tensors="pt")
    inputs = {k: batch[k].contiguous() for k in ("input_ids", "pixel_values", "image_grid_thw")}
    with torch.no_grad():
        ours = model(**inputs, use_cache=False).logits
    save_file(inputs, str(work / "inputs.safetensors"))
    script = work / "reference.py"
    script.write_text(REFERENCE_SCRIPT)
    done = run_reference(
        script,
        [
            str(MODELS / "llava-onevision-1.5"),
            str(final),
            str(work / "inputs.safetensors"),
            str(work / "out.safetensors"),
        ],
        reference_env(),
    )
    assert done.returncode == 0, done.stderr[-6000:]
    theirs = load_file(str(work / "out.safetensors"))["logits"]
    assert ours.shape == theirs.shape
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5


def _media_refs(pack: Path) -> list[dict[str, object]]:
    from packtrain.core.pack.shards import ShardReader

    return [ref for row in ShardReader(pack) for ref in row["media"]]
