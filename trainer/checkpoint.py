"""Resumable checkpoints and the final Hugging Face export.

A checkpoint folder `checkpoints/step-NNNNNNNN/` holds the full (unsharded) model
and optimizer state, the scheduler, the step, the data position and each
rank's RNG state. It is written under a temporary name and renamed once
complete, so a crash never leaves a folder that looks resumable but is not.
Full state dicts (gathered with `torch.distributed.checkpoint.state_dict`) work
the same for a plain module, DDP and FSDP2, and keep the on-disk format
independent of the world size. The final model is saved with `save_pretrained`,
so packing never changes what `from_pretrained` loads.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .distributed import DistEnv, barrier

STEP_DIR = re.compile(r"^step-(\d{8})$")
DONE = "trainer.pt"
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
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root/checkpoints`, if any."""
    folder = root / "checkpoints"
    if not folder.is_dir():
        return None
    done = [p for p in folder.iterdir() if STEP_DIR.match(p.name) and (p / DONE).is_file()]
    return max(done, key=lambda p: int(STEP_DIR.match(p.name).group(1)), default=None)  # type: ignore[union-attr]


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
    """Write checkpoint `step` (all ranks call this; rank 0 writes the shared files)."""
    final = root / "checkpoints" / f"step-{step:08d}"
    tmp = root / "checkpoints" / f".step-{step:08d}.tmp"
    model_sd = get_model_state_dict(model, options=FULL)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=FULL)
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(rng_state(), tmp / f"rng-{env.rank:05d}.pt")
    if env.is_main:
        torch.save(model_sd, tmp / "model.pt")
        torch.save(optim_sd, tmp / "optimizer.pt")
        torch.save({**trainer_state, "step": step, "scheduler": scheduler.state_dict()}, tmp / DONE)
    barrier()
    if env.is_main:
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
    """Restore everything saved by `save`; returns the trainer state (step, data position, ...)."""
    model_sd = torch.load(folder / "model.pt", map_location="cpu", weights_only=False)
    set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True))
    optim_sd = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False)
    # strict=False: parameters that never had a gradient yet (e.g. the vision tower after only
    # text batches) have no optimizer state, exactly as in the run that saved it.
    set_optimizer_state_dict(
        model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    state = torch.load(folder / DONE, map_location="cpu", weights_only=False)
    scheduler.load_state_dict(state["scheduler"])
    rng = folder / f"rng-{env.rank:05d}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, map_location="cpu", weights_only=False))
    return state


def save_hf(
    out: Path,
    model: torch.nn.Module,
    hf_model: Any,
    source_folder: str | Path,
    env: DistEnv,
    dtype: torch.dtype,
) -> Path | None:
    """The final model as a Hugging Face folder (weights, config, tokenizer and processor files)."""
    state = get_model_state_dict(model, options=FULL)
    if env.is_main:
        state = {k.removeprefix("hf."): v.to(dtype) for k, v in state.items()}
        out.mkdir(parents=True, exist_ok=True)
        hf_model.save_pretrained(out, state_dict=state)
        for name in HF_SIDE_FILES:
            src = Path(source_folder) / name
            if src.is_file():
                shutil.copy2(src, out / name)
    barrier()
    return out if env.is_main else None
