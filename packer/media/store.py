"""What a shard stores for each media file: original bytes, or pixels already at the counted size.

Original bytes keep shards small and exact (the trainer re-applies the same
resize rule). `resized` moves decode and resize work off the GPU nodes: images
become PNGs of exactly height x width, videos the sampled frames as PNGs, made by
`pixels` (the Hugging Face processor's pixels, as the trainer decodes originals), with
transparency handled by the pack's `model.alpha`, the value the trainer reads back from the manifest.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image

from packtrain.core.config import Alpha
from packtrain.core.contract import RejectReason
from packtrain.core.errors import ConfigError, MediaError
from packtrain.core.mp4_index import check_mp4_index
from packtrain.core.pixels import SNIFF_BYTES, decode_rgb, resize_uint8, sniff_container
from packtrain.packer.media.access import MediaLimits, hash_capped, open_regular, read_capped


def _png(pixels: np.ndarray) -> bytes:
    """Lossless, so the trainer reads back exactly the pixels `packer.pixels` made."""
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def video_frames(
    f: BinaryIO, indices: list[int], height: int, width: int, name: str = "video"
) -> list[np.ndarray]:
    """The frames at `indices` (decode order) at height x width, through an allowed demuxer only.

    Each wanted frame is resized as soon as it is decoded, so memory holds one source-size frame
    at a time.
    """
    frames = {
        i: resize_uint8(fr.to_ndarray(format="rgb24"), height, width) for i, fr in _sampled(f, indices, name)
    }
    return [frames[i] for i in indices]


def check_frames(f: BinaryIO, indices: list[int], name: str = "video") -> None:
    """Decode (no conversion kept) up to the last sampled frame, as the trainer will.

    Convert counts vision tokens from the stream header and packets without
    decoding, so this is where a video whose frames do not decode is found
    before training, also when shards keep the original bytes: a MediaError
    (`corrupt_media`) that materialize turns into a reject of each sample using it.
    """
    for _ in _sampled(f, indices, name):
        pass


def _sampled(f: BinaryIO, indices: list[int], name: str) -> Iterator[tuple[int, Any]]:
    """Each decoded frame at `indices`, through an allowed demuxer only; every wanted frame or a
    MediaError (`corrupt_media`) naming the file, or a ConfigError when reading it fails
    (`decode_failure`).

    A frame of another size than the stream header declared (what convert's decode cap measured
    and counted) is refused rather than decoded on.
    """
    import av

    wanted = set(indices)
    got: set[int] = set()
    try:
        f.seek(0)
        demuxer = sniff_container(f.read(SNIFF_BYTES))
        if demuxer is None:
            raise MediaError(RejectReason.CORRUPT_MEDIA, f"{name}: not a video in an allowed container")
        f.seek(0)
        if demuxer == "mp4":
            check_mp4_index(f)
        with av.open(f, mode="r", format=demuxer) as container:
            stream = container.streams.video[0]
            declared = (stream.codec_context.width, stream.codec_context.height)
            for i, frame in enumerate(container.decode(stream)):
                if (frame.width, frame.height) != declared:
                    raise MediaError(
                        RejectReason.CORRUPT_MEDIA,
                        f"{name}: frame {i} is {frame.width}x{frame.height}, but the stream declares "
                        f"{declared[0]}x{declared[1]}",
                    )
                if i in wanted:
                    got.add(i)
                    yield i, frame
                if len(got) == len(wanted):
                    break
    except (MediaError, MemoryError):
        raise
    except Exception as exc:  # decoders raise anything on hostile input; one file must not stop a worker
        raise decode_failure(exc, name) from exc
    missing = wanted - got
    if missing:
        raise MediaError(
            RejectReason.CORRUPT_MEDIA,
            f"{name}: sampled frames {sorted(missing)[:5]} could not be decoded "
            f"({len(got)} of {len(wanted)} were)",
        )


def decode_failure(exc: Exception, name: str) -> MediaError | ConfigError:
    """What an exception out of decoding video `name` means (a MemoryError never gets here: it is
    the worker's, not the file's, and stops the stage).

    Reading the file failed (an OSError that is not PyAV's own, e.g. EIO or ESTALE from network
    storage): the pack's inputs are unreadable now, a ConfigError like a file that vanished, never a
    permanent reject. Anything else the decoder raised is the file's content: `corrupt_media`.
    """
    import av

    if isinstance(exc, OSError) and not isinstance(exc, av.error.FFmpegError):
        return ConfigError(
            f"media file {name} could not be read while decoding it ({type(exc).__name__}: {exc}); it was "
            "readable at convert time. Restore it (or the storage it is on) and re-run, or re-pack into a "
            "new output folder"
        )
    return MediaError(
        RejectReason.CORRUPT_MEDIA, f"{name}: video does not decode ({type(exc).__name__}: {exc})"
    )


def _checked_open(
    path: Path, kind: str, key: str, limits: MediaLimits, roots: frozenset[str] | None, keep: bool
) -> tuple[BinaryIO, bytes]:
    """The open file and its bytes (b"" when not `keep`: then it is only hashed, streaming), read
    with the same regular-file rule and size caps as convert.

    Refuses a file that changed, vanished or turned into something else (a FIFO, a device, a bigger
    file) since convert measured it: its token count and grid came from the bytes that `key` hashes.
    """
    cap = limits.image_bytes if kind == "image" else limits.video_bytes
    try:
        f = open_regular(path, kind, cap, roots, hard_links=limits.hard_links)
        try:
            data = read_capped(f, cap, kind) if keep else b""
            digest = hashlib.sha256(data).hexdigest() if keep else hash_capped(f, cap, kind)
        except BaseException:
            f.close()
            raise
    except (OSError, MediaError) as exc:
        detail = exc.detail if isinstance(exc, MediaError) else str(exc)
        raise ConfigError(
            f"media file {path} was readable at convert time but not now ({detail}); restore it, "
            "or re-pack into a new output folder"
        ) from exc
    if digest != key:
        f.close()
        raise ConfigError(
            f"media file {path} changed since the convert stage measured it (sha256 differs); its "
            "vision-token count would be wrong. Restore it, or re-pack into a new output folder"
        )
    return f, data


def media_blob(
    ref: dict[str, Any],
    storage: str,
    limits: MediaLimits,
    roots: frozenset[str] | None = None,
    *,
    alpha: Alpha,
    tile_size: int = 0,
) -> dict[str, Any]:
    """The MEDIA_SCHEMA row for one media reference of a converted sample (re-opened inside `roots`);
    a resized image's transparency is handled by `alpha` (the pack's `model.alpha`: no default here,
    so the pixels written always follow the configuration the manifest records).

    A video whose sampled frames do not decode raises MediaError (the dataset's fault: a reject); a
    file that changed or vanished since convert raises ConfigError (the pack's inputs moved: re-pack).

    A tiled family's (`tile_size`) resized image is frames = [the tile canvas (ref height x width),
    the thumbnail (the original at tile_size², only when grid_t counts one)], no data: the trainer
    cuts the tiles row-major from the canvas, so it never needs the original.
    """
    path = Path(ref["path"])
    kind = ref["kind"]
    keep = storage == "original" or kind == "image"
    f, data = _checked_open(path, kind, ref["key"], limits, roots, keep)
    with f:
        if storage == "original":
            if kind == "video":
                check_frames(f, list(ref["frames"]), str(path))
            return {"key": ref["key"], "kind": kind, "encoding": "original", "data": data, "frames": []}
        h, w = ref["height"], ref["width"]
        if kind == "image" and tile_size:
            rgb = decode_rgb(data, alpha)
            tiles = [_png(resize_uint8(rgb, h, w))]
            if ref["grid_t"] > (h // tile_size) * (w // tile_size):
                tiles.append(_png(resize_uint8(rgb, tile_size, tile_size)))
            return {"key": ref["key"], "kind": "image", "encoding": "resized", "data": b"", "frames": tiles}
        if kind == "image":
            pixels = resize_uint8(decode_rgb(data, alpha), h, w)
            return {
                "key": ref["key"],
                "kind": "image",
                "encoding": "resized",
                "data": _png(pixels),
                "frames": [],
            }
        frames = [_png(fr) for fr in video_frames(f, list(ref["frames"]), h, w, str(path))]
    return {"key": ref["key"], "kind": "video", "encoding": "resized", "data": b"", "frames": frames}
