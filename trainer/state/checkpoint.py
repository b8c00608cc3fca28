"""Resumable checkpoints: sharded, written by every rank, resumable at any world size.

A checkpoint folder `checkpoints/step-NNNNNNNN/` is written through `torch.distributed.checkpoint`
(DCP): each rank writes its own part of the trainable parameters and their AdamW state
(`tensors-RRRRR.bin`, FSDP2 shards as they are, replicated tensors spread over the ranks once each)
and rank 0 the table of contents (`tensors.json`) that says where every piece of every tensor lies.
No rank ever holds the whole model or optimizer, so a 72B model checkpoints in what each rank
already holds; and DCP reads the pieces back into any layout, so a checkpoint written by 2 FSDP
ranks resumes on 1 process, on DDP or on 4 FSDP ranks. Beside it: `rng-RRRRR.json` per rank, and
`trainer.json` (step, scheduler, optimizer settings, data position, the run's settings, every file
with its size; written last). Frozen parameters (LoRA's base weights included) are not saved: they
are rebuilt from the model folder and seed as the first run built them.

Nothing is unpickled on resume (`safe_dcp`, `record`): a checkpoint is read as raw tensor bytes
and checked JSON, so a file planted on the checkpoint volume cannot run code in the trainer.
Folders of the former, pickled formats are refused unread. The folder is written as `.step-N.tmp`
and renamed once complete; a published folder found incomplete or cut short is skipped with a
WARNING for the newest complete one before it. The final Hugging Face export is `export`'s.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from packtrain.core.errors import ConfigError
from packtrain.trainer.data.sampler import Layout, plan_epoch
from packtrain.trainer.distributed import DistEnv, barrier, environ
from packtrain.trainer.state import safe_dcp
from packtrain.trainer.state.record import (
    DONE,
    FORMAT,
    STEP_DIR,
    VERSION,
    Saved,
    checked_groups,
    checked_scheduler,
    read_rng,
    read_saved,
    rng_file,
    rng_record,
    set_rng,
    step_of,
)
from packtrain.trainer.state.record import (
    check_position as check_position,  # for the resume (recipe)
)
from packtrain.trainer.state.safe_files import DamagedCheckpoint, fix, is_int, refused, write_json

MODEL, OPTIM = "model", "optim"  # the two parts of a checkpoint's DCP state dict
SHARDED = StateDictOptions(ignore_frozen_params=True)  # each rank's own part (FSDP2: DTensor shards)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of the model's state without frozen parameters (every name of a tied one: the
    torch option alone keeps a frozen tied LM head); buffers stay. No copy: FSDP2 gives its DTensor
    shards, DDP and one process the tensors themselves."""
    frozen = set(_names(model, lambda p: not p.requires_grad))
    state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=SHARDED))
    return {k: v for k, v in state.items() if k not in frozen}


def _names(model: torch.nn.Module, keep: Any) -> dict[str, torch.nn.Parameter]:
    """State-dict name (DDP's `module.` dropped; every name of a tied parameter) → parameter."""
    return {
        name.removeprefix("module."): p
        for name, p in model.named_parameters(remove_duplicate=False)
        if keep(p)
    }


def _sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint holds of the model and the optimizer, as this rank holds it."""
    return {MODEL: trainable_state(model), OPTIM: get_optimizer_state_dict(model, optimizer)}


@contextmanager
def _one_process_quietly() -> Iterator[bool]:
    """Whether DCP runs without a process group (one process), without its warning that it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield not dist.is_initialized()


def fresh_rng_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank that has no saved RNG state (the run grew): distinct per rank, the same
    for every rerun of that resume."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little")


def _rng_states(saved: Saved, env: DistEnv) -> dict[str, Any] | None:
    """This rank's saved RNG state (None: the saved run had no such rank). Every rank checks the
    files of all ranks of this run, so that all refuse a damaged one together (none waits for a
    peer in a collective)."""
    states = [read_rng(saved, rank) for rank in range(env.world_size)]
    return states[env.rank]


def _restore_rng(saved: Saved, env: DistEnv, state: dict[str, Any] | None) -> None:
    """This rank's saved RNG state; a rank the saved run did not have gets a fresh seeded one (the
    states of ranks beyond a smaller world size are not used)."""
    if state is not None:
        set_rng(state)
        return
    data = saved.state.get("data")
    seed = data.get("seed", 0) if isinstance(data, dict) else 0
    if not is_int(seed, -(1 << 63), 1 << 63):
        raise refused(saved.folder / DONE, "state.data.seed is not an integer")
    fresh = fresh_rng_seed(seed, saved.step, env.rank)
    random.seed(fresh)
    np.random.seed(fresh % 2**32)
    torch.manual_seed(fresh)


# Settings that change nothing a step computes (where things go, how fast they load, what is reported,
# when checkpoints are written), or that a run may change to be continued (its length): a checkpoint
# resumes under any value of these. Every other setting, a future one included, must match.
RESUME_NEUTRAL = frozenset(
    {
        "data.path",  # the pack is identified by its config hash instead (it may be mounted elsewhere)
        "data.packJobRef",
        "data.numWorkers",
        "data.prefetchFactor",
        "data.verifyChecksums",
        "data.evalPath",  # evaluation only
        "data.evalPackJobRef",
        "model.gradientCheckpointing",
        "model.lora.saveMerged",
        "training.maxSteps",
        "training.planCheck",  # the start-up memory check only
        "training.epochs",
        "training.evalEvery",
        "training.attention",
        "training.activationCheckpointing",
        "training.visionCheckpointing",
        "training.compile",
        "training.strategy",
        # The layout of a step (with the world size): a resume maps the data position onto the new
        # layout, or refuses where it cannot (resharded_data_state).
        "training.gradAccum",
        "training.microBatchSequences",
        "training.paddedBatchSize",
        # How a row is spread over ranks: the same step's gradient whatever it is (context_parallel);
        # the data position follows the data-parallel world it leaves, as for the world size.
        "training.contextParallel",
        "training.lossChunkTokens",
        "training.checkpointEvery",
        "training.checkpointAtEnd",
        "training.keepCheckpoints",
        "training.resume",
        "training.metricsPort",
        "training.peakTflops",
        "training.logEvery",
        "training.outputDir",
        "training.saveFinal",
    }
)


def resume_config(spec: dict[str, Any], pack_hash: Any) -> dict[str, Any]:
    """What a checkpoint must have been trained with to be resumed: the job's settings (camelCase, as
    dotted keys) less RESUME_NEUTRAL, and the pack's config hash."""
    flat: dict[str, Any] = {"data.packConfigHash": pack_hash}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value and not prefix.endswith(("configOverrides", "lrMultipliers")):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        elif prefix not in RESUME_NEUTRAL:
            flat[prefix] = value

    walk("", spec)
    return flat


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def check_resumable(folder: Path, config: dict[str, Any]) -> None:
    """ConfigError when the checkpoint in `folder` was trained with other settings than `config`, or
    does not record them (with the hash of what it records)."""
    saved = read_saved(folder)
    recorded, digest = saved.state.get("config"), saved.state.get("config_hash")
    if not isinstance(recorded, dict) or not isinstance(digest, str) or config_hash(recorded) != digest:
        raise refused(
            folder / DONE,
            "state.config and state.config_hash (the settings it was trained with) do not match",
        )
    if digest == config_hash(config):
        return
    differ = [
        f"{key} {recorded[key]!r} -> {config[key]!r}"
        for key in sorted(recorded.keys() & config.keys())
        if recorded[key] != config[key]
    ]
    if not differ:
        return  # only settings this version added or dropped
    root = folder.parent.parent
    raise ConfigError(
        f"{root} holds a checkpoint (step {saved.step}) trained with other settings: "
        f"{'; '.join(differ[:8])}{' …' if len(differ) > 8 else ''}. Resuming would mix two runs. To start "
        f"fresh, train into a new folder (`--output DIR` of `packtrain train` or `packtrain run`) or delete "
        f"{root}; to continue that run, restore its settings"
    )


_WARNED: set[str] = set()


def _warn(message: str) -> None:
    """One WARNING line on rank 0's stderr, once per message."""
    if message not in _WARNED and environ().is_main:
        _WARNED.add(message)
        print(f"WARNING {message}", file=sys.stderr, flush=True)


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root/checkpoints`, if any. A newer folder found
    incomplete or cut short (`DamagedCheckpoint`) is passed over with a WARNING naming it; with
    none complete before it, ConfigError naming it. A folder of a former format stops the scan
    (ConfigError): resuming from an older folder, or from scratch, would quietly drop that run."""
    folder = root / "checkpoints"
    if not folder.is_dir():
        return None
    found = sorted((p for p in folder.iterdir() if STEP_DIR.match(p.name)), key=step_of, reverse=True)
    broken: list[DamagedCheckpoint] = []
    for path in found:
        try:
            read_saved(path)
        except DamagedCheckpoint as exc:
            broken.append(exc)
            continue
        for skipped in broken:
            _warn(f"checkpoint {skipped.detail}: incomplete or damaged, resuming from {path} instead")
        return path
    if broken:
        raise ConfigError(f"no complete checkpoint to resume from: {broken[0]}")
    return None


def save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    env: DistEnv,
    keep: int,
) -> Path:
    """Write checkpoint `step`: all ranks call this and write their own parts; rank 0 also writes
    the shared files, then publishes the folder and prunes to the newest `keep`."""
    final = root / "checkpoints" / f"step-{step:08d}"
    tmp = root / "checkpoints" / f".step-{step:08d}.tmp"
    state = _sharded(model, optimizer)
    groups = state[OPTIM].pop("param_groups")  # settings, not tensors: in trainer.json
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    with _one_process_quietly() as no_dist:
        metadata = dcp.save(state, storage_writer=safe_dcp.TensorWriter(tmp), no_dist=no_dist)
    write_json(tmp / rng_file(env.rank), rng_record())
    barrier()
    if env.is_main:
        write_json(tmp / safe_dcp.TOC, safe_dcp.toc(metadata))
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        done = {"format": FORMAT, "version": VERSION, "step": step, "scheduler": scheduler.state_dict(),
                "param_groups": groups, "state": trainer_state, "files": files}  # fmt: skip
        write_json(tmp / DONE, done)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        older = sorted(
            (p for p in final.parent.iterdir() if STEP_DIR.match(p.name) and p != final),
            key=lambda p: p.name,
        )
        for stale in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return final


def load(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, env: DistEnv
) -> dict[str, Any]:
    """Restore everything saved by `save` into this rank's model, optimizer, schedule and RNG,
    whatever the world size that wrote it; returns the trainer state (step, data position, ...).
    Every file is checked before the tensors are read; nothing is unpickled."""
    saved = read_saved(folder)
    schedule = checked_scheduler(saved, scheduler.state_dict())
    rng = _rng_states(saved, env)
    _load_sharded(saved, model, optimizer)
    scheduler.load_state_dict(schedule)
    _restore_rng(saved, env, rng)
    return {**saved.state, "step": saved.step}


def _load_sharded(saved: Saved, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Each rank reads the pieces of its own part (DCP reshards: any world size, any strategy)."""
    folder = saved.folder
    table = safe_dcp.read_toc(folder, saved.files, (MODEL, OPTIM))
    # A fresh optimizer gets state for every parameter here (a zero-lr step) to load into.
    state = _sharded(model, optimizer)
    groups = checked_groups(saved, state[OPTIM]["param_groups"])
    stored = table.metadata.state_dict_metadata
    saved_model = {k.removeprefix(f"{MODEL}.") for k in stored if k.startswith(f"{MODEL}.")}
    trainable = _names(model, lambda p: p.requires_grad).keys()
    _check_fits(folder, sorted(trainable - saved_model) + sorted(saved_model - state[MODEL].keys()))
    # Parameters that never had a gradient yet in the saved run (e.g. the vision tower after only
    # text batches) had no AdamW state: they get none, or their step count would run one ahead.
    had = {
        fqn
        for fqn, entry in state[OPTIM]["state"].items()
        if all(f"{OPTIM}.state.{fqn}.{key}" in stored for key in entry)
    }
    wanted = {
        MODEL: {k: v for k, v in state[MODEL].items() if k in saved_model},
        OPTIM: {"state": {fqn: s for fqn, s in state[OPTIM]["state"].items() if fqn in had}},
    }
    _check_sizes(folder, wanted, table)
    with _one_process_quietly() as no_dist:
        safe_dcp.load(wanted, folder, table, no_dist)
    partial = StateDictOptions(strict=False)
    set_model_state_dict(model, wanted[MODEL], options=partial)
    optim = {"state": wanted[OPTIM]["state"], "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, optim, options=partial)
    _drop_state_not_saved(model, optimizer, had)


def _check_sizes(folder: Path, wanted: dict[str, Any], table: safe_dcp.Table) -> None:
    """ConfigError unless every tensor to load has the size the checkpoint records for it."""
    live = {f"{MODEL}.{k}": v for k, v in wanted[MODEL].items()} | {
        f"{OPTIM}.state.{fqn}.{key}": v
        for fqn, entry in wanted[OPTIM]["state"].items()
        for key, v in entry.items()
    }
    sizes = {
        k: tuple(cast(TensorStorageMetadata, md).size) for k, md in table.metadata.state_dict_metadata.items()
    }
    wrong = [k for k, v in live.items() if isinstance(v, torch.Tensor) and sizes[k] != tuple(v.shape)]
    if wrong:
        raise ConfigError(
            f"{folder} does not fit this model ({wrong[0]} has size {list(sizes[wrong[0]])}, the model "
            f"{list(live[wrong[0]].shape)}): resume with the model and model.lora / model.freeze settings "
            f"that wrote it, or {fix(folder)}"
        )


def _check_fits(folder: Path, absent: list[str]) -> None:
    """ConfigError when some trainable parameters are missing from the checkpoint or it holds others."""
    if absent:
        raise ConfigError(
            f"{folder} does not fit this model (missing or unexpected: {absent[:5]}); resume with the "
            f"model and model.lora / model.freeze settings that wrote it, or {fix(folder)}"
        )


def _drop_state_not_saved(model: torch.nn.Module, optimizer: torch.optim.Optimizer, had: set[str]) -> None:
    """No AdamW state for the parameters the saved run had none for (loading first makes some)."""
    keep = {id(p) for name, p in _names(model, lambda p: p.requires_grad).items() if name in had}
    for p in [p for p in optimizer.state if id(p) not in keep]:
        del optimizer.state[p]


def saved_state(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint's whole model and optimizer state in this process, as `get_model_state_dict` /
    `get_optimizer_state_dict` name them with full tensors: to inspect or convert a checkpoint (it
    needs the memory of the whole trainable state, at most the bytes of its tensor files; training
    never calls it)."""
    saved = read_saved(folder)
    table = safe_dcp.read_toc(folder, saved.files, (MODEL, OPTIM))
    state: dict[str, Any] = {}
    with _one_process_quietly():
        safe_dcp.load(state, folder, table, True, planner=_EmptyStateDictLoadPlanner())
    optim = {"state": state.get(OPTIM, {}).get("state", {}), "param_groups": saved.param_groups}
    return state.get(MODEL, {}), optim


# -- the data position under another layout (world size, gradAccum, micro-batch size) ---------------


def resharded_data_state(saved: dict[str, Any], layout: Layout, costs: Sequence[int]) -> dict[str, Any]:
    """The saved data position (`sampler.position_state`) mapped onto `layout`: the same global
    position, so every unit of the interrupted epoch is still trained once.

    The units trained so far in the epoch are the saved layout's first steps; the position maps when
    they are exactly the new layout's first steps: always at an epoch boundary and whenever a step
    keeps its global size (world size x gradAccum x micro-batch), elsewhere only where the epoch's
    balancing windows line up. Otherwise ConfigError, naming the settings that would map. A state of
    another seed, mode or pack is returned as is, for `sampler.resume_position` to refuse."""
    fields = asdict(layout)
    if all(saved.get(k) == v for k, v in fields.items()) or any(
        saved.get(k) != fields[k] for k in ("seed", "mode", "num_units")
    ):
        return saved
    old = replace(
        layout,
        world_size=int(saved["world_size"]),
        units_per_micro_batch=int(saved["units_per_micro_batch"]),
        grad_accum=int(saved["grad_accum"]),
    )
    epoch, index = int(saved["epoch"]), int(saved["next"])
    steps = index // old.grad_accum
    done = _units(plan_epoch(costs, old.world_size, old.units_per_rank, old.seed, epoch)[:steps])
    per_step = layout.world_size * layout.units_per_rank
    plan = plan_epoch(costs, layout.world_size, layout.units_per_rank, layout.seed, epoch)
    new_steps = len(done) // per_step
    if index % old.grad_accum == 0 and len(done) % per_step == 0 and _units(plan[:new_steps]) == done:
        position = (epoch + 1, 0) if new_steps >= len(plan) else (epoch, new_steps * layout.grad_accum)
        return {**saved, **fields, "epoch": position[0], "next": position[1]}
    global_batch = old.world_size * old.units_per_rank
    keep = global_batch % (layout.world_size * layout.units_per_micro_batch) == 0
    hint = (
        f"training.gradAccum {global_batch // (layout.world_size * layout.units_per_micro_batch)} keeps "
        f"the global batch of {global_batch} units at {layout.world_size} data-parallel ranks; "
        if keep
        else ""
    )
    raise ConfigError(
        f"cannot resume here: the checkpoint was written {steps} steps into epoch {epoch} with "
        f"{old.world_size} data-parallel ranks x {old.units_per_rank} units per step; those units are not "
        f"the first steps of that epoch with {layout.world_size} x {layout.units_per_rank}, so resuming "
        f"would train some twice and skip others. {hint}or resume with the former layout until a "
        "checkpoint at an epoch boundary "
        f"(every {old.steps_per_epoch} steps)"
    )


def _units(steps: Sequence[Sequence[Sequence[int]]]) -> set[int]:
    return {unit for step in steps for group in step for unit in group}
