"""The keys `model.configOverrides` may set: those the family's transformers config classes read.

transformers keeps a key it does not read as a stray attribute, so a misspelt override changes
nothing on a real model (and on a shrunk one fails deep inside the forward); this names it up
front. transformers is optional here: the operator's image has none, and the trainer checks again
when it starts. Importing a config class loads no model code (nor torch where it is not installed).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from packtrain.core.errors import ConfigError
from packtrain.core.families import FAMILIES
from packtrain.core.model_folder import read_json
from packtrain.core.model_size import deep_merge
from packtrain.core.spec_file import unknown_key

OVERRIDES = "model.configOverrides"
_ARGUMENTS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@cache
def class_keys(cls: type) -> frozenset[str]:
    """What a transformers config class reads: its `__init__` arguments, its aliases (`attribute_map`)
    and its settable properties (the deprecated `rope_scaling`, `torch_dtype`)."""
    params = {n for n, p in inspect.signature(cls).parameters.items() if p.kind in _ARGUMENTS}
    props = {
        n
        for n in dir(cls)
        if not n.startswith("_") and isinstance(p := getattr(cls, n, None), property) and p.fset is not None
    }
    return frozenset(params | set(getattr(cls, "attribute_map", {})) | props)


def _config_class(model_type: str) -> Any:
    """The transformers config class of `model_type`; None where transformers is absent or lacks it."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:  # the operator's image: the trainer checks the overrides when it starts
        return None
    try:
        return CONFIG_MAPPING[model_type]  # a lazy mapping: its .get() sees only what was loaded
    except KeyError:
        return None


def override_problems(overrides: Mapping[str, Any], model_type: str, base: Mapping[str, Any]) -> list[str]:
    """A message for each key of `overrides` the config of `model_type` does not read; `base` is the
    folder's config.json (its own keys count as known, and without a text_config there, text keys
    may sit at the top, as transformers reads flat Hub configs)."""
    cls = _config_class(model_type)
    if cls is None:
        return []
    subs = {name: class_keys(sub) | set(base.get(name) or {}) for name, sub in cls.sub_configs.items()}
    top = class_keys(cls) | set(base)
    if "text_config" in subs and "text_config" not in deep_merge(base, overrides):
        top |= subs["text_config"]
    problems = []
    for key, value in overrides.items():
        if key in subs and isinstance(value, Mapping):
            note = f": {cls.sub_configs[key].__name__} has no such setting"
            where = f"{OVERRIDES}.{key}"
            problems += [unknown_key(f"{where}.{k}", subs[key], note) for k in value if k not in subs[key]]
        elif key not in top:
            text_first = sorted(subs, key=lambda name: name != "text_config")
            nested = [f"{name}.{key}" for name in text_first if key in subs[name]]
            hint = f"did you mean {' or '.join(nested)}?" if nested else None
            note = f": {cls.__name__} has no such setting"
            problems.append(unknown_key(f"{OVERRIDES}.{key}", top, note, hint))
    return problems


def check_config_overrides(overrides: Mapping[str, Any], family: str | None, folder: str | Path) -> None:
    """ConfigError naming every override the model's config would ignore. The model type comes from
    the folder's config.json, else from `family`; with neither (a folder seen only inside a pod and no
    family), the trainer checks when it starts."""
    if not overrides:
        return
    try:
        base = read_json(Path(folder) / "config.json")
    except (OSError, ValueError):
        base = {}
    model_type = base.get("model_type") if isinstance(base, dict) else None
    if model_type is None and family is not None:
        model_type = FAMILIES[family].model_type
    if model_type is None:
        return
    problems = override_problems(overrides, model_type, base if isinstance(base, dict) else {})
    if problems:
        raise ConfigError("; ".join(problems))
