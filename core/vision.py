"""Measuring images and videos: sizes, frame sampling and patch grids, without decoding pixels.

The token count of a media item depends only on its (oriented) size and, for
videos, on which frames are sampled. Both are read from file headers here, so
converting a dataset costs about as much as hashing its files. The rules are
copies of the Hugging Face Qwen2-VL and Qwen3-VL processors (transformers 5.x:
`smart_resize`, `Qwen2VLVideoProcessor.sample_frames`, `Qwen3VLVideoProcessor`'s
sampling and volume resize, PyAV `read_video_pyav`); which rule applies comes
from the family entry through `VisionSpec`. `tests/packer/test_tokenize_parity.py`
proves they agree.
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, UnidentifiedImageError

from packtrain.core.contract import RejectReason
from packtrain.core.errors import MediaError
from packtrain.core.mp4_index import check_mp4_index

MAX_ASPECT_RATIO = 200
MAX_IMAGE_METADATA_BYTES = 1 << 20
"""Most bytes of an image's metadata (EXIF, ICC profile, XMP, text chunks together), checked before
any of it is parsed: parsing EXIF builds a Python object per value, so a file of one huge EXIF block
(millions of rationals) would cost more time and memory than its pixels. Camera EXIF fits a JPEG
APP1 segment (64 KiB); ICC profiles are a few KiB to a few hundred."""
_ORIENTATION_TAG = 0x0112
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class VisionSpec:
    """Processor settings that decide vision-token counts."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 56 * 56
    video_max_pixels: int = 28 * 28 * 1280
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    tokens_per_second: float | None = None  # Qwen2.5-VL: temporal position ids per second of video
    frame_sampling: str = "stride"  # "stride" (Qwen2VLVideoProcessor) or "linspace" (Qwen3VLVideoProcessor)
    video_resize: str = "frame"  # "frame": bounds per frame; "volume": over frames x height x width
    cap_pixels_per_frame: bool = False  # volume rule: the reference per-frame pixel cap
    max_video_tokens: int = 768  # its per-frame token ceiling
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    # Tiled families (InternVL): the square tile's side (0: not tiled), the tile count bounds of an
    # image's canvas, and whether a thumbnail follows the tiles of a many-tile canvas.
    tile_size: int = 0
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ImageInfo:
    """Upright size (EXIF orientation applied) and container format of an image."""

    width: int
    height: int
    format: str


@dataclass(frozen=True)
class VideoInfo:
    """What frame sampling needs: the header frame count and rate, and the decoded frame size."""

    width: int
    height: int
    total_frames: int
    fps: float


@dataclass(frozen=True)
class Grid:
    """Resized size and patch grid of one media item."""

    height: int
    width: int
    grid_t: int
    grid_h: int
    grid_w: int


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL resize rule: sides divisible by `factor`, area within bounds, aspect ratio kept.

    Raises MediaError("aspect_ratio") where the HF processor raises ValueError.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            RejectReason.ASPECT_RATIO,
            f"{width}x{height}: aspect ratio {max(height, width) / min(height, width):.1f} exceeds "
            f"{MAX_ASPECT_RATIO}, which the Qwen2-VL processor refuses",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@lru_cache(maxsize=16)
def tile_canvases(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """`get_all_supported_aspect_ratios`: every (columns, rows) with min..max tiles, by tile count
    (a stable sort: equal counts keep the columns-major order the tie-break depends on)."""
    grids = [
        (c, r)
        for c in range(1, max_tiles + 1)
        for r in range(1, max_tiles + 1)
        if min_tiles <= c * r <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def tile_canvas(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """`get_optimal_tiled_canvas`: the (columns, rows) whose aspect ratio is closest to the image's; on
    a tie the later (more tiles) one, while the image's area is over half the canvas's."""
    aspect = width / height
    area = width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in tile_canvases(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


def tile_count(columns: int, rows: int, thumbnail: bool) -> int:
    """Tiles of a canvas as the model sees them: its columns x rows, and the thumbnail of a
    many-tile canvas (`crop_image_to_patches(use_thumbnail=True)`)."""
    return columns * rows + (1 if thumbnail and columns * rows != 1 else 0)


def image_grid(info: ImageInfo, spec: VisionSpec) -> Grid:
    """Patch grid of an image: one temporal step (the processor repeats the frame to fill it); a
    tiled family's: height x width is the tile canvas and grid_t its tiles, thumbnail included."""
    if spec.tile_size:
        t = spec.tile_size
        cols, rows = tile_canvas(info.height, info.width, t, spec.min_tiles, spec.max_tiles)
        side = t // spec.patch_size
        return Grid(rows * t, cols * t, tile_count(cols, rows, spec.thumbnail), side, side)
    h, w = smart_resize(info.height, info.width, spec.factor, spec.min_pixels, spec.max_pixels)
    return Grid(h, w, 1, h // spec.patch_size, w // spec.patch_size)


def video_grid(info: VideoInfo, num_frames: int, spec: VisionSpec) -> Grid:
    """Patch grid of a video; an odd frame count is padded by repeating the last frame. A tiled
    family's frame is one tile (see `model_spec._tiled_spec` for its size and normalization)."""
    if spec.tile_size:
        side = spec.tile_size // spec.patch_size
        return Grid(spec.tile_size, spec.tile_size, num_frames, side, side)
    if spec.video_resize == "volume":
        h, w = _volume_resize(num_frames, info.height, info.width, spec)
    else:
        h, w = smart_resize(
            info.height, info.width, spec.factor, spec.video_min_pixels, spec.video_max_pixels
        )
    grid_t = -(-num_frames // spec.temporal_patch_size)
    return Grid(h, w, grid_t, h // spec.patch_size, w // spec.patch_size)


def _volume_resize(num_frames: int, height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """`Qwen3VLVideoProcessor.resize`: pixel bounds over frames x height x width, with the optional
    per-frame cap of the reference implementation (`cap_pixels_per_frame`)."""
    factor, tf = spec.factor, spec.temporal_patch_size
    min_pixels, max_pixels = spec.video_min_pixels, spec.video_max_pixels
    if num_frames < tf:
        raise MediaError(
            RejectReason.CORRUPT_MEDIA, f"{num_frames} sampled frame(s); at least {tf} are needed"
        )
    if spec.cap_pixels_per_frame:
        frame_cap = spec.max_video_tokens * factor * factor
        per_frame = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            RejectReason.ASPECT_RATIO,
            f"{width}x{height}: aspect ratio {max(height, width) / min(height, width):.1f} exceeds "
            f"{MAX_ASPECT_RATIO}, which the Qwen3-VL video processor refuses",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / tf) * tf
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def sample_frame_indices(total_frames: int, video_fps: float, spec: VisionSpec) -> list[int]:
    """Indices of the decoded frames the family's video processor keeps when sampling at `spec.fps`."""
    if spec.frame_sampling == "linspace":
        return _linspace_indices(total_frames, video_fps, spec)
    if spec.frame_sampling == "shifted":
        return _shifted_indices(total_frames, video_fps, spec)
    return _stride_indices(total_frames, video_fps, spec)


def _stride_indices(total_frames: int, video_fps: float, spec: VisionSpec) -> list[int]:
    """`Qwen2VLVideoProcessor.sample_frames` with fps: a multiple of the temporal patch, by a fixed stride.

    The reference computes `torch.arange(0, total, total / n).int()` in float32; the
    float32 rounding is reproduced so indices match bit for bit.
    """
    tp = spec.temporal_patch_size
    max_frames = math.floor(min(spec.max_frames, total_frames) / tp) * tp
    wanted = total_frames / video_fps * spec.fps
    wanted = min(max(wanted, spec.min_frames), max_frames, total_frames)
    n = math.floor(wanted / tp) * tp
    if n <= 0:
        raise MediaError(
            RejectReason.CORRUPT_MEDIA,
            f"video has {total_frames} frame(s); at least {tp} are needed to sample it",
        )
    step = total_frames / n
    count = math.ceil(total_frames / step)
    values = (np.arange(count, dtype=np.float64) * step).astype(np.float32)
    return values.astype(np.int32).tolist()


def _shifted_indices(total_frames: int, video_fps: float, spec: VisionSpec) -> list[int]:
    """`InternVLVideoProcessor.sample_frames` with fps and its default `initial_shift=True`: n frames
    by a fixed stride, starting half a stride in. n = int(duration * fps) as there, kept within
    minFrames..maxFrames and the clip (the processor has no such bounds: it fails on 0 frames or
    more than the clip has; within them the served processor samples these very frames).

    The reference is `torch.arange(shift, total, total / n).int()` in float32, whose CPU kernel
    computes `start + i * step` in double and rounds to float32: reproduced bit for bit.
    """
    n = int(total_frames / video_fps * spec.fps)
    n = min(max(n, spec.min_frames), spec.max_frames, total_frames)
    if n < 1:
        raise MediaError(RejectReason.CORRUPT_MEDIA, f"video has {total_frames} frame(s); none to sample")
    return shifted_indices(total_frames, n)


# torch's CPU `arange` kernel writes float32 values two vectors of 8 at a time (the same on default,
# AVX2 and AVX512 builds, measured): each vector is float32(start + step * i) + k * step, k < 8,
# rounded to float32; the tail is scalar, start + step * i in double rounded to float32.
_ARANGE_LANES = 8


def shifted_indices(total_frames: int, n: int) -> list[int]:
    """`torch.arange(total / n / 2, total, total / n).int()`: `n` frames of `total_frames` (1 <= n),
    bit for bit with torch's kernel (`tests/packer/test_internvl_parity.py` checks many pairs)."""
    step = total_frames / n
    start = step / 2
    count = math.ceil((total_frames - start) / step)
    values = start + np.arange(count, dtype=np.float64) * step
    vectorized = count // (2 * _ARANGE_LANES) * 2 * _ARANGE_LANES
    if vectorized:
        bases = (start + step * np.arange(0, vectorized, _ARANGE_LANES, dtype=np.float64)).astype(np.float32)
        lanes = np.arange(_ARANGE_LANES, dtype=np.float64) * step
        values[:vectorized] = (bases.astype(np.float64)[:, None] + lanes[None, :]).reshape(-1)
    return values.astype(np.float32).astype(np.int32).tolist()


def _linspace_indices(total_frames: int, video_fps: float, spec: VisionSpec) -> list[int]:
    """`Qwen3VLVideoProcessor.sample_frames` with fps: evenly spaced over the clip, first and last kept."""
    n = int(total_frames / video_fps * spec.fps)
    n = min(max(n, spec.min_frames), spec.max_frames, total_frames)
    if n < spec.temporal_patch_size:
        raise MediaError(
            RejectReason.CORRUPT_MEDIA,
            f"video has {total_frames} frame(s); at least {spec.temporal_patch_size} are needed to sample it",
        )
    return np.linspace(0, total_frames - 1, n).round().astype(int).tolist()


def frame_timestamps(indices: list[int], video_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group, as `Qwen3VLProcessor._calculate_timestamps` computes them:
    the mean time of the group's first and last sampled frame (the last frame pads the final group)."""
    padded = list(indices)
    if len(padded) % temporal_patch_size:
        padded += [padded[-1]] * (temporal_patch_size - len(padded) % temporal_patch_size)
    seconds = [i / video_fps for i in padded]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(seconds), temporal_patch_size)
    ]


def second_per_grid(indices: list[int], total_frames: int, video_fps: float, spec: VisionSpec) -> float:
    """Seconds per temporal grid step (Qwen2.5-VL mRoPE): temporal patch over the sampled frame rate."""
    sampled_fps = len(indices) / total_frames * video_fps
    return spec.temporal_patch_size / sampled_fps


def video_tokens(info: VideoInfo, spec: VisionSpec) -> int:
    """Vision tokens of a video under `spec`: its sampled frames' patch grid over the merge."""
    grid = video_grid(info, len(sample_frame_indices(info.total_frames, info.fps, spec)), spec)
    return grid.grid_t * grid.grid_h * grid.grid_w // spec.merge_size**2


def shorter_video(info: VideoInfo, spec: VisionSpec, budget: int) -> dict[str, tuple[int | float, int]]:
    """For each setting that shortens a video (`maxFrames`, `fps`, `videoMaxPixels`), the value
    nearest the current one that brings its vision tokens within `budget`, with the count it gives;
    a setting that cannot (at its floor the video is still over) is left out. A `maxFrames` under
    `spec.min_frames` also needs `minFrames` lowered to it."""

    def tokens(candidate: VisionSpec) -> int | None:
        try:
            return video_tokens(info, candidate)
        except MediaError:  # too few frames to sample, or a size the processor refuses
            return None

    def fitting(candidate: VisionSpec) -> int | None:
        count = tokens(candidate)
        return count if count is not None and count <= budget else None

    out: dict[str, tuple[int | float, int]] = {}
    sampled = len(sample_frame_indices(info.total_frames, info.fps, spec))
    for m in range(sampled - 1, spec.temporal_patch_size - 1, -1):
        if (count := fitting(replace(spec, max_frames=m, min_frames=min(spec.min_frames, m)))) is not None:
            out["maxFrames"] = (m, count)
            break
    for k in range(1, 80):  # about 10% lower each step, two significant digits
        fps = float(f"{spec.fps * 0.9**k:.2g}")
        if (count := fitting(replace(spec, fps=fps))) is not None:
            out["fps"] = (fps, count)
            break
    low, high = spec.video_min_pixels, spec.video_max_pixels
    if fitting(replace(spec, video_max_pixels=low)) is not None:
        while high - low > 1:  # `low` fits, `high` does not
            mid = (low + high) // 2
            fits = fitting(replace(spec, video_max_pixels=mid)) is not None
            low, high = (mid, high) if fits else (low, mid)
        step = spec.factor**2
        rounded = low // step * step  # a round number of merged patches, where that fits too
        if rounded >= spec.video_min_pixels and fitting(replace(spec, video_max_pixels=rounded)) is not None:
            low = rounded
        out["videoMaxPixels"] = (low, tokens(replace(spec, video_max_pixels=low)) or 0)
    return out


def probe_image(
    data: bytes, *, formats: Sequence[str] | None = None, max_pixels: int | None = None
) -> ImageInfo:
    """Upright size of an encoded image, read from its header, after a cheap integrity check.

    Orientation: the HF processor decodes paths with EXIF orientation applied
    (torchvision `decode_image(apply_exif_orientation=True)`, or PIL
    `exif_transpose`), so orientations 5-8 swap width and height here too. Only the
    EXIF block counts (XMP-only orientation is ignored, as torchvision does).
    The file's content decides its type, not its extension. `formats` restricts
    the PIL plugins tried and `max_pixels` refuses a size before any pixel is
    decoded (the packer's media module passes its allow-list and cap).
    """
    try:
        img = Image.open(io.BytesIO(data), formats=tuple(formats) if formats is not None else None)
    except Image.DecompressionBombError as exc:
        raise MediaError(RejectReason.MEDIA_TOO_LARGE, f"image too large to decode safely: {exc}") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        allowed = f" (allowed formats: {', '.join(formats)})" if formats else ""
        raise MediaError(RejectReason.CORRUPT_MEDIA, f"not a readable image{allowed}: {exc}") from exc
    with img:
        fmt = img.format or "?"
        width, height = img.size
        if max_pixels is not None and width * height > max_pixels:
            raise MediaError(
                RejectReason.MEDIA_TOO_LARGE,
                f"{width}x{height} image has {width * height} pixels, over source.maxImageSourcePixels "
                f"({max_pixels}); raise it to keep the image",
            )
        _check_metadata(img)
        exif = img.info.get("exif")
        if fmt == "PNG":
            _check_png(data)
        elif fmt in ("JPEG", "MPO"):
            _check_jpeg(data)
        else:
            try:
                img.load()
            except (OSError, SyntaxError, ValueError) as exc:
                raise MediaError(RejectReason.CORRUPT_MEDIA, f"{fmt} image does not decode: {exc}") from exc
    if width < 1 or height < 1:
        raise MediaError(RejectReason.CORRUPT_MEDIA, f"image has no pixels ({width}x{height})")
    if exif and _orientation(exif) in (5, 6, 7, 8):
        width, height = height, width
    return ImageInfo(width, height, fmt)


_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def upright(img: Image.Image) -> Image.Image:
    """The image as the count saw it: EXIF orientation applied, XMP ignored (see `probe_image`).

    PIL's `exif_transpose` also honours XMP orientation, which the HF processor
    does not; using it would make the pixels disagree with the counted size.
    """
    exif = img.info.get("exif")
    method = _TRANSPOSE.get(_orientation(exif)) if exif else None
    return img.transpose(method) if method is not None else img


def _check_metadata(img: Image.Image) -> None:
    size = sum(len(v) for v in img.info.values() if isinstance(v, (bytes, str)))
    if size > MAX_IMAGE_METADATA_BYTES:
        raise MediaError(
            RejectReason.MEDIA_TOO_LARGE,
            f"image metadata (EXIF, ICC, XMP, text) of {size} bytes, over {MAX_IMAGE_METADATA_BYTES}; "
            "not parsed",
        )


def _orientation(exif: bytes) -> int:
    """The EXIF orientation (1 when there is none); an EXIF block over MAX_IMAGE_METADATA_BYTES is a
    MediaError, never parsed (the packer rejects such images, so only an edited pack has one)."""
    if len(exif) > MAX_IMAGE_METADATA_BYTES:
        raise MediaError(
            RejectReason.MEDIA_TOO_LARGE,
            f"EXIF block of {len(exif)} bytes, over {MAX_IMAGE_METADATA_BYTES}; not parsed",
        )
    parsed = Image.Exif()
    try:
        parsed.load(exif)
    except (OSError, SyntaxError, ValueError, struct.error):
        return 1
    value = parsed.get(_ORIENTATION_TAG, 1)
    return value if isinstance(value, int) else 1


def _check_jpeg(data: bytes) -> None:
    """A JPEG is complete when an EOI marker follows its first scan.

    Entropy-coded data escapes 0xFF bytes, so 0xFFD9 after the first SOS can only
    be a real end marker; walking the marker segments skips EXIF thumbnails,
    which carry their own SOS/EOI.
    """
    pos, size = 2, len(data)
    sos = -1
    while pos + 4 <= size:
        if data[pos] != 0xFF:
            break
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        if marker == 0xDA:
            sos = pos
            break
        if marker in (0x01, *range(0xD0, 0xD8)):
            pos += 2
            continue
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    if sos < 0:
        raise MediaError(RejectReason.CORRUPT_MEDIA, "JPEG has no image data (no start-of-scan marker)")
    if data.rfind(b"\xff\xd9") < sos:
        raise MediaError(
            RejectReason.CORRUPT_MEDIA, "JPEG is truncated (no end-of-image marker after the image data)"
        )


def _check_png(data: bytes) -> None:
    """Walk the PNG chunks: critical chunks must pass their CRC and IEND must be present."""
    pos, size = len(_PNG_SIGNATURE), len(data)
    while pos + 12 <= size:
        length = int.from_bytes(data[pos : pos + 4], "big")
        ctype = data[pos + 4 : pos + 8]
        end = pos + 12 + length
        if end > size:
            break
        if ctype[:1].isupper():
            crc = int.from_bytes(data[end - 4 : end], "big")
            if zlib.crc32(data[pos + 4 : end - 4]) != crc:
                raise MediaError(
                    RejectReason.CORRUPT_MEDIA, f"PNG chunk {ctype.decode('latin-1')} fails its CRC check"
                )
        if ctype == b"IEND":
            return
        pos = end
    raise MediaError(RejectReason.CORRUPT_MEDIA, "PNG is truncated (no IEND chunk)")


# Demuxers whose streams carry the codec's headers (size included) before any frame, so probing
# need not decode; FFmpeg's probe otherwise decodes a few frames of each stream.
HEADER_SIZED_DEMUXERS = frozenset({"mp4", "matroska"})
_SKIP_DECODE = {"skip_frame": "all"}


def probe_video(
    source: str | Path | BinaryIO,
    *,
    format: str | None = None,
    demuxers: Sequence[str] | None = None,
    check: Callable[[int, int, int, float], None] | None = None,
    headers_only: bool = True,
) -> VideoInfo:
    """Frame count, rate and frame size as `read_video_pyav` reads them, checked against the packets present.

    Nothing is decoded: the token count needs only the header and the packet
    count, so a truncated file is caught cheaply here, and a bitstream that does
    not decode is caught where frames are decoded before training (materialize,
    see `packer.media_store.check_frames`). A container without a frame count in
    its header (e.g. some MKV/WebM) falls back to the packet count, where the
    reference would fail. The size is the stream's coded size: PyAV (the
    processor's and the trainer's decoder) does not apply a display matrix, so a
    rotated video's frames keep that size. `check(width, height, frames, fps)`
    sees these numbers before the packets are counted. `format` forces the
    demuxer and `demuxers` lists those allowed (the packer's media module passes
    both, so FFmpeg never guesses).

    With `headers_only`, FFmpeg's own probing skips decoding too (in mp4/mov and
    Matroska the size is in the codec's headers, e.g. the H.264 SPS): the same
    numbers as `read_video_pyav`'s open, which decodes a few frames, at a quarter
    of the cost. A stream whose headers lack the size is probed again decoding.
    """
    import av  # PyAV only where a video is opened: model code and benchmarks import this module without it

    target = str(source) if isinstance(source, Path) else source
    skip = headers_only and format in HEADER_SIZED_DEMUXERS
    if format == "mp4":  # FFmpeg builds the whole sample index on open: bound it first
        _check_index(target)
    try:
        with av.open(target, "r", format=format, options=dict(_SKIP_DECODE) if skip else None) as container:
            opened = set(container.format.name.split(","))
            if demuxers is not None and not opened & set(demuxers):
                raise MediaError(
                    RejectReason.CORRUPT_MEDIA, f"container {container.format.name!r} is not allowed"
                )
            if not container.streams.video:
                raise MediaError(RejectReason.MEDIA_TYPE_MISMATCH, "file has no video stream")
            stream = container.streams.video[0]
            header_frames = int(stream.frames or 0)
            rate = stream.average_rate
            if not rate:
                raise MediaError(RejectReason.CORRUPT_MEDIA, "video has no frame rate in its header")
            width, height = stream.codec_context.width, stream.codec_context.height
            if skip and not (width and height):
                sized = False
            elif not (width and height):
                raise MediaError(RejectReason.CORRUPT_MEDIA, "video has no frame size in its header")
            else:
                sized = True
                if check is not None and header_frames:
                    check(width, height, header_frames, float(rate))
                packets = sum(1 for p in container.demux(video=0) if p.size > 0)
                total = header_frames or packets
                if not total:
                    raise MediaError(RejectReason.CORRUPT_MEDIA, "video has no frames")
                if check is not None and not header_frames:
                    check(width, height, total, float(rate))
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, StopIteration) as exc:
        raise MediaError(RejectReason.CORRUPT_MEDIA, f"video does not open: {exc}") from exc
    if not sized:
        if not isinstance(target, str):
            target.seek(0)
        return probe_video(target, format=format, demuxers=demuxers, check=check, headers_only=False)
    if header_frames and packets < header_frames:
        raise MediaError(
            RejectReason.CORRUPT_MEDIA,
            f"video is truncated: the header lists {header_frames} frames, {packets} are present",
        )
    return VideoInfo(width, height, total, float(rate))


def _check_index(target: str | BinaryIO) -> None:
    if not isinstance(target, str):
        check_mp4_index(target)
        return
    try:
        with open(target, "rb") as f:
            check_mp4_index(f)
    except OSError as exc:
        raise MediaError(RejectReason.CORRUPT_MEDIA, f"video does not open: {exc}") from exc
