"""Model-family registry: what differs between VLM families at packing time.

A family names its tokenizer class, chat-template markers, vision special
tokens and how tool calls are written. Adding a family (InternVL,
LLaVA-OneVision, ...) means adding a `Family` entry here and, if its vision
tokens are not one pad run per media item, a grid rule in `vision.py`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .config import ModelConfig
from .records import ConfigError
from .vision import VisionSpec

QWEN_TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)
QWEN_DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class Family:
    """Static description of a model family."""

    name: str
    tokenizer_class: str  # dotted path; imported directly because AutoTokenizer pulls in torch
    assistant_header: str  # rendered text that opens an assistant turn
    turn_end: str  # rendered text that closes a turn (trained on for assistant turns)
    vision_start: str
    vision_end: str
    image_pad: str
    video_pad: str
    default_system: str
    reserved_tokens: tuple[
        str, ...
    ]  # turn/vision structure; grounding tokens like <|box_start|> stay allowed

    def tool_call_text(self, value: str) -> str:
        """An assistant function-call turn, as the family's text template writes it."""
        return f"<tool_call>\n{value}\n</tool_call>"

    def observation_text(self, value: str) -> str:
        """A tool result; it becomes a user turn (the VL templates have no tool role)."""
        return f"<tool_response>\n{value}\n</tool_response>"

    def system_with_tools(self, system: str | None, tools: list[Any]) -> str:
        """The system prompt carrying tool signatures, as Qwen2.5's text template renders `tools`."""
        lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        return (system or self.default_system) + QWEN_TOOLS_INTRO + lines + QWEN_TOOLS_OUTRO


_QWEN = {
    "tokenizer_class": "transformers.models.qwen2.tokenization_qwen2.Qwen2Tokenizer",
    "assistant_header": "<|im_start|>assistant\n",
    "turn_end": "<|im_end|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image_pad": "<|image_pad|>",
    "video_pad": "<|video_pad|>",
    "default_system": QWEN_DEFAULT_SYSTEM,
    "reserved_tokens": ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_pad|>"),
}

FAMILIES: dict[str, Family] = {
    "qwen2-vl": Family(name="qwen2-vl", **_QWEN),
    "qwen2.5-vl": Family(name="qwen2.5-vl", **_QWEN),
}


@dataclass(frozen=True)
class LoadedModel:
    """A family bound to a model folder: tokenizer, template, vision settings and token ids."""

    family: Family
    tokenizer: Any
    chat_template: str
    vision: VisionSpec
    vision_start_id: int
    vision_end_id: int
    image_pad_id: int
    video_pad_id: int
    reserved_tokens: frozenset[str]  # structural tokens a record's text must not contain
    render: Callable[[list[dict[str, Any]]], str]  # messages -> chat-template text


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _read_template(path: Path, key: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{key}: {path} is not a readable UTF-8 Jinja chat template ({exc}); point it at one"
        ) from exc


def _chat_template(folder: Path, override: str | None, tokenizer: Any) -> str:
    """Custom file, else the folder's `chat_template.json` (the VL one), else the tokenizer's own."""
    if override:
        path = Path(override)
        if not path.is_file():
            raise ConfigError(f"model.chatTemplate: {override} is not a file")
        return _read_template(path, "model.chatTemplate")
    for name in ("chat_template.jinja", "chat_template.json"):
        path = folder / name
        if path.is_file():
            if name.endswith(".jinja"):
                return _read_template(path, "model.path")
            template = _read_json(path).get("chat_template")
            if isinstance(template, str):
                return template
    if isinstance(tokenizer.chat_template, str):
        return tokenizer.chat_template
    raise ConfigError(f"{folder}: no chat template (chat_template.json or tokenizer_config.json)")


def _pixels(config: dict[str, Any], key: str, size_key: str) -> int | None:
    value = config.get(key)
    if value is None and isinstance(config.get("size"), dict):
        value = config["size"].get(size_key, config["size"].get(key))
    return int(value) if value is not None else None


def vision_spec(folder: Path, cfg: ModelConfig) -> VisionSpec:
    """Vision settings: explicit config first, then the folder's processor configs, then HF defaults.

    Videos use `video_preprocessor_config.json` when present and otherwise the
    image processor's bounds, as `AutoProcessor` does for these folders.
    """
    pre_path = folder / "preprocessor_config.json"
    pre = _read_json(pre_path) if pre_path.is_file() else {}
    vid_path = folder / "video_preprocessor_config.json"
    vid = _read_json(vid_path) if vid_path.is_file() else pre
    model_path = folder / "config.json"
    vision_config = (_read_json(model_path) if model_path.is_file() else {}).get("vision_config") or {}
    base = VisionSpec()
    min_px = cfg.min_pixels or _pixels(pre, "min_pixels", "shortest_edge") or base.min_pixels
    max_px = cfg.max_pixels or _pixels(pre, "max_pixels", "longest_edge") or base.max_pixels
    return replace(
        base,
        patch_size=int(pre.get("patch_size", base.patch_size)),
        merge_size=int(pre.get("merge_size", base.merge_size)),
        temporal_patch_size=int(pre.get("temporal_patch_size", base.temporal_patch_size)),
        min_pixels=min_px,
        max_pixels=max_px,
        video_min_pixels=cfg.video_min_pixels or _pixels(vid, "min_pixels", "shortest_edge") or min_px,
        video_max_pixels=cfg.video_max_pixels or _pixels(vid, "max_pixels", "longest_edge") or max_px,
        fps=cfg.fps,
        min_frames=cfg.min_frames,
        max_frames=cfg.max_frames,
        tokens_per_second=vision_config.get("tokens_per_second"),
    )


def _import(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _renderer(tokenizer: Any, template: str) -> Callable[[list[dict[str, Any]]], str]:
    """Render with the template compiled once in HF's own Jinja environment (same filters and globals).

    This skips `apply_chat_template`'s per-call copying of the messages, which
    costs as much as the rendering; where the private compile helper is missing,
    the public method is used.
    """
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        _compile_jinja_template = None
    if _compile_jinja_template is None:
        return lambda messages: tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False
        )
    try:
        compiled = _compile_jinja_template(template)
    except Exception as exc:  # jinja2.TemplateSyntaxError and whatever a hostile template's parse raises
        line = getattr(exc, "lineno", None)
        raise ConfigError(
            f"chat template does not compile{f' (line {line})' if line else ''}: {exc}. "
            "Fix model.chatTemplate (or the model folder's template)."
        ) from exc
    context = dict(tokenizer.special_tokens_map)

    def render(messages: list[dict[str, Any]]) -> str:
        return compiled.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=False, **context
        )

    return render


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load the tokenizer and template once per worker; ConfigError says what is wrong with the folder."""
    family = FAMILIES.get(cfg.family)
    if family is None:
        raise ConfigError(f"model.family {cfg.family!r} is not one of {sorted(FAMILIES)}")
    folder = Path(cfg.path)
    if not folder.is_dir():
        raise ConfigError(f"model.path: {folder} is not a folder")
    try:
        tokenizer = _import(family.tokenizer_class).from_pretrained(str(folder))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model.path: cannot load a {cfg.family} tokenizer from {folder} ({exc})") from exc
    template = _chat_template(folder, cfg.chat_template, tokenizer)
    ids = {}
    for token in (
        family.vision_start,
        family.vision_end,
        family.image_pad,
        family.video_pad,
        family.turn_end,
    ):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ConfigError(f"{folder}: tokenizer lacks the {cfg.family} special token {token}")
        ids[token] = token_id
    reserved = frozenset(family.reserved_tokens) | frozenset(ids)
    return LoadedModel(
        family=family,
        tokenizer=tokenizer,
        chat_template=template,
        vision=vision_spec(folder, cfg),
        vision_start_id=ids[family.vision_start],
        vision_end_id=ids[family.vision_end],
        image_pad_id=ids[family.image_pad],
        video_pad_id=ids[family.video_pad],
        reserved_tokens=reserved,
        render=_renderer(tokenizer, template),
    )
