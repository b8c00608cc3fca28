"""Input records to one normalized conversation: roles, text and media references in order.

Three layouts are accepted (auto-detected per record, or forced by
`source.format`): ShareGPT/LLaVA `conversations: [{from, value}]`, role/content
`messages` with string content and `<image>`/`<video>` placeholders, and
`messages` whose content is a list of typed parts. Media come from the
placeholders, filled in order from the record's media lists, or from the typed
parts themselves.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from packtrain.core import record_json
from packtrain.core.config import FieldMap
from packtrain.core.contract import RejectReason
from packtrain.core.families import Family


class SampleError(Exception):
    """Why one record cannot become a sample; `reason` is a stable reject code."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class MediaRef:
    kind: str  # "image" | "video"
    ref: str  # path as written in the record


@dataclass
class Turn:
    role: str  # "system" | "user" | "assistant"
    parts: list[str | MediaRef] = field(default_factory=list)
    reasoning: str | None = (
        None  # an assistant turn's `reasoning_content` (the template decides its rendering)
    )

    @property
    def has_media(self) -> bool:
        return any(isinstance(p, MediaRef) for p in self.parts)

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))


_TYPED_IMAGE = ("image", "image_url")
_TYPED_MEDIA_KEYS = ("image", "video", "image_url", "video_url", "url", "path", "value")
_AUDIO_TYPES = ("audio", "input_audio", "audio_url")


def detect_format(record: dict[str, Any], fm: FieldMap) -> str:
    """sharegpt when the ShareGPT column exists, else typed when any content is a list, else messages."""
    if isinstance(record.get(fm.conversations), list):
        return "sharegpt"
    turns = record.get(fm.messages)
    if isinstance(turns, list):
        if any(isinstance(t, dict) and isinstance(t.get("content"), list) for t in turns):
            return "typed"
        return "messages"
    raise SampleError(
        RejectReason.MALFORMED_RECORD,
        f"record has neither a {fm.conversations!r} nor a {fm.messages!r} list of turns",
    )


class ConversationParser:
    """Parses records of one source; the placeholder pattern is compiled once."""

    def __init__(self, fmt: str, fm: FieldMap, family: Family) -> None:
        self.fmt = fmt
        self.fm = fm
        self.family = family
        self.placeholders = {fm.image_placeholder: "image", fm.video_placeholder: "video"}
        self.splitter = re.compile(
            "|".join(re.escape(p) for p in sorted(self.placeholders, key=len, reverse=True))
        )
        self.roles = {
            name: role
            for role, names in (
                ("observation", fm.observation_roles),
                ("function_call", fm.function_call_roles),
                ("system", fm.system_roles),
                ("assistant", fm.assistant_roles),
                ("user", fm.user_roles),
            )
            for name in names
        }

    def parse(self, record: dict[str, Any]) -> list[Turn]:
        """The record as turns with media references; raises SampleError with a reject code."""
        fm = self.fm
        fmt = detect_format(record, fm) if self.fmt == "auto" else self.fmt
        column = fm.conversations if fmt == "sharegpt" else fm.messages
        raw_turns = record.get(column)
        if not isinstance(raw_turns, list):
            raise SampleError(
                RejectReason.MALFORMED_RECORD, f"format {fmt}: {column!r} is missing or not a list"
            )
        _refuse_audio(record, fm)
        role_key, content_key = (fm.role_key, fm.content_key) if fmt == "sharegpt" else ("role", "content")
        media = _MediaPool(
            _media_list(record, fm.images, "image"), _media_list(record, fm.videos, "video"), fm
        )
        turns: list[Turn] = []
        observed = False  # the previous turn was a tool result
        for i, raw in enumerate(raw_turns):
            if not isinstance(raw, dict):
                raise SampleError(
                    RejectReason.MALFORMED_RECORD, f"turn {i} is a {type(raw).__name__}, not an object"
                )
            role_name = raw.get(role_key, raw.get("role", raw.get("from")))
            role = self.roles.get(role_name) if isinstance(role_name, str) else None
            if role is None:
                raise SampleError(
                    RejectReason.MALFORMED_RECORD,
                    f"turn {i}: unknown role {role_name!r} (known: {', '.join(self.roles)})",
                )
            content = raw.get(content_key, raw.get("content", raw.get("value")))
            if isinstance(content, str):
                parts = self._split(content, media)
            elif isinstance(content, list):
                parts = self._typed_parts(content, i, media)
            elif content is None:
                parts = []
            else:
                raise SampleError(
                    RejectReason.MALFORMED_RECORD, f"turn {i}: content is a {type(content).__name__}"
                )
            reasoning = (
                _reasoning(raw, fm.reasoning_key, i) if role in ("assistant", "function_call") else None
            )
            if role in ("function_call", "observation"):
                self._tool_turn(turns, role, parts, reasoning, i, observed)
            else:
                turns.append(Turn(role, parts, reasoning))
            observed = role == "observation"
        media.check_all_used()
        _check_media_roles(turns)
        return _with_system(turns, record, fm, self.family)

    def _tool_turn(
        self,
        turns: list[Turn],
        role: str,
        parts: list[str | MediaRef],
        reasoning: str | None,
        i: int,
        observed: bool,
    ) -> None:
        """A function call as an assistant turn, a tool result as a user turn. With the xml tool style
        consecutive results share one user turn, as Qwen3.5's template renders a run of tool messages."""
        if any(isinstance(p, MediaRef) for p in parts):
            raise SampleError(RejectReason.MALFORMED_RECORD, f"turn {i}: media in a {role} turn")
        text = "".join(p for p in parts if isinstance(p, str))
        if role == "function_call":
            try:
                call = self.family.tool_call_text(text)
            except record_json.RecordJSONError as exc:
                raise SampleError(exc.reason, f"turn {i}: {exc.detail}") from exc
            except ValueError as exc:
                raise SampleError(RejectReason.MALFORMED_RECORD, f"turn {i}: {exc}") from exc
            turns.append(Turn("assistant", [call], reasoning))
        elif observed and self.family.tool_style == "xml":
            turns[-1].parts.append("\n" + self.family.observation_text(text))
        else:
            turns.append(Turn("user", [self.family.observation_text(text)]))

    def _split(self, text: str, media: _MediaPool) -> list[str | MediaRef]:
        if not any(p in text for p in self.placeholders):
            return [text] if text else []
        parts: list[str | MediaRef] = []
        pos = 0
        for m in self.splitter.finditer(text):
            if m.start() > pos:
                parts.append(text[pos : m.start()])
            parts.append(media.take(self.placeholders[m.group()], None))
            pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    def _typed_parts(self, content: list[Any], i: int, media: _MediaPool) -> list[str | MediaRef]:
        parts: list[str | MediaRef] = []
        for part in content:
            if isinstance(part, str):
                parts.extend(self._split(part, media))
                continue
            if not isinstance(part, dict):
                raise SampleError(
                    RejectReason.MALFORMED_RECORD, f"turn {i}: content part is a {type(part).__name__}"
                )
            kind = part.get("type")
            if kind in _AUDIO_TYPES or "audio" in part:
                raise SampleError(
                    RejectReason.UNSUPPORTED_MEDIA,
                    f"turn {i}: audio parts are not supported by Qwen2-VL models",
                )
            if kind == "text" or (kind is None and "text" in part):
                text = part.get("text", part.get("value", ""))
                if not isinstance(text, str):
                    raise SampleError(RejectReason.MALFORMED_RECORD, f"turn {i}: text part without a string")
                parts.extend(self._split(text, media))
            elif (
                kind in _TYPED_IMAGE
                or kind == "video"
                or (kind is None and ("image" in part or "video" in part))
            ):
                media_kind = "video" if kind == "video" or (kind is None and "video" in part) else "image"
                parts.append(media.take(media_kind, _part_path(part, i)))
            else:
                raise SampleError(
                    RejectReason.MALFORMED_RECORD, f"turn {i}: unknown content part type {kind!r}"
                )
        return parts


class _MediaPool:
    """The record's media lists, consumed in order by placeholders and path-less typed parts."""

    def __init__(self, images: list[str], videos: list[str], fm: FieldMap) -> None:
        self.pools = {"image": images, "video": videos}
        self.columns = {"image": fm.images, "video": fm.videos}
        self.used = {"image": 0, "video": 0}

    def take(self, kind: str, explicit: str | None) -> MediaRef:
        if explicit is not None:
            return MediaRef(kind, explicit)
        pool, used = self.pools[kind], self.used[kind]
        if used >= len(pool):
            raise SampleError(
                RejectReason.PLACEHOLDER_MISMATCH,
                f"more {kind} placeholders than paths in {self.columns[kind]!r} ({len(pool)})",
            )
        self.used[kind] = used + 1
        return MediaRef(kind, pool[used])

    def check_all_used(self) -> None:
        for kind, pool in self.pools.items():
            if self.used[kind] != len(pool):
                raise SampleError(
                    RejectReason.PLACEHOLDER_MISMATCH,
                    f"{len(pool)} path(s) in {self.columns[kind]!r} but {self.used[kind]} {kind} "
                    "placeholder(s) in the turns",
                )


def _reasoning(raw: dict[str, Any], key: str, i: int) -> str | None:
    """An assistant turn's reasoning text (`source.fieldMap.reasoningKey`), or None when it has none."""
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise SampleError(
            RejectReason.MALFORMED_RECORD, f"turn {i}: {key!r} is a {type(value).__name__}, not a string"
        )
    return value


def _part_path(part: dict[str, Any], i: int) -> str | None:
    for key in _TYPED_MEDIA_KEYS:
        value = part.get(key)
        if isinstance(value, dict):
            value = value.get("url", value.get("path"))
        if isinstance(value, str) and value:
            return value
        if value is not None and not isinstance(value, str):
            raise SampleError(
                RejectReason.MALFORMED_RECORD, f"turn {i}: media part {key!r} is not a path string"
            )
    return None


def _media_list(record: dict[str, Any], column: str, kind: str) -> list[str]:
    """The record's list of `kind` media: `column` (list or single string), else a singular
    `image`/`video`."""
    value = record.get(column)
    if value is None:
        value = record.get(kind)
    if value is None or value == "":
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) and v for v in items):
        raise SampleError(RejectReason.MALFORMED_RECORD, f"{column!r} must be a path or a list of paths")
    return items


def _refuse_audio(record: dict[str, Any], fm: FieldMap) -> None:
    if record.get(fm.audios):
        raise SampleError(
            RejectReason.UNSUPPORTED_MEDIA,
            f"record has {fm.audios!r}: audio input is not supported by the Qwen-VL families",
        )


def _check_media_roles(turns: list[Turn]) -> None:
    for i, turn in enumerate(turns):
        if turn.role == "assistant" and turn.has_media:
            raise SampleError(
                RejectReason.MALFORMED_RECORD, f"turn {i}: media in an assistant turn cannot be trained on"
            )


def _with_system(turns: list[Turn], record: dict[str, Any], fm: FieldMap, family: Family) -> list[Turn]:
    """Add the record's `system` and `tools` columns to the first turn (tools live in the system prompt)."""
    system = record.get(fm.system)
    tools = _tools(record.get(fm.tools))
    if turns and turns[0].role == "system":
        head, rest = turns[0], turns[1:]
        system_text: str | None = head.text
        if head.has_media:
            raise SampleError(RejectReason.MALFORMED_RECORD, "media in the system turn are not supported")
    else:
        rest = turns
        system_text = system if isinstance(system, str) and system else None
    if tools:
        system_text = family.system_with_tools(system_text, tools)
    return ([Turn("system", [system_text])] if system_text is not None else []) + rest


def _tools(value: Any) -> list[Any]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = record_json.loads(value, "tools")
        except record_json.RecordJSONError as exc:
            raise SampleError(exc.reason, exc.detail) from exc
        except json.JSONDecodeError as exc:
            raise SampleError(RejectReason.MALFORMED_RECORD, f"tools: not valid JSON ({exc})") from exc
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list):
        raise SampleError(
            RejectReason.MALFORMED_RECORD, f"tools: expected a list, got {type(value).__name__}"
        )
    return value
