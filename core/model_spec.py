"""A model family bound to a model folder: token ids, vision settings, tokenizer and chat template.

The families themselves are the entries of `families.FAMILIES`. Here an
entry meets a model folder: `model_spec` reads the special-token ids from the
folder's tokenizer files (checked against `config.json`) and the processor
settings from its preprocessor configs, without importing transformers or
torch, so the trainer reads the same facts; `load_model` adds the tokenizer and
the chat template the packer renders with.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic.alias_generators import to_camel

from packtrain.core.chat_template import check_size as check_template_size
from packtrain.core.chat_template import compile_template as bounded_compile
from packtrain.core.chat_template import read_template
from packtrain.core.config import MAX_FRAMES_CEILING, MAX_PIXELS_CEILING, ModelConfig
from packtrain.core.errors import ConfigError, relative_note
from packtrain.core.families import FAMILIES, Family
from packtrain.core.model_folder import (
    IMAGE_PROCESSOR_FILE,
    TOKENIZER_FILES,
    VIDEO_PROCESSOR_FILE,
    ModelFolder,
    family_for_model_type,
    get_family,
)
from packtrain.core.model_folder import read_json as _read_json
from packtrain.core.model_size import VISION_LIMITS
from packtrain.core.vision import VisionSpec

__all__ = [
    "FAMILIES",
    "Family",
    "LoadedModel",
    "ModelFolder",
    "ModelSpec",
    "TokenIds",
    "detect_family",
    "pack_family",
    "family_for_model_type",
    "get_family",
    "load_model",
    "model_spec",
    "vision_spec",
]


def detect_family(folder: str | Path) -> Family:
    """The family of a model folder, from its config.json `model_type`."""
    return ModelFolder(folder).detected_family()


DEFAULT_FAMILY = "qwen2-vl"  # a pack's family when neither model.family nor a config.json names one


def pack_family(cfg: ModelConfig) -> Family:
    """A pack's family: model.family, else the one model.path's config.json names (`model_type`),
    else (a folder without config.json) qwen2-vl; ConfigError when model.family contradicts it."""
    folder = ModelFolder(cfg.path, family=cfg.family)
    if cfg.family is None and not folder.has_config:
        return FAMILIES[DEFAULT_FAMILY]
    return folder.family


@dataclass(frozen=True)
class TokenIds:
    """Ids of a family's special tokens in one model folder's vocabulary."""

    im_start: int
    turn_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int
    pad: int


@dataclass(frozen=True)
class ModelSpec:
    """A family entry bound to a model folder: what the packer counts with and the trainer decodes with."""

    family: Family
    folder: Path
    token_ids: TokenIds
    vision: VisionSpec


def _added_tokens(folder: ModelFolder) -> dict[str, int]:
    """Special-token text -> id from the folder's tokenizer files (the same tables the tokenizer loads)."""
    found: dict[str, int] = {}
    files = folder.tokenizer_files
    if "tokenizer.json" in files:
        for tok in folder.json_file("tokenizer.json").get("added_tokens") or []:
            if (
                isinstance(tok, dict)
                and isinstance(tok.get("content"), str)
                and isinstance(tok.get("id"), int)
            ):
                found[tok["content"]] = tok["id"]
    if "tokenizer_config.json" in files:
        for key, tok in (folder.json_file("tokenizer_config.json").get("added_tokens_decoder") or {}).items():
            if isinstance(tok, dict) and isinstance(tok.get("content"), str) and str(key).isdigit():
                found[tok["content"]] = int(key)
    if "added_tokens.json" in files:
        found.update({k: v for k, v in folder.json_file("added_tokens.json").items() if isinstance(v, int)})
    return found


_CONFIG_ID_KEYS = {
    "image_pad": "image_token_id",
    "video_pad": "video_token_id",
    "vision_start": "vision_start_token_id",
    "vision_end": "vision_end_token_id",
}


def token_ids(model: Path | ModelFolder, family: Family) -> TokenIds:
    """The family's special-token ids as the folder's tokenizer defines them, checked against config.json."""
    model = model if isinstance(model, ModelFolder) else ModelFolder(model)
    folder = model.path
    added = _added_tokens(model)
    if not model.tokenizer_files:
        raise ConfigError(
            f"{folder}: no tokenizer files (expected {', '.join(TOKENIZER_FILES)}); point model.path at "
            "the model's own folder (the one with config.json and the tokenizer)"
        )
    ids: dict[str, int] = {}
    for role, text in family.token_names.items():
        if text not in added:
            raise ConfigError(
                f"{folder}: the tokenizer files define no {family.name} special token {text}; "
                "point model.path at the model's own folder"
            )
        ids[role] = added[text]
    config = model.config_json
    for role, key in _CONFIG_ID_KEYS.items():
        value = config.get(key)
        if isinstance(value, int) and value != ids[role]:
            raise ConfigError(
                f"{folder}: config.json {key} is {value} but the tokenizer has {family.token_names[role]} "
                f"at {ids[role]}; the folder mixes two models"
            )
    return TokenIds(**ids)


def model_spec(
    folder: str | Path | ModelFolder, family: str | Family | None = None, cfg: ModelConfig | None = None
) -> ModelSpec:
    """The registry entry bound to `folder` (family from config.json when not given); cheap, torch-free.

    A `ModelFolder` is read through (its family, model.family's, unless `family` is given), so a
    caller that holds one reads config.json once however many readers ask."""
    if isinstance(folder, ModelFolder):
        model = folder if family is None else ModelFolder(folder.path, folder.overrides, _name(family))
    else:
        model = ModelFolder(folder, family=None if family is None else _name(family))
    path = model.path
    if not path.is_dir():
        raise ConfigError(f"model.path: {path} is not a folder{relative_note(path)}")
    fam = model.family
    settings = cfg if cfg is not None else ModelConfig(family=fam.name, path=str(path))
    return ModelSpec(fam, path, token_ids(model, fam), vision_spec(model, settings, fam))


def _name(family: str | Family) -> str:
    return family.name if isinstance(family, Family) else family


@dataclass(frozen=True)
class LoadedModel:
    """A `ModelSpec` plus the tokenizer and the chat template the packer renders with."""

    spec: ModelSpec
    tokenizer: Any
    chat_template: str
    reserved_tokens: frozenset[str]  # structural tokens a record's text must not contain
    render: Callable[[list[dict[str, Any]]], str]  # messages -> chat-template text

    @property
    def family(self) -> Family:
        return self.spec.family

    @property
    def vision(self) -> VisionSpec:
        return self.spec.vision

    @property
    def ids(self) -> TokenIds:
        return self.spec.token_ids


def _chat_template(folder: Path, override: str | None, tokenizer: Any) -> str:
    """Custom file, else the folder's `chat_template.json` (the VL one), else the tokenizer's own."""
    if override:
        path = Path(override)
        if not path.is_file():
            raise ConfigError(f"model.chatTemplate: {override} is not a file")
        return read_template(path, "model.chatTemplate")
    for name in ("chat_template.jinja", "chat_template.json"):
        path = folder / name
        if path.is_file():
            if name.endswith(".jinja"):
                return read_template(path, "model.path")
            template = _read_json(path).get("chat_template")
            if isinstance(template, str):
                check_template_size(len(template.encode("utf-8", "surrogatepass")), f"model.path: {path}")
                return template
    if isinstance(tokenizer.chat_template, str):
        where = f"model.path: {folder / 'tokenizer_config.json'}"
        check_template_size(len(tokenizer.chat_template.encode("utf-8", "surrogatepass")), where)
        return tokenizer.chat_template
    raise ConfigError(f"{folder}: no chat template (chat_template.json or tokenizer_config.json)")


def _pixels(config: dict[str, Any], key: str, size_key: str) -> int | None:
    value = config.get(key)
    if value is None and isinstance(config.get("size"), dict):
        value = config["size"].get(size_key, config["size"].get(key))
    return int(value) if value is not None else None


def vision_spec(folder: Path | ModelFolder, cfg: ModelConfig, family: Family | None = None) -> VisionSpec:
    """Vision settings: explicit config first, then the folder's processor configs, then the family's
    defaults.

    Videos use `video_preprocessor_config.json` when present and otherwise the
    image processor's bounds, as `AutoProcessor` does for these folders.
    """
    fam = family or pack_family(cfg)
    model = folder if isinstance(folder, ModelFolder) else ModelFolder(folder)
    try:
        spec = _vision_spec(model, cfg, fam)
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError, AttributeError) as exc:  # not a number, not a mapping
        raise ConfigError(
            f"{model.path}: the processor configs ({IMAGE_PROCESSOR_FILE}, {VIDEO_PROCESSOR_FILE}) or "
            f"config.json's vision_config hold a value that is not a number ({exc}): fix the folder"
        ) from exc
    return _checked(spec, model.path)


# The processor numbers a folder may set, as bounds (inclusive) on `VisionSpec`'s fields: the spec's
# own ceilings where a spec field has one, the vision tower's (`model_size.VISION_LIMITS`) otherwise.
MAX_TILES = 64
MAX_TILE_SIZE = 2048
_SPEC_LIMITS: dict[str, tuple[float, float]] = {
    "patch_size": VISION_LIMITS["patch_size"],
    "merge_size": VISION_LIMITS["spatial_merge_size"],
    "temporal_patch_size": VISION_LIMITS["temporal_patch_size"],
    **{
        k: (1, MAX_PIXELS_CEILING)
        for k in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels")
    },
    "min_frames": (1, MAX_FRAMES_CEILING),
    "max_frames": (1, MAX_FRAMES_CEILING),
    "max_video_tokens": (1, MAX_PIXELS_CEILING),
    "fps": (1e-3, 1e3),
    "tokens_per_second": (1e-3, 1e6),
    "rescale_factor": (1e-9, 1.0),
    # Tiled families: the canvas search is over max_tiles² grids, and a tile is whole merged patches.
    "min_tiles": (1, MAX_TILES),
    "max_tiles": (1, MAX_TILES),
}


def _checked(spec: VisionSpec, folder: Path) -> VisionSpec:
    """`spec` when every number a model folder's files may set is within its bounds (a folder is
    untrusted input too: a merge size of 0 divides by zero, a minimum of 10^12 pixels upscales every
    image to that); else ConfigError naming the setting."""
    problems = [
        f"{key} {value!r} (allowed: {low} to {high})"
        for key, (low, high) in _SPEC_LIMITS.items()
        if (value := getattr(spec, key)) is not None and not low <= value <= high
    ]
    if spec.tile_size:
        factor = spec.patch_size * spec.merge_size
        if not (factor <= spec.tile_size <= MAX_TILE_SIZE and spec.tile_size % factor == 0):
            problems.append(f"tile size {spec.tile_size} (a multiple of {factor} up to {MAX_TILE_SIZE})")
        if spec.min_tiles > spec.max_tiles:
            problems.append(f"min_patches {spec.min_tiles} over max_patches {spec.max_tiles}")
    stats = (*spec.image_mean, *spec.image_std)
    if len(spec.image_mean) != 3 or len(spec.image_std) != 3 or not all(-1e3 <= v <= 1e3 for v in stats):
        problems.append("image_mean / image_std: three finite numbers each")
    elif min(spec.image_std) <= 0:
        problems.append(f"image_std {list(spec.image_std)} (each above 0: pixels are divided by it)")
    if problems:
        raise ConfigError(
            f"{folder}: the processor settings hold {'; '.join(problems[:3])}: fix the folder's "
            f"{IMAGE_PROCESSOR_FILE} / {VIDEO_PROCESSOR_FILE}, or set the model section's own value"
        )
    return spec


def _vision_spec(model: ModelFolder, cfg: ModelConfig, fam: Family) -> VisionSpec:
    if fam.tiling is not None:
        return _tiled_spec(model, cfg, fam)
    if cfg.min_tiles is not None or cfg.max_tiles is not None:
        raise ConfigError(
            f"model: minTiles / maxTiles cut images into tiles, but {fam.name} sizes images by pixels: "
            "set model.minPixels / model.maxPixels instead"
        )
    files = model.processor_files
    pre = model.json_file(IMAGE_PROCESSOR_FILE) if IMAGE_PROCESSOR_FILE in files else {}
    # A family without videos reads every setting from the image processor (LLaVA-OneVision-1.5's
    # video config says temporal patches of 2, its image processor and vision tower 1).
    has_video = fam.videos and VIDEO_PROCESSOR_FILE in files
    vid = model.json_file(VIDEO_PROCESSOR_FILE) if has_video else pre
    vision_config = model.config_json.get("vision_config") or {}
    min_px = cfg.min_pixels or _pixels(pre, "min_pixels", "shortest_edge") or fam.min_pixels
    max_px = cfg.max_pixels or _pixels(pre, "max_pixels", "longest_edge") or fam.max_pixels
    tps = vision_config.get("tokens_per_second") if fam.time_scaled_rope else None
    return replace(
        VisionSpec(),
        patch_size=int(vid.get("patch_size", pre.get("patch_size", fam.patch_size))),
        merge_size=int(vid.get("merge_size", pre.get("merge_size", fam.merge_size))),
        temporal_patch_size=int(
            vid.get("temporal_patch_size", pre.get("temporal_patch_size", fam.temporal_patch_size))
        ),
        min_pixels=min_px,
        max_pixels=max_px,
        video_min_pixels=cfg.video_min_pixels
        or _pixels(vid, "min_pixels", "shortest_edge")
        or fam.video_min_pixels
        or min_px,
        video_max_pixels=cfg.video_max_pixels
        or _pixels(vid, "max_pixels", "longest_edge")
        or fam.video_max_pixels
        or max_px,
        fps=float(cfg.fps or vid.get("fps") or VisionSpec.fps),
        min_frames=int(cfg.min_frames or vid.get("min_frames") or VisionSpec.min_frames),
        max_frames=min(
            int(cfg.max_frames or vid.get("max_frames") or VisionSpec.max_frames), MAX_FRAMES_CEILING
        ),
        tokens_per_second=None if tps is None else float(tps),
        frame_sampling=fam.frame_sampling,
        video_resize=fam.video_resize,
        cap_pixels_per_frame=cfg.cap_pixels_per_frame,
        max_video_tokens=int(vid.get("max_video_tokens") or VisionSpec.max_video_tokens),
        image_mean=tuple(float(x) for x in pre.get("image_mean", fam.image_mean)),
        image_std=tuple(float(x) for x in pre.get("image_std", fam.image_std)),
        rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
    )


# The settings of a family whose images are sized by pixels (patches); a tiled family refuses them.
_PATCH_SETTINGS = ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels")


def _tiled_spec(model: ModelFolder, cfg: ModelConfig, fam: Family) -> VisionSpec:
    """A tiled family's (InternVL's) settings: tile side from the image processor's `size`, tile
    bounds from its `min_patches` / `max_patches`, mean/std from it too.

    Tiling is always on: `InternVLProcessor` passes its own `crop_to_patches=True` with every call,
    which wins over the image processor's config (the official files say false; transformers 5.25
    tiles regardless). Videos: the official video config says 384x384 frames and CLIP mean/std, but
    the vision tower takes 448 tiles (384/14 is no whole number of patches: the pixel shuffle cannot
    take them), so a frame is one tile normalized like an image, as OpenGVLab's own `load_video`
    does; token ids do not depend on it (one tile's tokens per frame either way).
    """
    assert fam.tiling is not None
    files = model.processor_files
    pre = model.json_file(IMAGE_PROCESSOR_FILE) if IMAGE_PROCESSOR_FILE in files else {}
    vid = model.json_file(VIDEO_PROCESSOR_FILE) if VIDEO_PROCESSOR_FILE in files else {}
    size = pre.get("size") or {}
    side = int(size.get("height", fam.tiling.tile_size))
    if int(size.get("width", side)) != side:
        raise ConfigError(f"{model.path}: {IMAGE_PROCESSOR_FILE} size {size} is not square; tiles are")
    tile_area = side * side
    unused = [to_camel(k) for k in _PATCH_SETTINGS if getattr(cfg, k) is not None]
    if unused:
        raise ConfigError(
            f"model: {', '.join(unused)} size a {fam.name} image by pixels, but {fam.name} cuts images into "
            f"{side}x{side} tiles: set model.minTiles / model.maxTiles instead"
        )
    max_tiles = int(cfg.max_tiles or pre.get("max_patches", fam.tiling.max_tiles))
    return replace(
        VisionSpec(),
        patch_size=int(pre.get("patch_size", fam.patch_size)),
        merge_size=fam.merge_size,
        temporal_patch_size=1,
        min_pixels=tile_area,
        max_pixels=tile_area * max_tiles,
        video_min_pixels=tile_area,
        video_max_pixels=tile_area,
        fps=float(cfg.fps or vid.get("fps") or VisionSpec.fps),
        min_frames=int(cfg.min_frames or VisionSpec.min_frames),
        max_frames=min(int(cfg.max_frames or VisionSpec.max_frames), MAX_FRAMES_CEILING),
        frame_sampling=fam.frame_sampling,
        video_resize=fam.video_resize,
        image_mean=tuple(float(x) for x in pre.get("image_mean", fam.image_mean)),
        image_std=tuple(float(x) for x in pre.get("image_std", fam.image_std)),
        rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
        tile_size=side,
        min_tiles=int(cfg.min_tiles or pre.get("min_patches", fam.tiling.min_tiles)),
        max_tiles=max_tiles,
        thumbnail=fam.tiling.thumbnail,
    )


def _import(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _renderer(tokenizer: Any, template: str) -> Callable[[list[dict[str, Any]]], str]:
    """Render with the template compiled once in HF's own Jinja environment (same filters and globals;
    an overlay that evaluates nothing while compiling: `chat_template.compile_template`).

    This skips `apply_chat_template`'s per-call copying of the messages, which
    costs as much as the rendering; where the private compile helper is missing,
    the public method is used.
    """
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        compile_template = None
    else:
        compile_template = _compile_jinja_template
    if compile_template is None:
        return lambda messages: tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False
        )
    try:
        compiled = bounded_compile(template, compile_template("").environment)
    except ConfigError:
        raise
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
    family = pack_family(cfg)
    spec = model_spec(cfg.path, family, cfg)
    folder = spec.folder
    try:
        tokenizer = _import(family.tokenizer_class).from_pretrained(str(folder))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model.path: cannot load a {family.name} tokenizer from {folder} ({exc})") from exc
    for role, text in family.token_names.items():
        if tokenizer.convert_tokens_to_ids(text) != getattr(spec.token_ids, role):
            raise ConfigError(f"{folder}: the tokenizer does not map {text} to the id its files list")
    template = _chat_template(folder, cfg.chat_template, tokenizer)
    names = family.token_names
    vision = {names[k] for k in ("vision_start", "vision_end", "image_pad", "video_pad", "turn_end")}
    return LoadedModel(
        spec=spec,
        tokenizer=tokenizer,
        chat_template=template,
        reserved_tokens=frozenset(family.reserved_tokens) | frozenset(vision),
        render=_renderer(tokenizer, template),
    )


def processor_settings(spec: VisionSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The image and the video processor settings, under transformers' names, that count as `spec`
    does. Frame sampling is on (Qwen2-VL's video processor defaults it off) and the per-frame cap is
    the volume rule's only (Qwen2-VL's video processor has one too, which the frame rule does not
    apply). Set them on the processor (its config files): Qwen3-VL's `sample_frames` ignores
    `min_frames`/`max_frames` passed with a call."""
    if spec.tile_size:
        return _tiled_settings(spec)
    volume = spec.video_resize == "volume"
    image = {"size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}}
    video: dict[str, Any] = {
        "size": {"shortest_edge": spec.video_min_pixels, "longest_edge": spec.video_max_pixels},
        "do_sample_frames": True,
        "fps": spec.fps,
        "min_frames": spec.min_frames,
        "max_frames": spec.max_frames,
        "cap_pixels_per_frame": volume and spec.cap_pixels_per_frame,
    }
    if volume:
        video["max_video_tokens"] = spec.max_video_tokens
    return image, video


def _tiled_settings(spec: VisionSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tiled family's: the tile and its bounds; video frames sampled (the processor's `sample_frames`
    with fps; it has no frame bounds) and made one tile each, normalized like images (`_tiled_spec`)."""
    tile = {"height": spec.tile_size, "width": spec.tile_size}
    image = {
        "size": tile,
        "crop_to_patches": True,
        "min_patches": spec.min_tiles,
        "max_patches": spec.max_tiles,
    }
    video = {
        "size": tile,
        "do_sample_frames": True,
        "fps": spec.fps,
        "image_mean": list(spec.image_mean),
        "image_std": list(spec.image_std),
    }
    return image, video


def _over(config: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` over a processor config. A top-level `min_pixels`/`max_pixels` (Qwen2-VL's files)
    overrides `size` when the processor loads, so where present it carries the same bounds."""
    out = {**config, **settings}
    size = settings["size"]
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if key in config and edge in size:
            out[key] = size[edge]
    return out


def served_processor_configs(folder: Path, cfg: ModelConfig) -> dict[str, dict[str, Any]]:
    """The folder's image and video processor configs (by file name) rewritten to the settings a pack
    was made with (`cfg`: the pack's model config), so that `AutoProcessor` loaded from them, with its
    default kwargs, gives every packed sample the pack's token ids: a model is served as it was trained.
    The pack's `alpha` has no processor key (transformers composites an in-memory RGBA image onto
    white and drops the alpha of an image it decodes from a path)."""
    spec = vision_spec(folder, cfg, pack_family(cfg))
    pre_path, vid_path = folder / IMAGE_PROCESSOR_FILE, folder / VIDEO_PROCESSOR_FILE
    pre = _read_json(pre_path) if pre_path.is_file() else {}
    # Without its own file the video processor reads the image processor's (as `vision_spec` does).
    vid = (
        _read_json(vid_path)
        if vid_path.is_file()
        else {k: v for k, v in pre.items() if k != "image_processor_type"}
    )
    image, video = processor_settings(spec)
    return {IMAGE_PROCESSOR_FILE: _over(pre, image), VIDEO_PROCESSOR_FILE: _over(vid, video)}
