"""The one pixel pipeline: encoded image or decoded frame -> upright RGB uint8 at the counted size.

Both the packer (`packing.mediaStorage: resized`) and the trainer's own decode
call these functions, so a pack gives the same pixels in either storage mode,
and they are the Hugging Face processor's pixels. Transparency follows the
pack's `model.alpha` (`flatten`): `white` composites onto white, as transformers'
in-memory `convert_to_rgb` does and as qwen-vl-utils and vLLM do for RGBA images
at inference, so training sees what the deployed model sees; `drop` discards it,
as PIL's `convert("RGB")` and the processor's decode of a file path
(`torchvision.io.decode_image(..., mode=RGB)`) do. Packs made before the setting
existed dropped it (`pack_alpha`). Resizing is torchvision's antialiased bicubic
kernel on uint8 pixels: `resize_uint8` calls torchvision itself where torch is
already loaded (the trainer); elsewhere (the packer, which never imports torch) a
numpy port of it, equal bit for bit (the same Pillow-SIMD-derived int16
fixed-point arithmetic as torch's AVX2 path; `tests/packer/test_pixels.py` holds
the two equal). 16-bit images are reduced to 8 bits by PIL, where torchvision
would hand the processor 16-bit values. Vision-token counts depend only on sizes,
never on these choices.
"""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Mapping
from typing import Any, cast, get_args

import numpy as np
from PIL import Image

from packtrain.core.config import Alpha
from packtrain.core.errors import PackIntegrityError
from packtrain.core.vision import upright

ALPHA_BEFORE_THE_SETTING: Alpha = "drop"
"""How packs made before `model.alpha` existed treated transparency: `convert("RGB")` dropped it."""

_WHITE = (255, 255, 255, 255)


def pack_alpha(manifest: Mapping[str, Any]) -> Alpha:
    """The transparency rule a pack's pixels were made with: its manifest's `config.model.alpha`.

    The trainer decodes original bytes with this value, never a default of its own, so a pack's
    `original` and `resized` storage give the same pixels. A manifest without the key is a pack made
    before the setting existed: those dropped alpha, so it reads as `drop`.
    """
    config = manifest.get("config")
    model = (config.get("model") if isinstance(config, Mapping) else None) or {}
    value = model.get("alpha", ALPHA_BEFORE_THE_SETTING) if isinstance(model, Mapping) else None
    if value not in get_args(Alpha):
        raise PackIntegrityError(
            f"the manifest's config.model.alpha is {value!r}, not one of {list(get_args(Alpha))}: the pack "
            "was edited; run `packtrain pack verify` on it, and re-pack the data"
        )
    return cast(Alpha, value)


def has_transparency(img: Image.Image) -> bool:
    """Transparency as transformers' `convert_to_rgb` finds it: an alpha band (RGBA, LA, PA) or a
    transparency entry (a palette index or alpha table, a PNG tRNS colour key, GIF's transparent index)."""
    return "A" in img.getbands() or img.info.get("transparency") is not None


def flatten(img: Image.Image, alpha: Alpha) -> Image.Image:
    """An RGB PIL image with transparency handled by `alpha` (see the module docstring).

    `white` is transformers' `convert_to_rgb` rule (RGBA, then `Image.alpha_composite` onto opaque
    white; PIL's `paste` with the alpha mask, the qwen-vl-utils and vLLM rule, gives the same
    pixels). `drop` goes through RGBA too: the same pixels as `convert("RGB")`, without the
    warning PIL gives for a palette with an alpha table.
    """
    if not has_transparency(img):
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    if alpha == "white":
        rgba = Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba)
    return rgba.convert("RGB")


def rgb_of(img: Image.Image, alpha: Alpha) -> np.ndarray:
    """(H, W, 3) uint8 of a PIL image: EXIF orientation applied first (the count's size), then
    transparency handled by `alpha`."""
    return np.asarray(flatten(upright(img), alpha))


IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""The only PIL plugins an image is ever decoded with, in the packer and the trainer (JPEG includes MPO)."""


def decode_rgb(data: bytes, alpha: Alpha) -> np.ndarray:
    """(H, W, 3) uint8 of encoded image bytes (see `rgb_of`), decoded only by an `IMAGE_FORMATS` plugin:
    a pack's blobs are bytes like any other, and PIL would otherwise try every decoder it has."""
    with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
        return rgb_of(img, alpha)


def image_rgb(data: bytes, height: int, width: int, alpha: Alpha) -> np.ndarray:
    """Encoded image bytes -> (height, width, 3) uint8: the pixels the processor normalizes."""
    return resize_uint8(decode_rgb(data, alpha), height, width)


def resize_uint8(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """(..., H, W, C) uint8 -> (..., height, width, C): torchvision's antialiased bicubic resize of uint8."""
    if pixels.shape[-3:-1] == (height, width):
        return pixels
    if "torch" in sys.modules:  # the trainer: torch is loaded, use the reference kernel itself (faster)
        return _torchvision_resize(pixels, height, width)
    return _numpy_resize(pixels, height, width)


def _torchvision_resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    import torch
    from torchvision.transforms.v2 import functional as tvF

    chw = torch.from_numpy(np.require(pixels, requirements=["C", "W"])).movedim(-1, -3)
    out = tvF.resize(chw, [height, width], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    return out.movedim(-3, -1).contiguous().numpy()


def _numpy_resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Horizontal pass then vertical pass, each only when that side changes, as torch's uint8 kernel."""
    out = pixels
    if out.shape[-2] != width:
        out = _resample_axis(out, width, out.ndim - 2)
    if out.shape[-3] != height:
        out = _resample_axis(out, height, out.ndim - 3)
    return out


def _bicubic(x: np.ndarray) -> np.ndarray:
    """The antialiasing bicubic filter with a = -0.5 (Pillow's and torch's `aa_filter`)."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _int16_weights(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Source indices (n_out, K), int16 fixed-point weights (n_out, K) and their precision in bits.

    Float weights as torch's `_compute_indices_min_size_weights_aa` (double,
    normalized by their in-order sum), then scaled by the largest power of two
    that keeps the largest weight under 2^15 and rounded half away from zero.
    """
    scale = n_in / n_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    kmax = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(n_out, dtype=np.float64) + 0.5)
    lo = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    size = np.clip(np.minimum(np.trunc(center + support + 0.5).astype(np.int64), n_in) - lo, 0, kmax)
    weights = np.zeros((n_out, kmax), np.float64)
    total = np.zeros(n_out, np.float64)
    for j in range(kmax):
        w = np.where(j < size, _bicubic((j + lo - center + 0.5) * invscale), 0.0)
        weights[:, j] = w
        total += w
    np.divide(weights, total[:, None], out=weights, where=total[:, None] != 0)
    precision = 0
    largest = float(weights.max())
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    fixed = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int32)
    index = np.minimum(lo[:, None] + np.arange(kmax), n_in - 1)
    return index, fixed, precision


def _resample_axis(pixels: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """One separable pass in int32 fixed point; the resampled axis is moved first and made contiguous,
    so each tap gathers whole rows."""
    index, fixed, precision = _int16_weights(pixels.shape[axis], n_out)
    src = np.ascontiguousarray(np.moveaxis(pixels, axis, 0))
    shape = (n_out,) + (1,) * (src.ndim - 1)
    acc = np.full((n_out, *src.shape[1:]), 1 << (precision - 1), np.int32)
    term = np.empty_like(acc)
    for j in range(fixed.shape[1]):
        np.multiply(src[index[:, j]], fixed[:, j].reshape(shape), out=term)
        acc += term
    return np.moveaxis(np.clip(acc >> precision, 0, 255).astype(np.uint8), 0, axis)


SNIFF_BYTES = 512


def sniff_container(head: bytes) -> str | None:
    """The allowed FFmpeg demuxer for a file's first bytes, or None: FFmpeg is never left to guess."""
    if head[4:8] == b"ftyp" or head[4:8] in (b"moov", b"mdat", b"wide", b"free"):
        return "mp4"
    if head.startswith(b"\x1aE\xdf\xa3"):
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"FLV\x01"):
        return "flv"
    if len(head) > 376 and head[0] == head[188] == head[376] == 0x47:
        return "mpegts"
    return None


def looks_like_image(head: bytes) -> bool:
    return head.startswith((b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM")) or head[8:12] == b"WEBP"
