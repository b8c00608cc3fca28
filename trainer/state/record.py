"""What a checkpoint records besides its tensors, as JSON checked on the way in: `trainer.json` (the
step, the schedule, the optimizer's settings, the data position and the run's settings, and every
file of the checkpoint with its size; written last, so its presence marks a complete folder) and
one `rng-RRRRR.json` per rank (Python's and numpy's generator states are integers, torch's bytes
in base64).

Every value is checked against what it must be (the folder's step, this run's scheduler and
optimizer, the pack's layout) before anything uses it: a checkpoint volume is writable by more
than the job that wrote it, and what is read from it is untrusted. Folders of the former formats
(`trainer.pt`, `model.pt`, DCP's pickled `.metadata`) are refused without being read.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import random
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from packtrain.core.errors import ConfigError
from packtrain.core.untrusted import JsonLimits
from packtrain.trainer.data.sampler import Layout
from packtrain.trainer.state.safe_dcp import TENSOR_FILE, TOC
from packtrain.trainer.state.safe_files import (
    check_file,
    damaged,
    fix,
    is_int,
    read_json,
    refused,
)

STEP_DIR = re.compile(r"^step-(\d{8})$")
DONE = "trainer.json"
FORMAT, VERSION = "packtrain.checkpoint", 2  # version 1: the pickled trainer.pt of earlier releases
# The run's settings and the optimizer's parameter names fit in far less; a rank's RNG is ~20 KB.
DONE_LIMITS = JsonLimits(max_bytes=16 << 20, max_depth=32, max_values=1 << 20)
RNG_LIMITS = JsonLimits(max_bytes=1 << 20, max_depth=4, max_values=1 << 12)
RNG_FILE = re.compile(r"^rng-(\d{5})\.json$")
MAX_FILES = 1 << 18  # two per rank and the table of contents
# Files only the former formats have: each is a pickle, which runs code when it is read.
FORMER = ("trainer.pt", ".metadata", "model.pt", "optimizer.pt")
MT_WORDS = 624  # Mersenne Twister state words (Python's and numpy's generators)
MAX_RANKS = 1 << 20


def step_of(folder: Path) -> int:
    """The step a checkpoint folder (`step-NNNNNNNN`) holds."""
    match = STEP_DIR.match(folder.name)
    if match is None:
        raise ValueError(f"{folder} is not a checkpoint folder (step-NNNNNNNN)")
    return int(match.group(1))


def rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.json"


@dataclass(frozen=True)
class Saved:
    """A checkpoint's trainer.json, checked: its files are all there with the sizes it records."""

    folder: Path
    step: int
    scheduler: dict[str, Any]
    param_groups: list[dict[str, Any]]
    state: dict[str, Any]  # what the loop saved: the data position, the run's settings
    files: dict[str, int]  # name -> bytes


def read_saved(folder: Path) -> Saved:
    """`folder/trainer.json`, checked. DamagedCheckpoint when the folder is incomplete (no
    trainer.json, a file missing, cut short or not a regular file); ConfigError for a folder of a
    former format (never read) or values that cannot be right."""
    _check_folder(folder)
    path = folder / DONE
    doc = read_json(path, DONE_LIMITS)
    keys = {"format", "version", "step", "scheduler", "param_groups", "state", "files"}
    if not isinstance(doc, dict) or (doc.get("format"), doc.get("version")) != (FORMAT, VERSION):
        raise refused(path, f"not a checkpoint of this version ({FORMAT} {VERSION})")
    if set(doc) != keys:
        raise refused(path, f"needs exactly {sorted(keys)}")
    files, step = doc["files"], doc["step"]
    if not (
        isinstance(files, dict)
        and TOC in files
        and len(files) <= MAX_FILES
        and all(_known_file(name) and is_int(size) for name, size in files.items())
    ):
        raise refused(
            path,
            "files must name this checkpoint's files (tensors.json, tensors-*.bin, rng-*.json) with sizes",
        )
    if not is_int(step, 0, 99_999_999) or step != step_of(folder):
        raise refused(path, f"step {str(step)[:40]} is not the step of the folder's name ({folder.name})")
    groups, scheduler, state = doc["param_groups"], doc["scheduler"], doc["state"]
    if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)):
        raise refused(path, "param_groups must be a list of objects")
    if not isinstance(scheduler, dict) or not isinstance(state, dict):
        raise refused(path, "scheduler and state must be objects")
    for name, size in files.items():
        check_file(folder / name, size)
    return Saved(folder, step, scheduler, groups, state, files)


def _known_file(name: Any) -> bool:
    return isinstance(name, str) and (name == TOC or bool(TENSOR_FILE.match(name) or RNG_FILE.match(name)))


def _check_folder(folder: Path) -> None:
    """A real folder (not a symlink) with a trainer.json; one of a former format is refused unread."""
    try:
        mode = os.lstat(folder).st_mode
    except OSError as exc:
        raise ConfigError(f"{folder} cannot be read as a checkpoint ({exc.strerror})") from None
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        raise ConfigError(
            f"{folder} is not a folder the trainer wrote (a symbolic link or a file): remove it, or train "
            "into a new folder (`--output DIR` of `packtrain train` or `packtrain run`)"
        )
    if os.path.lexists(folder / DONE):
        return
    former = [name for name in FORMER if os.path.lexists(folder / name)]
    if former:
        raise ConfigError(
            f"{folder} was written by an earlier packtrain in a format that cannot be read safely "
            f"({', '.join(former)}: pickles, which run code when they are read), so it was not read. To "
            f"start fresh, train into a new folder (`--output DIR` of `packtrain train` or `packtrain run`) "
            f"or delete {folder.parent} (every checkpoint of that format)"
        )
    raise damaged(folder / DONE, "is missing (a checkpoint is published with it, last)")


# -- values checked against this run's --------------------------------------------------------------


def same_kind(saved: Any, live: Any, flags: bool = False) -> bool:
    """Whether a JSON value can stand for `live` (this run's value of the same setting): a bool for
    a bool, an integer for an integer, a finite number for a float, a list of as many for a tuple or
    list. `flags`: None also takes a bool (optimizer options whose default None means "pick")."""
    if live is None:
        return saved is None or (flags and isinstance(saved, bool))
    if isinstance(live, bool):
        return isinstance(saved, bool)
    if isinstance(live, int):
        return is_int(saved, -(1 << 62), 1 << 62)
    if isinstance(live, float):
        return type(saved) in (int, float) and math.isfinite(saved)
    if isinstance(live, str):
        return isinstance(saved, str) and len(saved) <= 256
    if isinstance(live, list | tuple):
        return (
            isinstance(saved, list)
            and len(saved) == len(live)
            and all(same_kind(s, v, flags) for s, v in zip(saved, live, strict=True))
        )
    return False


def checked_scheduler(saved: Saved, live: dict[str, Any]) -> dict[str, Any]:
    """The saved schedule's state, each key one this run's scheduler has, of its kind, and at the
    checkpoint's step (`load_state_dict` sets every key it is given as an attribute)."""
    bad = sorted(k for k, v in saved.scheduler.items() if k not in live or not same_kind(v, live[k]))
    if bad or saved.scheduler.get("last_epoch") != saved.step:
        raise refused(
            saved.folder / DONE,
            f"scheduler does not fit this run's schedule at step {saved.step} "
            f"({', '.join(bad[:5]) or 'last_epoch'})",
        )
    return dict(saved.scheduler)


def checked_groups(saved: Saved, live: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer's saved parameter groups: as many as this run's, over the same parameters, each
    setting one this optimizer has, of its kind; settings not saved keep this run's value."""
    path = saved.folder / DONE
    if len(saved.param_groups) != len(live) or any(
        s.get("params") != v["params"] for s, v in zip(saved.param_groups, live, strict=False)
    ):
        raise ConfigError(
            f"{path}: its optimizer parameter groups are not this model's: resume with the model and "
            "model.lora / model.freeze / training.lrMultipliers settings that wrote it, or "
            f"{fix(saved.folder)}"
        )
    groups = []
    for i, (s, v) in enumerate(zip(saved.param_groups, live, strict=True)):
        bad = sorted(
            k for k, x in s.items() if k != "params" and (k not in v or not same_kind(x, v[k], True))
        )
        if bad:
            raise refused(path, f"param_groups[{i}]: {', '.join(bad[:5])} not this optimizer's settings")
        groups.append({**v, **s})
    return groups


def check_position(folder: Path, layout: Layout) -> None:
    """ConfigError unless the checkpoint's data position is one this run can continue from: the
    layout's fields in range, the epoch at most the step (every epoch is at least one step), the next
    micro-batch inside its epoch, and the pack, seed and mode this run's."""
    saved = read_saved(folder)
    path, data, fields = folder / DONE, saved.state.get("data"), asdict(layout)
    if not isinstance(data, dict) or set(data) != {"epoch", "next", *fields}:
        raise refused(path, "state.data is not a data position (epoch, next and the layout it is in)")
    sizes = ("world_size", "units_per_micro_batch", "grad_accum", "num_units")
    if not (all(is_int(data[k], 1, MAX_RANKS << 20) for k in sizes) and isinstance(data["mode"], str)):
        raise refused(
            path, "state.data: world_size, units_per_micro_batch, grad_accum and num_units must be positive"
        )
    for key in ("num_units", "seed", "mode"):
        if data[key] != fields[key]:
            raise ConfigError(
                f"{path} holds a data position for {key} {str(data[key])[:40]}, this run has "
                f"{fields[key]!r}: resume with the pack and settings that wrote it, or {fix(folder)}"
            )
    then = Layout(**{k: data[k] for k in fields})
    if not is_int(data["epoch"], 0, saved.step) or not is_int(
        data["next"], 0, then.micro_batches_per_epoch - 1
    ):
        raise refused(
            path,
            f"data position epoch {str(data['epoch'])[:20]}, micro-batch {str(data['next'])[:20]} is out "
            f"of range (epoch 0..{saved.step} at step {saved.step}, micro-batch "
            f"0..{then.micro_batches_per_epoch - 1})",
        )


# -- the RNG states ---------------------------------------------------------------------------------


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def rng_record() -> dict[str, Any]:
    """This process's generator states as JSON values."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    record: dict[str, Any] = {
        "python": [version, list(words), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        record["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return record


def read_rng(saved: Saved, rank: int) -> dict[str, Any] | None:
    """Rank `rank`'s saved generator states, checked (None: the saved run had no such rank)."""
    name = rng_file(rank)
    if name not in saved.files:
        return None
    path = saved.folder / name
    doc = read_json(path, RNG_LIMITS, saved.files[name])
    if not isinstance(doc, dict) or not {"python", "numpy", "torch"} <= set(doc) <= {
        "python",
        "numpy",
        "torch",
        "cuda",
    }:
        raise refused(path, "needs python, numpy and torch generator states (and cuda)")
    py, npy = doc["python"], doc["numpy"]
    words = py[1] if isinstance(py, list) and len(py) == 3 else None
    if not (
        isinstance(words, list)
        and py[0] == 3
        and len(words) == MT_WORDS + 1
        and all(is_int(w, 0, 2**32 - 1) for w in words[:-1])
        and is_int(words[-1], 0, MT_WORDS)
        and (py[2] is None or same_kind(py[2], 0.0))
    ):
        raise refused(path, f"python: not a generator state (3, {MT_WORDS} words and a position, gauss)")
    keys = npy[1] if isinstance(npy, list) and len(npy) == 5 else None
    if not (
        isinstance(keys, list)
        and npy[0] == "MT19937"
        and len(keys) == MT_WORDS
        and all(is_int(k, 0, 2**32 - 1) for k in keys)
        and is_int(npy[2], 0, MT_WORDS)
        and npy[3] in (0, 1)
        and same_kind(npy[4], 0.0)
    ):
        raise refused(path, f"numpy: not an MT19937 state ({MT_WORDS} words, position, gauss)")
    state: dict[str, Any] = {
        "python": (3, tuple(words), py[2]),
        "numpy": ("MT19937", np.asarray(keys, dtype=np.uint32), npy[2], npy[3], float(npy[4])),
        "torch": _bytes(path, "torch", doc["torch"], torch.get_rng_state().numel()),
    }
    cuda = doc.get("cuda", [])
    if not isinstance(cuda, list) or len(cuda) > 1024:
        raise refused(path, "cuda: not a list of generator states")
    size = torch.cuda.get_rng_state(0).numel() if torch.cuda.is_available() else None
    state["cuda"] = [_bytes(path, "cuda", s, size) for s in cuda]
    return state


def _bytes(path: Path, what: str, value: Any, size: int | None) -> torch.Tensor:
    """A generator state's bytes (base64) as the byte tensor torch takes, of the length it takes."""
    try:
        raw = (
            base64.b64decode(value, validate=True)
            if isinstance(value, str) and len(value) < 1 << 16
            else None
        )
    except binascii.Error:
        raw = None
    if raw is None or len(raw) != (size if size is not None else len(raw)):
        raise refused(path, f"{what}: not a generator state of {size} bytes (base64)")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def set_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available():
        for device, cuda in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda, device)
