"""InternVL: the packer's ids, tiles, frames and pixels against transformers' own `InternVLProcessor`.

The real tokenizer, template and processor configs of the shared InternVL3.5 folder; real PNGs, real
H.264 videos decoded by PyAV on both sides. Each equivalence has a broken control that must fail.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

import media_factory as mf
import numpy as np
import pytest
from support.paths import DEMO, MODELS

from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
from packtrain.core.model_spec import model_spec
from packtrain.core.pack.integrity import grid_problem, model_facts
from packtrain.core.pack.schema import IGNORE_INDEX
from packtrain.core.pixels import decode_rgb, resize_uint8
from packtrain.core.vision import shifted_indices, tile_canvas, tile_canvases, tile_count
from packtrain.packer.media.store import video_frames
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample

FOLDER = MODELS / "internvl3.5"
TILE = 448


@pytest.fixture(scope="module")
def processor(shared_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoProcessor.from_pretrained(str(FOLDER))


@functools.cache
def _tok(label_mode: str = "all_assistant") -> SampleTokenizer:
    return SampleTokenizer(
        SourceConfig(paths=["unused"]),
        ModelConfig(family="internvl", path=str(FOLDER)),
        PackingConfig(label_mode=label_mode, max_length=65536),
    )


def _ours(record: dict[str, Any], source: Path, label_mode: str = "all_assistant") -> TokenizedSample:
    sample = _tok(label_mode)(RawRecord(source, 0, record, None))
    assert isinstance(sample, TokenizedSample), sample
    return sample


def _typed(prompt: str) -> list[dict[str, str]]:
    parts: list[dict[str, str]] = []
    for piece in prompt.replace("<image>", "\0image\0").replace("<video>", "\0video\0").split("\0"):
        if piece in ("image", "video"):
            parts.append({"type": piece})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _theirs(processor: Any, turns: list[tuple[str, str]], **media: Any) -> list[int]:
    """The processor's ids for (role, text with `<image>`/`<video>`) turns."""
    conversation = [{"role": r, "content": _typed(t)} for r, t in turns]
    text = processor.apply_chat_template(conversation, tokenize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(text=[text], return_tensors="pt", **media)
    return [int(t) for t in out["input_ids"][0]]


def _record(turns: list[tuple[str, str]], images: list[str] = (), videos: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    return {
        "messages": [{"role": r, "content": t} for r, t in turns],
        "images": list(images),
        "videos": list(videos),
    }


# (width, height): tile counts 1..12 (thumbnail from 2 tiles), ties, tiny and huge images.
SIZES = [
    (448, 448), (1, 1), (3, 2), (40, 2000), (2000, 40), (900, 448), (448, 900), (1344, 448),
    (1000, 1000), (1800, 1200), (1792, 1344), (3000, 1000), (1200, 3100), (5000, 300), (640, 480),
    (1024, 768), (1920, 1080), (896, 896), (1337, 911), (4000, 4000), (100, 1200), (2200, 1700),
]  # fmt: skip


def _pil(path: Path) -> Any:
    from PIL import Image

    return Image.open(path).convert("RGB")


def test_image_ids_match_processor_for_every_tile_count(processor: Any, tmp_path: Path) -> None:
    seen: set[int] = set()
    for w, h in SIZES:
        path = mf.image(tmp_path / f"{w}x{h}.png", w, h)
        turns = [("user", "<image>What is it?"), ("assistant", "A picture.")]
        ours = _ours(_record(turns, [str(path)]), tmp_path / "d.json")
        assert ours.input_ids == _theirs(processor, turns, images=[_pil(path)]), (w, h)
        item = ours.media[0]
        seen.add(item.grid_t)
        assert (item.grid_h, item.grid_w, item.num_tokens) == (32, 32, 256 * item.grid_t)
        assert ours.labels[: ours.input_ids.index(_tok().model.ids.vision_end) + 1].count(IGNORE_INDEX) > 0
    assert {1, 3, 4, 5, 7, 10, 13} <= seen  # tile counts 1..12, and their thumbnail


def test_tile_count_matches_processor_and_broken_rules_do_not(processor: Any) -> None:
    """Canvas and tile count equal `get_number_of_image_patches` over many sizes; the rule without the
    tie-break, or without the thumbnail, disagrees somewhere (the controls)."""
    ip = processor.image_processor
    kwargs = {"crop_to_patches": True, "min_patches": 1, "max_patches": 12}
    no_tie = no_thumb = 0
    for h in [1, 2, 7, 100, 300, 447, 448, 449, 600, 896, 1000, 1344, 2000, 4000, 9000]:
        for w in [1, 3, 50, 224, 448, 672, 896, 999, 1000, 1344, 1792, 2240, 3000, 5376, 12000]:
            want = ip.get_number_of_image_patches(h, w, kwargs)
            cols, rows = tile_canvas(h, w, TILE, 1, 12)
            assert tile_count(cols, rows, True) == want, (h, w)
            no_tie += tile_count(*_first_best(h, w), True) != want
            no_thumb += tile_count(cols, rows, False) != want
    assert no_tie > 0 and no_thumb > 0


def _first_best(h: int, w: int) -> tuple[int, int]:
    """The broken control: the closest aspect ratio, first found on a tie."""
    return min(tile_canvases(1, 12), key=lambda g: abs(w / h - g[0] / g[1]))


def test_multi_image_multi_turn_and_text_only_match(processor: Any, tmp_path: Path) -> None:
    a, b, c = (
        mf.image(tmp_path / f"{n}.png", w, h) for n, (w, h) in enumerate([(1500, 500), (64, 64), (700, 1400)])
    )
    turns = [
        ("system", "Be brief."),
        ("user", "<image><image>Compare these."),
        ("assistant", "The first is wide."),
        ("user", "And this?<image>"),
        ("assistant", "Tall."),
    ]
    ours = _ours(_record(turns, [str(a), str(b), str(c)]), tmp_path / "d.json")
    assert ours.input_ids == _theirs(processor, turns, images=[_pil(a), _pil(b), _pil(c)])
    text = [("user", "Hi there"), ("assistant", "Hello!")]
    assert _ours(_record(text), tmp_path / "d.json").input_ids == _theirs(processor, text)


@functools.cache
def _video(tmp: str, frames: int, fps: int) -> Path:
    return mf.video(Path(tmp) / f"v{frames}_{fps}.mp4", frames, fps=fps, width=80, height=60)


def _decoded(path: Path) -> tuple[Any, Any]:
    from transformers.video_utils import load_video

    return load_video(str(path), backend="pyav")  # type: ignore[arg-type]


@pytest.mark.parametrize(("frames", "fps", "prompt"), [
    (20, 10, "<video>What happens?"),
    (30, 10, "Watch <video>what?"),
    (45, 9, "Look: <video>"),
    (9, 3, "Two clips<video><video>compare them"),
])  # fmt: skip
def test_video_ids_match_processor(
    processor: Any, tmp_path: Path, frames: int, fps: int, prompt: str
) -> None:
    """Frame-prefixed blocks exactly, text glued before the video included (`WatchFrame1:`)."""
    path = _video(str(tmp_path), frames, fps)
    count = prompt.count("<video>")
    turns = [("user", prompt), ("assistant", "Ok.")]
    ours = _ours(_record(turns, videos=[str(path)] * count), tmp_path / "d.json")
    decoded = [_decoded(path)] * count
    theirs = _theirs(
        processor,
        turns,
        videos=[f for f, _ in decoded],
        video_metadata=[m for _, m in decoded],
        do_sample_frames=True,
        fps=2.0,
    )
    assert ours.input_ids == theirs
    item = ours.media[0]
    assert (
        item.frames == processor.video_processor.sample_frames(decoded[0][1], num_frames=item.grid_t).tolist()
    )
    assert len(_tok().media_spans(ours)) == count
    # The control: the pads expanded without re-tokenizing the glued text differ where text is glued.
    if prompt.startswith("Watch"):
        enc = functools.partial(_tok().model.tokenizer.encode, add_special_tokens=False)
        assert enc("Watch Frame1: ") != enc("Watch ") + enc("Frame1: ")


def test_label_mode_all_masks_each_vision_run(tmp_path: Path) -> None:
    path = _video(str(tmp_path), 20, 10)
    image = mf.image(tmp_path / "i.png", 900, 448)
    turns = [("user", "<image>and<video>?"), ("assistant", "Ok.")]
    sample = _ours(_record(turns, [str(image)], [str(path)]), tmp_path / "d.json", "all")
    ids, m = _tok("all").model.ids, sample.input_ids
    masked = [i for i, lab in enumerate(sample.labels) if lab == IGNORE_INDEX]
    runs = [i for i, t in enumerate(m) if t in (ids.vision_start, ids.vision_end, ids.image_pad)]
    assert masked == runs
    assert sample.labels.count(IGNORE_INDEX) == 256 * sum(x.grid_t for x in sample.media) + 2 * (
        1 + sample.media[1].grid_t
    )


def test_shifted_sampling_equals_sample_frames_bit_for_bit(processor: Any) -> None:
    """Every (total, n) up to 200 frames and long clips: the float32 `torch.arange` included."""
    from transformers.video_utils import VideoMetadata

    vp = processor.video_processor
    pairs = [(t, n) for t in range(1, 201) for n in range(1, t + 1)]
    pairs += [(t, n) for t in (997, 7777, 10000, 65537) for n in (7, 256, 333, 768)]
    for total, n in pairs:
        want = vp.sample_frames(VideoMetadata(total_num_frames=total, fps=30.0), num_frames=n).tolist()
        assert shifted_indices(total, n) == want, (total, n)
    # The control: the same stride computed in double alone differs somewhere.
    naive = [
        (t, n) for t, n in pairs if [int(t / n / 2 + i * t / n) for i in range(n)] != shifted_indices(t, n)
    ]
    assert naive


def test_grid_check_reads_internvl_rows(tmp_path: Path) -> None:
    """`model_facts` of the folder (image_token_id, no video_token_id) checks image and video rows."""
    facts, _ = model_facts(FOLDER)
    path = _video(str(tmp_path), 20, 10)
    image = mf.image(tmp_path / "i.png", 1500, 500)
    sample = _ours(
        _record([("user", "<image><video>?"), ("assistant", "Ok.")], [str(image)], [str(path)]),
        tmp_path / "d.json",
    )
    refs = [
        {"sample": 0, "kind": x.kind, "grid_t": x.grid_t, "grid_h": x.grid_h, "grid_w": x.grid_w}
        for x in sample.media
    ]
    ids = np.array(sample.input_ids)
    assert grid_problem(ids, [len(ids)], refs, facts) is None
    refs[1] = {**refs[1], "grid_t": refs[1]["grid_t"] + 1}
    assert grid_problem(ids, [len(ids)], refs, facts) is not None


def test_tile_pixels_equal_processor(processor: Any, tmp_path: Path) -> None:
    """The pack contract's tiles (canvas cut row-major, then the thumbnail of the original), made by
    `core.pixels`, against GotOcr2's pixel_values before rescale and normalize."""
    worst, controls = 0.0, 0
    for w, h in [(1500, 500), (64, 64), (700, 1400), (1337, 911), (3, 2)]:
        path = mf.noisy_jpeg(tmp_path / f"{w}.jpg", w, h)
        rgb = decode_rgb(path.read_bytes(), "white")
        cols, rows = tile_canvas(h, w, TILE, 1, 12)
        canvas = resize_uint8(rgb, rows * TILE, cols * TILE)
        tiles = [
            canvas[r * TILE : (r + 1) * TILE, c * TILE : (c + 1) * TILE]
            for r in range(rows)
            for c in range(cols)
        ]
        if tile_count(cols, rows, True) > rows * cols:
            tiles.append(resize_uint8(rgb, TILE, TILE))
        ours = np.stack(tiles).astype(np.float32).transpose(0, 3, 1, 2)
        out = processor.image_processor(
            [_pil(path)], crop_to_patches=True, do_rescale=False, do_normalize=False, return_tensors="pt"
        )
        theirs = out["pixel_values"].numpy()
        assert theirs.shape == ours.shape
        worst = max(worst, float(np.abs(theirs - ours).max()))
        if rows > 1 and cols > 1:  # the control: tiles in column-major order are not the processor's
            controls += 1
            swapped = np.stack(
                [tiles[c * rows + r] for r in range(rows) for c in range(cols)] + tiles[rows * cols :]
            )
            assert np.abs(swapped.astype(np.float32).transpose(0, 3, 1, 2) - theirs).max() > 1
    assert worst == 0.0 and controls > 0


def test_video_frame_pixels_equal_processor(processor: Any, tmp_path: Path) -> None:
    """A video's sampled frames as the packer stores them (448x448 by `core.pixels`) against the video
    processor's frames resized to the tile, before rescale and normalize."""
    path = _video(str(tmp_path), 30, 10)
    spec = model_spec(FOLDER).vision
    frames, meta = _decoded(path)
    indices = shifted_indices(30, 6)
    with path.open("rb") as f:
        ours = np.stack(video_frames(f, indices, spec.tile_size, spec.tile_size)).transpose(0, 3, 1, 2)
    tile = {"height": TILE, "width": TILE}
    out = processor.video_processor(
        [frames], video_metadata=[meta], do_sample_frames=True, num_frames=6, size=tile,
        do_rescale=False, do_normalize=False, return_tensors="pt",
    )  # fmt: skip
    theirs = out["pixel_values_videos"][0].numpy()
    assert theirs.shape == ours.shape
    assert float(np.abs(theirs - ours.astype(np.float32)).max()) == 0.0
    assert np.abs(theirs[::-1] - ours.astype(np.float32)).max() > 1  # the control: other frames differ


def test_vision_spec_reads_the_folder_and_bounds_it(tmp_path: Path) -> None:
    spec = model_spec(FOLDER).vision
    assert (spec.tile_size, spec.min_tiles, spec.max_tiles, spec.frame_sampling) == (448, 1, 12, "shifted")
    assert spec.image_mean == (0.485, 0.456, 0.406)
    from packtrain.core.errors import ConfigError

    for bad in (
        {"max_patches": 10**6},
        {"min_patches": 0},
        {"size": {"height": 450, "width": 450}},
        {"min_patches": 13},
    ):
        folder = tmp_path / json.dumps(bad).replace('"', "").replace(" ", "").replace(":", "-")[:40]
        folder.mkdir()
        for p in FOLDER.iterdir():
            (folder / p.name).write_bytes(p.read_bytes())
        pre = json.loads((FOLDER / "preprocessor_config.json").read_text())
        (folder / "preprocessor_config.json").write_text(json.dumps({**pre, **bad}))
        with pytest.raises(ConfigError):
            model_spec(folder)


def test_demo_image_records_match_processor(processor: Any) -> None:
    data = json.loads((DEMO / "mllm_demo.json").read_text())
    for i, rec in enumerate(data[:3]):
        sample = _tok()(RawRecord(DEMO / "mllm_demo.json", i, rec, None))
        assert isinstance(sample, TokenizedSample), sample
        turns = [
            ({"human": "user", "gpt": "assistant"}.get(m.get("role", ""), m.get("role", "")), m["content"])
            for m in rec["messages"]
        ]
        images = [_pil(DEMO / p) for p in rec["images"]]
        assert sample.input_ids == _theirs(processor, turns, images=images)
