"""A Hugging Face safetensors checkpoint read tensor by tensor, and of each tensor only some rows.

`from_pretrained` reads every tensor whole into host memory; a rank of a sharded (FSDP2) run
needs only its own rows of each. safetensors files are memory-mapped and a slice
(`safe_open(...).get_slice(name)[start:stop]`) copies only the bytes it covers, so a rank's host
memory at load is its share of the model plus the tensor being read, never the whole model.

`Checkpoint` opens a folder's `model.safetensors`, or the shards listed by
`model.safetensors.index.json`, and maps each checkpoint name to the model's parameter name the
way `from_pretrained` does in this transformers version: the released Qwen2-VL / Qwen2.5-VL
checkpoints' `model.layers.*` and `visual.*` become `model.language_model.layers.*` and
`model.visual.*`, the names our own export writes stay as they are. Names it cannot place (or
that would need more than a rename) are refused with what to do, as are missing tensors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PreTrainedModel

from packtrain.core.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Buffers older checkpoints saved that the model now recomputes (transformers drops them too).
ALWAYS_UNEXPECTED = (r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$")
SHOWN = 5  # names an error message lists


@dataclass
class ReadStats:
    """What a load read: tensors sliced and the bytes those slices copied (for tests and benchmarks)."""

    tensors: int = 0
    bytes: int = 0


@dataclass
class Checkpoint:
    """The tensors of one checkpoint folder, by checkpoint name, read lazily from their files."""

    folder: Path
    files: dict[str, str]  # checkpoint name -> file name in `folder`
    stats: ReadStats = field(default_factory=ReadStats)
    _open: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, folder: str | Path) -> Checkpoint:
        """A folder's single file or its index (what `save_pretrained` writes, sharded or not)."""
        folder = Path(folder)
        if (folder / INDEX).is_file():
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            return cls(folder, dict(weight_map))
        if (folder / SINGLE).is_file():
            with safe_open(folder / SINGLE, framework="pt") as handle:
                return cls(folder, dict.fromkeys(handle.keys(), SINGLE))
        raise ConfigError(
            f"{folder} holds neither {SINGLE} nor {INDEX}; save the weights as safetensors "
            "(`save_pretrained(folder)` does by default) or set model.init: random"
        )

    def _slice(self, name: str) -> Any:
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(self.folder / file, framework="pt")
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The part `box` (one slice per dimension) of tensor `name`: only its bytes are copied."""
        sliced = self._slice(name)
        part: torch.Tensor = sliced[box] if box else self._open[self.files[name]].get_tensor(name)
        self.stats.tensors += 1
        self.stats.bytes += part.numel() * part.element_size()
        return part

    def close(self) -> None:
        self._open.clear()

    def by_file(self, names: Iterable[str]) -> list[str]:
        """`names` ordered file by file, so each shard file is read through once."""
        return sorted(names, key=lambda name: (self.files[name], name))


def _renamer(model: PreTrainedModel, targets: set[str]) -> Any:
    """checkpoint name -> model name, with transformers' own conversion rules for `model`'s class.

    Only renamings apply; a name that matches a converter (tensors merged or split on load, e.g.
    some MoE checkpoints) raises: its tensors are not the model's, row for row."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    known = dict.fromkeys(targets, True)

    def rename(name: str) -> str:
        target, converter = rename_source_key(name, renamings, converters, model.base_model_prefix, known)
        if converter is not None:
            raise ConfigError(
                f"checkpoint tensor {name} needs transformers' weight conversion ({converter}), which a "
                "sharded load does not do; convert the folder once with from_pretrained + save_pretrained"
            )
        return str(target)

    return rename


def _ignored(model: PreTrainedModel, attribute: str, extra: tuple[str, ...] = ()) -> re.Pattern[str] | None:
    patterns = [*(getattr(model, attribute, None) or ()), *extra]
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def match_names(
    checkpoint: Checkpoint, model: PreTrainedModel, wanted: dict[str, tuple[str, ...]]
) -> dict[str, str]:
    """For each key of `wanted` (a parameter, by its first name; the value: every name it has, so
    a tied LM head is found under either), the checkpoint name holding it.

    Raises, naming some of them, when the checkpoint lacks tensors the model needs or holds
    tensors the model has no place for (a different model, or a different size of it)."""
    owner = {alias: key for key, aliases in wanted.items() for alias in aliases}
    rename = _renamer(model, set(owner))
    found: dict[str, str] = {}
    unexpected: list[str] = []
    skip = _ignored(model, "_keys_to_ignore_on_load_unexpected", ALWAYS_UNEXPECTED)
    for name in checkpoint.files:
        key = owner.get(rename(name))
        if key is None:
            if skip is None or not skip.search(name):
                unexpected.append(name)
        else:
            found.setdefault(key, name)  # a tied tensor saved under both names: read once
    allowed = _ignored(model, "_keys_to_ignore_on_load_missing")
    missing = [k for k in wanted if k not in found and (allowed is None or not allowed.search(k))]
    if missing or unexpected:
        raise ConfigError(
            f"{checkpoint.folder} does not hold this model's weights: "
            + (f"{len(missing)} missing (e.g. {missing[:SHOWN]})" if missing else "none missing")
            + (f", {len(unexpected)} unexpected (e.g. {unexpected[:SHOWN]})" if unexpected else "")
            + "; point model.path at the folder of this model (config.json and weights from the same "
            "save), remove model.configOverrides that change its shape, or set model.init: random"
        )
    return found
