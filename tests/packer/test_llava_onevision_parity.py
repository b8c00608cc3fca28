"""LLaVA-OneVision-1.5 in the packer: its ids and image grids equal `Qwen2_5_VLProcessor`'s, loaded
from the model folder without remote code (the processor the released model is served with), for
images of many sizes (tiny, beyond the 2,560,000-pixel bound, extreme aspect ratios), several images,
multi-turn chats, a system prompt, text-only chats and the shared demo data. The folder's video
processor config (temporal patches of 2, a larger pixel bound) is not the model's: reading it would
give other grids (the broken control). A video is a per-sample `unsupported_media` reject, and a
real `pack run` of images and videos checks its token layout on image probes only, with no warning,
its counts adding up.
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
from packtrain.core.families import FAMILIES
from packtrain.core.layout import PROBES, family_layout, family_probes
from packtrain.core.model_spec import model_spec
from packtrain.core.pack.shards import MANIFEST, REJECTS
from packtrain.packer.cli import main as pack_main
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.sources.records import iter_records
from packtrain.packer.tokenize import Reject, SampleTokenizer, TokenizedSample

FAMILY = "llava-onevision-1.5"
FOLDER = MODELS / FAMILY
MAX_PIXELS = 2_560_000  # the folder's image processor's max_pixels (1600 x 1600)

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def processor(shared_dir: Path) -> Any:
    transformers.utils.logging.set_verbosity_error()
    return transformers.Qwen2_5_VLProcessor.from_pretrained(str(FOLDER), trust_remote_code=False)


@functools.cache
def _tokenizer(max_pixels: int | None = None) -> SampleTokenizer:
    source = SourceConfig(paths=["unused"])
    model = ModelConfig(family=FAMILY, path=str(FOLDER), max_pixels=max_pixels)
    return SampleTokenizer(source, model, PackingConfig())


def _ours(record: dict[str, Any], source: Path, max_pixels: int | None = None) -> TokenizedSample | Reject:
    return _tokenizer(max_pixels)(RawRecord(source, 0, record, None))


def _hf(processor: Any, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return processor.apply_chat_template(conversation, tokenize=True, return_dict=True)


def _grids(sample: TokenizedSample) -> list[list[int]]:
    return [[m.grid_t, m.grid_h, m.grid_w] for m in sample.media if m.kind == "image"]


def _to_hf(message: dict[str, Any], images: list[str]) -> dict[str, Any]:
    """A message with `<image>` placeholders as the typed message `apply_chat_template` takes."""
    parts: list[dict[str, str]] = []
    for i, chunk in enumerate(message["content"].split("<image>")):
        if i:
            parts.append({"type": "image", "path": images.pop(0)})
        if chunk:
            parts.append({"type": "text", "text": chunk})
    return {"role": message["role"], "content": parts}


def _assert_same(processor: Any, record: dict[str, Any], source: Path, images: list[str]) -> TokenizedSample:
    """Our ids and grids for `record` equal the processor's; returns our sample."""
    ours = _ours(record, source)
    assert isinstance(ours, TokenizedSample), ours
    head = [{"role": "system", "content": record["system"]}] if "system" in record else []
    remaining = list(images)  # each placeholder takes the next image, across messages
    ref = _hf(processor, head + [_to_hf(m, remaining) for m in record["messages"]])
    assert ours.input_ids == ref["input_ids"][0]
    if images:
        assert _grids(ours) == ref["image_grid_thw"].tolist()
    return ours


# (width, height): tiny, odd, at and beyond the pixel bound, huge, and extreme aspect ratios (under 200:1)
SIZES = [(1, 1), (10, 10), (27, 29), (56, 56), (640, 480), (1600, 1600), (2000, 1600), (8000, 6000),
         (3000, 28), (28, 3000), (5000, 30), (333, 177)]  # fmt: skip


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_image_ids_and_grids_match_processor(processor: Any, tmp_path: Path, size: tuple[int, int]) -> None:
    path = mf.image(tmp_path / "img.png", *size)
    record = {
        "messages": [
            {"role": "user", "content": "<image>What is shown?"},
            {"role": "assistant", "content": "A test image."},
        ],
        "images": [path.name],
    }
    ours = _assert_same(processor, record, tmp_path / "d.json", [str(path)])
    media = ours.media[0]
    assert media.grid_t == 1  # one frame a patch: temporal_patch_size 1
    assert media.num_tokens == ours.input_ids.count(processor.image_token_id)
    assert media.grid_h * media.grid_w * 14 * 14 <= MAX_PIXELS


def test_several_images_multi_turn_and_a_system_prompt_match(processor: Any, tmp_path: Path) -> None:
    paths = [
        mf.image(tmp_path / f"{i}.png", w, h)
        for i, (w, h) in enumerate([(300, 200), (64, 900), (2500, 2500)])
    ]
    record = {
        "system": "You answer in one short sentence.",
        "messages": [
            {"role": "user", "content": "Compare <image> and <image>."},
            {"role": "assistant", "content": "The first is wider."},
            {"role": "user", "content": "Hello again."},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "And this one?<image>"},
            {"role": "assistant", "content": "Square."},
        ],
        "images": [p.name for p in paths],
    }
    ours = _assert_same(processor, record, tmp_path / "d.json", [str(p) for p in paths])
    assert len(ours.media) == 3


def test_the_demo_data_and_text_only_chats_match(processor: Any) -> None:
    records = json.loads((DEMO / "mllm_demo.json").read_text())
    for raw in iter_records([str(DEMO / "mllm_demo.json")]):
        images = [str(DEMO / p) for p in records[raw.index]["images"]]
        _assert_same(processor, records[raw.index], DEMO / "mllm_demo.json", images)
    path = SHARED / "datasets" / "text-sft" / "fastchat" / "dummy_conversation.json"
    roles = {"human": "user", "gpt": "assistant"}
    for raw in list(iter_records([str(path)]))[:30]:
        ours = _tokenizer()(raw)
        assert isinstance(ours, TokenizedSample), ours
        chat = [{"role": roles[t["from"]], "content": t["value"]} for t in raw.record["conversations"]]
        assert ours.input_ids == _hf(processor, chat)["input_ids"][0], raw.index


def test_the_video_processor_config_is_not_the_models(processor: Any, tmp_path: Path) -> None:
    """The broken control: the folder's video processor config says temporal patches of 2 and a
    12,845,056-pixel bound. The packer reads the image processor's (1 and 2,560,000); counting with the
    video config's bound gives another grid and other ids than the processor, so the equality above
    can fail."""
    video = json.loads((FOLDER / "video_preprocessor_config.json").read_text())
    assert (video["temporal_patch_size"], video["max_pixels"]) == (2, 12845056)
    spec = model_spec(FOLDER, FAMILY, ModelConfig(family=FAMILY, path=str(FOLDER)))
    assert (spec.vision.temporal_patch_size, spec.vision.max_pixels) == (1, MAX_PIXELS)
    path = mf.image(tmp_path / "big.png", 3000, 2000)
    record = {
        "messages": [{"role": "user", "content": "<image>Big."}, {"role": "assistant", "content": "Yes."}],
        "images": [path.name],
    }
    ref = _hf(processor, [_to_hf(record["messages"][0], [str(path)]), _to_hf(record["messages"][1], [])])
    wrong = _ours(record, tmp_path / "d.json", max_pixels=video["max_pixels"])
    assert isinstance(wrong, TokenizedSample)
    assert _grids(wrong) != ref["image_grid_thw"].tolist()
    assert wrong.input_ids != ref["input_ids"][0]
    right = _ours(record, tmp_path / "d.json")
    assert isinstance(right, TokenizedSample) and right.input_ids == ref["input_ids"][0]


def test_a_video_is_an_unsupported_media_reject(tmp_path: Path) -> None:
    """Alone or beside an image, a video rejects its sample with a reason that says what to do,
    before the video is read (a path that does not exist gives the same reject)."""
    image = mf.image(tmp_path / "a.png", 64, 64)
    for videos in (["mllm_demo_data/1.mp4"], ["missing.mp4"]):
        for content, images in (("<video>What happens?", []), ("<image><video>Compare.", [image.name])):
            record = {
                "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Ok."}],
                "images": images,
                "videos": videos,
            }
            ours = _ours(record, (DEMO if "demo" in videos[0] else tmp_path) / "d.json")
            assert isinstance(ours, Reject), ours
            assert ours.reason == "unsupported_media"
            assert "takes images only" in ours.detail and "drop the video" in ours.detail


def test_the_probes_of_an_images_only_family() -> None:
    family = FAMILIES[FAMILY]
    assert [p.name for p in family_probes(family)] == ["image", "multi-image"]
    assert family_probes(FAMILIES["qwen2.5-vl"]) == PROBES
    assert family_layout(family) == {"image": "<|vision_start|><|image_pad|>*<|vision_end|>"}


def test_pack_run_checks_images_and_rejects_videos(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], shared_dir: Path
) -> None:
    """A real `pack run` of the image demo and the video demo: the processor check runs (a fresh
    cache) on the image probes with no warning, each video sample is an `unsupported_media` reject,
    and packed + rejected = input; `pack verify` agrees."""
    monkeypatch.setenv("PACKTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "pack"
    argv = ["run", "-o", str(out), "--model", str(FOLDER), "--max-length", "4096", "--no-progress"]
    argv += ["--input", str(DEMO / "mllm_demo.json"), "--input", str(DEMO / "mllm_video_demo.json")]
    assert pack_main([*argv, "--workers", "1", "--max-rejected-fraction", "0.5"]) == 0
    err = capsys.readouterr().err
    assert "not checked" not in err and "probe" not in err
    assert len(list((tmp_path / "cache" / "processor-checks").glob("*.ok"))) == 1  # the check ran, agreed
    manifest = json.loads((out / MANIFEST).read_text())
    counts = manifest["counts"]
    videos = len(json.loads((DEMO / "mllm_video_demo.json").read_text()))
    images = len(json.loads((DEMO / "mllm_demo.json").read_text()))
    assert (counts["input"], counts["packed"], counts["rejected"]) == (images + videos, images, videos)
    rejects = [json.loads(line) for line in (out / REJECTS).read_text().splitlines()]
    assert [r["reason"] for r in rejects] == ["unsupported_media"] * videos
    assert manifest["layout"] == family_layout(FAMILIES[FAMILY])
    assert pack_main(["verify", str(out)]) == 0
    assert f"{images} packed + {videos} rejected = {images + videos}" in capsys.readouterr().out
