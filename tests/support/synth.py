"""Deterministic synthetic data for tests and benchmarks.

The shared real sets hold a few hundred samples; scale questions (planner speed
at 10^8 samples, fill quality on a multimodal mix, packer throughput) need more.
Two generators, both seeded and reproducible:

* `synthetic_lengths` draws token lengths only: a mixture of text, image and
  video samples whose token counts follow the Qwen2-VL rules (28-pixel merged
  patches, 2 fps, 2-frame temporal patches), with heavy-tailed (lognormal)
  turn lengths and a few long-document samples. Over-long samples are dropped
  and redrawn, as the packer's default `overlong: drop` would leave them.
* `generate_dataset` writes a real `messages`-format JSONL with real image files
  (JPEG and PNG of varied sizes) and short MP4 videos (few frames, so small).

Run `python -m support.synth OUT_DIR --samples 100` for a dataset.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

PATCH = 28  # merged-token side in pixels (14-pixel patches, 2x2 merge)
IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 12845056  # Qwen2-VL preprocessor default: at most 16384 tokens per image
VIDEO_MIN_PIXELS = 128 * PATCH * PATCH
VIDEO_MAX_PIXELS = 768 * PATCH * PATCH
VIDEO_TOTAL_PIXELS = 24576 * PATCH * PATCH
FPS = 2.0
MIN_FRAMES, MAX_FRAMES = 4, 768
VISION_WRAP = 2  # <|vision_start|> ... <|vision_end|>

SYSTEM_TOKENS = 21  # default system turn of the Qwen2-VL chat template
TURN_OVERHEAD = 5  # <|im_start|>role\n ... <|im_end|>\n
MAX_TURNS = 8

# Mixture of sample kinds (by default); the rest is text-only.
IMAGE_FRAC = 0.35
VIDEO_FRAC = 0.10
LONG_DOC_FRAC = 0.03  # text samples carrying a long document (RAG, summarisation)

_CHUNK = 1 << 16


def synthetic_lengths(
    n: int, seed: int, max_length: int, image_frac: float = IMAGE_FRAC, video_frac: float = VIDEO_FRAC
) -> npt.NDArray[np.int32]:
    """`n` token lengths in [1, max_length] from a heavy-tailed text/image/video mix.

    Generated in chunks of 2^16 so 10^8 lengths cost 400 MB (int32) and little else;
    a smaller `n` gives a prefix of a larger one (same seed and max_length), so a
    benchmark can time a slow baseline on a prefix of the same data.
    """
    _check_fracs(image_frac, video_frac)
    if n < 0 or max_length < 1:
        raise ValueError(f"need n >= 0 and max_length >= 1, got n={n}, max_length={max_length}")
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int32)
    filled = 0
    while filled < n:
        draw = _draw_lengths(rng, _CHUNK, image_frac, video_frac)
        kept = draw[draw <= max_length]
        if kept.size == 0:
            raise ValueError(f"max_length {max_length} is below every length this mix draws")
        take = min(kept.size, n - filled)
        out[filled : filled + take] = kept[:take]
        filled += take
    return out


def _check_fracs(image_frac: float, video_frac: float) -> None:
    if image_frac < 0 or video_frac < 0 or image_frac + video_frac > 1:
        raise ValueError(f"need image_frac, video_frac >= 0 with sum <= 1, got {image_frac}, {video_frac}")


def _draw_lengths(
    rng: np.random.Generator, size: int, image_frac: float, video_frac: float
) -> npt.NDArray[np.int64]:
    # Draw only the values a sample uses (turns, images, videos) and sum them per sample with bincount.
    turns = np.minimum(rng.geometric(0.45, size), MAX_TURNS)
    owner = np.repeat(np.arange(size), turns)
    per_turn = rng.lognormal(math.log(40), 1.1, owner.size) + rng.lognormal(math.log(150), 1.0, owner.size)
    text = np.bincount(owner, weights=per_turn + 2 * TURN_OVERHEAD, minlength=size)
    long_doc = np.flatnonzero(rng.random(size) < LONG_DOC_FRAC)
    text[long_doc] += rng.lognormal(math.log(2500), 0.7, long_doc.size)
    tokens = SYSTEM_TOKENS + np.ceil(text).astype(np.int64)

    kind = rng.random(size)
    images = np.flatnonzero(kind < image_frac)
    n_images = np.where(rng.random(images.size) < 0.85, 1, rng.integers(2, 5, images.size))
    owner = np.repeat(images, n_images)
    tokens += np.bincount(owner, weights=_image_tokens(rng, owner.size), minlength=size).astype(np.int64)
    videos = np.flatnonzero((kind >= image_frac) & (kind < image_frac + video_frac))
    tokens[videos] += _video_tokens(rng, videos.size)
    return tokens


def smart_resize(
    height: npt.NDArray[np.float64], width: npt.NDArray[np.float64], min_pixels: float, max_pixels: float
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Qwen2-VL `smart_resize`: round sides to 28 px, then scale into [min_pixels, max_pixels]."""
    h = np.maximum(PATCH, np.round(height / PATCH) * PATCH)
    w = np.maximum(PATCH, np.round(width / PATCH) * PATCH)
    area = height * width
    down = h * w > max_pixels
    beta = np.sqrt(area / max_pixels)
    h = np.where(down, np.maximum(PATCH, np.floor(height / beta / PATCH) * PATCH), h)
    w = np.where(down, np.maximum(PATCH, np.floor(width / beta / PATCH) * PATCH), w)
    up = h * w < min_pixels
    beta = np.sqrt(min_pixels / area)
    h = np.where(up, np.ceil(height * beta / PATCH) * PATCH, h)
    w = np.where(up, np.ceil(width * beta / PATCH) * PATCH, w)
    return h.astype(np.int64), w.astype(np.int64)


def image_tokens(height: int, width: int) -> int:
    """LLM tokens of one image under the Qwen2-VL processor defaults, vision start/end included."""
    h, w = smart_resize(
        np.array([float(height)]), np.array([float(width)]), IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS
    )
    return int((h[0] // PATCH) * (w[0] // PATCH)) + VISION_WRAP


def _image_tokens(rng: np.random.Generator, size: int) -> npt.NDArray[np.int64]:
    width = np.clip(rng.lognormal(math.log(800), 0.6, size), 32, 8000)
    height = np.clip(width / np.exp(rng.normal(0.25, 0.3, size)), 32, 8000)
    h, w = smart_resize(height, width, IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS)
    return (h // PATCH) * (w // PATCH) + VISION_WRAP


_VIDEO_SIDES = np.array([[240, 320], [360, 640], [480, 854], [720, 1280], [1080, 1920]], dtype=np.float64)


def _video_tokens(rng: np.random.Generator, size: int) -> npt.NDArray[np.int64]:
    seconds = np.clip(rng.lognormal(math.log(12), 0.8, size), 1, 600)
    frames = np.clip(np.round(seconds * FPS / 2) * 2, MIN_FRAMES, MAX_FRAMES)
    sides = _VIDEO_SIDES[rng.choice(len(_VIDEO_SIDES), size, p=[0.1, 0.3, 0.3, 0.2, 0.1])]
    max_pixels = np.maximum(
        np.minimum(VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS / frames * 2), VIDEO_MIN_PIXELS * 1.05
    )
    h, w = smart_resize(sides[:, 0], sides[:, 1], VIDEO_MIN_PIXELS, max_pixels)
    return (frames.astype(np.int64) // 2) * (h // PATCH) * (w // PATCH) + VISION_WRAP


def generate_dataset(
    out_dir: str | Path,
    n_samples: int,
    seed: int = 0,
    image_frac: float = IMAGE_FRAC,
    video_frac: float = VIDEO_FRAC,
    media_pool: int = 0,
) -> Path:
    """Write `out_dir/data.jsonl` plus `images/` and `videos/`; return the JSONL path.

    Records follow the `messages` format with `<image>`/`<video>` placeholders,
    media paths relative to the JSONL's folder. Text lengths are lognormal per
    turn and multi-turn, like `synthetic_lengths`, scaled down to words.
    `media_pool` > 0 draws each image and video from a pool of at most that many
    files per kind (each written once, as datasets reuse COCO images), so a
    million samples fit on a disk; 0 writes one file per use.
    """
    _check_fracs(image_frac, video_frac)
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    if media_pool < 0:
        raise ValueError(f"media_pool must be >= 0, got {media_pool}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocabulary = _vocabulary(rng)
    path = out / "data.jsonl"
    pool = _MediaPool(out, seed, media_pool) if media_pool else None
    with path.open("w", encoding="utf-8") as f:
        for index in range(n_samples):
            record = _record(rng, vocabulary, out, index, image_frac, video_frac, pool)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "an", "el", "or", "is", "qu", "ph", "st", "ing"]


def _vocabulary(rng: np.random.Generator) -> tuple[list[str], npt.NDArray[np.float64]]:
    """Pseudo-words with Zipf frequencies, so text tokenises and compresses like prose rather than noise."""
    words = sorted({"".join(rng.choice(_SYLLABLES, int(rng.integers(1, 5)))) for _ in range(3000)})
    rng.shuffle(words)
    weights = 1.0 / np.arange(1, len(words) + 1)
    cdf = np.cumsum(weights / weights.sum())
    return words, cdf / cdf[-1]


def _sentence_text(
    rng: np.random.Generator, vocabulary: tuple[list[str], npt.NDArray[np.float64]], n_words: int
) -> str:
    words, cdf = vocabulary
    # What rng.choice(len(words), n_words, p=...) draws, without re-validating p on every call.
    chosen = [words[i] for i in cdf.searchsorted(rng.random(n_words), side="right").tolist()]
    parts: list[str] = []
    for start in range(0, n_words, 12):
        sentence = " ".join(chosen[start : start + 12])
        parts.append(sentence[:1].upper() + sentence[1:] + ".")
    return " ".join(parts)


def _record(
    rng: np.random.Generator,
    vocabulary: tuple[list[str], npt.NDArray[np.float64]],
    out: Path,
    index: int,
    image_frac: float,
    video_frac: float,
    pool: _MediaPool | None = None,
) -> dict[str, object]:
    kind = rng.random()
    n_images = 0
    n_videos = 0
    if kind < image_frac:
        n_images = 1 if rng.random() < 0.85 else int(rng.integers(2, 4))
    elif kind < image_frac + video_frac:
        n_videos = 1
    turns = min(int(rng.geometric(0.45)), MAX_TURNS)
    long_doc = rng.random() < LONG_DOC_FRAC
    messages: list[dict[str, str]] = []
    for turn in range(turns):
        user_words = max(1, int(rng.lognormal(math.log(30), 1.1)))
        if long_doc and turn == 0:
            user_words += int(rng.lognormal(math.log(1800), 0.7))
        user = _sentence_text(rng, vocabulary, min(user_words, 20000))
        if turn == 0:
            marks = "<image>" * n_images + "<video>" * n_videos
            user = marks + user if rng.random() < 0.8 else user + marks
        assistant_words = max(1, int(rng.lognormal(math.log(110), 1.0)))
        messages.append({"role": "user", "content": user})
        messages.append(
            {"role": "assistant", "content": _sentence_text(rng, vocabulary, min(assistant_words, 8000))}
        )
    record: dict[str, object] = {"id": f"synth-{index:06d}", "messages": messages}
    if pool is not None:
        if n_images:
            record["images"] = [pool.image(int(rng.integers(pool.size))) for _ in range(n_images)]
        if n_videos:
            record["videos"] = [pool.video(int(rng.integers(pool.size)))]
        return record
    if n_images:
        record["images"] = [_write_image(rng, out, index, slot) for slot in range(n_images)]
    if n_videos:
        record["videos"] = [_write_video(rng, out, index)]
    return record


class _MediaPool:
    """Media files shared by many records, each written on first use from its own seed (so the
    dataset does not depend on which record draws a file first)."""

    def __init__(self, out: Path, seed: int, size: int) -> None:
        self.out, self.seed, self.size = out, seed, size
        self._images: dict[int, str] = {}
        self._videos: dict[int, str] = {}

    def image(self, k: int) -> str:
        if k not in self._images:
            self._images[k] = _write_image(np.random.default_rng((self.seed, 0, k)), self.out, k, 0)
        return self._images[k]

    def video(self, k: int) -> str:
        if k not in self._videos:
            self._videos[k] = _write_video(np.random.default_rng((self.seed, 1, k)), self.out, k)
        return self._videos[k]


def _write_image(rng: np.random.Generator, out: Path, index: int, slot: int) -> str:
    from PIL import Image, ImageDraw

    width = int(np.clip(rng.lognormal(math.log(480), 0.6), 32, 2048))
    height = int(np.clip(width / math.exp(rng.normal(0.25, 0.3)), 32, 2048))
    image = Image.fromarray(_gradient(rng, height, width))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(2, 8))):
        x0, x1 = sorted(rng.integers(0, width, 2).tolist())
        y0, y1 = sorted(rng.integers(0, height, 2).tolist())
        colour = tuple(rng.integers(0, 256, 3).tolist())
        if rng.random() < 0.5:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        else:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
    suffix = "jpg" if rng.random() < 0.7 else "png"
    rel = f"images/{index:06d}_{slot}.{suffix}"
    if suffix == "jpg":
        image.save(out / rel, format="JPEG", quality=85)
    else:
        image.save(out / rel, format="PNG")
    return rel


def _gradient(rng: np.random.Generator, height: int, width: int) -> npt.NDArray[np.uint8]:
    ys = np.linspace(0.0, 1.0, height)[:, None, None]
    xs = np.linspace(0.0, 1.0, width)[None, :, None]
    a, b, c = (rng.integers(0, 256, 3) for _ in range(3))
    pixels = a * (1 - ys) * (1 - xs) + b * ys + c * xs * (1 - ys)
    pixels += rng.normal(0, 6, (height, width, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def _write_video(rng: np.random.Generator, out: Path, index: int) -> str:
    import av

    width = int(rng.choice([64, 128, 160, 240, 320, 480]))
    height = int(2 * round(width / math.exp(rng.normal(0.3, 0.15)) / 2))
    fps = int(rng.choice([2, 4, 8]))
    frames = int(rng.integers(4, 17))
    rel = f"videos/{index:06d}.mp4"
    base = _gradient(rng, height, width)
    box = max(4, min(height, width) // 4)
    with av.open(str(out / rel), mode="w") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t in range(frames):
            frame = base.copy()
            x = (t * width // frames) % max(1, width - box)
            frame[height // 3 : height // 3 + box, x : x + box] = (
                255 - frame[height // 3 : height // 3 + box, x : x + box]
            )
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return rel


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write a synthetic multimodal SFT dataset (messages JSONL + media)."
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-frac", type=float, default=IMAGE_FRAC)
    parser.add_argument("--video-frac", type=float, default=VIDEO_FRAC)
    args = parser.parse_args(argv)
    print(generate_dataset(args.out_dir, args.samples, args.seed, args.image_frac, args.video_frac))


if __name__ == "__main__":
    main()
