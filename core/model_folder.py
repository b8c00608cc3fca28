"""One model folder, read once: its config.json (as on disk and with `model.configOverrides`
merged), its family checked against `model_type`, its tokenizer and processor files, its weights.

An entry point (the trainer's `setup`, `load_model`, the memory check) builds one `ModelFolder`
and hands it to every reader of the folder (`model_spec`, `model_size`, the trainer's model
build), so each fact is read from disk once. Each fact is read when first asked for, and a
failed read is kept: every reader still refuses a broken folder with its own message, at the
point it did before. Torch-free; the trainer builds its transformers config from `config`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from packtrain.core import untrusted
from packtrain.core.errors import ConfigError
from packtrain.core.families import FAMILIES, Family

__all__ = [
    "IMAGE_PROCESSOR_FILE",
    "VIDEO_PROCESSOR_FILE",
    "TOKENIZER_FILES",
    "FOLDER_FILES",
    "FILE_LIMITS",
    "WEIGHT_GLOBS",
    "ModelFolder",
    "check_files",
    "deep_merge",
    "family_for_model_type",
    "folder_error",
    "get_family",
    "read_json",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "added_tokens.json")
"""Where the special tokens are read from (at least one must be in the model folder)."""
IMAGE_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE = "preprocessor_config.json", "video_preprocessor_config.json"
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
INDEX_FILE = "model.safetensors.index.json"
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    *TOKENIZER_FILES,
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    IMAGE_PROCESSOR_FILE,
    VIDEO_PROCESSOR_FILE,
    "processor_config.json",
    "audio_tokenizer_config.json",
    INDEX_FILE,
)
"""Every file of a model folder that packtrain or transformers (tokenizer, processor, the export's
copy) opens by name; `ModelFolder.check_files` checks each one present before any is read."""
CHAT_TEMPLATES_DIR = "additional_chat_templates"  # transformers reads every *.jinja in it
FILE_LIMITS = untrusted.JsonLimits(max_bytes=64 << 20, max_depth=32, max_values=4_000_000)
"""The cap on each of those files (weights are bounded by their headers instead): the largest released
tokenizer.json is some 33 MB, 500,000-2,000,000 JSON values, 5 levels deep; a config file is a few
KB. Parsing one at the caps costs under 400 MiB, whatever the bytes hold."""


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


def _resolved_tie(config: dict[str, Any]) -> dict[str, Any]:
    """The config with `tie_word_embeddings` written out where the family takes it from its decoder.

    transformers' InternVL config ties the LM head to the embeddings unless the top level says
    otherwise, while InternVL releases put the choice in `text_config` (untied from 2B up: their
    checkpoints hold an `lm_head.weight` of its own); building from the top-level default would train
    and export a model other than the one released."""
    family = next((f for f in FAMILIES.values() if f.model_type == config.get("model_type")), None)
    text = config.get("text_config")
    if family is None or not family.tie_from_text_config or "tie_word_embeddings" in config:
        return config
    tie = text.get("tie_word_embeddings", False) if isinstance(text, dict) else False
    return {**config, "tie_word_embeddings": tie if isinstance(tie, bool) else False}


def folder_error(problem: str) -> ConfigError:
    """A model folder's file refused (outside it, not a regular file, over its caps)."""
    return ConfigError(f"model.path: {problem}")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of the model folder `path` lies in (read as `untrusted.read_json` reads:
    inside the folder, a regular file, within `FILE_LIMITS`); ConfigError naming the file when it
    is refused, unreadable or not an object."""
    data = untrusted.read_json(path, untrusted.confinement_root(path.parent), FILE_LIMITS, folder_error)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def check_files(folder: Path) -> Path:
    """Refuse a model folder any of whose `FOLDER_FILES` (and additional chat templates) resolves
    outside it, is not a regular file, or is over `FILE_LIMITS` (a JSON file's depth and values
    measured on its bytes), before transformers or packtrain opens one; returns the folder's
    confinement root. Its weights are checked where they are read (`trainer/model/weights.py`)."""
    root = untrusted.confinement_root(folder)
    names = list(FOLDER_FILES)
    templates = folder / CHAT_TEMPLATES_DIR
    if templates.is_dir():
        untrusted.resolve_inside(templates, root, folder_error)
        names += [
            f"{CHAT_TEMPLATES_DIR}/{e.name}" for e in os.scandir(templates) if e.name.endswith(".jinja")
        ]
    for name in names:
        path = folder / name
        if not os.path.lexists(path):
            continue
        st = untrusted.check_file(path, root, FILE_LIMITS.max_bytes, folder_error)
        version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if name.endswith(".json") and version not in _SCANNED:
            data = untrusted.read_bytes(path, root, FILE_LIMITS.max_bytes, folder_error)
            untrusted.check_json_shape(data, FILE_LIMITS, path, folder_error)
            _SCANNED.add(version)
    return root


_SCANNED: set[tuple[int, ...]] = set()
"""The JSON files whose shape passed, by file and version (a rewrite changes its ctime): a process
that reads one folder several times scans each of its files once."""


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
    def root(self) -> Path:
        """What the folder's files must resolve inside, once `check_files` passed: every reader of
        the folder asks for it first, so no file of a hostile folder is opened."""
        return check_files(self.path)

    def file(self, name: str) -> Path:
        """The folder's file `name`: the folder's files pass `check_files` before the first is named."""
        self.check()
        return self.path / name

    def check(self) -> Path:
        """`check_files` of the folder, run once (`root`)."""
        return self.root

    @cached_property
    def _config_read(self) -> tuple[Any, OSError | ValueError | None]:
        """config.json parsed, or the error reading it raised (each reader words it its own way)."""
        root = self.root  # another file's refusal is its own, not config.json's
        try:
            return untrusted.read_json(self.config_path, root, FILE_LIMITS, folder_error), None
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
        merged = deep_merge(data, self.overrides)
        return _resolved_tie(merged) if isinstance(merged, dict) else merged

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
        return tuple(name for name in TOKENIZER_FILES if self.file(name).is_file())

    @cached_property
    def processor_files(self) -> tuple[str, ...]:
        """The image and video processor configs the folder has."""
        files = (IMAGE_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE)
        return tuple(n for n in files if self.file(n).is_file())

    def json_file(self, name: str) -> dict[str, Any]:
        """A tokenizer or processor JSON file of the folder (read when asked: one reader each)."""
        data = untrusted.read_json(self.path / name, self.root, FILE_LIMITS, folder_error)
        if not isinstance(data, dict):
            raise ConfigError(f"{self.path / name}: expected a JSON object")
        return data

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
