"""One input record to one tokenized sample (input ids, labels, media measurements) or one reject.

The text is rendered with the model's own chat template and tokenized once,
with a single pad token per media item; the pads are then expanded to the
exact vision-token count. Added tokens are split before the text is
pre-tokenized, so this equals tokenizing the expanded text, as the HF
processor does, at a fraction of the cost.

Label policy: an assistant turn is trained on from the first token after
`<|im_start|>assistant\\n` through its closing `<|im_end|>` (the end token is
learned, so the model stops; the newline after it belongs to the next prompt),
as LLaMA-Factory and ms-swift do. Function-call turns are assistant turns;
tool results are user turns. `label_mode: all` trains on every token except
vision tokens.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ModelConfig, PackingConfig, SourceConfig
from .conversation import ConversationParser, MediaRef, SampleError, Turn
from .families import LoadedModel, load_model
from .records import ConfigError, RawRecord
from .shard_format import IGNORE_INDEX
from .vision import (
    MediaError,
    VisionSpec,
    image_grid,
    probe_image,
    probe_video,
    sample_frame_indices,
    second_per_grid,
    video_grid,
)

QWEN_VISION_START_ID = 151652
QWEN_VISION_END_ID = 151653
_MEDIA_CACHE_SIZE = 65536
_VIDEO_MAGIC = (b"\x1aE\xdf\xa3", b"OggS", b"FLV")  # Matroska/WebM, Ogg, FLV; MP4/MOV and AVI below


@dataclass(frozen=True)
class MediaItem:
    """One image or video as the model will see it: resized size, patch grid and sampled frames."""

    kind: str
    path: Path
    key: str  # sha256 of the file bytes
    height: int
    width: int
    grid_t: int
    grid_h: int
    grid_w: int
    frames: list[int]
    second_per_grid: float
    merge_size: int = 2

    @property
    def num_tokens(self) -> int:
        return self.grid_t * self.grid_h * self.grid_w // self.merge_size**2


@dataclass
class TokenizedSample:
    sample_id: str
    source: str  # dataset file name (see `records.source_names`)
    index: int
    input_ids: list[int]
    labels: list[int]
    media: list[MediaItem]


REJECT_REASONS: dict[str, str] = {
    "bad_json": "a line or file is not valid JSON",
    "bad_utf8": "a line or file is not valid UTF-8",
    "malformed_record": "the record is not a conversation this packer can read (see detail)",
    "empty_conversation": "no turns, or nothing to train on",
    "placeholder_mismatch": "<image>/<video> placeholders and listed media do not pair up",
    "reserved_token": "text contains a turn or vision control token of the model",
    "missing_media": "a media file does not exist or cannot be read",
    "corrupt_media": "a media file does not decode (truncated, not an image/video, too few frames)",
    "media_type_mismatch": "a video used as an image, or an image used as a video",
    "unsupported_media": "audio, remote URLs, or images too large to decode safely",
    "aspect_ratio": "an image or video more than 200 times wider than tall (or taller than wide)",
    "template_error": "the chat template failed on this record",
    "overlong": "longer than packing.maxLength (set by the convert stage)",
}


@dataclass
class Reject:
    source: str
    index: int
    sample_id: str | None
    reason: str  # short stable code, a key of REJECT_REASONS
    detail: str  # human message


class SampleTokenizer:
    """Tokenizes records of one source for one model; holds the tokenizer and a media cache per worker."""

    def __init__(
        self,
        source: SourceConfig,
        model: ModelConfig,
        packing: PackingConfig,
        *,
        base_dir: Path | None = None,
    ) -> None:
        self.source = source
        self.packing = packing
        self.model: LoadedModel = load_model(model)
        self._backend = self.model.tokenizer.backend_tokenizer
        self._encode = _fast_encoder(self._backend)
        try:
            root = Path(source.media_root).expanduser() if source.media_root else None
        except RuntimeError as exc:  # "~someone/…" naming an unknown user
            raise ConfigError(f"source.mediaRoot: {source.media_root}: {exc}") from exc
        if root is not None and not root.is_absolute() and base_dir is not None:
            root = base_dir / root
        if root is not None and not root.is_dir():
            raise ConfigError(f"source.mediaRoot: {source.media_root} is not a folder")
        self._media_root = root
        self._cache: OrderedDict[tuple[str, Path], MediaItem | MediaError] = OrderedDict()
        self._parser = ConversationParser(source.format, source.field_map, self.model.family)
        self._header_ids, self._end_id = self._assistant_markers()

    def __call__(self, raw: RawRecord) -> TokenizedSample | Reject:
        name = raw.source_name
        if raw.record is None:
            return Reject(
                name, raw.index, None, raw.reason or "malformed_record", raw.error or "unreadable record"
            )
        sample_id = self._sample_id(raw)
        try:
            turns = self._parser.parse(raw.record)
            self._check_turns(turns)
            media = [
                self._media(ref, raw.source.parent)
                for t in turns
                for ref in t.parts
                if isinstance(ref, MediaRef)
            ]
            input_ids, labels = self._tokenize(turns, media)
        except SampleError as exc:
            return Reject(name, raw.index, sample_id, exc.reason, exc.detail)
        except MediaError as exc:
            return Reject(name, raw.index, sample_id, exc.reason, exc.detail)
        return TokenizedSample(sample_id, name, raw.index, input_ids, labels, media)

    def truncate(self, sample: TokenizedSample, max_length: int) -> TokenizedSample | None:
        """`truncate_sample` with this family's vision markers."""
        return truncate_sample(
            sample,
            max_length,
            vision_start_id=self.model.vision_start_id,
            vision_end_id=self.model.vision_end_id,
        )

    def render(self, turns: list[Turn]) -> str:
        """The chat-template text of a conversation, one pad token per media item."""
        return self.model.render([{"role": t.role, "content": _template_content(t)} for t in turns])

    def _sample_id(self, raw: RawRecord) -> str:
        value = raw.record.get(self.source.field_map.id) if raw.record else None
        if value is None or value == "" or isinstance(value, dict | list):
            return f"{raw.source_name}:{raw.index}"
        return str(value)

    def _check_turns(self, turns: list[Turn]) -> None:
        if not turns:
            raise SampleError("empty_conversation", "the conversation has no turns")
        if self.packing.label_mode != "all" and not any(t.role == "assistant" for t in turns):
            raise SampleError("empty_conversation", "the conversation has no assistant turn to train on")
        reserved = self.model.reserved_tokens
        for i, turn in enumerate(turns):
            text = turn.text
            if "<|" in text:
                found = sorted(tok for tok in reserved if tok in text)
                if found:
                    raise SampleError(
                        "reserved_token",
                        f"turn {i} ({turn.role}) contains the reserved token(s) {', '.join(found)}; "
                        "they would corrupt the turn or vision structure",
                    )

    def _assistant_markers(self) -> tuple[list[int], int]:
        """Token ids that open and close an assistant turn, checked on a probe conversation.

        Labels are placed on token ids, not characters: a turn is trained from the
        token after the header's newline through the end token. This relies on the
        header's newline starting a new token (the pre-tokenizer splits letters from
        newlines); start-up fails if the template or tokenizer breaks that.
        """
        family = self.model.family
        header = family.assistant_header
        probe = [Turn("user", ["a"]), Turn("assistant", ["b"]), Turn("user", ["c"]), Turn("assistant", ["d"])]
        try:
            text = self.render(probe)
        except Exception as exc:  # a broken user template can raise anything from Jinja
            raise ConfigError(f"chat template does not render a plain conversation: {exc}") from exc
        header_ids = self._backend.encode(header.rstrip("\n"), add_special_tokens=False).ids
        end_id = self.model.tokenizer.convert_tokens_to_ids(family.turn_end)
        ids = self._encode(text)
        got = self.model.tokenizer.decode(
            [t for a, b in _assistant_spans(ids, header_ids, end_id) for t in ids[a:b]]
        )
        want = "b" + family.turn_end + "d" + family.turn_end
        if not header.endswith("\n") or got != want:
            raise ConfigError(
                f"chat template does not mark assistant turns with {header!r} ... {family.turn_end!r} "
                f"(trained text of a probe: {got!r}, expected {want!r}); labels cannot be placed"
            )
        return header_ids, end_id

    def _tokenize(self, turns: list[Turn], media: list[MediaItem]) -> tuple[list[int], list[int]]:
        """Ids and labels with pads expanded; plain list operations (slices share int objects), since
        per-token Python or numpy work would cost as much as the tokenizer itself."""
        try:
            text = self.render(turns)
        except Exception as exc:  # Jinja raises arbitrary errors (raise_exception in templates)
            raise SampleError("template_error", f"chat template failed: {exc}") from exc
        m = self.model
        ids = self._encode(text)
        n = len(ids)
        mode = self.packing.label_mode
        if mode == "all":
            labels = list(ids)
            for a, b in _runs(ids, m.vision_start_id, m.vision_end_id):
                labels[a:b] = [IGNORE_INDEX] * (b - a)
            trained = n - labels.count(IGNORE_INDEX)
        else:
            spans = _assistant_spans(ids, self._header_ids, self._end_id)
            if mode == "last_assistant":
                spans = spans[-1:]
            labels = [IGNORE_INDEX] * n
            for a, b in spans:
                labels[a:b] = ids[a:b]
            trained = sum(b - a for a, b in spans)
        if trained == 0:
            raise SampleError("empty_conversation", "no token is left to train on")
        pads = _pad_positions(ids, m.image_pad_id, m.video_pad_id)
        kinds = ["image" if ids[p] == m.image_pad_id else "video" for p in pads]
        if kinds != [x.kind for x in media]:
            raise SampleError(
                "placeholder_mismatch",
                f"the rendered text has {len(pads)} media pad token(s) for {len(media)} media item(s)",
            )
        if not media:
            return ids, labels
        out_ids: list[int] = []
        out_labels: list[int] = []
        prev = 0
        for p, item in zip(pads, media, strict=True):
            count = item.num_tokens
            out_ids += ids[prev:p]
            out_ids += [ids[p]] * count
            out_labels += labels[prev:p]
            out_labels += [IGNORE_INDEX] * count
            prev = p + 1
        out_ids += ids[prev:]
        out_labels += labels[prev:]
        return out_ids, out_labels

    def _media(self, ref: MediaRef, dataset_dir: Path) -> MediaItem:
        path = self._resolve(ref.ref, dataset_dir)
        key = (ref.kind, path)
        cached = self._cache.get(key)
        if cached is None:
            try:
                cached = _measure(ref.kind, path, self.model.vision)
            except MediaError as exc:
                cached = exc
            self._cache[key] = cached
            if len(self._cache) > _MEDIA_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(cached, MediaError):
            raise MediaError(cached.reason, cached.detail)
        return cached

    def _resolve(self, ref: str, dataset_dir: Path) -> Path:
        if ("://" in ref and not ref.startswith("file://")) or ref.startswith("data:"):
            raise MediaError(
                "unsupported_media", f"{ref[:80]}: remote or inline media are not fetched; use local files"
            )
        ref = ref.removeprefix("file://")
        if "\0" in ref:
            raise MediaError("missing_media", f"{ref[:80]!r}: a path cannot contain a NUL character")
        for old, new in self.source.media_path_map.items():
            if ref.startswith(old):
                ref = new + ref[len(old) :]
                break
        try:
            path = Path(ref).expanduser()
        except RuntimeError as exc:  # "~someone/…" naming an unknown user
            raise MediaError("missing_media", f"{ref[:80]}: {exc}") from exc
        if not path.is_absolute():
            path = (self._media_root or dataset_dir) / path
        return path


def _fast_encoder(backend: Any) -> Callable[[str], list[int]]:
    """Token ids of one text, as `tokenizer(text)` gives them.

    `encode_batch_fast` skips the character offsets (labels are placed on token
    ids, so they are not needed) and is about a fifth faster than `encode`.
    """
    if hasattr(backend, "encode_batch_fast"):
        return lambda text: backend.encode_batch_fast([text])[0].ids
    return lambda text: backend.encode(text).ids


def _template_content(turn: Turn) -> str | list[dict[str, str]]:
    """String content for text turns (any template takes it), typed parts where media appear."""
    if not turn.has_media:
        return turn.text
    return [{"type": p.kind} if isinstance(p, MediaRef) else {"type": "text", "text": p} for p in turn.parts]


def _assistant_spans(ids: list[int], header: list[int], end_id: int) -> list[tuple[int, int]]:
    """Token spans trained on: from the token after each assistant header's newline through the next end token."""
    spans = []
    first, k, n = header[0], len(header), len(ids)
    pos = 0
    while True:
        try:
            i = ids.index(first, pos)
        except ValueError:
            return spans
        if ids[i : i + k] != header:
            pos = i + 1
            continue
        start = min(i + k + 1, n)
        try:
            stop = ids.index(end_id, start) + 1
        except ValueError:
            stop = n
        spans.append((start, stop))
        pos = stop


def _runs(ids: list[int], start_id: int, end_id: int) -> list[tuple[int, int]]:
    """Spans from each start token through the next end token (vision runs)."""
    runs = []
    pos = 0
    while True:
        try:
            a = ids.index(start_id, pos)
        except ValueError:
            return runs
        try:
            b = ids.index(end_id, a) + 1
        except ValueError:
            b = len(ids)
        runs.append((a, b))
        pos = b


def _pad_positions(ids: list[int], image_pad: int, video_pad: int) -> list[int]:
    """Positions of media pad tokens, in order (C-level scans; there are few)."""
    found = []
    for pad in (image_pad, video_pad):
        pos = 0
        for _ in range(ids.count(pad)):
            pos = ids.index(pad, pos) + 1
            found.append(pos - 1)
    return sorted(found)


def _measure(kind: str, path: Path, spec: VisionSpec) -> MediaItem:
    """Hash and measure one media file (called once per path per worker)."""
    try:
        if kind == "image":
            data = path.read_bytes()
            key = hashlib.sha256(data).hexdigest()
        else:
            with path.open("rb") as f:
                key = hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError as exc:
        raise MediaError("missing_media", f"{path}: no such file") from exc
    except OSError as exc:
        raise MediaError("missing_media", f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        if kind == "image":
            return _image_item(path, key, data, spec)
        return _video_item(path, key, spec)
    except MediaError as exc:
        raise MediaError(exc.reason, f"{path}: {exc.detail}") from exc
    except Exception as exc:  # decoders raise anything on hostile input; one file must not stop a worker
        raise MediaError("corrupt_media", f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc


def _image_item(path: Path, key: str, data: bytes, spec: VisionSpec) -> MediaItem:
    try:
        info = probe_image(data)
    except MediaError as exc:
        if exc.reason == "corrupt_media" and _looks_like_video(data[:16]):
            raise MediaError("media_type_mismatch", "a video file is used as an image") from exc
        raise
    g = image_grid(info, spec)
    return MediaItem(
        "image", path, key, g.height, g.width, g.grid_t, g.grid_h, g.grid_w, [], 0.0, spec.merge_size
    )


def _video_item(path: Path, key: str, spec: VisionSpec) -> MediaItem:
    with path.open("rb") as f:
        head = f.read(16)
    if not _looks_like_video(head) and _looks_like_image(head):
        raise MediaError("media_type_mismatch", "an image file is used as a video")
    info = probe_video(path)
    frames = sample_frame_indices(info.total_frames, info.fps, spec)
    g = video_grid(info, len(frames), spec)
    spg = second_per_grid(frames, info.total_frames, info.fps, spec)
    return MediaItem(
        "video", path, key, g.height, g.width, g.grid_t, g.grid_h, g.grid_w, frames, spg, spec.merge_size
    )


def _looks_like_video(head: bytes) -> bool:
    return (
        head[4:8] == b"ftyp"
        or (head[:4] == b"RIFF" and head[8:12] == b"AVI ")
        or head.startswith(_VIDEO_MAGIC)
    )


def _looks_like_image(head: bytes) -> bool:
    return head.startswith((b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM")) or head[8:12] == b"WEBP"


def truncate_sample(
    sample: TokenizedSample,
    max_length: int,
    *,
    vision_start_id: int = QWEN_VISION_START_ID,
    vision_end_id: int = QWEN_VISION_END_ID,
) -> TokenizedSample | None:
    """Cut the tail to `max_length` tokens, never inside a vision run; None if no trained token is left.

    A run that would be cut is dropped whole with its media item, so the media
    list always matches the vision runs kept.
    """
    if len(sample.input_ids) <= max_length:
        return sample
    runs = _runs(sample.input_ids, vision_start_id, vision_end_id)
    if len(runs) != len(sample.media):
        raise ValueError(
            f"sample {sample.sample_id}: {len(runs)} vision runs for {len(sample.media)} media items"
        )
    cut = next((a for a, b in runs if a < max_length < b), max_length)
    kept = sum(1 for a, _ in runs if a < cut)
    labels = sample.labels[:cut]
    if labels.count(IGNORE_INDEX) == len(labels):
        return None
    return TokenizedSample(
        sample.sample_id, sample.source, sample.index, sample.input_ids[:cut], labels, sample.media[:kept]
    )
