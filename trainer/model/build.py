"""Building Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 / InternVL with `transformers` (LLaVA-OneVision-1.5
with packtrain's own class), and the packed forward.

`build_model` builds the model from the folder's config.json (merged with overrides, read once
by `core.model_folder.ModelFolder`) empty; `materialize` then loads the real weights when present
(or when `init: pretrained`), else initialises randomly from the config. `VLMForTraining` wraps
the Hugging Face model so DDP/FSDP see a single forward: vision features are computed first (each
image/frame isolated by `grid_thw`), then the language model runs on the packed row with the
backend's isolation arguments, and the loss is computed on label tokens only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from packtrain.core.errors import ConfigError
from packtrain.core.families import Family
from packtrain.core.memory_plan import unsplit_family
from packtrain.core.model_folder import ModelFolder
from packtrain.core.model_spec import ModelSpec, family_for_model_type, model_spec
from packtrain.core.sft_config import LOSS_CHUNK_TOKENS
from packtrain.trainer.data.batch import ModelInputs
from packtrain.trainer.model import context_parallel
from packtrain.trainer.model.attention import HF_IMPLEMENTATION, attention_kwargs, register_backend
from packtrain.trainer.model.context_parallel import Mesh
from packtrain.trainer.model.init_weights import materialize, parameters_on_meta
from packtrain.trainer.model.linear_attention import (
    SEGMENTS,
    has_linear_attention,
    isolate_linear_attention,
    resolve_linear,
)
from packtrain.trainer.model.loss import token_losses
from packtrain.trainer.model.parts import is_tiled, vision_blocks, vision_side
from packtrain.trainer.model.vision_attention import one_call_vision


def _model_folder(folder: str | Path | ModelFolder, overrides: dict[str, Any] | None = None) -> ModelFolder:
    return folder if isinstance(folder, ModelFolder) else ModelFolder(folder, overrides)


def has_weights(folder: str | Path | ModelFolder) -> bool:
    return _model_folder(folder).has_weights


def load_config(
    folder: str | Path | ModelFolder, overrides: dict[str, Any] | None = None
) -> PretrainedConfig:
    """config.json deep-merged with `overrides` (config.json key names; a `ModelFolder` carries its
    own), as a transformers config."""
    model = _model_folder(folder, overrides)
    model.loaded_config()  # an unreadable config.json raises what reading it raised
    raw = dict(model.config)
    model_type = raw.pop("model_type", None)
    family_class(family_for_model_type(model_type))  # a ConfigError naming the supported families
    return AutoConfig.for_model(model_type, **raw)


def family_class(family: Family) -> type[PreTrainedModel]:
    """The class a family's model is built as: transformers' own, or packtrain's for a family
    transformers has no class for (importing its module registers its config type with AutoConfig)."""
    module = transformers if family.model_module is None else importlib.import_module(family.model_module)
    cls: type[PreTrainedModel] = getattr(module, family.model_class)
    return cls


def checked_spec(
    folder: str | Path | ModelFolder, config: PretrainedConfig, family: str | None = None
) -> ModelSpec:
    """The folder's family registry entry (what the pack was counted with), checked against the
    model config the trainer builds (config.json plus overrides): a pack and a model that disagree
    on token ids or patch geometry would train on misplaced vision features. A `ModelFolder`
    brings its own family (model.family) and the config.json it already read."""
    spec = model_spec(folder, family)
    folder = folder.name if isinstance(folder, ModelFolder) else folder
    if config.model_type != spec.family.model_type:
        raise ConfigError(
            f"model.family is {spec.family.name} but {folder} holds a {config.model_type} model; "
            "drop model.family or point model.path at a matching folder"
        )
    pairs = _tiled_pairs(config, spec) if spec.family.tiling is not None else _patch_pairs(config, spec)
    for key, (model_value, folder_value) in pairs.items():
        if model_value != folder_value:
            raise ConfigError(
                f"{key} is {model_value} in the model config but {folder_value} in {folder}'s processor "
                "and tokenizer files (what packs are counted with); remove it from model.configOverrides"
            )
    return spec


def _patch_pairs(config: PretrainedConfig, spec: ModelSpec) -> dict[str, tuple[Any, Any]]:
    """(model config, folder) values a patch family's pack and model must agree on."""
    vision = config.vision_config
    pairs: dict[str, tuple[Any, Any]] = {
        "image_token_id": (config.image_token_id, spec.token_ids.image_pad),
        "video_token_id": (config.video_token_id, spec.token_ids.video_pad),
        "vision_config.spatial_merge_size": (vision.spatial_merge_size, spec.vision.merge_size),
        "vision_config.patch_size": (vision.patch_size, spec.vision.patch_size),
        "vision_config.temporal_patch_size": (vision.temporal_patch_size, spec.vision.temporal_patch_size),
    }
    if spec.family.time_scaled_rope:
        pairs["vision_config.tokens_per_second"] = (vision.tokens_per_second, spec.vision.tokens_per_second)
    return pairs


def _square(value: Any) -> Any:
    """A square size given as one number or a pair (InternViT writes `[448, 448]`)."""
    if isinstance(value, list | tuple) and len(value) == 2 and value[0] == value[1]:
        return value[0]
    return value


def _tiled_pairs(config: PretrainedConfig, spec: ModelSpec) -> dict[str, tuple[Any, Any]]:
    """(model config, folder) values a tiled family's pack and model must agree on: the context token
    (images and video frames alike), the patch, the pixel shuffle (`downsample_ratio` = 1 / merge) and
    the tile, all of which fix the 256 tokens a tile is counted as."""
    vision = config.vision_config
    return {
        "image_token_id": (config.image_token_id, spec.token_ids.image_pad),
        "vision_config.patch_size": (_square(vision.patch_size), spec.vision.patch_size),
        "vision_config.image_size": (_square(vision.image_size), spec.vision.tile_size),
        "downsample_ratio": (config.downsample_ratio, 1 / spec.vision.merge_size),
    }


def pretrained_weights(folder: str | Path | ModelFolder, init: str) -> Path | None:
    """The folder whose weights `init` loads, or None for `random`. `auto` and `pretrained` both need
    the weights there: a model trains from random init only when the spec says `init: random`, never
    because the weights were forgotten. A `ModelFolder` lists its weight files once."""
    if init == "random":
        return None
    model = _model_folder(folder)
    if not model.has_weights:
        raise ConfigError(
            f"no weights in {model.name}: put the safetensors there, or set model.init: random to train "
            "from scratch"
        )
    return model.path


def init_used(weights: Path | None) -> str:
    """What the start-up line and the summary say the model started from."""
    return "random" if weights is None else f"pretrained from {weights}"


def build_model(
    folder: str | Path | ModelFolder,
    *,
    init: str = "auto",
    overrides: dict[str, Any] | None = None,
    config: PretrainedConfig | None = None,
    dtype: torch.dtype = torch.float32,
    attention: str = "sdpa",
    seed: int = 0,
    device: torch.device | str = "cpu",
    empty: bool = False,
) -> PreTrainedModel:
    """The family's Hugging Face class (`Family.model_class`), its parameters created on the meta
    device, then (unless `empty`, or `device` is meta) materialised on `device` with the pretrained
    weights or a random init seeded by `seed` (see `materialize`).

    Training builds it `empty`, adds adapters, freezes and shards it, and only then materialises
    it, so each rank allocates and reads only its own shards. `folder` may be the run's `ModelFolder`
    (its overrides, and its config.json read once) and `config` the `load_config` already made of it."""
    model_folder = _model_folder(folder, overrides)
    config = load_config(model_folder) if config is None else config
    model_class = family_class(family_for_model_type(config.model_type))
    impl = HF_IMPLEMENTATION[attention]
    register_backend(attention)
    weights = pretrained_weights(model_folder, init)
    with parameters_on_meta():  # rotary buffers are computed for real, in fp32, as transformers keeps them
        # What AutoModel's `from_config` calls once it has picked the class.
        model = model_class._from_config(config, attn_implementation=impl, dtype=dtype)
    if weights is not None:
        model.config.name_or_path = model_folder.name  # as from_pretrained records it
    # Hybrid decoders (Qwen3.5): each linear-attention layer restarts its conv and recurrent state
    # at every packed sample's first token; fla kernels on CUDA when installed, else per sample.
    isolate_linear_attention(model, resolve_linear(device))
    if not empty and torch.device(device).type != "meta":
        materialize(model, device, weights=weights, seed=seed)
    return model


def _checkpointed(forward: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if module.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


def apply_layer_options(
    model: PreTrainedModel, activation_checkpointing: bool, vision_checkpointing: bool, compile: bool
) -> None:
    """Activation checkpointing per decoder layer (and per vision block), `torch.compile` per
    decoder layer, in place.

    Both act on each layer's `forward` / call, never by wrapping the module, so parameter names (and
    so checkpoints and the exported model) do not change, and FSDP's per-layer hooks stay outside
    the recomputed region. Done here rather than through transformers' gradient-checkpointing
    switch, whose name and reach (every layer, vision included) differ between its versions.
    """
    hf: Any = model
    layers = list(hf.model.language_model.layers)
    blocks = vision_blocks(hf)
    for module in (layers if activation_checkpointing else []) + (blocks if vision_checkpointing else []):
        module.forward = _checkpointed(module.forward, module)
    if compile:
        for layer in layers:
            layer.compile()


class VLMForTraining(nn.Module):
    """Packed (or padded) batch → label-token losses, through one module forward."""

    def __init__(
        self,
        model: PreTrainedModel,
        backend: str,
        always_run_vision: bool = False,
        loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
        mesh: Mesh | None = None,
    ) -> None:
        super().__init__()
        self.hf = model
        self.backend = backend
        # Under DDP/FSDP every rank must use the vision tower every step, or gradient
        # reduction waits forever for a rank whose batch happened to be text-only.
        self.always_run_vision = always_run_vision
        self.loss_chunk_tokens = loss_chunk_tokens
        # Linear-attention layers get the packed row's sample boundaries too (see linear_attention).
        self.linear_attention = has_linear_attention(model)
        self.router = Router.of(model)
        self.tiled = is_tiled(model)
        # LLaVA-OneVision-1.5: its tower takes the images grouped per sample (`vision_groups_by_sample`).
        self.groups_by_sample = family_for_model_type(model.config.model_type).vision_groups_by_sample
        # One attention call per vision block over all images, frames and windows (vision_attention).
        # A tiled tower already is: its tiles are a batch of equal squares, attended within each.
        if not self.tiled:
            one_call_vision(model, backend)
        # Context parallelism: each rank of a group holds 1/N of every row (context_parallel).
        self.mesh = mesh if mesh is not None and mesh.on else None
        if self.mesh is not None:
            self._split_language_model(self.mesh.size)

    def _split_language_model(self, size: int) -> None:
        """The language model's attention through the group's all-to-all (the vision tower's stays)."""
        family = family_for_model_type(self.hf.config.model_type)
        if not family.context_parallel or self.tiled or self.groups_by_sample or self.router is not None:
            raise ConfigError(f"training.contextParallel {size}: {unsplit_family(family.name)}")
        text = self.hf.config.text_config
        inner = HF_IMPLEMENTATION[self.backend]
        name = context_parallel.register(inner)
        for layer in self.hf.model.language_model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                attn.config._attn_implementation = name
        text._attn_implementation = name

    def _encode_media(self, inputs: ModelInputs) -> tuple[dict[str, Any], torch.Tensor | None]:
        """Images and videos through the vision tower in *one* call (each grid stays isolated:
        per-frame attention segments and per-grid windows), split back per modality.

        One call per micro-batch, whatever the media mix, keeps FSDP's per-block all-gathers in
        the same order on every rank (a tower whose features depend on the images sharing its call
        gets them grouped per sample, `_groups`); a rank without media runs a tiny dummy image instead and
        returns a zero term to add to the loss, so every parameter gets a gradient everywhere.
        """
        if self.tiled:
            return self._encode_tiles(inputs)
        visual = self.hf.model.visual
        parts = _media_parts(inputs)
        if not parts:
            if not self.always_run_vision:
                return {}, None
            _, used = self._encode_dummy()
            return {}, sum(f.sum() for f in used) * 0.0
        grids = torch.cat([g for _, _, g in parts])
        out = visual(
            torch.cat([px for _, px, _ in parts]).to(visual.dtype), grid_thw=grids, **self._groups(inputs)
        )
        sizes = (grids.prod(-1) // self.hf.config.vision_config.spatial_merge_size**2).tolist()
        features = torch.split(out.pooler_output, sizes)
        # DeepStack (Qwen3-VL): per-layer features of the same tokens, split the same way; the model
        # adds them at the placeholder positions, which are each sample's own.
        deepstack = [torch.split(f, sizes) for f in getattr(out, "deepstack_features", None) or []]
        encoded, first = {}, 0
        for kind, _, grid in parts:
            items = slice(first, first + len(grid))
            extra = {"deepstack_features": [layer[items] for layer in deepstack]} if deepstack else {}
            encoded[kind] = type(out)(pooler_output=features[items], **extra)
            first += len(grid)
        return encoded, None

    def _encode_dummy(self) -> tuple[Any, list[Any]]:
        """One zero image of a single merged patch through the tower, for a rank with nothing to
        encode (its parameters still take part in the step): the output and its feature tensors."""
        visual = self.hf.model.visual
        vision = self.hf.config.vision_config
        m, p, tp = vision.spatial_merge_size, vision.patch_size, vision.temporal_patch_size
        dummy = torch.zeros(m * m, 3 * tp * p * p, dtype=visual.dtype, device=visual.device)
        out = visual(dummy, grid_thw=torch.tensor([[1, m, m]], device=visual.device))
        return out, _features(out)

    def _groups(self, inputs: ModelInputs) -> dict[str, Any]:
        """The tower's `group_sizes` (images per sample) for a family whose image features depend on
        the images sharing the call: one call per micro-batch then equals one call per sample."""
        if not self.groups_by_sample:
            return {}
        if inputs.pixel_values_videos is not None or inputs.image_groups is None:
            raise ValueError(
                "this family's vision tower takes images grouped per sample (image_groups) and no videos"
            )
        return {"group_sizes": inputs.image_groups.tolist()}

    def _encode_tiles(self, inputs: ModelInputs) -> tuple[dict[str, Any], torch.Tensor | None]:
        """A tiled family (InternVL): every tile of the micro-batch (images' tiles and thumbnails, video
        frames, in order of appearance) through the tower, pixel shuffle and projector in one
        `get_image_features` call; the model's forward scatters them, in order, over the
        `<IMG_CONTEXT>` tokens. Each tile is its own batch row, so the tower needs no boundaries.
        Without media (and `always_run_vision`) one zero tile runs instead, for a zero term."""
        model: Any = self.hf.model
        pixels = inputs.pixel_values
        if pixels is None:
            if not self.always_run_vision:
                return {}, None
            tile = _square(self.hf.config.vision_config.image_size)
            tower = model.vision_tower
            dummy = torch.zeros(1, 3, tile, tile, dtype=tower.dtype, device=tower.device)
            return {}, model.get_image_features(dummy, return_dict=True).pooler_output.sum() * 0.0
        out = model.get_image_features(pixels, return_dict=True)
        return {"image": out}, None

    def _packed_kwargs(self, cu_seq_lens: torch.Tensor, max_length: int, total: int) -> dict[str, Any]:
        """The language model's isolation arguments for a packed row of `total` tokens."""
        extra = attention_kwargs(self.backend, cu_seq_lens, max_length, total)
        if self.linear_attention:
            extra[SEGMENTS] = cu_seq_lens
            if extra.get("attention_mask") is not None and not torch.is_tensor(extra["attention_mask"]):
                # A flex BlockMask is for the full-attention layers only: transformers' hybrid
                # decoder takes a mask per layer type, and its linear-attention layers (isolated by
                # SEGMENTS) would read a BlockMask as a padding mask and fail.
                extra["attention_mask"] = {
                    "full_attention": extra["attention_mask"],
                    "linear_attention": None,
                }
        return extra

    def _forward_split(self, inputs: ModelInputs, mesh: Mesh) -> dict[str, torch.Tensor]:
        """This rank's share of a packed row (see context_parallel): its tokens through the language
        model, the row's media encoded once per group, the loss of its own label tokens."""
        if inputs.cu_seq_lens is None or inputs.max_length is None:
            raise ValueError("context parallelism trains packed rows; set training.mode: packed")
        split = context_parallel.split_row(
            inputs.input_ids, inputs.position_ids, inputs.shift_labels, inputs.cu_seq_lens,
            inputs.max_length, mesh, pad_id=0,
        )  # fmt: skip
        encoded, zero = self._encode_media_split(inputs, split)
        extra = self._packed_kwargs(split.cu_seq_lens, split.max_length, split.layout.total)
        extra[context_parallel.LAYOUT] = split.layout
        out = self.hf.model(
            input_ids=split.input_ids,
            position_ids=split.position_ids,
            mm_encoder_outputs=encoded or None,
            use_cache=False,
            **extra,
        )
        losses, positions = token_losses(
            out.last_hidden_state, self.hf.lm_head, split.shift_labels, self.loss_chunk_tokens
        )
        # Positions in the row (as without the split), so per-sample sums read the row's sample index.
        return {
            "loss_sum": losses.sum() + zero,
            "token_losses": losses,
            "positions": split.layout.local[positions],
        }

    def _encode_media_split(
        self, inputs: ModelInputs, split: context_parallel.Split
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """The row's images and videos dealt out over the group (contiguous runs of about equal patch
        counts), each rank's run through the tower in one call, the features gathered; this rank
        keeps those of its own placeholders. A rank with no run encodes a dummy (FSDP's gathers stay
        in step). The zero term reaches every feature, so every rank's backward meets the gather."""
        mesh = split.layout.mesh
        visual = self.hf.model.visual
        vision = self.hf.config.vision_config
        merge = vision.spatial_merge_size**2
        parts = _media_parts(inputs)
        grids = torch.cat([g for _, _, g in parts]) if parts else None
        patches = [] if grids is None else grids.prod(-1).tolist()
        runs = context_parallel.deal(patches, mesh.size)
        first, stop = runs[mesh.rank]
        if grids is not None and stop > first:
            pixels = torch.cat([px for _, px, _ in parts])
            rows = slice(sum(patches[:first]), sum(patches[:stop]))
            out = visual(pixels[rows].to(visual.dtype), grid_thw=grids[first:stop])
            produced = _features(out)
            mine = produced
        else:
            out, produced = self._encode_dummy()
            mine = [f[:0] for f in produced]
        zero = sum(f.sum() for f in produced) * 0.0
        if grids is None:  # a text-only row: nothing to gather
            return {}, zero
        counts = [sum(patches[a:b]) // merge for a, b in runs]
        gathered = [context_parallel.gather_rows(f, counts, mesh) for f in mine]
        zero = zero + sum(f.sum() for f in gathered) * 0.0
        encoded, start = {}, 0
        for kind, _, grid in parts:
            n = int(grid.prod(-1).sum()) // merge
            token = self.hf.config.image_token_id if kind == "image" else self.hf.config.video_token_id
            local = [
                context_parallel.local_rows(f[start : start + n], split.full_input_ids, token, split.layout)
                for f in gathered
            ]
            start += n
            if local[0].shape[0]:
                extra = {"deepstack_features": [(f,) for f in local[1:]]} if len(local) > 1 else {}
                encoded[kind] = type(out)(pooler_output=(local[0],), **extra)
        return encoded, zero

    def forward(self, inputs: ModelInputs) -> dict[str, torch.Tensor]:
        if self.mesh is not None:
            return self._forward_split(inputs, self.mesh)
        encoded, zero = self._encode_media(inputs)
        input_ids = inputs.input_ids
        if (
            inputs.attention_mask is not None
        ):  # padded baseline: 2-D padding mask, transformers builds the rest
            extra: dict[str, Any] = {"attention_mask": inputs.attention_mask}
        elif inputs.cu_seq_lens is not None and inputs.max_length is not None:
            extra = self._packed_kwargs(inputs.cu_seq_lens, inputs.max_length, input_ids.shape[1])
        else:
            raise ValueError(
                "model inputs need an attention mask (padded) or cu_seq_lens and max_length (packed)"
            )
        if self.router is not None:
            extra["output_router_logits"] = True
        out = self.hf.model(
            input_ids=input_ids,
            position_ids=inputs.position_ids,
            mm_encoder_outputs=encoded or None,
            use_cache=False,
            **extra,
        )
        losses, positions = token_losses(
            out.last_hidden_state, self.hf.lm_head, inputs.shift_labels, self.loss_chunk_tokens
        )
        loss_sum = losses.sum() if zero is None else losses.sum() + zero
        result = {"loss_sum": loss_sum, "token_losses": losses, "positions": positions}
        if self.router is not None:
            result["aux_loss"] = self.router.aux_loss(out.router_logits, inputs.attention_mask)
        return result


def _features(out: Any) -> list[Any]:
    """A tower output's feature tensors: the merged features, then DeepStack's (Qwen3-VL)."""
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def _media_parts(inputs: ModelInputs) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(kind, pixels, grids) of the micro-batch's images, then its videos: the order of one tower call."""
    return [
        (kind, px, grid)
        for kind, px, grid in (
            ("image", inputs.pixel_values, inputs.image_grid_thw),
            ("video", inputs.pixel_values_videos, inputs.video_grid_thw),
        )
        if px is not None and grid is not None
    ]


@dataclass(frozen=True)
class Router:
    """A mixture-of-experts decoder's routing (Qwen3.5-MoE, Qwen3-VL-MoE), for its auxiliary
    load-balancing loss.

    The loss is the model's own `load_balancing_loss_func` (Switch Transformer: experts x Σ_e
    f_e · P_e, where f_e is the share of top-k assignments to expert e and P_e its mean router
    probability) over the *real* tokens of the micro-batch, every MoE layer's tokens pooled: a
    packed row has no padding, a padded batch passes its padding mask. The same samples therefore
    give the same aux loss packed or padded; the step objective weighs each micro-batch's aux loss
    by its share of the step's label tokens (`loss.aux_objective`)."""

    num_experts: int
    top_k: int
    coef: float
    loss_fn: Callable[..., Any]

    @classmethod
    def of(cls, model: PreTrainedModel) -> Router | None:
        text = getattr(model.config, "text_config", model.config)
        experts = getattr(text, "num_experts", None)
        loss_fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if not experts or loss_fn is None:
            return None
        return cls(int(experts), int(text.num_experts_per_tok), float(text.router_aux_loss_coef), loss_fn)

    def aux_loss(self, router_logits: Any, padding_mask: torch.Tensor | None) -> torch.Tensor:
        if not router_logits:
            raise ValueError("a mixture-of-experts model returned no router logits")
        aux: torch.Tensor = self.loss_fn(tuple(router_logits), self.num_experts, self.top_k, padding_mask)
        return aux


def parameter_groups(model: nn.Module) -> dict[str, int]:
    """Parameter counts used by the FLOPs estimate: LLM body, LM head, vision tower."""
    hf: Any = model.hf if isinstance(model, VLMForTraining) else model
    layers = list(hf.model.language_model.layers.parameters())
    visual = [p for module in vision_side(hf) for p in module.parameters()]
    body = sum(p.numel() for p in layers)
    vision = sum(p.numel() for p in visual)
    head = hf.lm_head.weight.numel()
    return {
        "llm": body,
        "lm_head": head,
        "vision": vision,
        "llm_trainable": sum(p.numel() for p in layers if p.requires_grad),
        "vision_trainable": sum(p.numel() for p in visual if p.requires_grad),
    }
