"""The pydantic models of an SFTJob spec (the PackJob's are `config.py`), in the core because the
trainer runs them and the operator embeds them in its CRD, and neither imports the other.

The same YAML runs locally (`packtrain train -c job.yaml`) and on a cluster: the
operator embeds `SFTSpecCore`'s sections in the `SFTJob` CRD, so every field is
camelCase, documented and defaulted, and unknown keys are errors.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from packtrain.core.config import CamelModel, FamilyName
from packtrain.core.config_keys import check_config_overrides
from packtrain.core.errors import ConfigError
from packtrain.core.model_folder import ModelFolder
from packtrain.core.model_size import dimension_problems, limits_schema, model_dims
from packtrain.core.spec_file import load_spec_section

Init = Literal["auto", "pretrained", "random"]
Attention = Literal["auto", "varlen", "flash", "flex", "sdpa"]
Mode = Literal["packed", "padded"]
Strategy = Literal["ddp", "fsdp"]
DType = Literal["auto", "bf16", "fp32"]
FrozenDType = Literal["fp32", "bf16"]
# The parts of a VLM that freezing and per-module learning rates address (trainer.param_groups maps them).
Module = Literal["vision", "merger", "llm", "embeddings"]
# Each dataloader worker is a process holding decoded media: more than this per rank only exhausts a node.
MAX_NUM_WORKERS = 64
# Label rows whose logits exist at once in the loss: 1024 x 151,936 fp32 is 0.6 GiB, below the
# LM head's own weight gradient (0.9-1.2 GiB for 1536-2048 hidden), so smaller chunks save little.
LOSS_CHUNK_TOKENS = 1024
# model.lora's default targets: the attention and MLP projections of the Qwen2/2.5 language model
# (q/k/v/o, gate/up/down), Qwen3.5's linear-attention projections (in_proj_qkv, in_proj_z, out_proj;
# no other family has layers by these names) and of the vision blocks (qkv, proj; fc1/fc2 in
# Qwen2-VL's MLP).
LORA_TARGET_MODULES = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    *("in_proj_qkv", "in_proj_z", "out_proj"),
    *("qkv", "proj", "fc1", "fc2"),
)
# Optimizer steps of a run that sets neither training.maxSteps nor training.epochs.
DEFAULT_MAX_STEPS = 100
# Holding out more than half of the training pack is a mistake, not an evaluation set.
MAX_EVAL_FRACTION = 0.5


class DataSpec(CamelModel):
    """Which pack to train on: a folder written by `packtrain pack run`, or a PackJob by name."""

    path: str | None = Field(None, description="Pack output folder (holds manifest.json and shards/).")
    pack_job_ref: str | None = Field(
        None, description="Name of a PackJob in the same namespace; the operator mounts its output as `path`."
    )
    num_workers: int = Field(
        2, ge=0, le=MAX_NUM_WORKERS, description="Dataloader worker processes per rank (media decoding)."
    )
    prefetch_factor: int = Field(
        2, ge=1, le=64, description="Micro-batches each worker decodes ahead (each holds decoded media)."
    )
    verify_checksums: bool = Field(
        True, description="Check shard sha256 against the manifest on open (local rank 0 of each node)."
    )
    eval_path: str | None = Field(
        None, description="Evaluation pack folder (same model family), never trained on."
    )
    eval_pack_job_ref: str | None = Field(
        None,
        description="Name of a PackJob whose pack is the evaluation set; the operator mounts it as "
        "`evalPath`.",
    )
    eval_fraction: float = Field(
        0.0,
        ge=0.0,
        le=MAX_EVAL_FRACTION,
        description="Share of the training pack's sequences held out (seeded by training.seed) as the "
        "evaluation set instead of an evaluation pack; 0: none.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if self.path is None and self.pack_job_ref is None:
            raise ValueError("data needs `path` (a pack folder) or `packJobRef` (a PackJob name)")
        sources = [self.eval_path is not None, self.eval_pack_job_ref is not None, self.eval_fraction > 0]
        if sum(sources) > 1:
            raise ValueError("data needs at most one of `evalPath`, `evalPackJobRef` or `evalFraction`")
        return self


class LoraSpec(CamelModel):
    """LoRA adapters (PEFT) on the model's linear layers; every base weight stays frozen."""

    rank: int = Field(16, ge=1, le=1024, description="Rank r of each adapter (B·A with inner size r).")
    alpha: float = Field(32.0, gt=0, description="Adapters add alpha / rank x B·A to the frozen weight.")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapters' input. 0 keeps packed training exactly equal to each sample "
        "alone (dropout masks depend on the row layout).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGET_MODULES),
        min_length=1,
        max_length=64,
        description="Linear layers that get adapters: regular expressions matched against the last part of "
        "each module name (q_proj, fc1, ...), in the language model and, with vision, in the vision tower. "
        "Default: the attention and MLP projections of both.",
    )
    vision: bool = Field(
        False, description="Adapters in the vision tower too (default: the language model only)."
    )
    save_merged: bool = Field(
        False,
        description="Also save the adapters merged into the base weights as a full Hugging Face model "
        "(outputDir/final-merged), next to the adapter (outputDir/final).",
    )

    @model_validator(mode="after")
    def _patterns_compile(self) -> LoraSpec:
        for pattern in self.target_modules:
            if not pattern or len(pattern) > 100:
                raise ValueError(f"lora.targetModules entry {pattern!r} must be 1-100 characters")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(
                    f"lora.targetModules entry {pattern!r} is not a regular expression: {exc}"
                ) from exc
        return self


class TrainModelSpec(CamelModel):
    """The model: a Hugging Face folder with config.json (+ weights when pretrained)."""

    path: str = Field(..., description="Folder with config.json, tokenizer and preprocessor config.")
    family: FamilyName | None = Field(
        None, description="A model family packtrain knows; default: from config.json model_type."
    )
    init: Init = Field(
        "auto",
        description="Where the weights start. auto (default) and pretrained: the *.safetensors in "
        "model.path, which must be there (a folder without them is an error, not a silent random model); "
        "random: a random init from config.json (training from scratch, or a tiny test model).",
    )
    config_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Keys merged into config.json before building (nested dicts for textConfig/visionConfig "
        "keys use the config's own snake_case names), e.g. to shrink a model for tests. Model sizes are "
        "whole numbers within bounds (e.g. at most 1024 layers, hidden size 65536, 1024 experts).",
        json_schema_extra={"properties": limits_schema(), "x-kubernetes-preserve-unknown-fields": True},
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Deprecated: true turns on training.activationCheckpointing and visionCheckpointing.",
    )
    freeze: list[Module] = Field(
        default_factory=list,
        description="Parts that do not train (no gradients, no optimizer state): vision (the vision tower's "
        "patch embedding and blocks, run without autograd), merger (the projector), llm (decoder layers and "
        "final norm, and with them the token embeddings and LM head), embeddings (only the token embeddings "
        "and LM head). To train everything but the vision tower: [vision].",
    )
    lora: LoraSpec | None = Field(
        None, description="Train LoRA adapters instead of the full model (saved as a PEFT adapter)."
    )
    frozen_dtype: FrozenDType = Field(
        "fp32",
        description="Storage of the weights that do not train (model.freeze parts, LoRA's base weights): "
        "bf16 halves their memory, losslessly for a bf16 checkpoint; with FSDP, which gathers weights in "
        "the compute dtype, a step computes the same. Trainable weights always keep fp32 masters. bf16 "
        "needs bf16 compute (training.dtype).",
    )

    @field_validator("config_overrides")
    @classmethod
    def _sizes_in_bounds(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        """Refuse out-of-bounds model sizes here, where the operator, `render`, `run` and `train` all
        read the spec; the merged config.json is checked again where the folder is read (`model_dims`)."""
        if problems := dimension_problems(overrides):
            raise ValueError("; ".join(problems[:3]))
        return overrides


class TrainingSpec(CamelModel):
    """The optimisation: steps, batch shape, attention backend, parallelism, checkpoints, metrics."""

    max_steps: int | None = Field(
        None,
        ge=1,
        description=f"Optimizer steps; default {DEFAULT_MAX_STEPS}, or from `epochs` when that is set.",
    )
    epochs: int | None = Field(
        None,
        ge=1,
        le=10_000,
        description="Passes over the pack instead of maxSteps: steps = epochs x steps per epoch (the pack's "
        "units over the global batch), reported before training starts.",
    )
    eval_every: int = Field(
        0, ge=0, description="Evaluate every N steps (with an evaluation set); 0: only after the last step."
    )
    micro_batch_sequences: int = Field(
        1, ge=1, le=1024, description="Packed sequences per rank per micro step."
    )
    grad_accum: int = Field(1, ge=1, description="Micro steps per optimizer step.")
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    warmup: int = Field(0, ge=0, description="Linear warmup steps, then cosine decay to 10% of lr.")
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW weight decay of matrices; biases and norm weights never decay."
    )
    lr_multipliers: dict[Module, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        max_length=len(get_args(Module)),
        description="Scale lr per part, e.g. {vision: 0.1}; unlisted parts use 1, and embeddings follow "
        "llm's multiplier unless listed.",
        # The CRD schema cannot restrict map keys; the API server checks them with this rule.
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, k in {list(get_args(Module))})",
                    "message": f"lrMultipliers keys are parts of the model: {', '.join(get_args(Module))}",
                }
            ]
        },
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping; null disables it.")
    max_non_finite_steps: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Steps whose loss or gradient norm is NaN or infinite that a run may skip (their update "
        "is not applied); the next one stops it (exit 2) naming the step and the first non-finite "
        "parameter or gradient. 0 (default): the first one stops it. Non-finite weights, at the start or "
        "before the export, always stop it.",
    )
    seed: int = Field(0, description="Seeds data order and random init.")
    attention: Attention = Field(
        "auto",
        description="varlen (torch's FlashAttention varlen kernel, CUDA), flash (needs flash-attn), flex "
        "(document-id block mask) or sdpa (dense block-diagonal mask); auto: the first available of "
        "varlen, flash, flex, sdpa on CUDA, sdpa elsewhere.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward: less memory, ~1/3 more compute.",
    )
    vision_checkpointing: bool = Field(
        False, description="The same for each vision-tower block (large images and videos)."
    )
    compile: bool = Field(
        False, description="torch.compile each decoder layer (first steps pay the compilation)."
    )
    mode: Mode = Field("packed", description="packed, or the padded baseline (one sample per row).")
    padded_batch_size: int = Field(
        8, ge=1, le=4096, description="Samples per rank per micro step in padded mode."
    )
    checkpoint_every: int = Field(
        0, ge=0, description="Save a resumable checkpoint every N steps (0: only at end)."
    )
    checkpoint_at_end: bool = Field(True, description="Write a resumable checkpoint after the last step.")
    keep_checkpoints: int = Field(2, ge=1, description="Resumable checkpoints kept on disk.")
    resume: bool = Field(True, description="Continue from the newest checkpoint in the output folder.")
    strategy: Strategy = Field(
        "ddp", description="ddp (replicated), or fsdp (FSDP2, sharded) for large models."
    )
    context_parallel: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks one packed row is split over (context parallelism: Ulysses all-to-all over "
        "attention heads, a balanced zigzag split of the row); the world is data-parallel x "
        "contextParallel ranks and must divide by it, and so must the attention heads. 1: off.",
    )
    dtype: DType = Field(
        "auto",
        description="Compute dtype; auto: bf16 on GPU, fp32 on CPU. bf16 is mixed precision: fp32 weights "
        "and optimizer state, bf16 autocast (the final export is saved in bf16).",
    )
    loss_chunk_tokens: int = Field(
        LOSS_CHUNK_TOKENS,
        ge=0,
        description="Label tokens whose LM-head logits are computed at once, in forward and backward "
        "(memory ~ this x vocabulary x 4 bytes); 0: all label tokens at once.",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Serve Prometheus /metrics on this port + local rank; null: off."
    )
    peak_tflops: float | None = Field(
        None, gt=0, description="Device peak for MFU; default: known GPUs' dense bf16 peak, none on CPU."
    )
    log_every: int = Field(1, ge=1, description="Print a JSON line every N steps (rank 0).")
    output_dir: str = Field("runs/sft", description="Checkpoints, final model and summary go here.")
    save_final: bool = Field(True, description="Save the final model in Hugging Face format.")
    plan_check: bool = Field(
        True,
        description="Before building the model, plan the job's GPU memory (weights, gradients, AdamW state, "
        "activations) and exit 2 naming what to change when it cannot fit; false: start regardless.",
    )

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingSpec:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("training needs at most one of `maxSteps` or `epochs`: remove one")
        return self

    def fixed_steps(self) -> int | None:
        """The run's steps when the spec alone fixes them (None with `epochs`: they depend on the pack)."""
        if self.max_steps is not None:
            return self.max_steps
        return None if self.epochs is not None else DEFAULT_MAX_STEPS


class SFTSpecCore(CamelModel):
    """What `packtrain train` needs from an SFTJob spec (cluster-only keys are ignored)."""

    data: DataSpec
    model: TrainModelSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)

    @model_validator(mode="after")
    def _fold_gradient_checkpointing(self) -> SFTSpecCore:
        """Older specs set model.gradientCheckpointing; the trainer reads only the training options."""
        if self.model.gradient_checkpointing:  # it checkpointed every layer, vision blocks included
            self.training.activation_checkpointing = True
            self.training.vision_checkpointing = True
        return self


# SFTJob spec keys only a cluster reads (where and how the job runs): `train -c` sets them aside.
SFT_CLUSTER_KEYS = frozenset(
    {
        *("resources", "image", "volumes", "backend", "runtime", "suspend", "queueName", "metricsPort"),
        *("backoffLimit", "cleanPodPolicy", "serviceAccountName"),
    }
)


def check_model_overrides(model: TrainModelSpec, where: str) -> None:
    """ConfigError (prefixed by `where`) naming each model.configOverrides key the model's config ignores,
    or a size of config.json with them merged that breaks a bound (`model_dims`), where this machine
    has the folder: `packtrain run` refuses it before packing, `train -c` before anything."""
    try:
        check_config_overrides(model.config_overrides, model.family, model.path)
        folder = ModelFolder(model.path, model.config_overrides, model.family)
        if folder.has_config:
            model_dims(folder.config, folder.family.name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_train_config(path: str | Path) -> SFTSpecCore:
    """Read an `SFTJob` manifest or bare spec (the first SFTJob of a multi-document YAML)."""
    cfg = load_spec_section(path, "SFTJob", SFTSpecCore, SFT_CLUSTER_KEYS)
    check_model_overrides(cfg.model, str(path))
    return cfg
