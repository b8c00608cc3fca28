"""Proof that the packer's ids and vision-token counts equal what the HF processors produce.

The reference is `AutoProcessor.from_pretrained(<model folder>)` with its chat
template (transformers decodes the images itself; videos are decoded with its
PyAV reader and sampled by the processor at the same fps/min/max frames). For
Qwen3-VL the video processor runs with `cap_pixels_per_frame=True`, the
reference implementation's per-frame cap that packtrain applies by default.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

import media_factory as mf
import pytest
from support.paths import DEMO, MODELS, SHARED

from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.sources.records import iter_records
from packtrain.packer.tokenize import Reject, SampleTokenizer, TokenizedSample

FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5"]
FPS, MIN_FRAMES, MAX_FRAMES = 2.0, 4, 768

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, shared_dir: Path) -> str:
    return request.param


@pytest.fixture(scope="module")
def processor(family: str) -> Any:
    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoProcessor.from_pretrained(str(MODELS / family))


@functools.cache
def _tokenizer(family: str, root: Path | None = None, max_pixels: int | None = None) -> SampleTokenizer:
    source = SourceConfig(paths=["unused"], media_root=str(root) if root else None)
    model = ModelConfig(
        family=family,
        path=str(MODELS / family),
        fps=FPS,
        min_frames=MIN_FRAMES,
        max_frames=MAX_FRAMES,
        max_pixels=max_pixels,
    )
    return SampleTokenizer(source, model, PackingConfig())


def _ours(tok: SampleTokenizer, record: dict[str, Any], source: Path) -> TokenizedSample | Reject:
    return tok(RawRecord(source, 0, record, None))


def _hf(processor: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return processor.apply_chat_template(conversation, tokenize=True, return_dict=True, **kwargs)


def _grids(sample: TokenizedSample, kind: str) -> list[list[int]]:
    return [[m.grid_t, m.grid_h, m.grid_w] for m in sample.media if m.kind == kind]


IMAGES = {
    "1x1.png": lambda p: mf.image(p, 1, 1),
    "10x10.png": lambda p: mf.image(p, 10, 10),
    "27x29.jpg": lambda p: mf.image(p, 27, 29),
    "3000x28.png": lambda p: mf.image(p, 3000, 28),
    "28x3000.png": lambda p: mf.image(p, 28, 3000),
    "rgba.png": lambda p: mf.image(p, 333, 177, "RGBA"),
    "palette.png": lambda p: mf.image(p, 177, 333, "P"),
    "gray16.png": lambda p: mf.image(p, 640, 480, "I;16"),
    "cmyk.jpg": lambda p: mf.image(p, 500, 301, "CMYK"),
    "exif6.jpg": lambda p: mf.image(p, 900, 300, "RGB", exif_orientation=6),
    "exif3.jpg": lambda p: mf.image(p, 900, 300, "RGB", exif_orientation=3),
    "exif8.png": lambda p: mf.image(p, 900, 300, "RGB", exif_orientation=8),
    "png-named.jpg": lambda p: mf.png_named_jpg(p, 1280, 720),
    "noise.jpg": lambda p: mf.noisy_jpeg(p, 1023, 767),
}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_ids_match_processor(family: str, processor: Any, tmp_path: Path, name: str) -> None:
    path = IMAGES[name](tmp_path / name)
    record = {
        "messages": [
            {"role": "user", "content": "<image>What is shown?"},
            {"role": "assistant", "content": "A test image."},
        ],
        "images": [name],
    }
    ours = _ours(_tokenizer(family), record, tmp_path / "data.json")
    ref = _hf(
        processor,
        [
            {
                "role": "user",
                "content": [{"type": "image", "path": str(path)}, {"type": "text", "text": "What is shown?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A test image."}]},
        ],
    )
    assert isinstance(ours, TokenizedSample), ours
    assert ours.input_ids == ref["input_ids"][0]
    assert _grids(ours, "image") == ref["image_grid_thw"].tolist()
    media = ours.media[0]
    assert media.num_tokens == ours.input_ids.count(processor.image_token_id)
    patch = processor.image_processor.patch_size
    assert (media.height, media.width) == (media.grid_h * patch, media.grid_w * patch)


def test_huge_image_with_max_pixels_override(family: str, processor: Any, tmp_path: Path) -> None:
    """8000x6000 hits the pixel bound; a config override must reach the count like the processor's `size`."""
    max_pixels = 1003520
    path = mf.image(tmp_path / "huge.png", 8000, 6000)
    record = {
        "messages": [{"role": "user", "content": "<image>Big."}, {"role": "assistant", "content": "Yes."}],
        "images": [path.name],
    }
    ours = _ours(_tokenizer(family, max_pixels=max_pixels), record, tmp_path / "d.json")
    conversation = [
        {"role": "user", "content": [{"type": "image", "path": str(path)}, {"type": "text", "text": "Big."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]},
    ]
    ref = _hf(processor, conversation, size={"shortest_edge": 3136, "longest_edge": max_pixels})
    assert isinstance(ours, TokenizedSample), ours
    assert ours.input_ids == ref["input_ids"][0]
    assert _grids(ours, "image") == ref["image_grid_thw"].tolist()
    assert ours.media[0].height * ours.media[0].width <= max_pixels


def test_extreme_aspect_ratio_rejected_like_processor(family: str, processor: Any, tmp_path: Path) -> None:
    path = mf.image(tmp_path / "strip.png", 3000, 14)
    record = {
        "messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
        "images": [path.name],
    }
    ours = _ours(_tokenizer(family), record, tmp_path / "d.json")
    assert isinstance(ours, Reject) and ours.reason == "aspect_ratio"
    assert "200" in ours.detail
    with pytest.raises(ValueError, match="aspect ratio"):
        _hf(processor, [{"role": "user", "content": [{"type": "image", "path": str(path)}]}])


@pytest.fixture(scope="module")
def decoded_videos() -> dict[str, tuple[Any, Any]]:
    """Every shared demo video, all frames, decoded once by the transformers PyAV reader."""
    from transformers.video_utils import load_video

    return {
        name: load_video(str(DEMO / "mllm_demo_data" / name), backend="pyav")
        for name in ("1.mp4", "2.avi", "3.mp4", "4.mp4")
    }


@pytest.mark.parametrize("name", ["1.mp4", "2.avi", "3.mp4", "4.mp4"])
def test_video_ids_match_processor(
    family: str, processor: Any, decoded_videos: dict[str, tuple[Any, Any]], name: str
) -> None:
    record = {
        "messages": [
            {"role": "user", "content": "<video>What happens?"},
            {"role": "assistant", "content": "Things."},
        ],
        "videos": [f"mllm_demo_data/{name}"],
    }
    ours = _ours(_tokenizer(family), record, DEMO / "mllm_video_demo.json")
    assert isinstance(ours, TokenizedSample), ours
    frames, metadata = decoded_videos[name]
    conversation = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Things."}]},
    ]
    text = processor.apply_chat_template(conversation, tokenize=False)
    kwargs = {"do_sample_frames": True, "fps": FPS, "min_frames": MIN_FRAMES, "max_frames": MAX_FRAMES}
    extra = {"cap_pixels_per_frame": True} if family in ("qwen3-vl", "qwen3.5") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = processor(text=[text], videos=[frames], video_metadata=[metadata], **kwargs, **extra)
        indices = processor.video_processor.sample_frames(metadata, temporal_patch_size=2, **kwargs).tolist()
    media = ours.media[0]
    assert ours.input_ids == ref["input_ids"][0]
    assert _grids(ours, "video") == ref["video_grid_thw"].tolist()
    assert media.frames == indices
    if family == "qwen2.5-vl":
        assert media.second_per_grid == pytest.approx(float(ref["second_per_grid_ts"][0]))


def _typed_to_hf(message: dict[str, Any], root: Path) -> dict[str, Any]:
    parts = []
    for part in message["content"]:
        if part["type"] == "text":
            parts.append({"type": "text", "text": part["value"]})
        else:
            parts.append({"type": "image", "path": str(root / part["value"])})
    return {"role": message["role"], "content": parts}


def test_v1_typed_demo_matches_processor(family: str, processor: Any, tmp_path: Path) -> None:
    """The typed-parts demo: its paths are relative to a root holding `data/mllm_demo_data`."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mllm_demo_data").symlink_to(DEMO / "mllm_demo_data")
    tok = _tokenizer(family, root=tmp_path)
    raws = list(iter_records([str(DEMO / "v1_multimodal_demo.jsonl")]))
    assert len(raws) == 24
    for raw in raws[::6]:
        ours = tok(raw)
        assert isinstance(ours, TokenizedSample), ours
        ref = _hf(processor, [_typed_to_hf(m, tmp_path) for m in raw.record["messages"]])
        assert ours.input_ids == ref["input_ids"][0], raw.index
        assert _grids(ours, "image") == ref["image_grid_thw"].tolist()


def _placeholder_to_hf(message: dict[str, Any], images: list[str]) -> dict[str, Any]:
    parts: list[dict[str, str]] = []
    for i, chunk in enumerate(message["content"].split("<image>")):
        if i:
            parts.append({"type": "image", "path": images.pop(0)})
        if chunk:
            parts.append({"type": "text", "text": chunk})
    return {"role": message["role"], "content": parts}


def test_mllm_demo_matches_processor(family: str, processor: Any) -> None:
    tok = _tokenizer(family)
    records = json.loads((DEMO / "mllm_demo.json").read_text())
    for raw in iter_records([str(DEMO / "mllm_demo.json")]):
        ours = tok(raw)
        assert isinstance(ours, TokenizedSample), ours
        images = [str(DEMO / p) for p in records[raw.index]["images"]]
        ref = _hf(processor, [_placeholder_to_hf(m, images) for m in records[raw.index]["messages"]])
        assert ours.input_ids == ref["input_ids"][0], raw.index
        assert _grids(ours, "image") == ref["image_grid_thw"].tolist()


def test_text_only_matches_processor(family: str, processor: Any) -> None:
    tok = _tokenizer(family)
    path = SHARED / "datasets" / "text-sft" / "fastchat" / "dummy_conversation.json"
    roles = {"human": "user", "gpt": "assistant"}
    for raw in list(iter_records([str(path)]))[:40]:
        ours = tok(raw)
        assert isinstance(ours, TokenizedSample), ours
        conversation = [
            {"role": roles[t["from"]], "content": t["value"]} for t in raw.record["conversations"]
        ]
        assert ours.input_ids == _hf(processor, conversation)["input_ids"][0], raw.index


QWEN3_VIDEOS = {
    # name: (frames, fps, width, height); the first is short and sharp, where the per-frame cap binds
    "hd-short.mp4": (8, 4, 1280, 720),
    "odd-frames.mp4": (5, 10, 64, 48),
    "tiny.mp4": (30, 25, 20, 18),
    "long-narrow.mp4": (61, 12, 320, 64),
}


@pytest.mark.parametrize("name", sorted(QWEN3_VIDEOS))
@pytest.mark.parametrize("model", ["qwen3-vl", "qwen3.5"])
def test_qwen3_generated_video_ids_match_processor(tmp_path: Path, name: str, model: str) -> None:
    """Sampled frame counts odd and even, sides below the patch factor, and a clip where
    `cap_pixels_per_frame` changes the size: ids (timestamps included) equal the processor's."""
    from transformers.video_utils import load_video

    transformers.utils.logging.set_verbosity_error()
    processor = transformers.AutoProcessor.from_pretrained(str(MODELS / model))
    frames_n, fps, width, height = QWEN3_VIDEOS[name]
    path = mf.video(tmp_path / name, frames=frames_n, fps=fps, width=width, height=height)
    record = {
        "messages": [
            {"role": "user", "content": "<video>Describe."},
            {"role": "assistant", "content": "Ok."},
        ],
        "videos": [name],
    }
    ours = _ours(_tokenizer(model), record, tmp_path / "d.json")
    assert isinstance(ours, TokenizedSample), ours
    frames, metadata = load_video(str(path), backend="pyav")
    conversation = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Ok."}]},
    ]
    text = processor.apply_chat_template(conversation, tokenize=False)
    grids = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cap in (True, False):
            ref = processor(
                text=[text], videos=[frames], video_metadata=[metadata], fps=FPS, cap_pixels_per_frame=cap
            )
            grids[cap] = ref["video_grid_thw"].tolist()
            if cap:
                assert ours.input_ids == ref["input_ids"][0]
    assert _grids(ours, "video") == grids[True]
    if name == "hd-short.mp4":
        assert grids[True] != grids[False], "the clip must exercise the per-frame cap"


def test_system_prompt_and_multi_turn_image_match_processor(family: str, processor: Any) -> None:
    """A record's `system` column and a multi-turn chat with an image in a later turn."""
    image = str(DEMO / "mllm_demo_data" / "1.jpg")
    record = {
        "system": "You answer in one short sentence.",
        "messages": [
            {"role": "user", "content": "Hello, who are you?"},
            {"role": "assistant", "content": "An assistant."},
            {"role": "user", "content": "What is in <image>this picture?"},
            {"role": "assistant", "content": "Two dogs."},
        ],
        "images": [image],
    }
    ours = _ours(_tokenizer(family), record, DEMO / "d.json")
    assert isinstance(ours, TokenizedSample), ours
    conversation = [
        {"role": "system", "content": record["system"]},
        *[_placeholder_to_hf(m, [image]) for m in record["messages"]],
    ]
    ref = _hf(processor, conversation)
    assert ours.input_ids == ref["input_ids"][0]
    assert _grids(ours, "image") == ref["image_grid_thw"].tolist()


GLAIVE = SHARED / "datasets" / "text-sft" / "glaive-toolcall" / "glaive_toolcall_en_demo.json"
_HF_ROLES = {"human": "user", "gpt": "assistant", "observation": "tool"}


def _glaive_to_hf(turn: dict[str, str]) -> dict[str, Any]:
    """A ShareGPT tool-calling turn as the structured message `apply_chat_template` takes."""
    if turn["from"] == "function_call":
        call = json.loads(turn["value"])
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
    return {"role": _HF_ROLES[turn["from"]], "content": turn["value"]}


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_qwen35_tool_calls_match_processor(system: str | None) -> None:
    """Qwen3.5's template renders `tools` and `tool_calls` itself (XML function/parameter blocks);
    the packer's tools system prompt and function-call turns equal what it renders."""
    processor = transformers.AutoProcessor.from_pretrained(str(MODELS / "qwen3.5"))
    tok = _tokenizer("qwen3.5")
    raws = [r for r in iter_records([str(GLAIVE)]) if "function_call" in str(r.record)][:25]
    assert len(raws) == 25
    for raw in raws:
        record = {**raw.record, **({"system": system} if system else {})}
        ours = _ours(tok, record, GLAIVE)
        assert isinstance(ours, TokenizedSample), ours
        messages = [_glaive_to_hf(t) for t in record["conversations"]]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        ref = _hf(processor, messages, tools=json.loads(record["tools"]))
        assert ours.input_ids == ref["input_ids"][0], raw.index


QWEN35_REASONING = [
    # (record turns, why): each is compared with the processor on the same messages
    (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two is four."},
        ],
        "last turn with reasoning",
    ),
    (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "See you."},
        ],
        "history reasoning dropped, last turn without reasoning gets an empty block",
    ),
    (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
            {"role": "user", "content": "Again"},
            {"role": "assistant", "content": "<think>Once more.</think>Hello again!"},
        ],
        "<think> written in the content",
    ),
    (
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "function_call",
                "content": '{"name": "weather", "arguments": {"city": "Paris", "days": 2, "metric": true}}',
                "reasoning_content": "Look it up.",
            },
            {"role": "observation", "content": '{"temp": 21}'},
            {"role": "observation", "content": '{"temp": 25}'},
            {"role": "assistant", "content": "Paris 21, Rome 25.", "reasoning_content": "Both known."},
        ],
        "turns after the last user query all get think blocks; tool results share one user turn",
    ),
]


def _reasoning_to_hf(turn: dict[str, Any]) -> dict[str, Any]:
    if turn["role"] == "function_call":
        call = {"type": "function", "function": json.loads(turn["content"])}
        return {"role": "assistant", "content": "", "tool_calls": [call], **_reasoning(turn)}
    role = "tool" if turn["role"] == "observation" else turn["role"]
    return {"role": role, "content": turn["content"], **_reasoning(turn)}


def _reasoning(turn: dict[str, Any]) -> dict[str, Any]:
    return {"reasoning_content": turn["reasoning_content"]} if "reasoning_content" in turn else {}


@pytest.mark.parametrize("case", range(len(QWEN35_REASONING)))
def test_qwen35_reasoning_matches_processor(case: int) -> None:
    """`reasoning_content` on assistant turns and `<think>` in their content render as the template
    renders them (history vs turns after the last user query), in both record layouts."""
    processor = transformers.AutoProcessor.from_pretrained(str(MODELS / "qwen3.5"))
    turns, why = QWEN35_REASONING[case]
    ref = _hf(processor, [_reasoning_to_hf(t) for t in turns])["input_ids"][0]
    ours = _ours(_tokenizer("qwen3.5"), {"messages": turns}, Path("d.json"))
    assert isinstance(ours, TokenizedSample), ours
    assert ours.input_ids == ref, why
    sharegpt = [{"from": t["role"], "value": t["content"], **_reasoning(t)} for t in turns]
    ours = _ours(_tokenizer("qwen3.5"), {"conversations": sharegpt}, Path("d.json"))
    assert isinstance(ours, TokenizedSample) and ours.input_ids == ref, why
