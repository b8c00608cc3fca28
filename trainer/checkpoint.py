"""Resumable checkpoints and the final Hugging Face export.

A checkpoint folder `checkpoints/step-NNNNNNNN/` holds the full (unsharded) trainable
parameters (frozen ones, LoRA's base weights included, are rebuilt from the model folder
and seed as the first run built them) and optimizer state, the scheduler, the step, the
data position and each rank's RNG state. It is written under a temporary name and renamed once
complete, so a crash never leaves a folder that looks resumable but is not.
Full state dicts (gathered with `torch.distributed.checkpoint.state_dict`) work
the same for a plain module, DDP and FSDP2, and keep the on-disk format
independent of the world size. The final model is saved with `save_pretrained`,
so packing never changes what `from_pretrained` loads; with LoRA, the final model is a
PEFT adapter (`PeftModel.from_pretrained(base, folder)`) and optionally the merged model.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from packtrain.packer.core.errors import ConfigError
from packtrain.trainer import lora
from packtrain.trainer.config import TrainModelSpec
from packtrain.trainer.distributed import DistEnv, barrier

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
TRAINABLE = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
MERGED_DIR = "final-merged"


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict without frozen parameters (every name of a tied one: the torch option
    alone keeps a frozen tied LM head), on CPU; buffers stay."""
    frozen = set(_names(model, lambda p: not p.requires_grad))
    return {k: v for k, v in _model_state(model, TRAINABLE).items() if k not in frozen}


def _model_state(model: torch.nn.Module, options: StateDictOptions) -> dict[str, torch.Tensor]:
    """A module's full state dict: tensors only (the union torch annotates covers optimizer state)."""
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


def _names(model: torch.nn.Module, keep: Any) -> dict[str, torch.nn.Parameter]:
    """State-dict name (DDP's `module.` dropped; every name of a tied parameter) → parameter."""
    return {
        name.removeprefix("module."): p
        for name, p in model.named_parameters(remove_duplicate=False)
        if keep(p)
    }


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
        "training.epochs",
        "training.evalEvery",
        "training.attention",
        "training.activationCheckpointing",
        "training.visionCheckpointing",
        "training.compile",
        "training.strategy",
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
    """ConfigError when the checkpoint in `folder` was trained with other settings than `config`
    (a checkpoint written before checkpoints recorded them resumes unchecked)."""
    state = torch.load(folder / DONE, map_location="cpu", weights_only=False)
    saved = state.get("config")
    if not isinstance(saved, dict) or state.get("config_hash") == config_hash(config):
        return
    differ = [
        f"{key} {saved[key]!r} -> {config[key]!r}"
        for key in sorted(saved.keys() & config.keys())
        if saved[key] != config[key]
    ]
    if not differ:
        return  # only settings this version added or dropped
    root = folder.parent.parent
    raise ConfigError(
        f"{root} holds a checkpoint (step {state.get('step')}) trained with other settings: "
        f"{'; '.join(differ[:8])}{' …' if len(differ) > 8 else ''}. Resuming would mix two runs. To start "
        f"fresh, train into a new folder (`--output DIR` of `packtrain train` or `packtrain run`) or delete "
        f"{root}; to continue that run, restore its settings"
    )


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
    model_sd = trainable_state(model)
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
    keys = set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True, strict=False))
    trainable = _names(model, lambda p: p.requires_grad)
    absent = sorted(trainable.keys() & set(keys.missing_keys)) + sorted(keys.unexpected_keys)
    if absent:
        raise ValueError(
            f"{folder} does not fit this model (missing or unexpected: {absent[:5]}); resume with the "
            "model and model.lora / model.freeze settings that wrote it, or use a new training.outputDir"
        )
    optim_sd = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False)
    # strict=False: parameters that never had a gradient yet (e.g. the vision tower after only
    # text batches) have no optimizer state, exactly as in the run that saved it.
    set_optimizer_state_dict(
        model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    # Loading first creates state for every parameter (a zero-lr step); drop it where the saved run
    # had none, or AdamW's step count for those parameters runs one ahead of a straight run's.
    saved = {id(p) for name, p in trainable.items() if name in optim_sd["state"]}
    for p in [p for p in optimizer.state if id(p) not in saved]:
        del optimizer.state[p]
    state = torch.load(folder / DONE, map_location="cpu", weights_only=False)
    scheduler.load_state_dict(state["scheduler"])
    rng = folder / f"rng-{env.rank:05d}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, map_location="cpu", weights_only=False))
    return state


def _export(
    out: Path,
    gathered: dict[str, torch.Tensor],
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    saver: Any,
    source_folder: str | Path,
    env: DistEnv,
) -> Path | None:
    """Write one Hugging Face folder from a state dict every rank gathered: the main rank converts
    the names and dtypes, saves with `saver.save_pretrained` and copies the tokenizer and processor
    files; all ranks wait for it, so no rank reads a half-written export."""
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        saver.save_pretrained(out, state_dict=convert(gathered))
        for name in HF_SIDE_FILES:
            src = Path(source_folder) / name
            if src.is_file():
                shutil.copy2(src, out / name)
    barrier()
    return out if env.is_main else None


def save_hf(
    out: Path,
    model: torch.nn.Module,
    hf_model: Any,
    source_folder: str | Path,
    env: DistEnv,
    dtype: torch.dtype,
) -> Path | None:
    """The final model as a Hugging Face folder (weights, config, tokenizer and processor files)."""
    return _export(
        out,
        _model_state(model, FULL),
        lambda state: {k.removeprefix("hf."): v.to(dtype) for k, v in state.items()},
        hf_model,
        source_folder,
        env,
    )


def save_final(
    root: Path,
    model: torch.nn.Module,
    hf_model: Any,
    adapter: Any,
    spec: TrainModelSpec,
    env: DistEnv,
    dtype: torch.dtype,
) -> Path | None:
    """The final export under `root`: `final/` (the model, or with LoRA the adapter) and, with
    `lora.saveMerged`, `final-merged/`."""
    if adapter is None:
        return save_hf(root / "final", model, hf_model, spec.path, env, dtype)
    final = save_adapter(root / "final", model, adapter, spec.path, env, dtype)
    if spec.lora is not None and spec.lora.save_merged:
        save_merged(root / MERGED_DIR, model, hf_model, spec.path, env, dtype)
    return final


def save_adapter(
    out: Path,
    model: torch.nn.Module,
    adapter: Any,
    source_folder: str | Path,
    env: DistEnv,
    dtype: torch.dtype,
) -> Path | None:
    """The LoRA adapters in PEFT's format (adapter_config.json, adapter_model.safetensors) plus the
    tokenizer and processor files, gathered from every rank (DDP or FSDP2)."""
    # VLMForTraining names the HF model `hf`; PeftModel names it `base_model.model`.
    return _export(
        out,
        trainable_state(model),
        lambda state: {"base_model.model." + k.removeprefix("hf."): v.to(dtype) for k, v in state.items()},
        adapter,
        source_folder,
        env,
    )


def save_merged(
    out: Path,
    model: torch.nn.Module,
    hf_model: Any,
    source_folder: str | Path,
    env: DistEnv,
    dtype: torch.dtype,
) -> Path | None:
    """The adapters merged into the base weights (W + alpha/r x B·A), saved as the plain Hugging
    Face model: merged from the gathered state dict, so sharded (FSDP2) weights merge the same."""

    def convert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plain = {k.removeprefix("hf."): v for k, v in state.items()}
        merged = lora.merged_state_dict(plain, lora.scalings(hf_model))
        return {k: v.to(dtype) for k, v in merged.items()}

    return _export(out, _model_state(model, FULL), convert, hf_model, source_folder, env)
