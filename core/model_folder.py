"""One model folder, read once: its config.json (as on disk and with `model.configOverrides`
merged), its family checked against `model_type`, its tokenizer and processor files, its weights.

An entry point (the trainer's `setup`, `load_model`, the memory check) builds one `ModelFolder`
and hands it to every reader of the folder (`model_spec`, `model_size`, the trainer's model
build), so each fact is read from disk once. Each fact is read when first asked for, and a
failed read is kept: every reader still refuses a broken folder with its own message, at the
point it did before. Torch-free; the trainer builds its transformers config from `config`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from packtrain.core.errors import ConfigError
from packtrain.core.families import FAMILIES, Family

__all__ = [
    "IMAGE_PROCESSOR_FILE",
    "VIDEO_PROCESSOR_FILE",
    "TOKENIZER_FILES",
    "WEIGHT_GLOBS",
    "ModelFolder",
    "deep_merge",
    "family_for_model_type",
    "get_family",
    "read_json",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "added_tokens.json")
"""Where the special tokens are read from (at least one must be in the model folder)."""
IMAGE_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE = "preprocessor_config.json", "video_preprocessor_config.json"
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


def get_family(name: str) -> Family:
    """The registry entry named `name`; ConfigError lists the known ones."""
    family = FAMILIES.get(name)
    if family is None:
        raise ConfigError(f"model.family {name!r} is not one of {sorted(FAMILIES)}")
    return family


def family_for_model_type(model_type: str | None) -> Family:
    """The entry whose HF `model_type` (config.json) is `model_type`."""
    for family in FAMILIES.values():
        if family.model_type == model_type:
            return family
    known = sorted(f.model_type for f in FAMILIES.values())
    raise ConfigError(f"model_type {model_type!r} is not a supported family (known: {', '.join(known)})")


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`overrides` merged into `base`, nested dicts key by key (how model.configOverrides apply)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; ConfigError naming the file when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


class ModelFolder:
    """A model folder (`model.path`) with `model.configOverrides` and `model.family` as the job sets
    them; each fact below is read from disk the first time it is asked for, and only then."""

    def __init__(
        self, path: str | Path, overrides: Mapping[str, Any] | None = None, family: str | None = None
    ) -> None:
        self.path = Path(path)
        self.name = str(path)  # as model.path spells it, for messages
        self.overrides: Mapping[str, Any] = overrides or {}
        self.family_name = family  # model.family as set, None to take it from config.json

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @cached_property
    def has_config(self) -> bool:
        return self.config_path.is_file()

    @cached_property
    def _config_read(self) -> tuple[Any, OSError | ValueError | None]:
        """config.json parsed, or the error reading it raised (each reader words it its own way)."""
        try:
            return json.loads(self.config_path.read_text(encoding="utf-8")), None
        except (OSError, ValueError) as exc:
            return None, exc

    def loaded_config(self) -> Any:
        """config.json as parsed (no overrides), raising what reading it raised."""
        data, exc = self._config_read
        if exc is not None:
            raise exc
        return data

    @cached_property
    def config_json(self) -> dict[str, Any]:
        """config.json as on disk (the tokenizer's and processor's own model), {} without one."""
        if not self.has_config:
            return {}
        data, exc = self._config_read
        if exc is not None:
            raise ConfigError(f"{self.config_path}: cannot read JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{self.config_path}: expected a JSON object")
        return data

    @cached_property
    def config(self) -> dict[str, Any]:
        """config.json with `overrides` merged (what the model is built and planned from);
        ConfigError naming what is missing."""
        data, exc = self._config_read
        if exc is not None:
            raise ConfigError(
                f"cannot read {self.config_path} ({exc}): point model.path at a Hugging Face model folder"
            ) from exc
        return deep_merge(data, self.overrides)

    def detected_family(self) -> Family:
        """The family config.json's `model_type` names."""
        if not self.has_config:
            raise ConfigError(f"{self.path}: no config.json to tell the model family from; set model.family")
        return family_for_model_type(self.config_json.get("model_type"))

    @cached_property
    def family(self) -> Family:
        """model.family (else the one config.json names), checked once against config.json's `model_type`."""
        fam = self.detected_family() if self.family_name is None else get_family(self.family_name)
        model_type = self.config_json.get("model_type") if self.has_config else None
        if model_type is not None and model_type != fam.model_type:
            names = ", ".join(f.name for f in FAMILIES.values() if f.model_type == model_type)
            raise ConfigError(
                f"model.family is {fam.name} but {self.path}/config.json is a {model_type!r} model; set "
                f"model.family to {names or 'its family'}"
            )
        return fam

    @cached_property
    def tokenizer_files(self) -> tuple[str, ...]:
        """The tokenizer files (`TOKENIZER_FILES`) the folder has."""
        return tuple(name for name in TOKENIZER_FILES if (self.path / name).is_file())

    @cached_property
    def processor_files(self) -> tuple[str, ...]:
        """The image and video processor configs the folder has."""
        return tuple(n for n in (IMAGE_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE) if (self.path / n).is_file())

    def json_file(self, name: str) -> dict[str, Any]:
        """A tokenizer or processor JSON file of the folder (read when asked: one reader each)."""
        return read_json(self.path / name)

    @cached_property
    def weight_files(self) -> tuple[Path, ...]:
        """The weight files (safetensors, else PyTorch bins) the folder holds; () for none."""
        for pattern in WEIGHT_GLOBS:
            found = tuple(sorted(self.path.glob(pattern)))
            if found:
                return found
        return ()

    @property
    def has_weights(self) -> bool:
        return bool(self.weight_files)
