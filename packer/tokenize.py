"""One input record to one tokenized sample (input ids, labels, media measurements) or one reject.

The text is rendered with the model's own chat template and tokenized once (a
long text piece by piece, and only until it is over maxLength: `long_text`),
with a single pad token per media item; the pads are then expanded to the
exact vision-token count. Added tokens are split before the text is
pre-tokenized, so this equals tokenizing the expanded text, as the HF
processor does, at a fraction of the cost.

Label policy: an assistant turn is trained on from the first token after
`<|im_start|>assistant\\n` through its closing `<|im_end|>` (the end token is
learned, so the model stops). By default the newline after `<|im_end|>` is not
trained: it belongs to the next prompt, and a model that stops at `<|im_end|>`
never generates it. Trainers differ here: ms-swift 4.6 also trains that newline
(measured: identical input ids, about 2% more label tokens on a chat mix), and
LLaMA-Factory's Qwen templates put it in the assistant slot
(`{{content}}<|im_end|>\\n`) too. `packing.labelNewlineAfterTurnEnd: true`
trains it, to match them. A turn is trained as the template renders it: where a
thinking template (Qwen3.5) opens it with a `<think>` block, reasoning or empty,
that block is trained with the answer. Function-call turns are assistant turns; tool results
are user turns. `label_mode: all` trains on every token except vision tokens
(a Qwen3-VL video's frame timestamps included).

Qwen3-VL videos: the template's `<|vision_start|><|video_pad|><|vision_end|>` becomes one
`<{t:.1f} seconds><|vision_start|>` + pads + `<|vision_end|>` block per temporal
group, with no outer pair, as `Qwen3VLProcessor` renders it; the timestamps are tokenized
alone (added tokens split the text around them, so this equals tokenizing the whole).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packtrain.core.config import ModelConfig, PackingConfig, SourceConfig
from packtrain.core.contract import RejectReason
from packtrain.core.errors import ConfigError, MediaError
from packtrain.core.model_spec import LoadedModel, load_model
from packtrain.core.pack.schema import IGNORE_INDEX
from packtrain.core.vision import frame_timestamps
from packtrain.packer.long_text import PieceEncoder
from packtrain.packer.media.access import MediaAccess, MediaItem
from packtrain.packer.sources.conversation import ConversationParser, MediaRef, SampleError, Turn
from packtrain.packer.sources.raw import RawRecord

# Normalizers that shrink text at most 3-fold (canonical or compatibility (de)composition: Hangul jamo
# compose 9 bytes into 3); a margin of 4 keeps the cheap overlong bound sound under them.
_BOUNDED_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
_NORMALIZER_SHRINK = 4
_DETAIL_CHARS = 300
# The block a thinking template (Qwen3.5's reads `reasoning_content`) wraps an assistant turn's
# reasoning in: inside the reasoning, either tag would end the block early or open another.
_THINK_TAGS = frozenset({"<think>", "</think>"})


@dataclass
class TokenizedSample:
    sample_id: str
    source: str  # dataset file name (see `records.source_names`)
    index: int
    input_ids: list[int]
    labels: list[int]
    media: list[MediaItem]
    # False: the text was tokenized only until it was over maxLength (`long_text`); the ids are exactly
    # the first ones of the whole sample's, with the media they hold.
    complete: bool = True


@dataclass
class Reject:
    source: str
    index: int
    sample_id: str | None
    reason: str  # a RejectReason (a raw record's reason is a plain str of one)
    detail: str  # human message
    media_path: str | None = None  # a media file named as missing or unreadable (see MediaError.path)


class SampleTokenizer:
    """Tokenizes records of one source for one model; holds the tokenizer and a media cache per worker."""

    def __init__(
        self,
        source: SourceConfig,
        model: ModelConfig,
        packing: PackingConfig,
        *,
        base_dir: Path | None = None,
        embedded_dir: Path | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        """`loaded`: the model already loaded for these settings (another source of the same job)."""
        self.source = source
        self.packing = packing
        self.model: LoadedModel = loaded or load_model(model)
        self._backend = self.model.tokenizer.backend_tokenizer
        self._encode = _fast_encoder(self._backend)
        m = self.model.ids
        self.pieces = PieceEncoder(self._backend, self._encode, (m.vision_start, m.vision_end))
        thinking = "reasoning_content" in self.model.chat_template
        self._reasoning_reserved = self.model.reserved_tokens | (_THINK_TAGS if thinking else frozenset())
        self._media = MediaAccess(source, self.model.vision, base_dir=base_dir, embedded_dir=embedded_dir)
        self._parser = ConversationParser(source.format, source.field_map, self.model.family)
        self._newline_id = self._single_id("\n") if packing.label_newline_after_turn_end else None
        self._header_ids, self._end_id = self._assistant_markers()
        self._timestamp_ids: dict[str, list[int]] = {}
        self._max_chars = self._fitting_chars()

    def __call__(self, raw: RawRecord) -> TokenizedSample | Reject:
        """One sample or one reject; no record, however hostile, raises (except a ConfigError)."""
        name = raw.source_name
        if raw.record is None:
            return Reject(
                name,
                raw.index,
                None,
                raw.reason or RejectReason.MALFORMED_RECORD,
                raw.error or "unreadable record",
            )
        sample_id: str | None = None
        try:
            sample_id = self._sample_id(raw)
            turns = self._parser.parse(raw.record)
            self._check_turns(turns)
            self._check_media_kinds(turns)
            text = self._render_checked(turns)
            media = [
                self._media.item(ref, raw.source.parent)
                for t in turns
                for ref in t.parts
                if isinstance(ref, MediaRef)
            ]
            input_ids, labels, media, complete = self._tokenize(text, media)
        except (SampleError, MediaError) as exc:
            return Reject(name, raw.index, sample_id, exc.reason, exc.detail, getattr(exc, "path", None))
        except ConfigError:
            raise
        except Exception as exc:  # one bad record is one reject (RecursionError, MemoryError, a decoder bug)
            detail = f"{type(exc).__name__}: {exc}"[:_DETAIL_CHARS]
            return Reject(name, raw.index, sample_id, RejectReason.INTERNAL_ERROR, detail)
        return TokenizedSample(sample_id, name, raw.index, input_ids, labels, media, complete)

    def truncate(self, sample: TokenizedSample, max_length: int) -> TokenizedSample | None:
        """`truncate_sample` over this sample's media spans."""
        return truncate_sample(sample, max_length, self.media_spans(sample))

    def media_spans(self, sample: TokenizedSample) -> list[tuple[int, int]]:
        """The token span of each media item: its vision run, a timestamped video's groups with
        their timestamps (one run per temporal group), or a tiled family's video frames from the
        first frame's run through the last's (the first `Frame1: ` stays with the text before it)."""
        m = self.model.ids
        runs = _runs(sample.input_ids, m.vision_start, m.vision_end)
        spans: list[tuple[int, int]] = []
        k = 0
        tiled = self.model.family.tiling is not None
        for item in sample.media:
            grouped = (self.model.family.video_timestamps or tiled) and item.kind == "video"
            count = item.grid_t if grouped else 1
            if k + count > len(runs):
                break
            end = runs[k + count - 1][1]
            stamped = grouped and not tiled
            spans.append((end - len(self._video_block(item)) if stamped else runs[k][0], end))
            k += count
        if len(spans) != len(sample.media) or k != len(runs):
            raise ValueError(
                f"sample {sample.sample_id}: {len(runs)} vision runs for {len(sample.media)} media items"
            )
        return spans

    def render(self, turns: list[Turn]) -> str:
        """The chat-template text of a conversation, one pad token per media item; an assistant turn's
        reasoning goes in as `reasoning_content` (only where the record gives one)."""
        return self.model.render([_template_message(t) for t in turns])

    def _sample_id(self, raw: RawRecord) -> str:
        value = raw.record.get(self.source.field_map.id) if raw.record else None
        if value is None or value == "" or isinstance(value, dict | list):
            return f"{raw.source_name}:{raw.index}"
        return str(value)

    def _check_turns(self, turns: list[Turn]) -> None:
        """A reject for a conversation with nothing to train on, or with a reserved token in any text
        the template renders: every string of its messages (content, reasoning, function calls, tool
        results, the system prompt with the tool definitions), and a think tag in reasoning that a
        thinking template wraps in its block."""
        if not turns:
            raise SampleError(RejectReason.EMPTY_CONVERSATION, "the conversation has no turns")
        if self.packing.label_mode != "all" and not any(t.role == "assistant" for t in turns):
            raise SampleError(
                RejectReason.EMPTY_CONVERSATION, "the conversation has no assistant turn to train on"
            )
        reserved = self.model.reserved_tokens
        for i, turn in enumerate(turns):
            for field, text in _template_texts(_template_message(turn)):
                if "<" not in text:
                    continue
                tokens = self._reasoning_reserved if field == "reasoning_content" else reserved
                found = sorted(tok for tok in tokens if tok in text)
                if found:
                    raise SampleError(
                        RejectReason.RESERVED_TOKEN,
                        f"turn {i} ({turn.role}) {field} contains the reserved token(s) {', '.join(found)}; "
                        "they would corrupt the turn, thinking or vision structure",
                    )

    def _check_media_kinds(self, turns: list[Turn]) -> None:
        """A reject for a video where the family's model takes none, before any media is read."""
        family = self.model.family
        if family.videos or not any(
            isinstance(p, MediaRef) and p.kind == "video" for t in turns for p in t.parts
        ):
            return
        raise SampleError(
            RejectReason.UNSUPPORTED_MEDIA,
            f"{family.name} takes images only: its model has no video path (upstream's code refuses the "
            "processor's video inputs); drop the video, or pack it for another family",
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
        end_id = self.model.ids.turn_end
        ids = self._encode(text)
        got = self.model.tokenizer.decode(
            [t for a, b in _assistant_spans(ids, header_ids, end_id, self._newline_id) for t in ids[a:b]]
        )
        after = "\n" if self._newline_id is not None else ""
        # The rendered assistant turns (a template may open one with more than the answer, such as
        # Qwen3.5's `<think>` block after the last user turn), each ending with its answer.
        turns = [t.split(family.turn_end, 1)[0] for t in text.split(header)[1:]]
        want = "".join(t + family.turn_end + after for t in turns)
        if not header.endswith("\n") or len(turns) != 2 or got != want or not _answers(turns, "b", "d"):
            raise ConfigError(
                f"chat template does not mark assistant turns with {header!r} ... {family.turn_end!r} "
                f"(trained text of a probe: {got!r}, expected {want!r}); labels cannot be placed"
            )
        return header_ids, end_id

    def _single_id(self, text: str) -> int:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ConfigError(f"the tokenizer splits {text!r} into {len(ids)} tokens; expected one")
        return ids[0]

    def _media_tokens(self, ids: list[int], p: int, item: MediaItem) -> tuple[int, int, list[int]]:
        """The span `ids[a:b]` a media item's pad at `p` replaces, and its tokens.

        A timestamped video brings a vision start/end pair per temporal group, so the template's
        outer pair around its pad goes with the pad, as the family's processor writes it
        (`Qwen3VLProcessor`: Qwen's release and transformers >= 5.25; see `core/layout.py`).
        A tiled family's pad (an image, or one video frame: `_frame_pads`) becomes `<img>`, its
        context tokens and `</img>`, as `InternVLProcessor` writes it.
        """
        m = self.model.ids
        if self.model.family.tiling is not None:
            per = item.num_tokens if item.kind == "image" else item.grid_h * item.grid_w // item.merge_size**2
            return p, p + 1, [m.vision_start, *[m.image_pad] * per, m.vision_end]
        if not (self.model.family.video_timestamps and item.kind == "video"):
            return p, p + 1, [ids[p]] * item.num_tokens
        wrapped = 0 < p < len(ids) - 1 and ids[p - 1] == m.vision_start and ids[p + 1] == m.vision_end
        return p - wrapped, p + 1 + wrapped, self._video_block(item)

    def _video_block(self, item: MediaItem) -> list[int]:
        """A Qwen3-VL video's tokens in place of its pad: per temporal group a timestamp and a vision run."""
        m = self.model.ids
        per_group = item.grid_h * item.grid_w // item.merge_size**2
        stamps = frame_timestamps(item.frames, item.video_fps, self.model.vision.temporal_patch_size)
        if len(stamps) != item.grid_t:
            raise SampleError(
                RejectReason.CORRUPT_MEDIA,
                f"video has {item.grid_t} temporal groups but {len(stamps)} timestamps",
            )
        block: list[int] = []
        for t in stamps:
            text = f"<{t:.1f} seconds>"
            ts = self._timestamp_ids.get(text)
            if ts is None:
                ts = self._timestamp_ids[text] = self._backend.encode(text, add_special_tokens=False).ids
            block += ts
            block.append(m.vision_start)
            block += [m.video_pad] * per_group
            block.append(m.vision_end)
        return block

    def _fitting_chars(self) -> int | None:
        """Most characters a rendered text may have and still fit `maxLength`, or None (no sound bound).

        Every token covers at most `longest` bytes of normalized UTF-8 and a character
        is at least one byte, so a text of n characters has at least
        n / (longest * shrink) tokens, where `shrink` bounds how much the normalizer
        can shorten text. Tokens that strip neighbouring whitespace cover unbounded
        text, and other normalizers may drop characters: no bound then. Only
        `overlong: drop` uses it, to reject such a text without tokenizing any of it;
        `truncate` needs its first maxLength tokens and `error` a count, which
        `long_text` gives by tokenizing only until the text is over maxLength.
        """
        if self.packing.overlong != "drop":
            return None
        backend = self._backend
        normalizer = backend.normalizer
        kinds = (
            [type(n).__name__ for n in getattr(normalizer, "normalizers", [normalizer])] if normalizer else []
        )
        added = backend.get_added_tokens_decoder().values()
        if any(k not in _BOUNDED_NORMALIZERS for k in kinds) or any(t.lstrip or t.rstrip for t in added):
            return None
        longest = max(
            max(len(tok.encode("utf-8")) for tok in backend.get_vocab(with_added_tokens=False)),
            max((len(t.content.encode("utf-8")) for t in added), default=1),
        )
        return self.packing.max_length * longest * (_NORMALIZER_SHRINK if kinds else 1)

    def _render_checked(self, turns: list[Turn]) -> str:
        """The template text; an `overlong` reject, before any tokenizing or media work, if it cannot fit."""
        try:
            text = self.render(turns)
        except Exception as exc:  # Jinja raises arbitrary errors (raise_exception in templates)
            raise SampleError(RejectReason.TEMPLATE_ERROR, f"chat template failed: {exc}") from exc
        if self._max_chars is not None and len(text) > self._max_chars:
            raise SampleError(
                RejectReason.OVERLONG,
                f"text of {len(text)} characters cannot fit maxLength {self.packing.max_length} "
                f"(more than {self._max_chars} characters are more than {self.packing.max_length} tokens); "
                "not tokenized",
            )
        return text

    def _tokenize(
        self, text: str, media: list[MediaItem]
    ) -> tuple[list[int], list[int], list[MediaItem], bool]:
        """Ids and labels with pads expanded, the media they hold, and whether they are complete (a
        long text is tokenized only until it is over maxLength: `long_text`). Plain list operations
        (slices share int objects), since per-token Python or numpy work would cost as much as the
        tokenizer itself."""
        tiled = self.model.family.tiling is not None
        owners = list(range(len(media)))
        if tiled:
            text, owners = self._frame_pads(text, media)
        ids, complete = self.pieces(text, self.packing.max_length)
        labels, trained = self._labels(ids, text, complete)
        if trained == 0 and complete:  # a prefix without labels: truncation finds none, the rest is over
            raise SampleError(RejectReason.EMPTY_CONVERSATION, "no token is left to train on")
        pads, per_pad = self._pads(ids, text, [media[k] for k in owners], complete)
        if tiled:
            ids, labels, pads, per_pad, media = _whole_videos(ids, labels, pads, per_pad, owners, media)
        else:
            media = per_pad
        if not media:
            return ids, labels, media, complete
        out_ids: list[int] = []
        out_labels: list[int] = []
        prev = 0
        for p, item in zip(pads, per_pad, strict=True):
            a, b, block = self._media_tokens(ids, p, item)
            out_ids += ids[prev:a]
            out_labels += labels[prev:a]
            out_ids += block
            out_labels += [IGNORE_INDEX] * len(block)
            prev = b
        out_ids += ids[prev:]
        out_labels += labels[prev:]
        return out_ids, out_labels, media, complete

    def _frame_pads(self, text: str, media: list[MediaItem]) -> tuple[str, list[int]]:
        """A tiled family's text with each video pad written as the processor writes the video, one
        pad per frame in place of each frame's vision run (`Frame1: <video>` `\n` `Frame2: <video>`…),
        and the index in `media` of each pad's item, in order.

        `InternVLProcessor` tokenizes the text with every video expanded, so the text glued before a
        video tokenizes with `Frame1: ` (`WatchFrame1: ` is one pre-token `WatchFrame`). A pad and
        the `<img>`/`</img>` it becomes are all added tokens, which split the text: every text piece
        between them is the processor's own, so these ids with each pad expanded are its ids.
        """
        tiling = self.model.family.tiling
        assert tiling is not None
        pad = self.model.family.video_pad
        pieces = text.split(pad)
        videos = [x for x in media if x.kind == "video"]
        if len(pieces) - 1 != len(videos):
            return text, list(range(len(media)))  # the pad count check in `_pads` rejects it
        out = [pieces[0]]
        for item, piece in zip(videos, pieces[1:], strict=True):
            frames = (tiling.frame_prefix.format(n=n + 1) + pad for n in range(item.grid_t))
            out += [tiling.frame_separator.join(frames), piece]
        owners = [
            k for k, item in enumerate(media) for _ in range(item.grid_t if item.kind == "video" else 1)
        ]
        return "".join(out), owners

    def _labels(self, ids: list[int], text: str, complete: bool) -> tuple[list[int], int]:
        """The labels of `ids` (the first ids of `text` when not `complete`) and how many are trained."""
        n = len(ids)
        mode = self.packing.label_mode
        if mode == "all":
            m = self.model.ids
            labels = list(ids)
            for a, b in _runs(ids, m.vision_start, m.vision_end):
                labels[a:b] = [IGNORE_INDEX] * (b - a)
            return labels, n - labels.count(IGNORE_INDEX)
        spans = _assistant_spans(ids, self._header_ids, self._end_id, self._newline_id)
        if mode == "last_assistant":
            # A prefix holds the text's last assistant turn only if it holds every assistant header.
            last = complete or len(spans) >= text.count(self.model.family.assistant_header)
            spans = spans[-1:] if last else []
        labels = [IGNORE_INDEX] * n
        for a, b in spans:
            labels[a:b] = ids[a:b]
        return labels, sum(b - a for a, b in spans)

    def _pads(
        self, ids: list[int], text: str, media: list[MediaItem], complete: bool
    ) -> tuple[list[int], list[MediaItem]]:
        """The positions of the media pads in `ids` and the media items they stand for: all of them,
        or those of a prefix (the text's own pads counted by kind, so every item still has its pad)."""
        m, family = self.model.ids, self.model.family
        pads = _pad_positions(ids, m.image_pad, m.video_pad)
        kinds = ["image" if ids[p] == m.image_pad else "video" for p in pads]
        want = [x.kind for x in media]
        if complete:
            found, fits = len(pads), kinds == want
        else:
            images, videos = text.count(family.image_pad), text.count(family.video_pad)
            found = images + videos
            fits = kinds == want[: len(kinds)] and (images, videos) == (
                want.count("image"),
                want.count("video"),
            )
        if not fits:
            raise SampleError(
                RejectReason.PLACEHOLDER_MISMATCH,
                f"the rendered text has {found} media pad token(s) for {len(media)} media item(s)",
            )
        return pads, media[: len(pads)]


def _whole_videos(
    ids: list[int],
    labels: list[int],
    pads: list[int],
    per_pad: list[MediaItem],
    owners: list[int],
    media: list[MediaItem],
) -> tuple[list[int], list[int], list[int], list[MediaItem], list[MediaItem]]:
    """A tiled family's pads with their items (`owners`: each pad's index in `media`), and the items
    they hold: a prefix (a long text tokenized only until it is over maxLength) that holds only some
    frames of its last video is cut before that video's first frame pad, so every item kept is whole
    (the cut is far past maxLength: the first frame pad alone became a whole vision run)."""
    held = owners[: len(pads)]
    if held and media[held[-1]].kind == "video" and held.count(held[-1]) < media[held[-1]].grid_t:
        first = held.index(held[-1])
        ids, labels = ids[: pads[first]], labels[: pads[first]]
        pads, per_pad, held = pads[:first], per_pad[:first], held[:first]
    return ids, labels, pads, per_pad, [media[k] for k in sorted(set(held))]


def _fast_encoder(backend: Any) -> Callable[[str], list[int]]:
    """Token ids of one text, as `tokenizer(text)` gives them.

    `encode_batch_fast` skips the character offsets (labels are placed on token
    ids, so they are not needed) and is about a fifth faster than `encode`.
    """
    if hasattr(backend, "encode_batch_fast"):
        return lambda text: backend.encode_batch_fast([text])[0].ids
    return lambda text: backend.encode(text).ids


def _answers(turns: list[str], *answers: str) -> bool:
    """Whether each rendered assistant turn ends with its answer."""
    return all(t.endswith(a) for t, a in zip(turns, answers, strict=True))


def _template_message(turn: Turn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": turn.role, "content": _template_content(turn)}
    if turn.reasoning is not None:
        message["reasoning_content"] = turn.reasoning
    return message


def _template_texts(value: Any, field: str = "") -> Iterator[tuple[str, str]]:
    """Every string of a template message, with the message field it is in: all the text a chat
    template can render (a turn's role and a content part's type are the packer's own words)."""
    if isinstance(value, str):
        yield field, value
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in ("role", "type"):
                yield from _template_texts(item, field or key)
    elif isinstance(value, list):
        for item in value:
            yield from _template_texts(item, field)


def _template_content(turn: Turn) -> str | list[dict[str, str]]:
    """String content for text turns (any template takes it), typed parts where media appear."""
    if not turn.has_media:
        return turn.text
    return [{"type": p.kind} if isinstance(p, MediaRef) else {"type": "text", "text": p} for p in turn.parts]


def _assistant_spans(
    ids: list[int], header: list[int], end_id: int, newline_id: int | None = None
) -> list[tuple[int, int]]:
    """Token spans trained on: from the token after each assistant header's newline through the next end
    token, and the newline token right after it when `newline_id` is given."""
    spans: list[tuple[int, int]] = []
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
        if newline_id is not None and stop < n and ids[stop] == newline_id:
            stop += 1
        spans.append((start, stop))
        pos = stop


def _runs(ids: list[int], start_id: int, end_id: int) -> list[tuple[int, int]]:
    """Spans from each outermost start token through its matching end token: one per image or video,
    one per temporal group of a timestamped (Qwen3-VL) video."""
    runs: list[tuple[int, int]] = []
    pos = 0
    n = len(ids)
    while True:
        try:
            a = ids.index(start_id, pos)
        except ValueError:
            return runs
        depth, b = 1, a + 1
        while depth and b < n:
            try:
                e = ids.index(end_id, b)
            except ValueError:
                b = n
                break
            try:
                nxt = ids.index(start_id, b, e)
            except ValueError:
                depth, b = depth - 1, e + 1
            else:
                depth, b = depth + 1, nxt + 1
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


def truncate_sample(
    sample: TokenizedSample, max_length: int, spans: list[tuple[int, int]]
) -> TokenizedSample | None:
    """Cut the tail to `max_length` tokens, never inside a media item's span; None if no trained token
    is left.

    A media item that would be cut is dropped whole, so the media list always matches the spans kept.
    """
    if len(sample.input_ids) <= max_length:
        return sample
    cut = next((a for a, b in spans if a < max_length < b), max_length)
    kept = sum(1 for a, _ in spans if a < cut)
    labels = sample.labels[:cut]
    if labels.count(IGNORE_INDEX) == len(labels):
        return None
    return TokenizedSample(
        sample.sample_id, sample.source, sample.index, sample.input_ids[:cut], labels, sample.media[:kept]
    )
