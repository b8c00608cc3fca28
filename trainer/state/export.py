"""The final Hugging Face export, streamed: no rank ever holds the whole model.

`final/` is a folder `from_pretrained` loads: config.json, generation_config.json, the model
folder's tokenizer and processor files (the processor configs set to the pixel and frame settings
of the pack trained on, so the model is served as it was trained), and the weights as safetensors
shards of at most `shard_bytes` (5 GB unless told): `model-00001-of-0000N.safetensors`, … and
`model.safetensors.index.json`, or one `model.safetensors` when the model fits in one shard (as
`save_pretrained` writes them). The weights go one unit at a time (a decoder layer, a vision
block, the embedding), each rank's FSDP2 shards cast to the export dtype first, and are renamed
(VLMForTraining's `hf.` dropped, then transformers' original checkpoint names, as
`save_pretrained` restores them). A tensor FSDP2 shards by rows is streamed (`stream_rows`): rank
0 writes its own rows, then each other rank's as they arrive, a piece at a time; a unit whose
conversion makes new tensors (fused experts split, say) is gathered whole, converted, written.
Rank 0 writes the bytes at once (`ShardWriter`), so it holds its own shards and a piece (or that
one unit), never a file's worth of weights (a 5 GB shard is all of a small model), and the files
are the bytes `save_file` writes, whatever the world size or strategy that trained it.

Each folder is written under a temp name beside it and renamed into place when whole (the export
it replaces removed after): `final/` is always a whole export, and a run killed while exporting
leaves only a temp folder, which the next run of the output folder removes (`sweep_exports`).
`EXPORT_RECORD` in it names the step it was exported at, so a rerun can tell an export older than
the newest checkpoint (one killed before it was replaced) and export again.

With LoRA, `final/` is the PEFT adapter (`PeftModel.from_pretrained(base, folder)`: the adapters
only, small enough to gather whole) and `lora.saveMerged` adds `final-merged/`, the plain model
with each targeted W replaced by W + scale·B·A, merged unit by unit as it streams.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from safetensors.torch import save as safetensors_bytes
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard
from transformers.core_model_loading import revert_weight_conversion

from packtrain.core.config import ModelConfig
from packtrain.core.model_spec import served_processor_configs
from packtrain.core.pack.shards import temp_path
from packtrain.core.sft_config import TrainModelSpec
from packtrain.trainer.distributed import DistEnv, barrier
from packtrain.trainer.model import lora

SHARD_BYTES = 5 * 10**9  # the largest safetensors file of an export (one bigger tensor gets its own)
FINAL_DIR, MERGED_DIR = "final", "final-merged"
EXPORT_RECORD = "packtrain_export.json"  # in an export: {"step": the training step it holds}
_STAGED = re.compile(rf"^\.(?:{FINAL_DIR}|{MERGED_DIR})\.(?:tmp|old)-")
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "generation_config.json",
)
_NUMBERED = re.compile(r"^(.*?\.\d+)\.")  # a numbered module: a decoder layer, a vision block, …
_LORA_PART = re.compile(r"\.(?:base_layer|lora_[A-Za-z_]+\.[^.]+)(?=\.|$)")

Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
Processor = Mapping[str, dict[str, Any]]  # processor config files by name, written over the folder's


def unit_of(name: str) -> str:
    """The unit a state-dict entry is gathered with: its first numbered ancestor (a decoder layer,
    a vision block), else its own module; a LoRA layer's base and adapters stay together."""
    numbered = _NUMBERED.match(name)
    return numbered.group(1) if numbered else _LORA_PART.sub("", name).rpartition(".")[0]


def _aliases(model: torch.nn.Module) -> set[str]:
    """Every name of a tied parameter but its first (the LM head tied to the embedding): written once."""
    seen: set[int] = set()
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name.removeprefix("module."))
        seen.add(id(p))
    return aliases


def local_units(
    model: torch.nn.Module, keep: Callable[[str], bool] = lambda _: True, dtype: torch.dtype | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's part of the model's state dict (names as `get_model_state_dict`'s: DTensors under
    FSDP2, no copy), one unit at a time, for the entries `keep` accepts, floating-point entries
    cast to `dtype` if given; a tied weight once, under its first name."""
    # The union torch annotates covers optimizer state: tensors here.
    state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=StateDictOptions()))
    skip = _aliases(model)
    names = [name for name in state if keep(name) and name not in skip]
    start = 0
    while start < len(names):
        end = start + 1
        while end < len(names) and unit_of(names[end]) == unit_of(names[start]):
            end += 1
        yield {name: state[name] if dtype is None else _cast(state[name], dtype) for name in names[start:end]}
        start = end


def gathered(
    model: torch.nn.Module,
    main: bool,
    keep: Callable[[str], bool] = lambda _: True,
    dtype: torch.dtype | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """The model's full state dict, one unit at a time (`local_units`). Every rank must consume it in
    step: each DTensor is gathered from all ranks. Only the main rank gets the tensors (on CPU);
    the others get empty units.

    The cast comes before the gather: every rank briefly holds each full tensor (an all-gather),
    so a bf16 export gathers half the bytes of the fp32 master weights and makes no second copy."""
    for local in local_units(model, keep, dtype):
        yield _gather_unit(local, main)
        del local


def _gather_unit(local: dict[str, torch.Tensor], main: bool) -> dict[str, torch.Tensor]:
    unit: dict[str, torch.Tensor] = {}
    for name, value in local.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if main:
            unit[name] = full.detach().cpu()
        del full
    return unit


def renames(convert: Convert, local: dict[str, torch.Tensor]) -> dict[str, str] | None:
    """{exported name: state-dict name} when `convert` only renames the unit's tensors, else None.
    Tried on meta stand-ins of the full tensors (nothing is allocated): a rename gives back the
    very tensors it was given."""
    stand_ins = {name: torch.empty(v.shape, dtype=v.dtype, device="meta") for name, v in local.items()}
    given = {id(t): name for name, t in stand_ins.items()}
    try:
        out = convert(stand_ins)
    except (RuntimeError, NotImplementedError):  # a conversion meta tensors cannot run: gathered whole
        return None
    names = {new: given.get(id(t)) for new, t in out.items()}
    if sorted(n or "" for n in names.values()) != sorted(local):
        return None
    return cast(dict[str, str], names)


_PIECE_BYTES = 64 << 20  # the most of a tensor the main rank receives at a time


def stream_rows(value: torch.Tensor, data: Path | None) -> None:
    """Append the full `value`, row-major (as safetensors stores it), to the data file `data` on the
    main rank (None on the others); every rank calls it in step.

    A DTensor sharded along its rows (FSDP2's `Shard(0)`) is never put together: the full tensor's
    bytes are the ranks' shards one after another, so the main rank writes its own rows and then
    each other rank's, received `_PIECE_BYTES` at a time. No rank holds more than its own shard and
    one piece; `DTensor.full_tensor` would give every rank the whole tensor, twice over while it
    is assembled. Any other layout is gathered whole."""
    if isinstance(value, DTensor) and not _row_sharded(value):
        value = value.full_tensor()
    if not isinstance(value, DTensor):
        if data is not None:
            with data.open("ab") as file:
                _write_tensor(file, value)
        return
    group = value.device_mesh.get_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rows, shape = value.shape[0], tuple(value.shape[1:])
    per_rank = -(-rows // world)  # torch.chunk's split, as DTensor shards
    local = value.to_local()
    if local.shape[0] != max(0, min(per_rank, rows - rank * per_rank)):
        raise RuntimeError(
            f"rank {rank} holds {local.shape[0]} rows of a {rows}-row tensor sharded {world} ways"
        )
    step = max(1, _PIECE_BYTES // max(1, math.prod(shape) * value.dtype.itemsize))
    main = dist.get_global_rank(group, 0)
    with data.open("ab") if data is not None else contextlib.nullcontext() as file:
        for source in range(world):
            held = max(0, min(per_rank, rows - source * per_rank))
            for start in range(0, held, step):
                stop = min(held, start + step)
                if source == 0:  # the main rank's own rows
                    if file is not None:
                        _write_tensor(file, local[start:stop])
                elif source == rank:
                    dist.send(local[start:stop].contiguous(), main, group=group)
                elif file is not None:
                    piece = torch.empty((stop - start, *shape), dtype=value.dtype, device=local.device)
                    dist.recv(piece, dist.get_global_rank(group, source), group=group)
                    _write_tensor(file, piece)
                    del piece


def _row_sharded(value: DTensor) -> bool:
    return value.device_mesh.ndim == 1 and value.ndim > 0 and value.placements[0] == Shard(0)


@dataclass(frozen=True)
class _Entry:
    """A tensor written to a shard's data file: where its bytes lie there."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    size: int


class ShardWriter:
    """Safetensors files of at most `limit` bytes, filled in the order tensors come; `close` names
    them as `save_pretrained` does.

    A tensor's bytes are written as it is added, to a data file beside the shard, so the writer
    holds no tensor. Once the next tensor would not fit, the shard is laid out as `save_file` lays
    it out (`_layout`: its header, then the data ordered by dtype and name), the data copied from
    the data file (in the kernel where it can) and the data file removed: the same bytes as
    `save_file` of the tensors, at the cost of writing each byte twice."""

    def __init__(self, out: Path, limit: int) -> None:
        self.out, self.limit = out, limit
        self.pending: list[_Entry] = []
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.parameters = 0

    def _path(self, suffix: str) -> Path:
        return self.out / f".shard-{len(self.written):05d}{suffix}"

    def start(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Path:
        """Record the tensor `name` in the shard it fits in (the next one, if it does not fit in this
        one): its bytes, row-major, are to be appended to the data file returned, before the next
        tensor starts."""
        numel = math.prod(shape)
        size = numel * dtype.itemsize
        if self.pending and self.pending_bytes + size > self.limit:
            self._flush()
        self.pending.append(_Entry(name, dtype, shape, self.pending_bytes, size))
        self.pending_bytes += size
        self.total_bytes += size
        self.parameters += numel
        return self._path(".data.tmp")

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            with self.start(name, tensor.dtype, tuple(tensor.shape)).open("ab") as data:
                _write_tensor(data, tensor)

    def _flush(self) -> None:
        path, data = self._path(".tmp"), self._path(".data.tmp")
        held = data.stat().st_size if self.pending_bytes else 0
        if held != self.pending_bytes:
            raise RuntimeError(f"{data} holds {held} bytes, its tensors {self.pending_bytes}")
        header, order = _layout(self.pending)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, len(header).to_bytes(8, "little") + header)
            if order:
                src = os.open(data, os.O_RDONLY)
                try:
                    for entry in order:
                        _copy(src, fd, entry.offset, entry.size)
                finally:
                    os.close(src)
        finally:
            os.close(fd)
        data.unlink(missing_ok=True)
        self.written.append((path, [entry.name for entry in self.pending]))
        self.pending, self.pending_bytes = [], 0

    def close(self) -> list[str]:
        """The files' final names: `model.safetensors` alone, or the numbered shards and their index."""
        if self.pending or not self.written:
            self._flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.out / WEIGHTS)
            return [WEIGHTS]
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self.written, start=1):
            name = f"model-{i:05d}-of-{len(self.written):05d}.safetensors"
            path.rename(self.out / name)
            weight_map.update(dict.fromkeys(names, name))
        metadata = {"total_parameters": self.parameters, "total_size": self.total_bytes}
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return sorted(set(weight_map.values()))


def _write_tensor(file: Any, tensor: torch.Tensor) -> None:
    """The tensor's bytes (row-major, as safetensors stores them) appended to `file`, without a copy
    when it is contiguous and on the CPU."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel():
        file.write(flat.cpu().view(torch.uint8).numpy())


def _layout(entries: list[_Entry]) -> tuple[bytes, list[_Entry]]:
    """The safetensors header of `entries` (padded to 8 bytes) and the order of their data after it,
    as `save_file` writes them: safetensors itself orders zero-size stand-ins of the tensors (by
    dtype, then name) and names their dtypes; the offsets follow from the sizes."""
    metadata = {"format": "pt"}
    stand_ins = safetensors_bytes({e.name: torch.empty(0, dtype=e.dtype) for e in entries}, metadata)
    length = int.from_bytes(stand_ins[:8], "little")
    infos = json.loads(stand_ins[8 : 8 + length])
    header: dict[str, Any] = {"__metadata__": infos.pop("__metadata__")}
    by_name = {e.name: e for e in entries}
    order, start = [], 0
    for name, info in infos.items():
        entry = by_name[name]
        header[name] = {
            "dtype": info["dtype"],
            "shape": list(entry.shape),
            "data_offsets": [start, start + entry.size],
        }
        order.append(entry)
        start += entry.size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8), order


_COPY_CHUNK = 64 << 20  # bytes a copy through user space holds at a time
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def _copy(src: int, dst: int, offset: int, size: int) -> None:
    """Append `size` bytes of `src` from `offset` to `dst`: `copy_file_range` where the system has
    it, else through a buffer of at most 64 MiB."""
    kernel = getattr(os, "copy_file_range", None)
    end = offset + size
    while offset < end:
        done = 0
        if kernel is not None:
            try:
                done = kernel(src, dst, end - offset, offset)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                kernel = None
        if not done:
            chunk = os.pread(src, min(end - offset, _COPY_CHUNK), offset)
            if not chunk:
                raise OSError(errno.EIO, f"a shard's data file ends {end - offset} bytes short")
            _write_all(dst, chunk)
            done = len(chunk)
        offset += done


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _cast(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return value.to(dtype) if value.is_floating_point() else value


def sweep_exports(root: Path) -> list[Path]:
    """Remove what a killed export left under `root` (temp folders beside `final/` and, from exports
    written in place, temp shards inside it); returns them. Only for the run that holds `root`'s
    claim: no other export can be in progress there."""
    left = [p for p in root.iterdir() if _STAGED.match(p.name)] if root.is_dir() else []
    for name in (FINAL_DIR, MERGED_DIR):
        if (root / name).is_dir():
            left += (root / name).glob(".shard-*.tmp")
    for path in left:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return left


@contextlib.contextmanager
def _published(out: Path, env: DistEnv, step: int | None) -> Iterator[Path | None]:
    """The main rank's temp folder beside `out`, renamed to `out` once the block has filled it (the
    export it replaces removed after); None on the other ranks. A failed block leaves `out` as it was."""
    if not env.is_main:
        yield None
        return
    staged = temp_path(out)
    staged.mkdir(parents=True)
    try:
        yield staged
        if step is not None:
            (staged / EXPORT_RECORD).write_text(json.dumps({"step": step}) + "\n")
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    old = temp_path(out, "old") if out.exists() else None
    if old is not None:
        out.rename(old)  # a crash before the next rename leaves no `out`: the rerun exports again
    staged.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def exported_step(folder: Path) -> int | None:
    """The step the export in `folder` holds, from its EXPORT_RECORD (None: an export without one)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        return int(json.loads((folder / EXPORT_RECORD).read_text())["step"])
    return None


def _side_files(out: Path, source_folder: str | Path, processor: Processor | None) -> None:
    """The model folder's tokenizer and processor files, the processor configs replaced by `processor`
    (the pack's pixel and frame settings) when given."""
    for name in HF_SIDE_FILES:
        src = Path(source_folder) / name
        if processor is not None and name in processor:
            (out / name).write_text(json.dumps(processor[name], indent=2, sort_keys=True) + "\n")
        elif src.is_file():
            shutil.copy2(src, out / name)


def _finish_folder(
    out: Path, hf_model: Any, source_folder: str | Path, dtype: torch.dtype, processor: Processor | None
) -> None:
    """config.json and generation_config.json as `save_pretrained` writes them (the dtype the weights
    have), then the model folder's tokenizer and processor files."""
    config = copy.deepcopy(hf_model.config)
    # A family packtrain implements itself names the released class, as serving stacks know it.
    released = getattr(hf_model, "released_architecture", None)
    config.architectures = [released or type(hf_model).__name__.removeprefix("FSDP")]
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(out)
    if hf_model.can_generate():
        hf_model.generation_config.save_pretrained(out)
    _side_files(out, source_folder, processor)


def _write_model(
    out: Path,
    model: torch.nn.Module,
    hf_model: Any,
    convert: Convert,
    source_folder: str | Path,
    env: DistEnv,
    dtype: torch.dtype,
    shard_bytes: int,
    gather_dtype: torch.dtype | None,
    processor: Processor | None,
    step: int | None = None,
) -> Path | None:
    """Stream the model into the Hugging Face folder `out` (all ranks call this; rank 0 writes);
    all ranks wait for it, so no rank reads a half-written export. `gather_dtype` is what the
    weights are cast to before they are gathered (None: as trained)."""
    with _published(out, env, step) as staged:
        writer = ShardWriter(staged, shard_bytes) if staged is not None else None
        with torch.no_grad():
            for local in local_units(model, dtype=gather_dtype):
                # Every rank decides alike (on the names and shapes only), so they gather in step.
                plain = renames(convert, local)
                if plain is None:  # converted: the unit gathered whole, then converted
                    unit = _gather_unit(local, writer is not None)
                    if writer is not None:
                        writer.add(convert(unit))
                    del unit  # written: not held while the next unit is gathered
                else:
                    for new, name in plain.items():
                        value = local[name]
                        data = writer.start(new, value.dtype, tuple(value.shape)) if writer else None
                        stream_rows(value, data)
                del local
        if writer is not None and staged is not None:
            writer.close()
            _finish_folder(staged, hf_model, source_folder, dtype, processor)
    barrier()
    return out if env.is_main else None


def save_hf(
    out: Path,
    model: torch.nn.Module,
    hf_model: Any,
    source_folder: str | Path,
    env: DistEnv,
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
    processor: Processor | None = None,
    step: int | None = None,
) -> Path | None:
    """The final model as a Hugging Face folder (weights, config, tokenizer and processor files)."""

    def convert(unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plain = {k.removeprefix("hf."): v for k, v in unit.items()}  # cast as gathered
        return dict(revert_weight_conversion(hf_model, plain))

    return _write_model(
        out, model, hf_model, convert, source_folder, env, dtype, shard_bytes, dtype, processor, step
    )


def save_merged(
    out: Path,
    model: torch.nn.Module,
    hf_model: Any,
    source_folder: str | Path,
    env: DistEnv,
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
    processor: Processor | None = None,
    step: int | None = None,
) -> Path | None:
    """The adapters merged into the base weights (W + alpha/r x B·A), saved as the plain Hugging
    Face model: each unit merged as it is gathered (a LoRA layer's base and adapters come together)."""
    scale = lora.scalings(hf_model)

    def convert(unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plain = {k.removeprefix("hf."): v for k, v in unit.items()}
        merged = {k: _cast(v, dtype) for k, v in lora.merged_state_dict(plain, scale).items()}
        return dict(revert_weight_conversion(hf_model, merged))

    # Gathered as trained: W + scale·B·A is summed in the master weights' precision, then cast.
    return _write_model(
        out, model, hf_model, convert, source_folder, env, dtype, shard_bytes, None, processor, step
    )


def save_adapter(
    out: Path,
    model: torch.nn.Module,
    adapter: Any,
    source_folder: str | Path,
    env: DistEnv,
    dtype: torch.dtype,
    processor: Processor | None = None,
    step: int | None = None,
) -> Path | None:
    """The LoRA adapters in PEFT's format (adapter_config.json, adapter_model.safetensors) plus the
    tokenizer and processor files, gathered from every rank (DDP or FSDP2)."""
    trainable = {n.removeprefix("module.") for n, p in model.named_parameters() if p.requires_grad}
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for unit in gathered(model, env.is_main, keep=trainable.__contains__, dtype=dtype):
            # VLMForTraining names the HF model `hf`; PeftModel names it `base_model.model`.
            state.update({"base_model.model." + k.removeprefix("hf."): v for k, v in unit.items()})
    with _published(out, env, step) as staged:
        if staged is not None:
            adapter.save_pretrained(staged, state_dict=state)
            _side_files(staged, source_folder, processor)
    barrier()
    return out if env.is_main else None


def save_final(
    root: Path,
    model: torch.nn.Module,
    hf_model: Any,
    adapter: Any,
    spec: TrainModelSpec,
    env: DistEnv,
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
    pack: Mapping[str, Any] | None = None,
    step: int | None = None,
) -> Path | None:
    """The final export under `root`: `final/` (the model, or with LoRA the adapter) and, with
    `lora.saveMerged`, `final-merged/`. With the `pack` manifest trained on, their processor configs
    carry the pixel and frame settings the pack was made with, so serving them as they are tokenizes
    media as training saw it (the base folder's, e.g. Qwen2-VL's 12.8 MP images, would not). `step`:
    the training step exported, recorded in each folder (EXPORT_RECORD)."""
    processor = served_processor(spec.path, pack)
    final = root / FINAL_DIR
    if adapter is None:
        return save_hf(final, model, hf_model, spec.path, env, dtype, shard_bytes, processor, step)
    if spec.lora is not None and spec.lora.save_merged:  # first: a whole final/ implies its merged copy
        save_merged(root / MERGED_DIR, model, hf_model, spec.path, env, dtype, shard_bytes, processor, step)
    return save_adapter(final, model, adapter, spec.path, env, dtype, processor, step)


def served_processor(source_folder: str | Path, pack: Mapping[str, Any] | None) -> Processor | None:
    """The processor configs of a pack's settings (its manifest's `config.model`) over the model
    folder's; None without a pack or for a pack whose manifest predates its stored config."""
    config = (pack or {}).get("config")
    model = config.get("model") if isinstance(config, Mapping) else None
    if not isinstance(model, Mapping):
        return None
    return served_processor_configs(Path(source_folder), ModelConfig.model_validate(dict(model)))
