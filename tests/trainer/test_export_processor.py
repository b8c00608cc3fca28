"""Train what you serve: the exported `final/` carries the pack's pixel and frame settings, so
`AutoProcessor.from_pretrained(final)` with its default kwargs gives every packed sample exactly the
token ids it was trained on (images resized to the pack's maxPixels, video frames sampled at its fps)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image
from support.paths import DEMO, MODELS
from test_first_hour import TINY, packtrain

from packtrain.core.config import ModelConfig
from packtrain.core.model_spec import served_processor_configs
from packtrain.packer.tools import unpack

transformers = pytest.importorskip("transformers")
from transformers.video_utils import load_video  # noqa: E402

VIDEO = DEMO / "mllm_demo_data" / "4.mp4"  # 150 frames at 30 fps, 224x224
# Not the folders' defaults: each would change the token count if the export dropped it.
# The video: 2 frames at 0.5 fps with minFrames 2 (4 with the default minFrames, 10 at the default fps).
PACK_MODEL = {"maxPixels": 200704, "minPixels": 3136, "videoMaxPixels": 20000, "fps": 0.5, "minFrames": 2}
IMAGES = {"wide.jpg": (1000, 760), "tall.png": (420, 900)}  # both over maxPixels 200,704


def _dataset(root: Path) -> Path:
    """Two images over the pack's maxPixels and one video, as ShareGPT records."""
    for name, size in IMAGES.items():
        Image.new("RGB", size, (200, 30, 90)).save(root / name)
    shutil.copyfile(VIDEO, root / "clip.mp4")
    answer = {"from": "gpt", "value": "Something."}
    records = [
        {
            "id": n,
            "conversations": [{"from": "human", "value": "<image>What is this?"}, answer],
            "images": [n],
        }
        for n in IMAGES
    ]
    ask = {"from": "human", "value": "<video>What happens?"}
    records.append({"id": "clip", "conversations": [ask, answer], "videos": ["clip.mp4"]})
    data = root / "data.json"
    data.write_text(json.dumps(records))
    return data


def _processor_ids(processor: Any, record: dict[str, Any], root: Path) -> list[int]:
    """A one-media ShareGPT record of `_dataset` through the processor with its default kwargs: the
    image by path, the video's every frame decoded by PyAV (the processor samples them itself)."""
    kind = "image" if record.get("images") else "video"
    path = root / record[f"{kind}s"][0]
    ask, answer = record["conversations"]
    question = [{"type": "text", "text": ask["value"].removeprefix(f"<{kind}>")}]
    conversation = [
        {"role": "user", "content": [{"type": kind, "path": str(path)}, *question]},
        {"role": "assistant", "content": [{"type": "text", "text": answer["value"]}]},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "image":
            out = processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
        else:
            frames, metadata = load_video(str(path), backend="pyav")
            text = processor.apply_chat_template(conversation, tokenize=False)
            out = processor(text=[text], videos=[frames], video_metadata=[metadata])
    return list(out["input_ids"][0])


def _assert_served_as_packed(final: Path, pack: Path, data: Path) -> None:
    records = {r["id"]: r for r in json.loads(data.read_text())}
    samples = unpack(pack)
    assert sorted(s["id"] for s in samples) == sorted(records)
    processor = transformers.AutoProcessor.from_pretrained(str(final))
    model_path = json.loads((pack / "manifest.json").read_text())["config"]["model"]["path"]
    base = transformers.AutoProcessor.from_pretrained(model_path)
    for s in samples:
        ids = _processor_ids(processor, records[s["id"]], data.parent)
        assert ids == s["input_ids"], s["id"]
        # The base folder's settings tokenize the same sample differently: the check can fail.
        assert _processor_ids(base, records[s["id"]], data.parent) != s["input_ids"], s["id"]


def _pack(root: Path, family: str, data: Path) -> Path:
    """`packtrain pack run` of `data` with the non-default settings of PACK_MODEL."""
    model = {"family": family, "path": str(MODELS / family), **PACK_MODEL}
    if family == "qwen3-vl":  # 32-pixel merged patches; its video bound covers all frames together
        model |= {"maxPixels": 300000, "minPixels": 4096, "videoMaxPixels": 4 * 16 * 32 * 32, "fps": 1.0}
        del model["minFrames"]  # (the pack's processor check passes it with the call, which Qwen3-VL ignores)
    spec = {"source": {"paths": [str(data)]}, "model": model, "packing": {"maxLength": 2048}}
    (root / "pack.yaml").write_text(yaml.safe_dump({"kind": "PackJob", "spec": spec}))
    out = root / "pack"
    packed = packtrain("pack", "run", "-c", str(root / "pack.yaml"), "-o", str(out), "--workers", "1",
                       "--no-progress")  # fmt: skip
    assert packed.returncode == 0, packed.stderr[-3000:]
    return out


@pytest.mark.slow
def test_final_folder_tokenizes_as_the_pack(tmp_path: Path) -> None:
    """Pack with non-default pixel and frame settings, train one step of a tiny Qwen2-VL, and load
    the processor from `final/` as a server would."""
    data = _dataset(tmp_path)
    pack, run = _pack(tmp_path, "qwen2-vl", data), tmp_path / "run"
    train_spec = {
        "data": {"path": str(pack), "numWorkers": 0},
        "model": {"path": str(MODELS / "qwen2-vl"), "init": "random", "configOverrides": TINY},
        "training": {"maxSteps": 1, "outputDir": str(run)},
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({"kind": "SFTJob", "spec": train_spec}))
    trained = packtrain("train", "-c", str(tmp_path / "sft.yaml"), "--log-format", "json", timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    final = run / "final"
    saved = json.loads((final / "preprocessor_config.json").read_text())
    assert saved["max_pixels"] == saved["size"]["longest_edge"] == PACK_MODEL["maxPixels"]
    _assert_served_as_packed(final, pack, data)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_served_configs_tokenize_as_the_pack(tmp_path: Path, family: str) -> None:
    """The same for the other processor layouts (Qwen3-VL: `size` only, volume resize and the
    per-frame cap), from the export's processor configs without a training run."""
    data = _dataset(tmp_path)
    pack = _pack(tmp_path, family, data)
    manifest = json.loads((pack / "manifest.json").read_text())
    final = tmp_path / "final"
    shutil.copytree(MODELS / family, final)
    model = ModelConfig.model_validate(manifest["config"]["model"])
    for name, config in served_processor_configs(MODELS / family, model).items():
        (final / name).write_text(json.dumps(config))
    _assert_served_as_packed(final, pack, data)
