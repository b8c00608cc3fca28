"""What a run is built from, in the order it is built: data, model, optimizer and schedule, resume.

Data comes first, so a folder that is not a pack, or too small a pack, fails before a
(possibly many-GB) model is built. Each step is a function of the job's config and what the
steps before it made; `setup` only strings them together into the `Run` the loop trains.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from packtrain.core.errors import ConfigError
from packtrain.core.memory_plan import unsplit_family
from packtrain.core.model_folder import ModelFolder
from packtrain.core.model_spec import ModelSpec, family_for_model_type
from packtrain.core.report import rejects_warning
from packtrain.core.sft_config import DEFAULT_MAX_STEPS, SFTSpecCore
from packtrain.trainer import distributed
from packtrain.trainer.accounting import TiledShape, model_shape
from packtrain.trainer.data.layout_check import check_pack_layout
from packtrain.trainer.data.media import PixelSpec
from packtrain.trainer.data.packed import EvalDataset, PackedDataset, eval_dataset
from packtrain.trainer.data.sampler import PackTooSmall, Plan, imbalance, plan_epoch, total_steps
from packtrain.trainer.metrics import ModelShape
from packtrain.trainer.model import context_parallel, lora, param_groups
from packtrain.trainer.model.attention import resolve_attention
from packtrain.trainer.model.build import (
    VLMForTraining,
    apply_layer_options,
    build_model,
    checked_spec,
    init_used,
    load_config,
    pretrained_weights,
)
from packtrain.trainer.model.context_parallel import Mesh
from packtrain.trainer.model.init_weights import LoadReport, cast_frozen, materialize
from packtrain.trainer.model.vision_check import require_vision_features
from packtrain.trainer.state import checkpoint
from packtrain.trainer.state.export import FINAL_DIR, MERGED_DIR, exported_step


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "bf16":
        return torch.bfloat16
    if name == "fp32":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


@dataclass
class Data:
    """The training pack, as this rank reads it, and what the schedule needs from it."""

    dataset: PackedDataset
    evaluation: EvalDataset | None
    max_steps: int  # training.maxSteps, or epochs x steps per epoch
    first_plan: Plan  # epoch 0's plan (planned up front: it raises when the pack is too small)


@dataclass
class Model:
    """The model as it trains, and the pieces of it the export and the accounting need."""

    hf: Any  # the Hugging Face model (for the export)
    model: torch.nn.Module  # what trains: VLMForTraining, wrapped by DDP/FSDP when distributed
    shape: ModelShape | TiledShape
    adapter: Any  # the PeftModel around `hf` with model.lora (for the adapter export), else None
    load: LoadReport | None = None  # what materialising the weights read and held on this rank


@dataclass
class Run:
    """Everything setup builds for the steps: data, model, optimizer and where the run starts."""

    dataset: PackedDataset
    hf: Any  # the Hugging Face model (for the export)
    model: torch.nn.Module  # what trains: VLMForTraining, wrapped by DDP/FSDP when distributed
    shape: ModelShape | TiledShape
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    dtype: torch.dtype
    backend: str
    imbalance_max: float  # attention-cost imbalance of the epoch this run starts in
    max_steps: int  # training.maxSteps, or epochs x steps per epoch
    evaluation: EvalDataset | None  # the evaluation set, if any
    init: str  # what the model started from (`init_used`), for the start-up line and the summary
    step: int = 0
    resumed_from: Path | None = None
    adapter: Any = None  # the PeftModel around `hf` with model.lora (for the adapter export)
    config: dict[str, Any] | None = None  # what a checkpoint records and a resume checks (resume_config)
    skipped: int = 0  # non-finite steps this run skipped (training.maxNonFiniteSteps)
    mesh: Mesh = field(default_factory=Mesh.single)  # data-parallel x context-parallel (context_parallel)


@dataclass
class Finished:
    """A rerun that found every step done (and exported): nothing is built, nothing trains."""

    checkpoint: Path  # the newest checkpoint, at the run's last step
    step: int
    dataset: PackedDataset
    evaluation: EvalDataset | None
    backend: str
    imbalance_max: float
    init: str


def setup(cfg: SFTSpecCore, env: distributed.DistEnv, device: torch.device) -> Run | Finished:
    """Data, then model, then optimizer and schedule, then the checkpoint to resume from; a run whose
    output already holds every step stops after the data (`Finished`), before the model is built."""
    if cfg.data.path is None:
        raise ValueError(
            f"data.packJobRef {cfg.data.pack_job_ref!r} must be resolved to data.path (the operator does)"
        )
    dtype, backend, weights, (folder, config) = _start(cfg, device)
    mesh = _mesh(cfg, env, config)
    data = _setup_data(cfg.data.path, cfg, env, config, checked_spec(folder, config), mesh)
    done = _finished(cfg, data)
    if done is not None:
        step = checkpoint.step_of(done)
        return Finished(
            done, step, data.dataset, data.evaluation, backend, _imbalance(data), init_used(weights)
        )
    built = _setup_model(cfg, env, device, dtype, backend, weights, (folder, config), mesh)
    optimizer, scheduler = _setup_optimizer(cfg, built.model, data.max_steps)
    step, resumed_from = _resume(cfg, env, built.model, optimizer, scheduler, data)
    return Run(
        dataset=data.dataset,
        hf=built.hf,
        model=built.model,
        shape=built.shape,
        optimizer=optimizer,
        scheduler=scheduler,
        dtype=dtype,
        backend=backend,
        imbalance_max=_imbalance(data),
        max_steps=data.max_steps,
        evaluation=data.evaluation,
        init=init_used(weights),
        step=step,
        resumed_from=resumed_from,
        adapter=built.adapter,
        config=_resume_config(cfg, data.dataset),
        mesh=mesh,
    )


@dataclass
class Scoring:
    """What `packtrain train --score` reads: the model as a run starts (no optimizer, no checkpoint)
    and every sequence of the pack, this rank's round-robin share (`EvalDataset`)."""

    dataset: EvalDataset
    built: Model
    dtype: torch.dtype
    init: str


def setup_scoring(cfg: SFTSpecCore, env: distributed.DistEnv, device: torch.device) -> Scoring:
    """The pack (all of it, held-out sequences included, in pack order) and the model the run would
    start from: built, adapted, frozen and sharded as `setup` builds it for training."""
    if cfg.data.path is None:
        raise ValueError(f"data.packJobRef {cfg.data.pack_job_ref!r} must be resolved to data.path")
    dtype, backend, weights, (folder, config) = _start(cfg, device)
    spec = checked_spec(folder, config)
    dataset = EvalDataset(cfg.data.path, spec, PixelSpec.from_model(spec), **_reading(cfg, env, config))
    _check_pack(dataset, cfg, spec)
    built = _setup_model(cfg, env, device, dtype, backend, weights, (folder, config))
    return Scoring(dataset, built, dtype, init_used(weights))


def _start(
    cfg: SFTSpecCore, device: torch.device
) -> tuple[torch.dtype, str, Path | None, tuple[ModelFolder, PretrainedConfig]]:
    """The seeded RNG, compute dtype, attention backend, weights and model.path as read once
    (config.json, its family, tokenizer and processor files, weights), before any data or model."""
    t = cfg.training
    torch.manual_seed(t.seed)
    dtype = resolve_dtype(t.dtype, device)
    backend = resolve_attention(t.attention, device, dtype=dtype)
    folder = ModelFolder(cfg.model.path, cfg.model.config_overrides, cfg.model.family)
    config = load_config(folder)
    require_vision_features(config)  # before the model is built: vision features must reach it
    weights = pretrained_weights(folder, cfg.model.init)  # no weights: refused unless init: random
    return dtype, backend, weights, (folder, config)


def _check_pack(dataset: PackedDataset, cfg: SFTSpecCore, spec: ModelSpec) -> None:
    """The pack made for this model's family, with the media layout its processor writes."""
    pack_family = dataset.manifest.get("family")
    if pack_family not in (None, spec.family.name):
        raise ValueError(f"the pack was made for {pack_family} but the model is {spec.family.name}")
    check_pack_layout(dataset.manifest, cfg.model.path, spec)


def _mesh(cfg: SFTSpecCore, env: distributed.DistEnv, config: PretrainedConfig) -> Mesh:
    """The data-parallel x context-parallel world of this run (training.contextParallel), checked
    against the world size and the model's attention heads before anything is read."""
    size = cfg.training.context_parallel
    if size == 1:
        return Mesh.single(env.rank, env.world_size)
    if cfg.training.mode != "packed":
        raise ConfigError(
            "training.contextParallel splits packed rows; set training.mode: packed or contextParallel: 1"
        )
    family = family_for_model_type(config.model_type)
    if not family.context_parallel:
        raise ConfigError(f"training.contextParallel {size}: {unsplit_family(family.name)}")
    text = config.text_config
    context_parallel.check_mesh(
        env.world_size, size, text.num_attention_heads, getattr(text, "num_key_value_heads", None)
    )
    return context_parallel.make_mesh(env.rank, env.world_size, size)


def _reading(
    cfg: SFTSpecCore, env: distributed.DistEnv, config: PretrainedConfig, mesh: Mesh | None = None
) -> dict[str, Any]:
    """How this rank reads a pack, for training and for scoring alike: the ranks of a context group
    read the same micro-batches (their data-parallel rank's)."""
    t = cfg.training
    mesh = mesh or Mesh.single(env.rank, env.world_size)
    return {
        "rank": mesh.dp_rank,
        "world_size": mesh.dp_size,
        "units_per_micro_batch": t.micro_batch_sequences if t.mode == "packed" else t.padded_batch_size,
        "mode": t.mode,
        "pad_token_id": config.text_config.pad_token_id,
        # One process per node reads every shard to check it; its peers share that filesystem.
        "verify_checksums": cfg.data.verify_checksums and env.local_rank == 0,
        "vocab_size": config.text_config.vocab_size,
    }


def _setup_data(
    path: str,
    cfg: SFTSpecCore,
    env: distributed.DistEnv,
    config: PretrainedConfig,
    spec: ModelSpec,
    mesh: Mesh,
) -> Data:
    """This rank's view of the pack at `path`, checked against the model, and the run's length."""
    t = cfg.training
    dataset = PackedDataset(
        path,
        spec,
        PixelSpec.from_model(spec),
        grad_accum=t.grad_accum,
        seed=t.seed,
        eval_fraction=cfg.data.eval_fraction,
        **_reading(cfg, env, config, mesh),
    )
    _check_pack(dataset, cfg, spec)
    lay = dataset.layout
    try:  # planning epoch 0 raises when the pack holds less than one global step
        first_plan = plan_epoch(dataset.costs, lay.world_size, lay.units_per_rank, lay.seed, 0)
    except PackTooSmall as exc:
        raise PackTooSmall(f"{exc}; {_reject_share(dataset)}") from None
    max_steps = total_steps(t.max_steps, t.epochs, lay, DEFAULT_MAX_STEPS)
    return Data(dataset, eval_dataset(dataset, cfg.data), max_steps, first_plan)


def _reject_share(dataset: PackedDataset) -> str:
    """The pack's reject share (rejected / input samples, from its manifest), the usual reason a
    pack is smaller than expected, with where its rejects are listed."""
    counts = dataset.manifest.get("counts") or {}
    warning = rejects_warning(counts, dataset.path)
    return warning or f"none of its {counts.get('input', '?')} input samples was rejected (reject share 0%)"


def _finished(cfg: SFTSpecCore, data: Data) -> Path | None:
    """The newest checkpoint when it already holds the run's last step (and, with saveFinal, the export
    was written): a rerun then has nothing to build or train. Its settings must match this run's."""
    t = cfg.training
    newest = checkpoint.latest(Path(t.output_dir)) if t.resume else None
    if newest is not None:  # a data position this run cannot continue from: refused before the model
        checkpoint.check_position(newest, data.dataset.layout)
    if newest is None or checkpoint.step_of(newest) < data.max_steps:
        return None
    checkpoint.check_resumable(newest, _resume_config(cfg, data.dataset))
    final = Path(t.output_dir) / FINAL_DIR
    exported = (final / "config.json").is_file() or (final / "adapter_config.json").is_file()
    # An export of an earlier step (its run trained on but was killed before it replaced it) is stale.
    exported = exported and exported_step(final) in (None, checkpoint.step_of(newest))
    if cfg.model.lora is not None and cfg.model.lora.save_merged:
        exported = exported and (Path(t.output_dir) / MERGED_DIR / "config.json").is_file()
    return newest if exported or not t.save_final else None


def _setup_model(
    cfg: SFTSpecCore,
    env: distributed.DistEnv,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    weights: Path | None,
    model_config: tuple[ModelFolder, PretrainedConfig],
    mesh: Mesh | None = None,
) -> Model:
    """The model built empty (on the meta device), with adapters, layer options and frozen parts
    applied, then parallelized and only then given its weights: each rank allocates and reads
    only what it holds (see `materialize`). `model_config`: model.path as `setup` read it, and the
    transformers config made of it (the model is built from these, not from a second reading).

    Mixed precision: trainable weights and AdamW state stay fp32 (bf16 weights would round most
    small updates away); matmuls run in `dtype` under autocast. Frozen weights may be bf16."""
    t = cfg.training
    folder, config = model_config
    hf = build_model(
        folder,
        init=cfg.model.init,
        config=config,
        dtype=torch.float32,
        attention=backend,
        seed=t.seed,
        device=device,
        empty=True,
    )
    # LoRA first: it sets requires_grad (only adapters train) before freezing, DDP/FSDP and the optimizer.
    adapter = lora.apply(hf, cfg.model.lora, cfg.model.path) if cfg.model.lora else None
    apply_layer_options(hf, t.activation_checkpointing, t.vision_checkpointing, t.compile)
    param_groups.freeze(hf, cfg.model.freeze)  # after anything setting requires_grad, before DDP/FSDP
    if _frozen_dtype(cfg, dtype) == torch.bfloat16:
        cast_frozen(hf, torch.bfloat16)
    core = VLMForTraining(
        hf, backend, always_run_vision=env.distributed, loss_chunk_tokens=t.loss_chunk_tokens, mesh=mesh
    )
    shape = model_shape(hf)
    loads: list[LoadReport] = []
    model = distributed.parallelize(
        core, t.strategy, env, device, compute_dtype=dtype,
        fill=lambda m: loads.append(materialize(m, device, weights=weights, seed=t.seed)),
    )  # fmt: skip
    return Model(hf=hf, model=model, shape=shape, adapter=adapter, load=loads[0])


def _frozen_dtype(cfg: SFTSpecCore, dtype: torch.dtype) -> torch.dtype:
    """model.frozenDtype, checked: bf16 frozen weights need bf16 compute (fp32 activations would
    meet bf16 weights outside autocast, e.g. pixels cast to a frozen tower's dtype)."""
    if cfg.model.frozen_dtype == "fp32":
        return torch.float32
    if dtype != torch.bfloat16:
        raise ConfigError(
            "model.frozenDtype bf16 needs bf16 compute (training.dtype: bf16, or auto on a GPU); "
            "set training.dtype: bf16 or model.frozenDtype: fp32"
        )
    return torch.bfloat16


def _setup_optimizer(
    cfg: SFTSpecCore, model: torch.nn.Module, max_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters' groups, and the warmup + cosine schedule."""
    t = cfg.training
    optimizer = torch.optim.AdamW(
        param_groups.optimizer_groups(model, t.lr, t.weight_decay, t.lr_multipliers)
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.warmup, max_steps))


def _resume(
    cfg: SFTSpecCore,
    env: distributed.DistEnv,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    data: Data,
) -> tuple[int, Path | None]:
    """The newest checkpoint's state loaded into the model, optimizer, schedule and data position
    (with training.resume and a checkpoint there): the step to start at, and the folder.

    The checkpoint may come from another world size, gradAccum or micro-batch size: the model and
    optimizer reshard (checkpoint.load), the data position moves to the same global position
    (checkpoint.resharded_data_state, which refuses where there is none), and a run sized by
    training.epochs gets the length (and cosine) that ends after its epochs with the new step size."""
    t, dataset = cfg.training, data.dataset
    resumed_from = checkpoint.latest(Path(t.output_dir)) if t.resume else None
    if resumed_from is None:
        return 0, None
    checkpoint.check_resumable(resumed_from, _resume_config(cfg, dataset))
    checkpoint.check_position(resumed_from, dataset.layout)
    state = checkpoint.load(resumed_from, model, optimizer, scheduler, env)
    saved = state["data"]
    dataset.load_state_dict(checkpoint.resharded_data_state(saved, dataset.layout, dataset.costs))
    step, lay = int(state["step"]), dataset.layout
    layout_keys = ("world_size", "units_per_micro_batch", "grad_accum")
    saved_step_units = math.prod(int(saved.get(k, 1)) for k in layout_keys)
    if (
        t.max_steps is None
        and t.epochs is not None
        and saved_step_units != lay.world_size * lay.units_per_rank
    ):
        pos = dataset.position
        data.max_steps = step + (t.epochs - pos.epoch) * lay.steps_per_epoch - pos.next // lay.grad_accum
        scheduler.lr_lambdas = [lr_lambda(t.warmup, data.max_steps) for _ in scheduler.lr_lambdas]
    return step, resumed_from


def _resume_config(cfg: SFTSpecCore, dataset: PackedDataset) -> dict[str, Any]:
    """The settings a checkpoint of this run records, and a resume must match (see checkpoint)."""
    return checkpoint.resume_config(cfg.dump(), dataset.manifest.get("config_hash"))


def _imbalance(data: Data) -> float:
    """Max/mean attention cost over ranks of the epoch the run starts in (after a resume: its epoch)."""
    dataset, lay = data.dataset, data.dataset.layout
    epoch = dataset.position.epoch
    plan = (
        plan_epoch(dataset.costs, lay.world_size, lay.units_per_rank, lay.seed, epoch)
        if epoch
        else data.first_plan
    )
    return imbalance(plan, dataset.costs)["max"]
