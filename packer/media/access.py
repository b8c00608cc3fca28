"""The media a dataset names: where they may be, which files are opened, how much is read and decoded.

Datasets come from the internet, so every rule that keeps a record from reaching
beyond its data lives here, in one place:

- Confinement: a media path, absolute or relative, after `source.mediaPathMap`,
  is resolved with symlinks followed and must lie inside a root the job
  configuration names (`source.mediaRoot`, each dataset file's folder, the
  targets of `source.mediaPathMap`). Anything else is `media_outside_root`,
  decided before the file is opened and with the same detail whether or not the
  path exists, so a dataset cannot probe the file system. URLs are
  `remote_media`: the packer never fetches over the network.
- Only regular files are opened (`O_NONBLOCK`, then `fstat` on the open
  descriptor, which is closed on every refusal): a FIFO cannot hang a worker, a device
  cannot feed it endless bytes, a folder is `unsupported_media`.
- Hard links: a file with more than one link may be a second name of a file outside the
  roots, which no path check sees; such media are `hard_linked_media` and such dataset
  files a ConfigError, unless `source.allowHardLinks`.
- Byte caps (`source.maxImageBytes`, `source.maxVideoBytes`) are enforced while
  reading, not trusted from `stat`.
- Formats: images through PIL's plugins for `IMAGE_FORMATS` only; videos through
  an explicitly chosen FFmpeg demuxer of `VIDEO_DEMUXERS`, picked from the file's
  magic bytes, so FFmpeg never guesses (its `tty` demuxer would open any text
  file as a video; `concat`, playlists and image sequences would open other files).
- Decoded work: images up to `source.maxImageSourcePixels`, videos up to
  `source.maxVideoSourcePixels` (width x height x sampled frames), checked from
  headers before any pixel is decoded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import stat
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from packtrain.core.config import SourceConfig
from packtrain.core.contract import RejectReason
from packtrain.core.errors import ConfigError, MediaError, relative_note
from packtrain.core.pack.shards import atomic_write
from packtrain.core.pixels import IMAGE_FORMATS, SNIFF_BYTES, looks_like_image, sniff_container
from packtrain.core.vision import (
    VideoInfo,
    VisionSpec,
    image_grid,
    probe_image,
    probe_video,
    sample_frame_indices,
    second_per_grid,
    video_grid,
)
from packtrain.packer.sources.conversation import MediaRef
from packtrain.packer.sources.parquet import EmbeddedMedia
from packtrain.packer.sources.records import expand_paths

# Container magic -> the FFmpeg demuxer forced for it (the only demuxers ever used).
VIDEO_DEMUXERS = ("mp4", "matroska", "avi", "ogg", "flv", "mpegts")
_VIDEO_NAMES = "mp4/mov, Matroska/WebM, AVI, Ogg, FLV, MPEG-TS"
_MEDIA_CACHE_SIZE = 65536
_CHUNK = 1 << 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


@dataclass(frozen=True)
class MediaItem:
    """One image or video as the model will see it: resized size, patch grid and sampled frames."""

    kind: str
    path: Path  # resolved: inside the job's media roots
    key: str  # sha256 of the file bytes
    height: int
    width: int
    grid_t: int
    grid_h: int
    grid_w: int
    frames: list[int]
    second_per_grid: float
    merge_size: int = 2
    video_fps: float = 0.0  # video: the source frame rate (Qwen3-VL renders frame timestamps from it)
    source: VideoInfo | None = None  # video: as probed (an overlong reject counts other settings with it)

    @property
    def num_tokens(self) -> int:
        return self.grid_t * self.grid_h * self.grid_w // self.merge_size**2


@dataclass(frozen=True)
class MediaLimits:
    """Per-file caps from `source` (their defaults and meaning are documented on the config fields)."""

    image_bytes: int
    video_bytes: int
    image_pixels: int
    video_pixels: int
    hard_links: bool = False  # source.allowHardLinks

    @classmethod
    def of(cls, source: SourceConfig) -> MediaLimits:
        return cls(
            source.max_image_bytes,
            source.max_video_bytes,
            source.max_image_source_pixels,
            source.max_video_source_pixels,
            source.allow_hard_links,
        )


def is_url(ref: str) -> bool:
    """A URL or inline data rather than a path (`file://` included: media are named by path)."""
    return "://" in ref or ref[:5].lower() == "data:"


def within(path: str, roots: frozenset[str]) -> bool:
    """Whether the resolved `path` is one of `roots` or below one (checked per ancestor: no prefix tricks)."""
    current = path
    while True:
        if current in roots:
            return True
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent


class MediaRoots:
    """The folders a job's media may come from, and the rule that maps a record's reference into them."""

    def __init__(self, source: SourceConfig, base_dir: Path | None = None) -> None:
        try:
            root = Path(source.media_root).expanduser() if source.media_root else None
        except RuntimeError as exc:  # "~someone/…" naming an unknown user
            raise ConfigError(f"source.mediaRoot: {source.media_root}: {exc}") from exc
        if root is not None and not root.is_absolute() and base_dir is not None:
            root = base_dir / root
        if root is not None and not root.is_dir():
            where = relative_note(root) if base_dir is None else ""
            raise ConfigError(f"source.mediaRoot: {source.media_root} is not a folder{where}")
        self.media_root = root
        self.path_map = source.media_path_map
        fixed = [root] if root is not None else []
        # Missing dataset files are reported by the record reader; each record's own folder is a root anyway.
        self._fixed_files: list[Path] = []
        with contextlib.suppress(ConfigError):
            self._fixed_files = expand_paths(source.paths, base_dir)
        if not source.allow_hard_links:
            _refuse_hard_linked(self._fixed_files)
        fixed += [p.parent for p in self._fixed_files]
        self._fixed = [_real(p) for p in fixed]
        _refuse_filesystem_root(self._fixed)
        self._roots: dict[Path, frozenset[str]] = {}

    def all_roots(self) -> frozenset[str]:
        """Every root of every dataset file (the shard stage re-opens media without knowing their record)."""
        dirs = [Path(p).parent for p in self._fixed_files]
        return frozenset().union(*(self.roots(d) for d in dirs)) if dirs else frozenset(self._fixed)

    def roots(self, dataset_dir: Path) -> frozenset[str]:
        """Resolved roots for records of a dataset file in `dataset_dir` (relative map targets depend on
        it)."""
        found = self._roots.get(dataset_dir)
        if found is None:
            base = self.media_root or dataset_dir
            targets = [_target_root(base, new) for new in self.path_map.values()]
            _refuse_filesystem_root(targets)
            found = frozenset([*self._fixed, _real(dataset_dir), *targets])
            self._roots[dataset_dir] = found
        return found

    def resolve(self, ref: str, dataset_dir: Path) -> Path:
        """The resolved path of a media reference, or MediaError; nothing outside the roots is opened."""
        if is_url(ref):
            raise MediaError(
                RejectReason.REMOTE_MEDIA,
                f"{ref[:80]!r}: URLs are not fetched; name a file below the media root",
            )
        if "\0" in ref:
            raise MediaError(
                RejectReason.MISSING_MEDIA, f"{ref[:80]!r}: a path cannot contain a NUL character"
            )
        for old, new in self.path_map.items():
            if ref.startswith(old):
                ref = new + ref[len(old) :]
                break
        path = Path(ref)
        if not path.is_absolute():
            path = (self.media_root or dataset_dir) / path
        try:
            real = os.path.realpath(path)
        except (OSError, ValueError):
            real = ""
        if not real or not within(real, self.roots(dataset_dir)):
            raise MediaError(RejectReason.MEDIA_OUTSIDE_ROOT, outside_detail(ref, self.roots(dataset_dir)))
        return Path(real)


def outside_detail(ref: str, roots: frozenset[str]) -> str:
    """Why `ref` is refused, naming the folders the job reads and, for an absolute path, the exact
    `source.mediaPathMap` line that admits its folder. Built from the reference and the configuration
    only, so it reads the same whether or not the file exists (a dataset cannot probe with it)."""
    shown = sorted(roots)
    more = f" and {len(shown) - 3} more" if shown[3:] else ""
    seen = f"the folders read now: {', '.join(shown[:3])}{more}"
    parent = os.path.dirname(ref[:200]).rstrip(os.sep)
    if not os.path.isabs(ref) or not parent:  # relative, or in `/` (which is never a media folder)
        return f"{ref[:200]!r}: {_OUTSIDE}; {seen}"
    folder = json.dumps(parent + os.sep)
    return (
        f"{ref[:200]!r}: outside the folders this job reads media from; to read it where it is, add the "
        f"line {folder}: {folder} under source.mediaPathMap (or map that prefix to where the files are "
        f"now); {seen}"
    )


_OUTSIDE = (
    "resolves outside the folders this job reads media from (source.mediaRoot, the dataset files' "
    "folders, source.mediaPathMap targets); move the file there or name its folder in the job"
)


def _refuse_filesystem_root(roots: list[str]) -> None:
    """A root of `/` would confine nothing: every file of the pod (tokens, keys, /proc) would be media."""
    if os.sep in roots:
        raise ConfigError(
            "source.mediaRoot, a dataset file's folder or a source.mediaPathMap target resolves to `/`, "
            "which would let a dataset read any file of the pod; name the folder that holds the media"
        )


def _refuse_hard_linked(files: list[Path]) -> None:
    """A dataset file with other hard links may be a second name of a file outside the job's folders."""
    for path in files:
        with contextlib.suppress(OSError):
            links = path.stat().st_nlink
            if links > 1:
                raise ConfigError(f"source.paths: dataset file {path} {HARD_LINK_DETAIL % links}")


def _real(path: Path) -> str:
    return os.path.realpath(path)


def _target_root(base: Path, target: str) -> str:
    """The folder a `mediaPathMap` target names: itself when it ends in `/` or is a folder, else its parent
    (a prefix rewrite may end inside a file name, e.g. `imgs/train_`)."""
    path = Path(target)
    if not path.is_absolute():
        path = base / path
    if target.endswith(os.sep) or path.is_dir():
        return _real(path)
    return _real(path.parent)


EMBEDDED_DIR = "embedded"
"""Name of the folder (in the pack's work folder) embedded media are kept in until materialize."""


class MediaAccess:
    """Resolves, reads and measures the media of one source, with a per-worker cache by resolved path.

    Media embedded in a dataset file (`parquet_source.EmbeddedMedia`) are measured from their
    bytes under the same caps and decoders, and written to `embedded_dir` under their sha256,
    where the materialize stage reads them like any file.
    """

    def __init__(
        self,
        source: SourceConfig,
        spec: VisionSpec,
        *,
        base_dir: Path | None = None,
        embedded_dir: Path | None = None,
    ) -> None:
        self.roots = MediaRoots(source, base_dir)
        self.limits = MediaLimits.of(source)
        self.spec = spec
        self.embedded_dir = embedded_dir
        self._cache: OrderedDict[tuple[str, Path], MediaItem | MediaError] = OrderedDict()

    def item(self, ref: MediaRef, dataset_dir: Path) -> MediaItem:
        """The measured media item a reference names, or MediaError with a reject reason."""
        if isinstance(ref.ref, EmbeddedMedia):
            return self._embedded(ref.kind, ref.ref)
        path = self.roots.resolve(ref.ref, dataset_dir)
        return self._cached(
            (ref.kind, path),
            lambda: measure(ref.kind, path, self.spec, self.limits, self.roots.roots(dataset_dir)),
        )

    def _cached(self, key: tuple[str, Path], compute: Callable[[], MediaItem]) -> MediaItem:
        """One measurement per media file (or its reject), kept in a small LRU: datasets repeat media."""
        cached = self._cache.get(key)
        if cached is None:
            try:
                cached = compute()
            except MediaError as exc:
                cached = exc
            self._cache[key] = cached
            if len(self._cache) > _MEDIA_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(cached, MediaError):
            raise MediaError(cached.reason, cached.detail, cached.path)
        return cached

    def _embedded(self, kind: str, ref: EmbeddedMedia) -> MediaItem:
        """Measure bytes from the dataset file (untrusted like any file), then keep them by sha256."""
        data = ref.data
        cap = self.limits.image_bytes if kind == "image" else self.limits.video_bytes
        if len(data) > cap:
            raise MediaError(
                RejectReason.MEDIA_TOO_LARGE, f"{ref}: {_too_large(kind, len(data), cap).detail}"
            )
        digest = hashlib.sha256(data).hexdigest()
        path = (self.embedded_dir or Path(EMBEDDED_DIR)) / digest[:2] / digest
        item = self._cached(
            (kind, path),
            lambda: _decoded(str(ref), lambda: _measure_bytes(kind, path, data, self.spec, self.limits)),
        )
        if self.embedded_dir is not None and not path.is_file():
            atomic_write(path, data)  # same name, same bytes: concurrent workers write identical files
        return item


def _measure_bytes(kind: str, path: Path, data: bytes, spec: VisionSpec, limits: MediaLimits) -> MediaItem:
    if kind == "image":
        return _image_item(path, data, spec, limits)
    return _video_item(path, io.BytesIO(data), len(data), spec, limits)


def _decoded(name: str, work: Callable[[], MediaItem]) -> MediaItem:
    """`work()`, with every failure a MediaError naming `name` (decoders raise anything on hostile input;
    bytes in memory are never missing, so an OSError from a decoder is corrupt data too)."""
    try:
        return work()
    except MediaError as exc:
        raise MediaError(exc.reason, f"{name}: {exc.detail}") from exc
    except Exception as exc:  # one file must not stop a worker
        raise MediaError(
            RejectReason.CORRUPT_MEDIA, f"{name}: unreadable ({type(exc).__name__}: {exc})"
        ) from exc


def measure(
    kind: str, path: Path, spec: VisionSpec, limits: MediaLimits, roots: frozenset[str] | None = None
) -> MediaItem:
    """Hash and measure one media file (called once per path per worker); `path` is already resolved
    inside `roots`, which are checked again on the opened file."""
    cap = limits.image_bytes if kind == "image" else limits.video_bytes
    f = open_regular(path, kind, cap, roots, hard_links=limits.hard_links)
    try:
        with f:
            if kind == "image":
                return _image_item(path, read_capped(f, cap, kind), spec, limits)
            return _video_item(path, f, cap, spec, limits)
    except MediaError as exc:
        raise MediaError(exc.reason, f"{path}: {exc.detail}") from exc
    except OSError as exc:
        raise MediaError(
            RejectReason.MISSING_MEDIA, f"{path}: cannot read ({exc.strerror or exc})", str(path)
        ) from exc
    except Exception as exc:  # decoders raise anything on hostile input; one file must not stop a worker
        raise MediaError(
            RejectReason.CORRUPT_MEDIA, f"{path}: unreadable ({type(exc).__name__}: {exc})"
        ) from exc


def open_regular(
    path: Path, kind: str, cap: int, roots: frozenset[str] | None = None, *, hard_links: bool = False
) -> BinaryIO:
    """The open file, if it is a regular file of at most `cap` bytes (inside `roots`); else MediaError.

    A file with more than one hard link is refused unless `hard_links` (`source.allowHardLinks`):
    its other names may lie outside the roots, and no path check can tell.

    `O_NONBLOCK` keeps opening a FIFO from waiting for a writer; type and place are checked on
    the open descriptor (`fstat`, and its /proc link where there is one), so a folder swapped
    for a symlink after the path was resolved cannot lead outside.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError as exc:
        raise MediaError(RejectReason.MISSING_MEDIA, f"{path}: no such file", str(path)) from exc
    except OSError as exc:
        raise MediaError(
            RejectReason.MISSING_MEDIA, f"{path}: cannot open ({exc.strerror or exc})", str(path)
        ) from exc
    try:  # checked on the bare descriptor: `os.fdopen` itself refuses a folder, which would leak `fd`
        st = os.fstat(fd)
        opened = _opened_path(fd)
        if roots is not None and opened is not None and not within(opened, roots):
            raise MediaError(RejectReason.MEDIA_OUTSIDE_ROOT, f"{path}: {_OUTSIDE}")
        if not stat.S_ISREG(st.st_mode):
            raise MediaError(
                RejectReason.UNSUPPORTED_MEDIA,
                f"{path}: not a regular file (a folder, FIFO, socket or device)",
            )
        if st.st_nlink > 1 and not hard_links:
            raise MediaError(RejectReason.HARD_LINKED_MEDIA, f"{path}: {HARD_LINK_DETAIL % st.st_nlink}")
        if st.st_size > cap:
            raise MediaError(
                RejectReason.MEDIA_TOO_LARGE, f"{path}: {_too_large(kind, st.st_size, cap).detail}"
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


HARD_LINK_DETAIL = (
    "has %d hard links; another name of it may lie outside the folders this job reads, which no path "
    "check can see. Copy the file, or set source.allowHardLinks if the data is deduplicated with hard links"
)


def _opened_path(fd: int) -> str | None:
    """Where an open descriptor really points (Linux /proc), or None where that cannot be told."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def read_capped(f: BinaryIO, cap: int, kind: str) -> bytes:
    """All bytes of an open file, reading at most `cap + 1` (a file may grow after `fstat`)."""
    data = f.read(cap + 1)
    if len(data) > cap:
        raise _too_large(kind, len(data), cap, at_least=True)
    return data


def hash_capped(f: BinaryIO, cap: int, kind: str) -> str:
    digest = hashlib.sha256()
    total = 0
    while chunk := f.read(min(_CHUNK, cap + 1 - total)):
        total += len(chunk)
        if total > cap:
            raise _too_large(kind, total, cap, at_least=True)
        digest.update(chunk)
    return digest.hexdigest()


def _too_large(kind: str, size: int, cap: int, at_least: bool = False) -> MediaError:
    setting = "source.maxImageBytes" if kind == "image" else "source.maxVideoBytes"
    more = "more than " if at_least else ""
    return MediaError(
        RejectReason.MEDIA_TOO_LARGE,
        f"{kind} file has {more}{size} bytes, over {setting} ({cap}); raise it to keep it",
    )


def _image_item(path: Path, data: bytes, spec: VisionSpec, limits: MediaLimits) -> MediaItem:
    key = hashlib.sha256(data).hexdigest()
    try:
        info = probe_image(data, formats=IMAGE_FORMATS, max_pixels=limits.image_pixels)
    except MediaError as exc:
        if exc.reason == RejectReason.CORRUPT_MEDIA and sniff_container(data[:SNIFF_BYTES]) is not None:
            raise MediaError(RejectReason.MEDIA_TYPE_MISMATCH, "a video file is used as an image") from exc
        raise
    g = image_grid(info, spec)
    return MediaItem(
        "image", path, key, g.height, g.width, g.grid_t, g.grid_h, g.grid_w, [], 0.0, spec.merge_size
    )


def _video_item(path: Path, f: BinaryIO, cap: int, spec: VisionSpec, limits: MediaLimits) -> MediaItem:
    head = f.read(SNIFF_BYTES)
    demuxer = sniff_container(head)
    if demuxer is None:
        if looks_like_image(head):
            raise MediaError(RejectReason.MEDIA_TYPE_MISMATCH, "an image file is used as a video")
        raise MediaError(RejectReason.CORRUPT_MEDIA, f"not a video in an allowed container ({_VIDEO_NAMES})")
    f.seek(0)
    key = hash_capped(f, cap, "video")
    f.seek(0)

    def check_work(width: int, height: int, total_frames: int, fps: float) -> None:
        sampled = len(sample_frame_indices(total_frames, fps, spec))
        work = width * height * sampled
        if work > limits.video_pixels:
            raise MediaError(
                RejectReason.VIDEO_TOO_LARGE,
                f"{width}x{height} x {sampled} sampled frames = {work} source pixels to decode, over "
                f"source.maxVideoSourcePixels ({limits.video_pixels}); raise it or lower model.maxFrames/fps",
            )

    info = probe_video(f, format=demuxer, demuxers=VIDEO_DEMUXERS, check=check_work)
    frames = sample_frame_indices(info.total_frames, info.fps, spec)
    g = video_grid(info, len(frames), spec)
    spg = second_per_grid(frames, info.total_frames, info.fps, spec)
    return MediaItem(
        "video",
        path,
        key,
        g.height,
        g.width,
        g.grid_t,
        g.grid_h,
        g.grid_w,
        frames,
        spg,
        spec.merge_size,
        info.fps,
        info,
    )
