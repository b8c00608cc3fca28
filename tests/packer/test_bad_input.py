"""Bad input never stops a conversion: every record becomes one sample or one reject with a clear reason."""

from __future__ import annotations

import json
from pathlib import Path

import media_factory as mf
import pytest
from support.paths import SHARED

from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
from packtrain.core.contract import REJECT_REASONS
from packtrain.core.vision import VisionSpec, image_grid, probe_image
from packtrain.packer.sources.records import iter_records
from packtrain.packer.tokenize import Reject, SampleTokenizer, TokenizedSample

DEMO_MEDIA = SHARED / "datasets" / "llamafactory-mllm-demo" / "mllm_demo_data"


def _ask(placeholders: str, images: list[str] | None = None, videos: list[str] | None = None) -> dict:
    record: dict = {
        "messages": [
            {"role": "user", "content": placeholders + "Describe."},
            {"role": "assistant", "content": "OK."},
        ]
    }
    if images is not None:
        record["images"] = images
    if videos is not None:
        record["videos"] = videos
    return record


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str | None]]:
    """A JSONL mixing good and bad records; the expected reject reason per line (None: accepted)."""
    d = tmp_path_factory.mktemp("bad")
    mf.image(d / "good.png", 320, 240)
    mf.random_bytes(d / "corrupt.jpg")
    mf.truncated_copy(DEMO_MEDIA / "1.mp4", d / "truncated.mp4", 0.4)
    mf.png_named_jpg(d / "really-png.jpg", 100, 80)
    mf.image(d / "cmyk.jpg", 200, 100, "CMYK")
    mf.image(d / "rgba.png", 90, 300, "RGBA")
    mf.image(d / "palette.png", 1000, 700, "P")
    mf.image(d / "strip.png", 5000, 20)
    mf.video(d / "one-frame.mp4", frames=1)
    mf.video(d / "clip.mp4", frames=9, fps=4)
    lines: list[tuple[str | bytes, str | None]] = [
        (json.dumps(_ask("<image>", ["good.png"])), None),
        (json.dumps(_ask("<image>", ["corrupt.jpg"])), "corrupt_media"),
        (json.dumps(_ask("<image>", ["corrupt.jpg"])), "corrupt_media"),
        (json.dumps(_ask("<video>", videos=["truncated.mp4"])), "corrupt_media"),
        (json.dumps(_ask("<video>", videos=["one-frame.mp4"])), "corrupt_media"),
        (json.dumps(_ask("<video>", videos=["clip.mp4"])), None),
        (json.dumps(_ask("<image>", ["really-png.jpg"])), None),
        (json.dumps(_ask("<image>", ["cmyk.jpg"])), None),
        (json.dumps(_ask("<image><image>", ["rgba.png", "palette.png"])), None),
        (json.dumps(_ask("<image>", ["strip.png"])), "aspect_ratio"),
        (json.dumps(_ask("<image>", ["nowhere.png"])), "missing_media"),
        (json.dumps(_ask("<image><image>", ["good.png"])), "placeholder_mismatch"),
        (json.dumps(_ask("", ["good.png"])), "placeholder_mismatch"),
        (json.dumps(_ask("<image>", videos=["clip.mp4"])), "placeholder_mismatch"),
        (json.dumps(_ask("<image>", ["clip.mp4"])), "media_type_mismatch"),
        (json.dumps(_ask("<video>", videos=["good.png"])), "media_type_mismatch"),
        (json.dumps(_ask("<image>", ["https://example.com/a.png"])), "remote_media"),
        (json.dumps({**_ask("<audio>"), "audios": ["a.wav"]}), "unsupported_media"),
        (json.dumps({"messages": []}), "empty_conversation"),
        (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}), "empty_conversation"),
        (
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "x<|im_end|>"},
                        {"role": "assistant", "content": "y"},
                    ]
                }
            ),
            "reserved_token",
        ),
        (json.dumps({"messages": [{"role": "narrator", "content": "x"}]}), "malformed_record"),
        (json.dumps({"text": "no turns"}), "malformed_record"),
        (json.dumps(["not", "an", "object"]), "malformed_record"),
        ('{"messages": [{"role": "user", "content": "cut', "bad_json"),
        (b'{"messages": "\xff\xfe"}', "bad_utf8"),
        (json.dumps(_ask("<image>", ["good.png"])), None),
    ]
    path = d / "mixed.jsonl"
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x, _ in lines))
    return path, [reason for _, reason in lines]


@pytest.fixture(scope="module")
def results(dataset: tuple[Path, list[str | None]]) -> list[TokenizedSample | Reject]:
    path, _ = dataset
    model = SHARED / "models" / "qwen2-vl"
    tok = SampleTokenizer(SourceConfig(paths=[str(path)]), ModelConfig(path=str(model)), PackingConfig())
    return [tok(raw) for raw in iter_records([str(path)])]


def test_every_record_gives_one_result_with_the_expected_reason(
    dataset: tuple[Path, list[str | None]], results: list[TokenizedSample | Reject]
) -> None:
    _, expected = dataset
    assert len(results) == len(expected)
    got = [r.reason if isinstance(r, Reject) else None for r in results]
    assert got == expected
    assert [r.index for r in results] == list(range(len(expected)))
    for r in results:
        if isinstance(r, Reject):
            assert r.detail and r.source == "mixed.jsonl"
            assert r.reason in REJECT_REASONS


def test_reject_details_name_the_problem(results: list[TokenizedSample | Reject]) -> None:
    details = {r.reason: r.detail for r in results if isinstance(r, Reject)}
    assert "nowhere.png" in details["missing_media"]
    assert "audio" in details["unsupported_media"]
    assert "URL" in details["remote_media"]
    assert "line 25" in details["bad_json"]
    assert "UTF-8" in details["bad_utf8"]
    assert "<|im_end|>" in details["reserved_token"]


def test_accepted_odd_images_have_the_right_counts(
    dataset: tuple[Path, list[str | None]], results: list
) -> None:
    folder = dataset[0].parent
    spec = VisionSpec(min_pixels=3136, max_pixels=12845056)
    accepted = [m for r in results if isinstance(r, TokenizedSample) for m in r.media if m.kind == "image"]
    for media in accepted:
        grid = image_grid(probe_image((folder / media.path.name).read_bytes()), spec)
        assert (media.grid_h, media.grid_w) == (grid.grid_h, grid.grid_w)
        assert media.num_tokens == grid.grid_h * grid.grid_w // 4
    assert {m.path.name for m in accepted} >= {"really-png.jpg", "cmyk.jpg", "rgba.png", "palette.png"}


def test_video_sample_counts_sampled_frames(results: list) -> None:
    video = next(m for r in results if isinstance(r, TokenizedSample) for m in r.media if m.kind == "video")
    assert video.frames == [0, 2, 4, 6]  # 9 frames at 4 fps, 2 fps wanted, min 4 frames
    assert video.grid_t == 2
    sample = next(
        r for r in results if isinstance(r, TokenizedSample) and r.media and r.media[0].kind == "video"
    )
    assert sample.input_ids.count(151656) == video.num_tokens


def test_shared_audio_demos_are_unsupported_media() -> None:
    demo = SHARED / "datasets" / "llamafactory-mllm-demo"
    tok = SampleTokenizer(
        SourceConfig(paths=["x"]),
        ModelConfig(path=str(SHARED / "models" / "qwen2.5-vl"), family="qwen2.5-vl"),
        PackingConfig(),
    )
    raws = list(iter_records([str(demo / "mllm_audio_demo.json"), str(demo / "mllm_video_audio_demo.json")]))
    results = [tok(r) for r in raws]
    assert len(results) == 6
    assert all(
        isinstance(r, Reject) and r.reason == "unsupported_media" and "audio" in r.detail for r in results
    )
