"""Tiny models and real demo samples for trainer tests.

Samples are built with the Hugging Face processor from the shared demo data, so
the "each sample alone" reference in the equivalence tests is exactly what a
plain `transformers` run would see; the packed side goes through packtrain's
own pixel path from the original file bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from support.paths import DEMO, MODELS
from transformers import AutoProcessor

from packtrain.core.model_spec import ModelSpec, model_spec
from packtrain.trainer.data.media import PixelSpec, decode_video_frames, media_pixels

TINY_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
}
TINY = {
    "qwen2-vl": {
        **TINY_TEXT,
        "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 64},
    },
    "qwen2.5-vl": {
        **TINY_TEXT,
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },
    },
}
TINY["qwen3-vl"] = {
    "text_config": {
        **{k: v for k, v in TINY_TEXT.items() if k != "rope_scaling"},
        "head_dim": 32,
        "rope_scaling": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": [6, 5, 5]},
    },
    "vision_config": {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "deepstack_visual_indexes": [0, 1],
    },
}
# Qwen3.5: a hybrid decoder, three Gated DeltaNet linear-attention layers then one full-attention
# layer (as in the real config's 3:1 pattern), grouped values (4 value heads over 2 key heads).
TINY["qwen3.5"] = {
    "text_config": {
        **{k: v for k, v in TINY_TEXT.items() if k != "rope_scaling"},
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "rope_parameters": {"mrope_section": [2, 1, 1]},  # partial_rotary_factor 0.25: 8 rotary dims
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
    },
}
FOLDER = {name: MODELS / name for name in TINY}
FAMILIES = tuple(TINY)
IMAGE_SIZE = {"shortest_edge": 3136, "longest_edge": 48 * 28 * 28}
VIDEO_SIZE = {"shortest_edge": 3136, "longest_edge": 12 * 28 * 28}
# (image, video) processor `size` per family. Qwen3-VL: 32-pixel merged patches, and its video
# bound covers all sampled frames together.
SIZES = {
    "qwen2-vl": (IMAGE_SIZE, VIDEO_SIZE),
    "qwen2.5-vl": (IMAGE_SIZE, VIDEO_SIZE),
    "qwen3-vl": (
        {"shortest_edge": 4096, "longest_edge": 48 * 32 * 32},
        {"shortest_edge": 4096, "longest_edge": 4 * 16 * 32 * 32},
    ),
    "qwen3.5": (
        {"shortest_edge": 4096, "longest_edge": 48 * 32 * 32},
        {"shortest_edge": 4096, "longest_edge": 4 * 16 * 32 * 32},
    ),
}
VIDEO_FRAMES = [0, 6, 12, 18]
VIDEO_FPS = 2.0  # second_per_grid = temporal_patch_size / fps
VIDEO_SOURCE = {"fps": 25.0, "total_num_frames": 243}  # mllm_demo_data/1.mp4, the demo video used


@functools.cache
def spec(family: str) -> ModelSpec:
    """The family registry entry bound to the family's shared model folder."""
    return model_spec(FOLDER[family])


@dataclass
class Sample:
    """One demo sample: the HF processor's output (reference) and the packer-style row pieces."""

    name: str
    input_ids: list[int]
    labels: list[int]
    hf: dict[str, torch.Tensor]
    media: list[dict[str, Any]] = field(default_factory=list)
    blobs: dict[str, dict[str, Any]] = field(default_factory=dict)


def _labels(ids: list[int], tokenizer: Any) -> list[int]:
    """Train on everything from the first assistant turn on, except vision placeholders."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assistant = tokenizer.encode("assistant", add_special_tokens=False)[0]
    first = next(i for i in range(len(ids) - 1) if ids[i] == start and ids[i + 1] == assistant)
    vision = set(tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"]))
    return [-100 if i < first or t in vision else t for i, t in enumerate(ids)]


def _messages(turns: list[dict[str, str]]) -> list[dict[str, Any]]:
    out = []
    for turn in turns:
        content: list[dict[str, Any]] = []
        text = turn["content"]
        while text:
            cut = min((text.find(t) for t in ("<image>", "<video>") if t in text), default=-1)
            if cut == -1:
                content.append({"type": "text", "text": text})
                break
            if cut:
                content.append({"type": "text", "text": text[:cut]})
            content.append({"type": "image" if text[cut:].startswith("<image>") else "video"})
            text = text[cut + 7 :]
        out.append({"role": turn["role"], "content": content})
    return out


@functools.cache
def demo_samples(family: str) -> list[Sample]:
    """text-only, single-image, multi-image (2 images) and video samples from the demo data
    (cached: treat as read-only)."""
    processor = AutoProcessor.from_pretrained(FOLDER[family])
    spec = PixelSpec.from_folder(FOLDER[family])
    images_demo = json.loads((DEMO / "mllm_demo.json").read_text())
    video_demo = json.loads((DEMO / "mllm_video_demo.json").read_text())
    picks = [
        (
            "text",
            [{**t, "content": t["content"].replace("<image>", "")} for t in images_demo[2]["messages"]],
            [],
            [],
        ),
        ("single-image", images_demo[1]["messages"], images_demo[1]["images"], []),
        ("multi-image", images_demo[0]["messages"], images_demo[0]["images"], []),
        ("video", video_demo[0]["messages"], [], video_demo[0]["videos"]),
    ]
    out = []
    for name, turns, image_paths, video_paths in picks:
        text = processor.apply_chat_template(_messages(turns), tokenize=False)
        images = [Image.open(DEMO / p) for p in image_paths]
        videos = [decode_video_frames((DEMO / p).read_bytes(), VIDEO_FRAMES) for p in video_paths]
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        image_size, video_size = SIZES[family]
        timestamps = model_spec(FOLDER[family]).family.video_timestamps  # Qwen3-VL's video processor and text
        if images:
            kwargs["images"] = images
            kwargs["images_kwargs"] = {"size": image_size}
        if videos:
            kwargs["videos"] = [torch.from_numpy(v).permute(0, 3, 1, 2) for v in videos]
            kwargs["videos_kwargs"] = {
                "size": video_size,
                "do_sample_frames": False,
                "cap_pixels_per_frame": timestamps,
                "fps": VIDEO_FPS,
            }
            if timestamps:  # its text has timestamps from the frame indices and the source fps
                kwargs["videos_kwargs"]["video_metadata"] = [
                    {**VIDEO_SOURCE, "frames_indices": VIDEO_FRAMES} for _ in videos
                ]
        hf = dict(processor(**kwargs))
        ids = hf["input_ids"][0].tolist()
        media, blobs = [], {}
        grids = iter(hf.get("image_grid_thw", torch.zeros(0, 3)).tolist())
        for p in image_paths:
            data = (DEMO / p).read_bytes()
            key = hashlib.sha256(data).hexdigest()
            t, h, w = next(grids)
            blobs[key] = {"key": key, "kind": "image", "encoding": "original", "data": data, "frames": []}
            media.append(_ref("image", key, t, h, w, [], 0.0, spec))
        vgrids = iter(hf.get("video_grid_thw", torch.zeros(0, 3)).tolist())
        # The processor's own seconds-per-grid (it depends on its fps handling), so both sides agree.
        spgs = iter(hf.get("second_per_grid_ts", torch.full((len(video_paths),), 2 / VIDEO_FPS)).tolist())
        for p in video_paths:
            data = (DEMO / p).read_bytes()
            key = hashlib.sha256(data).hexdigest()
            t, h, w = next(vgrids)
            blobs[key] = {"key": key, "kind": "video", "encoding": "original", "data": data, "frames": []}
            media.append(_ref("video", key, t, h, w, VIDEO_FRAMES, next(spgs), spec))
        out.append(Sample(name, ids, _labels(ids, processor.tokenizer), hf, media, blobs))
    return out


def _ref(
    kind: str, key: str, t: int, h: int, w: int, frames: list[int], spg: float, spec: PixelSpec
) -> dict[str, Any]:
    p = spec.patch_size
    return {
        "sample": 0,
        "kind": kind,
        "key": key,
        "height": h * p,
        "width": w * p,
        "grid_t": t,
        "grid_h": h,
        "grid_w": w,
        "frames": frames,
        "second_per_grid": spg,
    }


def packed_row(samples: list[Sample], family: str) -> dict[str, Any]:
    """A SEQUENCE_SCHEMA row holding `samples` back to back, with pixels decoded by packtrain."""
    return _row(samples, PixelSpec.from_folder(FOLDER[family]))


def _row(samples: list[Sample], spec: PixelSpec) -> dict[str, Any]:
    row: dict[str, Any] = {
        "input_ids": [],
        "labels": [],
        "seq_lens": [],
        "sample_ids": [],
        "sources": [],
        "indices": [],
        "media": [],
        "pixels": [],
    }
    for k, s in enumerate(samples):
        row["input_ids"] += s.input_ids
        row["labels"] += s.labels
        row["seq_lens"].append(len(s.input_ids))
        row["sample_ids"].append(s.name)
        row["sources"].append("demo")
        row["indices"].append(k)
        for ref in s.media:
            row["media"].append({**ref, "sample": k})
            row["pixels"].append(media_pixels(s.blobs[ref["key"]], ref, spec))
    return row


# InternVL (tiled): kept apart from TINY / FAMILIES, whose tests run the Qwen-style demo samples.
# A Qwen3-shaped tiny decoder and a one-layer, 16-wide InternViT at the real 448-pixel tile (1024
# patches, pixel-shuffled to the real 256 tokens per tile), so the processor runs unmodified.
INTERNVL = "internvl"
INTERNVL_FOLDER = MODELS / "internvl3.5"
INTERNVL_TINY: dict[str, Any] = {
    "text_config": {
        **{k: v for k, v in TINY_TEXT.items() if k != "rope_scaling"},
        "head_dim": 32,
        "layer_types": ["full_attention"] * 2,
        "max_window_layers": 2,
    },
    "vision_config": {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        # The released config's 1e-10 init range leaves a random tower all but constant (gradients
        # of ~1e-13 and below, pure rounding): a usual range makes its gradients mean something.
        "initializer_range": 0.02,
    },
}
IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
# A video frame is one 448x448 tile normalized like an image (the pack contract), not the official
# video processor config's 384x384 CLIP-normalized frames: the reference processor is told so.
INTERNVL_VIDEO_KWARGS = {"size": {"height": 448, "width": 448}, "do_sample_frames": False, **IMAGENET}


def _internvl_refs(
    hf: dict[str, torch.Tensor], image_paths: list[str], video_paths: list[str], processor: Any
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The pack contract's refs for a tiled family: an image's canvas (rows*448 x cols*448, the
    processor's own `get_optimal_tiled_canvas`) and tile count, a video's 448x448 frames."""
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

    ip = processor.image_processor
    tile, grid = ip.size["height"], ip.size["height"] // 14
    media, blobs = [], {}
    for p in image_paths:
        data = (DEMO / p).read_bytes()
        key = hashlib.sha256(data).hexdigest()
        width, height = Image.open(DEMO / p).size
        cols, rows = get_optimal_tiled_canvas((height, width), (tile, tile), ip.min_patches, ip.max_patches)
        n = cols * rows + (cols * rows > 1)
        blobs[key] = {"key": key, "kind": "image", "encoding": "original", "data": data, "frames": []}
        media.append(_tile_ref("image", key, rows * tile, cols * tile, n, grid, []))
    for p in video_paths:
        data = (DEMO / p).read_bytes()
        key = hashlib.sha256(data).hexdigest()
        blobs[key] = {"key": key, "kind": "video", "encoding": "original", "data": data, "frames": []}
        media.append(_tile_ref("video", key, tile, tile, len(VIDEO_FRAMES), grid, VIDEO_FRAMES))
    assert sum(m["grid_t"] for m in media) == (len(hf["pixel_values"]) if "pixel_values" in hf else 0)
    return media, blobs


def _tile_ref(kind: str, key: str, height: int, width: int, n: int, grid: int, frames: list[int]) -> dict:
    return {
        "sample": 0,
        "kind": kind,
        "key": key,
        "height": height,
        "width": width,
        "grid_t": n,
        "grid_h": grid,
        "grid_w": grid,
        "frames": frames,
        "second_per_grid": 0.0,
    }


@functools.cache
def internvl_samples() -> list[Sample]:
    """text-only, one image of several tiles plus thumbnail, a video of 4 frames, and a multi-turn
    sample with two images, each through InternVLProcessor alone (cached: treat as read-only)."""
    processor = AutoProcessor.from_pretrained(INTERNVL_FOLDER)
    images_demo = json.loads((DEMO / "mllm_demo.json").read_text())
    video_demo = json.loads((DEMO / "mllm_video_demo.json").read_text())
    picks = [
        (
            "text",
            [{**t, "content": t["content"].replace("<image>", "")} for t in images_demo[2]["messages"]],
            [],
            [],
        ),
        ("tiled-image", images_demo[1]["messages"], images_demo[1]["images"], []),
        ("video", video_demo[0]["messages"], [], video_demo[0]["videos"]),
        ("multi-turn", images_demo[0]["messages"], images_demo[0]["images"], []),
    ]
    context = processor.tokenizer.convert_tokens_to_ids(["<IMG_CONTEXT>", "<img>", "</img>"])
    out = []
    for name, turns, image_paths, video_paths in picks:
        text = processor.apply_chat_template(_messages(turns), tokenize=False)
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        if image_paths:
            kwargs["images"] = [Image.open(DEMO / p) for p in image_paths]
        if video_paths:
            frames = [decode_video_frames((DEMO / p).read_bytes(), VIDEO_FRAMES) for p in video_paths]
            kwargs["videos"] = [torch.from_numpy(v).permute(0, 3, 1, 2) for v in frames]
            kwargs["videos_kwargs"] = INTERNVL_VIDEO_KWARGS
        hf = dict(processor(**kwargs))
        ids = hf["input_ids"][0].tolist()
        media, blobs = _internvl_refs(hf, image_paths, video_paths, processor)
        labels = _labels(ids, processor.tokenizer)
        labels = [-100 if t in context else lab for t, lab in zip(ids, labels, strict=True)]
        out.append(Sample(name, ids, labels, hf, media, blobs))
    return out


def internvl_row(samples: list[Sample]) -> dict[str, Any]:
    """A SEQUENCE_SCHEMA row of InternVL `samples` back to back, tiles decoded by packtrain."""
    spec = PixelSpec.from_folder(INTERNVL_FOLDER)
    return _row(samples, spec)


# LLaVA-OneVision-1.5: Qwen2.5-VL's processor (temporal patches of 1) over the project's own model (a
# RICE-ViT tower, a Qwen3 decoder with 1-D positions). Kept apart from TINY / FAMILIES: no videos.
LLAVA_OV = "llava-onevision-1.5"
LLAVA_OV_FOLDER = MODELS / "llava-onevision-1.5"
LLAVA_OV_TINY: dict[str, Any] = {
    "text_config": {
        **{k: v for k, v in TINY_TEXT.items() if k != "rope_scaling"},
        "head_dim": 32,
        "layer_types": ["full_attention"] * 2,
        "max_window_layers": 2,
    },
    "vision_config": {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "text_hidden_size": 64,
    },
}


@functools.cache
def llava_ov_samples() -> list[Sample]:
    """text-only, one image, two images in one sample, and a multi-turn sample with two images, each
    through `Qwen2_5_VLProcessor` alone (the folder's processor; cached: treat as read-only)."""
    from transformers import Qwen2_5_VLProcessor

    processor = Qwen2_5_VLProcessor.from_pretrained(LLAVA_OV_FOLDER, trust_remote_code=False)
    spec = PixelSpec.from_folder(LLAVA_OV_FOLDER)
    demo = json.loads((DEMO / "mllm_demo.json").read_text())
    picks = [
        ("text", [{**t, "content": t["content"].replace("<image>", "")} for t in demo[2]["messages"]], []),
        ("one-image", demo[1]["messages"][:2], demo[1]["images"]),
        (
            "two-images",
            [{**demo[0]["messages"][0], "content": "<image><image>Who are they?"}, demo[0]["messages"][1]],
            demo[0]["images"],
        ),
        ("multi-turn", demo[3]["messages"], demo[3]["images"]),
    ]
    out = []
    for name, turns, image_paths in picks:
        text = processor.apply_chat_template(_messages(turns), tokenize=False)
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        if image_paths:
            kwargs["images"] = [Image.open(DEMO / p) for p in image_paths]
            kwargs["images_kwargs"] = {"size": IMAGE_SIZE}
        hf = dict(processor(**kwargs))
        ids = hf["input_ids"][0].tolist()
        media, blobs = [], {}
        for p, (t, h, w) in zip(
            image_paths, hf.get("image_grid_thw", torch.zeros(0, 3)).tolist(), strict=True
        ):
            data = (DEMO / p).read_bytes()
            key = hashlib.sha256(data).hexdigest()
            blobs[key] = {"key": key, "kind": "image", "encoding": "original", "data": data, "frames": []}
            media.append(_ref("image", key, t, h, w, [], 0.0, spec))
        out.append(Sample(name, ids, _labels(ids, processor.tokenizer), hf, media, blobs))
    return out


def llava_ov_row(samples: list[Sample]) -> dict[str, Any]:
    """A SEQUENCE_SCHEMA row of LLaVA-OneVision-1.5 `samples` back to back, pixels decoded by packtrain."""
    return _row(samples, PixelSpec.from_folder(LLAVA_OV_FOLDER))
