"""Media measuring: resize and frame-sampling rules against transformers, header probing, integrity checks."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import media_factory as mf
import pytest
from PIL import Image, ImageOps
from support.pack_runner import run_in_process
from support.paths import DEMO

from packtrain.core.errors import MediaError
from packtrain.core.vision import (
    VisionSpec,
    probe_image,
    probe_video,
    sample_frame_indices,
    second_per_grid,
    smart_resize,
)

DEMO_MEDIA = DEMO / "mllm_demo_data"


def test_smart_resize_equals_transformers() -> None:
    hf = pytest.importorskip("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    sides = [1, 2, 13, 14, 27, 28, 29, 55, 56, 57, 100, 224, 333, 448, 1000, 1023, 2048, 3000, 4001, 8000]
    bounds = [(3136, 12845056), (56 * 56, 28 * 28 * 1280), (256 * 28 * 28, 1003520)]
    for (h, w), (lo, hi) in itertools.product(itertools.product(sides, sides), bounds):
        if max(h, w) / min(h, w) > 200:
            with pytest.raises(MediaError):
                smart_resize(h, w, 28, lo, hi)
            with pytest.raises(ValueError):
                hf.smart_resize(h, w, 28, lo, hi)
        else:
            assert smart_resize(h, w, 28, lo, hi) == hf.smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)


def test_frame_sampling_equals_transformers() -> None:
    video_processing = pytest.importorskip("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    from transformers.video_utils import VideoMetadata

    processor = video_processing.Qwen2VLVideoProcessor()
    cases = itertools.product(
        [2, 3, 7, 50, 243, 270, 1001, 5000], [24.0, 25.0, 29.916666, 30.0, 59.94], [0.5, 1.0, 2.0]
    )
    for total, video_fps, fps in cases:
        for min_frames, max_frames in ((4, 768), (2, 16), (1, 6)):
            spec = VisionSpec(fps=fps, min_frames=min_frames, max_frames=max_frames)
            metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
            kwargs = {
                "temporal_patch_size": 2,
                "fps": fps,
                "min_frames": min_frames,
                "max_frames": max_frames,
            }
            try:
                ref = processor.sample_frames(metadata, **kwargs).tolist()
            except ZeroDivisionError:  # fewer frames than one temporal patch after rounding
                with pytest.raises(MediaError):
                    sample_frame_indices(total, video_fps, spec)
                continue
            assert sample_frame_indices(total, video_fps, spec) == ref, (total, video_fps, kwargs)


def test_second_per_grid_is_temporal_patch_over_sampled_rate() -> None:
    spec = VisionSpec(fps=2.0)
    indices = sample_frame_indices(250, 25.0, spec)
    assert len(indices) == 20
    assert second_per_grid(indices, 250, 25.0, spec) == pytest.approx(1.0)


def test_single_frame_video_cannot_be_sampled() -> None:
    with pytest.raises(MediaError) as err:
        sample_frame_indices(1, 25.0, VisionSpec())
    assert err.value.reason == "corrupt_media"


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_exif_transpose(tmp_path: Path, orientation: int) -> None:
    path = mf.image(tmp_path / "o.jpg", 120, 40, exif_orientation=orientation)
    info = probe_image(path.read_bytes())
    with Image.open(path) as img:
        upright = ImageOps.exif_transpose(img)
    assert (info.width, info.height) == upright.size
    assert (info.width, info.height) == ((40, 120) if orientation >= 5 else (120, 40))


def test_png_content_under_jpg_name_is_measured_by_content(tmp_path: Path) -> None:
    info = probe_image(mf.png_named_jpg(tmp_path / "x.jpg", 30, 20).read_bytes())
    assert (info.width, info.height, info.format) == (30, 20, "PNG")


@pytest.mark.parametrize(
    "make",
    [
        lambda d: mf.random_bytes(d / "r.jpg"),
        lambda d: mf.truncated_copy(mf.noisy_jpeg(d / "a.jpg", 200, 100), d / "t.jpg", 0.7),
        lambda d: mf.truncated_copy(mf.image(d / "a.png", 300, 300, "RGBA"), d / "t.png", 0.9),
        lambda d: mf.truncated_copy(mf.image(d / "a.gif", 50, 50, "P"), d / "t.gif", 0.5),
    ],
    ids=["random-bytes", "truncated-jpeg", "truncated-png", "truncated-gif"],
)
def test_broken_images_are_corrupt(tmp_path: Path, make: object) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(MediaError) as err:
        probe_image(path.read_bytes())
    assert err.value.reason == "corrupt_media"


def test_png_crc_error_is_corrupt(tmp_path: Path) -> None:
    png = tmp_path / "a.png"
    Image.new("RGB", (40, 40), (9, 9, 9)).save(png)
    data = bytearray(png.read_bytes())
    idat = data.index(b"IDAT")
    data[idat + 6] ^= 0xFF
    with pytest.raises(MediaError, match="CRC"):
        probe_image(bytes(data))


def test_progressive_jpeg_passes_the_end_marker_check(tmp_path: Path) -> None:
    path = tmp_path / "p.jpg"
    Image.new("RGB", (64, 48), (5, 6, 7)).save(path, progressive=True)
    assert probe_image(path.read_bytes()).width == 64


def test_probe_video_reads_the_pyav_header() -> None:
    import av

    for name in ("1.mp4", "2.avi"):
        info = probe_video(DEMO_MEDIA / name)
        with av.open(str(DEMO_MEDIA / name)) as c:
            stream = c.streams.video[0]
            assert info.total_frames == stream.frames
            assert info.fps == pytest.approx(float(stream.average_rate))
            assert (info.width, info.height) == (stream.codec_context.width, stream.codec_context.height)


def test_truncated_video_is_corrupt(tmp_path: Path) -> None:
    path = mf.truncated_copy(DEMO_MEDIA / "1.mp4", tmp_path / "t.mp4", 0.5)
    with pytest.raises(MediaError) as err:
        probe_video(path)
    assert err.value.reason == "corrupt_media"


def test_generated_video_is_measured(tmp_path: Path) -> None:
    info = probe_video(mf.video(tmp_path / "v.mp4", frames=21, fps=10))
    assert (info.width, info.height, info.total_frames, info.fps) == (64, 48, 21, 10.0)


def _rotated(path: Path, degrees: int) -> Path:
    """An mp4 whose stream carries a display matrix (a phone video held upright)."""
    import av
    import numpy as np

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 96, 40, "yuv420p"
        stream.set_display_rotation(degrees)
        for i in range(5):
            rgb = np.full((40, 96, 3), i * 40, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def test_header_only_probe_equals_what_read_video_pyav_decodes(tmp_path: Path) -> None:
    """Convert reads no frame: its size, count and rate must equal the processor's backend
    (`read_video_pyav`: frame count and rate from the header, frames as decoded, no display matrix
    applied), for every container, with and without FFmpeg's decoding probe."""
    import av

    from packtrain.core.pixels import sniff_container

    videos = [DEMO_MEDIA / n for n in ("1.mp4", "2.avi", "3.mp4", "4.mp4")]
    videos += [
        mf.video(tmp_path / f"v{ext}", frames=7, fps=6, width=100, height=58)
        for ext in (".mp4", ".mkv", ".avi")
    ]
    rotated = _rotated(tmp_path / "rotated.mp4", 90)
    for path in [*videos, rotated]:
        fmt = sniff_container(path.read_bytes()[:512])
        with av.open(str(path)) as c:
            stream = c.streams.video[0]
            first = next(c.decode(video=0))
            pixels = first.to_ndarray(format="rgb24")
            frames, rate = stream.frames, float(stream.average_rate)
            if path == rotated:
                assert first.rotation == 90  # the display matrix is there; PyAV does not apply it
        if not frames:  # no count in the header (Matroska): the packets, where the reference fails
            with av.open(str(path)) as c:
                frames = sum(1 for p in c.demux(video=0) if p.size)
        want = (pixels.shape[1], pixels.shape[0], frames, rate)
        for headers_only in (True, False):
            with path.open("rb") as f:
                info = probe_video(f, format=fmt, headers_only=headers_only)
            assert (info.width, info.height, info.total_frames, info.fps) == want, (path.name, headers_only)


def _undecodable(path: Path) -> Path:
    """A well-formed mp4 whose frame data is noise: header and packets intact, nothing decodes."""
    import random

    data = bytearray(path.read_bytes())
    start = data.find(b"mdat") + 4
    size = int.from_bytes(data[start - 8 : start - 4], "big")
    rng = random.Random(0)
    data[start : start + size - 8] = bytes(rng.randrange(256) for _ in range(size - 8))
    path.write_bytes(data)
    return path


def test_undecodable_video_is_counted_by_convert_and_rejected_by_materialize(tmp_path: Path) -> None:
    """Convert counts from headers only, so a video whose frames do not decode is caught before
    training by materialize (with shards keeping the original bytes too): one reject naming the file."""
    import json

    from packtrain.core.config import PackConfig
    from packtrain.packer.sources.records import iter_records
    from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample

    _undecodable(mf.video(tmp_path / "data" / "bad.mp4", frames=8))
    mf.video(tmp_path / "data" / "good.mp4", frames=8)
    lines = [
        {
            "messages": [
                {"role": "user", "content": "<video>Describe."},
                {"role": "assistant", "content": "OK."},
            ],
            "videos": [name],
        }
        for name in ("good.mp4", "bad.mp4")
    ]
    dataset = tmp_path / "data" / "d.jsonl"
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    model = DEMO_MEDIA.parents[2] / "models" / "qwen2-vl"
    for storage in ("original", "resized"):
        cfg = PackConfig.model_validate(
            {
                "source": {"paths": [str(dataset)]},
                "model": {"path": str(model)},
                "packing": {"maxLength": 4096, "mediaStorage": storage, "maxRejectedFraction": 0.5},
            }
        )
        tok = SampleTokenizer(cfg.source, cfg.model, cfg.packing)
        assert all(isinstance(tok(r), TokenizedSample) for r in iter_records(cfg.source.paths))
        out = tmp_path / f"out-{storage}"
        counts = run_in_process(cfg, out, workers=1)["counts"]
        assert (counts["packed"], counts["rejected_by_reason"]) == (1, {"corrupt_media": 1})
        (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
        assert reject["index"] == 1 and re.search(r"bad\.mp4.*does not decode", reject["detail"])


def test_decompression_bomb_is_refused_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = mf.image(tmp_path / "big.png", 100, 100).read_bytes()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(MediaError) as err:
        probe_image(data)
    assert err.value.reason == "media_too_large"


def test_vision_spec_reads_the_folder_and_config_overrides() -> None:
    from packtrain.core.config import ModelConfig
    from packtrain.core.model_spec import vision_spec

    models = DEMO_MEDIA.parents[2] / "models"
    spec = vision_spec(
        models / "qwen2.5-vl",
        ModelConfig(family="qwen2.5-vl", path="x", max_pixels=1003520, video_min_pixels=6272),
    )
    assert (spec.min_pixels, spec.max_pixels, spec.video_min_pixels, spec.video_max_pixels) == (
        3136,
        1003520,
        6272,
        12845056,  # video bounds come from the video fields or the folder, not the image override
    )
    assert spec.tokens_per_second == 2
    assert vision_spec(models / "qwen2-vl", ModelConfig(path="x")).tokens_per_second is None


def test_qwen3_sampling_video_size_and_timestamps_equal_transformers() -> None:
    """Qwen3-VL rules: linspace frame sampling, the volume resize with and without the per-frame cap,
    and the temporal-group timestamps, against `Qwen3VLVideoProcessor` / `Qwen3VLProcessor`."""
    video_processing = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    from packtrain.core.vision import VideoInfo, frame_timestamps, video_grid

    base = VisionSpec(
        patch_size=16,
        frame_sampling="linspace",
        video_resize="volume",
        video_min_pixels=4096,
        video_max_pixels=25165824,
    )
    for min_frames, max_frames in ((4, 768), (2, 16)):
        processor = video_processing.Qwen3VLVideoProcessor(min_frames=min_frames, max_frames=max_frames)
        for total, video_fps, fps in itertools.product(
            [2, 3, 7, 50, 243, 270, 1001, 5000], [24.0, 25.0, 29.916666, 59.94], [0.5, 2.0, 3.0]
        ):
            spec = VisionSpec(
                **{**base.__dict__, "fps": fps, "min_frames": min_frames, "max_frames": max_frames}
            )
            metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
            ref = processor.sample_frames(metadata, fps=fps).tolist()
            ours = sample_frame_indices(total, video_fps, spec)
            assert ours == ref, (total, video_fps, fps)
            stamps = Qwen3VLProcessor._calculate_timestamps(None, list(ref), video_fps, 2)
            assert frame_timestamps(ours, video_fps, 2) == stamps
    processor = video_processing.Qwen3VLVideoProcessor()
    size = {"shortest_edge": 4096, "longest_edge": 25165824}
    sides = [20, 31, 32, 33, 100, 360, 720, 1080, 1920, 3840]
    for (h, w), n, cap in itertools.product(
        itertools.product(sides, sides), [2, 3, 8, 19, 64, 301], [True, False]
    ):
        spec = VisionSpec(**{**base.__dict__, "cap_pixels_per_frame": cap})
        kwargs = {"size": size, "cap_pixels_per_frame": cap}
        try:
            ref = processor.get_num_of_video_patches(n, h, w, kwargs)
        except ValueError:
            with pytest.raises(MediaError):
                video_grid(VideoInfo(w, h, 1000, 25.0), n, spec)
            continue
        g = video_grid(VideoInfo(w, h, 1000, 25.0), n, spec)
        assert g.grid_t * g.grid_h * g.grid_w == ref, (h, w, n, cap)
        assert (g.height, g.width) == (g.grid_h * 16, g.grid_w * 16)
