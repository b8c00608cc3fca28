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

A model folder is untrusted: the index's file names must resolve inside the folder to regular files
(no file elsewhere, no FIFO that would hang the load), and each file's safetensors header is read
and checked here, within a cap, before safetensors maps a byte of it: every tensor's dtype known,
its shape's bytes equal to its span, the spans tiling the file's data exactly. A file that breaks
any of it is a ConfigError naming it (exit 2), never a traceback.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PreTrainedModel

from packtrain.core import untrusted
from packtrain.core.errors import ConfigError
from packtrain.core.model_folder import FILE_LIMITS, INDEX_FILE

INDEX = INDEX_FILE
SINGLE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header read (the format's own limit): a header is ~150 bytes a tensor."""
HEADER_LIMITS = untrusted.JsonLimits(max_bytes=MAX_HEADER_BYTES, max_depth=3, max_values=4_000_000)
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
"""The safetensors dtypes torch reads, by bytes per element."""
FLOAT_DTYPES = frozenset({"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"})
MAX_DIMS = 8
# Buffers older checkpoints saved that the model now recomputes (transformers drops them too).
ALWAYS_UNEXPECTED = (r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$")
SHOWN = 5  # names an error message lists


@dataclass
class ReadStats:
    """What a load read: tensors sliced and the bytes those slices copied (for tests and benchmarks)."""

    tensors: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as its file's header declares it (checked against the file before anything is read)."""

    dtype: str
    shape: tuple[int, ...]


def weights_error(problem: str) -> ConfigError:
    return ConfigError(
        f"model.path weights: {problem}; re-save the weights with save_pretrained into the model folder, "
        "or set model.init: random"
    )


def _whole(value: Any) -> bool:
    """A list of whole numbers (a bool is not one)."""
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    )


def _tensor(name: str, entry: Any, data_bytes: int) -> tuple[TensorInfo, int, int]:
    """One header entry checked: a known dtype, a shape of whole numbers whose bytes equal its span,
    the span inside the file's data; (info, start, end)."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name[:200]!r} is not described by dtype, shape and data_offsets alone")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(
            f"tensor {name[:200]!r} has dtype {str(dtype)[:40]!r}, not one of {', '.join(DTYPE_BYTES)}"
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not _whole(shape):
        raise ValueError(f"tensor {name[:200]!r}: its shape is not up to {MAX_DIMS} whole numbers")
    if not _whole(offsets) or len(offsets) != 2 or not offsets[0] <= offsets[1] <= data_bytes:
        raise ValueError(
            f"tensor {name[:200]!r}: data_offsets {str(offsets)[:80]} are not a span of the file's "
            f"{data_bytes} data bytes"
        )
    count = 1
    for n in shape:
        count *= n
    if count * DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
        raise ValueError(
            f"tensor {name[:200]!r} claims {count} elements of {dtype} in {offsets[1] - offsets[0]} bytes"
        )
    return TensorInfo(dtype, tuple(shape)), offsets[0], offsets[1]


FileIdentity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def _identity(st: os.stat_result) -> FileIdentity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_header(path: Path, root: Path) -> tuple[dict[str, TensorInfo], FileIdentity]:
    """The tensors of one safetensors file, from its header alone: the file a regular one inside
    `root`, the header's length within MAX_HEADER_BYTES and the file, every tensor checked
    (`_tensor`) and the spans tiling the data exactly, as safetensors itself requires; and the
    identity of the file checked, which the file mapped later must still have."""
    fd = untrusted.open_file(path, root, None, weights_error)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > MAX_HEADER_BYTES or 8 + length > size:
            said = "no 8-byte header length" if length is None else f"a {length}-byte header"
            raise weights_error(
                f"{path} declares {said} (the file has {size} bytes, a header at most {MAX_HEADER_BYTES})"
            )
        raw = f.read(length)
    header = untrusted.loads(raw, HEADER_LIMITS, path, weights_error)
    if not isinstance(header, dict):
        raise weights_error(f"{path}: its header is not a JSON object")
    header.pop("__metadata__", None)
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int]] = []
    try:
        for name, entry in header.items():
            tensors[name], start, end = _tensor(name, entry, size - 8 - length)
            spans.append((start, end))
    except ValueError as exc:
        raise weights_error(f"{path}: {exc}") from None
    end = 0
    for start, stop in sorted(spans):
        if start != end:
            raise weights_error(f"{path}: its tensors' data overlap or leave a gap at byte {start}")
        end = stop
    if end != size - 8 - length:
        raise weights_error(f"{path}: its tensors' data end at byte {end} of {size - 8 - length}")
    return tensors, _identity(st)


def map_checked(path: Path, root: Path, identity: FileIdentity) -> Any:
    """safetensors' handle of the very file `read_header` checked: opened again the checked way
    (inside `root`, no link followed, a regular file), refused unless it is still that file, and
    mapped through its descriptor, so a name swapped since (a FIFO, a link out of the folder, other
    bytes) is never what is read."""
    fd = untrusted.open_file(path, root, None, weights_error)
    try:
        if _identity(os.fstat(fd)) != identity:
            raise weights_error(
                f"{path} changed after its header was checked (replaced or rewritten while the run "
                "started); keep the model folder unchanged during a run"
            )
        return safe_open(f"/proc/self/fd/{fd}", framework="pt")
    finally:
        os.close(fd)


def _index(folder: Path, root: Path) -> dict[str, str]:
    """The index's weight map: checkpoint name -> file, every value a file name (checked where read)."""
    index = untrusted.read_json(folder / INDEX, root, FILE_LIMITS, weights_error)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise weights_error(f"{folder / INDEX}: `weight_map` is not an object of tensor name -> file name")
    return weight_map


@dataclass
class Checkpoint:
    """The tensors of one checkpoint folder, by checkpoint name, read lazily from their files."""

    folder: Path
    files: dict[str, str]  # checkpoint name -> file name in `folder`
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # checkpoint name -> its header entry
    root: Path | None = None  # the confinement root the files were checked in
    identities: dict[str, FileIdentity] = field(default_factory=dict)  # file name -> the file checked
    stats: ReadStats = field(default_factory=ReadStats)
    _open: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, folder: str | Path) -> Checkpoint:
        """A folder's single file or its index (what `save_pretrained` writes, sharded or not), every
        file it names checked (`read_header`) before any is mapped."""
        folder = Path(folder)
        root = untrusted.confinement_root(folder)
        headers: dict[str, tuple[dict[str, TensorInfo], FileIdentity]] = {}
        if os.path.lexists(folder / INDEX):
            files = _index(folder, root)
        elif os.path.lexists(folder / SINGLE):
            headers[SINGLE] = read_header(folder / SINGLE, root)
            files = dict.fromkeys(headers[SINGLE][0], SINGLE)
        else:
            raise ConfigError(
                f"{folder} holds neither {SINGLE} nor {INDEX}; save the weights as safetensors "
                "(`save_pretrained(folder)` does by default) or set model.init: random"
            )
        by_file: dict[str, list[str]] = {}
        for name, file in files.items():
            by_file.setdefault(file, []).append(name)
        tensors: dict[str, TensorInfo] = {}
        identities: dict[str, FileIdentity] = {}
        for file, names in sorted(by_file.items()):
            try:
                found, identities[file] = headers.get(file) or read_header(folder / file, root)
            except FileNotFoundError:
                raise weights_error(
                    f"{file[:200]!r} is named by {folder / INDEX} but not in {folder}"
                ) from None
            missing = [name for name in names if name not in found]
            if missing:
                raise weights_error(
                    f"{folder / file} lacks {len(missing)} tensors the index puts there, "
                    f"e.g. {missing[:SHOWN]}"
                )
            tensors.update({name: found[name] for name in names})
        return cls(folder, files, tensors, root, identities)

    def _slice(self, name: str) -> Any:
        file = self.files[name]
        if file not in self._open:
            assert self.root is not None, "Checkpoint.open() checks the files it maps"
            self._open[file] = map_checked(self.folder / file, self.root, self.identities[file])
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def dtype(self, name: str) -> str:
        return self.tensors[name].dtype

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
