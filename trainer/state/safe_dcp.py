"""DCP's sharded save and load over a storage layer that holds no pickle.

`torch.distributed.checkpoint` plans what each rank writes and reads (FSDP2 shards, replicated
tensors once, resharding on load); its own file storage would torch.save every tensor and pickle
the table of contents (`.metadata`), which runs code when read. Here each rank writes its tensors
as raw bytes, one after another, into `tensors-RRRRR.bin`, and rank 0 writes the table of contents
as JSON (`tensors.json`): for each flattened state-dict name, its dtype, global size and chunks
(file, byte offset, offsets and sizes in the tensor). Reading builds DCP's `Metadata` from that JSON
after checking every field: known dtypes, plain file names the checkpoint lists, chunks inside
the tensor and covering it, byte ranges inside their file and not overlapping. A chunk is read
with `readinto` into a buffer of the size its shape says and viewed as its dtype; only the rows a
rank needs are read when its part is a run of whole rows.
"""

from __future__ import annotations

import io
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from packtrain.core.errors import ConfigError
from packtrain.core.untrusted import JsonLimits
from packtrain.trainer.state.safe_files import fix, is_int, open_regular, read_json, refused

TOC = "tensors.json"
TOC_FORMAT = "packtrain.tensors"
# ~40 bytes and ~9 values a chunk: a 72B model's AdamW state over 512 ranks is ~80 MB, ~18M values.
TOC_LIMITS = JsonLimits(max_bytes=256 << 20, max_depth=8, max_values=1 << 25)
TENSOR_FILE = re.compile(r"^tensors-(\d{5})\.bin$")
MAX_DIMS = 8
MAX_SIZE = 1 << 48  # elements along one dimension
# The dtypes a checkpoint may hold (trainable weights, buffers, AdamW state), by name.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


def tensor_file(rank: int) -> str:
    return f"tensors-{rank:05d}.bin"


@dataclass(frozen=True)
class Stored:
    """Where a written chunk's bytes lie."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """A chunk to read: its bytes, dtype and shape."""

    file: str
    offset: int
    dtype: torch.dtype
    sizes: tuple[int, ...]


class TensorWriter(StorageWriter):
    """Each rank's tensors as raw bytes in its own file; no table of contents on disk (rank 0 writes
    `toc(metadata)` once `dcp.save` returns). Only tensors: anything else is not written."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = Path(folder)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.folder = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [replace(plan, storage_data=tensor_file(rank)) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name, results = cast(str, plan.storage_data), []
        with open(self.folder / name, "wb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise TypeError(f"{item.index.fqn}: a checkpoint's tensor files hold tensors only")
                tensor = cast(torch.Tensor, planner.resolve_data(item)).detach().to("cpu").contiguous()
                raw = tensor.reshape(-1).view(torch.uint8).numpy()
                offset = f.tell()
                f.write(raw.data)
                stored = Stored(name, offset, raw.nbytes)
                results.append(WriteResult(index=item.index, size_in_bytes=raw.nbytes, storage_data=stored))
            f.flush()
            os.fsync(f.fileno())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def toc(metadata: Metadata) -> dict[str, Any]:
    """The JSON table of contents of a checkpoint `TensorWriter` wrote (`dcp.save`'s metadata)."""
    stored = cast(dict[MetadataIndex, Stored], metadata.storage_data)
    files = sorted({s.file for s in stored.values()})
    number = {name: i for i, name in enumerate(files)}
    by_fqn: dict[str, list[tuple[MetadataIndex, Stored]]] = defaultdict(list)
    for index, where in stored.items():
        by_fqn[index.fqn].append((index, where))
    tensors: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"{fqn}: a checkpoint's tensor files hold tensors only")
        sizes = {tuple(c.offsets): list(c.sizes) for c in md.chunks}
        chunks = [
            [number[where.file], where.offset, list(cast(Sequence[int], index.offset)),
             sizes[tuple(cast(Sequence[int], index.offset))]]
            for index, where in by_fqn[fqn]
        ]  # fmt: skip
        tensors[fqn] = {
            "path": list(metadata.planner_data[fqn]),
            "dtype": str(md.properties.dtype).removeprefix("torch."),
            "size": list(md.size),
            "chunks": chunks,
        }
    return {"format": TOC_FORMAT, "version": 1, "files": files, "tensors": tensors}


@dataclass
class Table:
    """A checkpoint's validated table of contents: DCP's `Metadata` and where each chunk lies."""

    metadata: Metadata
    chunks: dict[MetadataIndex, Chunk]
    sizes: dict[str, int]  # tensor file -> its bytes


def read_toc(folder: Path, files: dict[str, int], parts: tuple[str, ...]) -> Table:
    """`folder/tensors.json`, checked field by field against `files` (name -> bytes, from
    trainer.json); `parts`: the state dict's top-level keys a path may start with."""
    path = folder / TOC
    doc = read_json(path, TOC_LIMITS, files.get(TOC))
    if not isinstance(doc, dict) or doc.get("format") != TOC_FORMAT or doc.get("version") != 1:
        raise refused(path, f"not a table of contents of this version ({TOC_FORMAT} 1)")
    names, entries = doc.get("files"), doc.get("tensors")
    if not isinstance(names, list) or not isinstance(entries, dict) or len(doc) != 4:
        raise refused(path, "needs exactly format, version, files and tensors")
    if len(set(map(str, names))) != len(names) or not all(
        isinstance(n, str) and TENSOR_FILE.match(n) and n in files for n in names
    ):
        raise refused(path, "files must be distinct tensors-RRRRR.bin files that trainer.json lists")
    sizes = {name: files[name] for name in names}
    table = Table(Metadata(state_dict_metadata={}, planner_data={}, storage_data={}), {}, sizes)
    spans: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for fqn, entry in entries.items():
        _add_tensor(path, table, fqn, entry, names, parts, spans)
    for name, ranges in spans.items():
        ranges.sort()
        for (_, end, a), (start, _, b) in zip(ranges, ranges[1:], strict=False):
            if start < end:
                raise refused(path, f"{a} and {b} overlap in {name}")
    table.metadata.storage_data = table.chunks
    return table


def _add_tensor(
    path: Path,
    table: Table,
    fqn: str,
    entry: Any,
    names: list[str],
    parts: tuple[str, ...],
    spans: dict[str, list[tuple[int, int, str]]],
) -> None:
    """One tensor of the table of contents, checked, into `table`; its byte ranges into `spans`."""
    if not isinstance(entry, dict) or set(entry) != {"path", "dtype", "size", "chunks"}:
        raise refused(path, f"{fqn[:200]!r} needs exactly path, dtype, size and chunks")
    route, dtype, size, chunks = entry["path"], DTYPES.get(entry["dtype"]), entry["size"], entry["chunks"]
    if not (
        isinstance(route, list)
        and 2 <= len(route) <= 4
        and all(isinstance(p, str) for p in route)
        and route[0] in parts
        and ".".join(route) == fqn
    ):
        raise refused(path, f"{fqn[:200]!r}: its path must be names joining to it under {'/'.join(parts)}")
    if dtype is None:
        raise refused(path, f"{fqn}: dtype {str(entry['dtype'])[:40]!r} is not one of {sorted(DTYPES)}")
    if not (isinstance(size, list) and len(size) <= MAX_DIMS and all(is_int(s, 0, MAX_SIZE) for s in size)):
        raise refused(path, f"{fqn}: size must be at most {MAX_DIMS} non-negative integers")
    if not isinstance(chunks, list) or len(chunks) > len(names):
        raise refused(path, f"{fqn}: chunks must be a list, at most one per tensor file")
    md = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [])
    seen: set[int] = set()
    for chunk in chunks:
        c = _chunk(path, fqn, chunk, size, names, seen)
        md.chunks.append(ChunkStorageMetadata(torch.Size(c[1]), torch.Size(c[2])))
        where = Chunk(names[c[0]], c[3], dtype, tuple(c[2]))
        table.chunks[MetadataIndex(fqn, c[1])] = where
        end = c[3] + math.prod(c[2]) * dtype.itemsize
        if end > table.sizes[where.file]:
            raise refused(path, f"{fqn}: a chunk ends at byte {end}, past the end of {where.file}")
        spans[where.file].append((c[3], end, fqn))
    if sum(math.prod(c.sizes) for c in md.chunks) != math.prod(size):
        raise refused(path, f"{fqn}: its chunks do not add up to its size {size}")
    table.metadata.state_dict_metadata[fqn] = md
    cast(dict[str, tuple[str, ...]], table.metadata.planner_data)[fqn] = tuple(route)


def _chunk(
    path: Path, fqn: str, chunk: Any, size: list[int], names: list[str], seen: set[int]
) -> tuple[int, list[int], list[int], int]:
    """One chunk `[file, byte offset, offsets, sizes]`, checked: (file, offsets, sizes, byte offset)."""
    ok = (
        isinstance(chunk, list)
        and len(chunk) == 4
        and is_int(chunk[0], 0, len(names) - 1)
        and is_int(chunk[1])
        and all(isinstance(x, list) and len(x) == len(size) for x in chunk[2:])
        and all(
            is_int(o, 0, MAX_SIZE) and is_int(n, 0, MAX_SIZE) for o, n in zip(chunk[2], chunk[3], strict=True)
        )
        and all(o + n <= s for o, n, s in zip(chunk[2], chunk[3], size, strict=True))
    )
    if not ok:
        raise refused(path, f"{fqn}: a chunk must be [file, byte offset, offsets, sizes] inside the tensor")
    if chunk[0] in seen:
        raise refused(path, f"{fqn}: two chunks in {names[chunk[0]]}")
    seen.add(chunk[0])
    return chunk[0], chunk[2], chunk[3], chunk[1]


class TensorReader(StorageReader):
    """Reads the chunks `table` locates (DCP asks for each rank's part, whatever wrote it)."""

    def __init__(self, folder: Path, table: Table) -> None:
        super().__init__()
        self.folder, self.table = Path(folder), table

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        return None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.table.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise ConfigError(f"{self.folder}: {item.dest_index.fqn} is not a tensor in this checkpoint")
            per_file[self.table.chunks[item.storage_index].file].append(item)
        for name, items in per_file.items():
            with open_regular(self.folder / name, self.table.sizes[name]) as f:
                for item in items:
                    part = self._read(f, item)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != part.size():
                        raise ConfigError(f"{self.folder}: {item.dest_index.fqn} does not fit this model")
                    target.copy_(part)
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read(self, f: io.BufferedReader, item: ReadItem) -> torch.Tensor:
        """The part of a chunk `item` asks for: only its rows when it is a run of whole rows."""
        chunk = self.table.chunks[item.storage_index]
        offsets, lengths, sizes = list(item.storage_offsets), list(item.lengths), chunk.sizes
        start, shape = chunk.offset, sizes
        if sizes and offsets[1:] == [0] * (len(sizes) - 1) and tuple(lengths[1:]) == sizes[1:]:
            row = math.prod(sizes[1:]) * chunk.dtype.itemsize
            start, shape = start + offsets[0] * row, (lengths[0], *sizes[1:])
            offsets, lengths = [0] * len(sizes), list(shape)
        count = math.prod(shape) * chunk.dtype.itemsize
        if count == 0:
            return torch.empty(shape, dtype=chunk.dtype)
        buffer = bytearray(count)
        f.seek(start)
        if f.readinto(buffer) != count:
            raise ConfigError(f"{self.folder / chunk.file} ended early: {fix(self.folder)}")
        tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(chunk.dtype).reshape(shape)
        for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def load(
    state: dict[str, Any], folder: Path, table: Table, no_dist: bool, planner: LoadPlanner | None = None
) -> None:
    """DCP's load of `state` (DCP's default planner, or `planner`) from the checkpoint `table`
    describes. DCP gathers every rank's exception and raises them together on all ranks (a
    BaseException): a rank's ConfigError is raised as such everywhere, so that every rank stops
    with it; any other failure is a crash."""
    try:
        _load_state_dict(state, storage_reader=TensorReader(folder, table), planner=planner, no_dist=no_dist)
    except CheckpointException as exc:
        failures = [pair[0] for _, pair in sorted(exc.failures.items())]
        first = next((e for e in failures if isinstance(e, ConfigError)), None)
        if first is None:
            raise RuntimeError(f"reading {folder} failed: {failures[0]!r}") from failures[0]
        raise ConfigError(str(first)) from None
