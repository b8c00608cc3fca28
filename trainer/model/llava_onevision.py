"""LLaVA-OneVision-1.5 (RICE-ViT + a Qwen3 decoder) as a transformers model of the project's own.

The released model ships only remote code that builds with transformers 4.53.x; the project never
runs a model folder's Python, so the architecture is written here: the same math and the same
parameter names (a released folder's safetensors load by name, `save_pretrained` writes a folder
the upstream code loads), on current transformers.

* `RiceVisionModel`: a 2-D conv patch embedding, 2-D rotary positions over the patch grid in
  merge-window order (as Qwen2-VL's tower), a learned class token prepended to every segment (one
  image, or one video frame) with its own rotary entry `class_pos_emb`, a pre-LayerNorm, the blocks
  (transformers' Qwen2-VL vision attention: one attention call per segment, or one varlen call
  over the segments' `cu_seqlens`; never a dense mask across images) and the patch merger.
* The decoder is transformers' own `Qwen3Model` (q/k RMSNorm per head, rotate-half RoPE on plain
  1-D positions, no biases: the upstream decoder's math and names), so every attention backend the
  trainer registers applies to it unchanged.

Upstream's class-token removal, reproduced on purpose: after the blocks, upstream takes segment
`i`'s features as rows `[cu[i] + 1, cu[i+1] + 1)` of the class-token-inserted sequence, where
`cu` are the offsets *without* class tokens. That is right for the first segment only: segment `i`
really starts at `cu[i] + i + 1`, so with two or more images (or frames) in one vision call every
later segment's features are shifted by `i - 1` rows (its own class token and the previous
segment's last `i - 1` patches in, its last `i` patches out). Released checkpoints were trained,
and the serving stacks that copied the code compute, this way, so the project does too
(`RiceVisionModel.drop_class_tokens`). A consequence: an image's features depend on its index in
the vision call, so which images share a call matters (upstream calls the tower once for a
sample's images and once for its videos). The trainer sends a packed micro-batch's images through
one call (FSDP needs the same collectives on every rank) with `group_sizes` (images per packed
sample): the removal then runs per group, each from the group's own first row, which equals one
upstream call per sample (the blocks attend within each image, so only this gather depends on it).

Importing this module registers the configs and models with transformers' Auto classes
(`model_type` "llavaonevision1_5") and the checkpoint renames of the released layout
(`visual.*`, `model.layers.*`), once per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationMixin,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3Model,
)
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.configuration_utils import SubConfigSpec
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.core_model_loading import WeightConverter, WeightRenaming
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    BaseModelOutputWithPooling,
    CausalLMOutputWithPast,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention
from transformers.utils.generic import is_flash_attention_requested

MODEL_TYPE = "llavaonevision1_5"
TEXT_MODEL_TYPE = "LLaVAOneVision1_5_text"
VISION_MODEL_TYPE = "rice_vit"


class RiceVisionConfig(PreTrainedConfig):
    """RICE-ViT's settings under the released names (defaults are upstream's)."""

    model_type = VISION_MODEL_TYPE
    base_config_key = "vision_config"

    depth: int = 24
    embed_dim: int = 1024
    hidden_size: int = 1024
    hidden_act: str = "gelu"
    intermediate_size: int = 4096
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 1
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    text_hidden_size: int = 2560

    def __post_init__(self, **kwargs: Any) -> None:
        # The released patch embedding is a 2-D conv over one frame; upstream ignores this value.
        if self.temporal_patch_size != 1:
            raise ValueError(
                f"RICE-ViT embeds one frame per patch (temporal_patch_size 1), got {self.temporal_patch_size}"
            )
        super().__post_init__(**kwargs)


class LlavaOneVision15TextConfig(Qwen3Config):
    """The decoder's settings: a `Qwen3Config` under upstream's text `model_type`, serialised with
    upstream's `rope_theta` / `rope_scaling` keys as well (the 4.53 config class reads those)."""

    model_type = TEXT_MODEL_TYPE
    base_config_key = "text_config"
    # Upstream's defaults (its 4B decoder), not Qwen3's: a config.json that leaves a key out means the
    # same model here as there, and as the memory planner counts it (`model_size`).
    default_theta = 5_000_000.0
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 36
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 262144
    sliding_window: int | None = None
    max_window_layers: int = 36

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        rope = dict(out.get("rope_parameters") or {})
        out["rope_theta"] = rope.pop("rope_theta", None)
        kind = rope.get("rope_type", "default")
        out["rope_scaling"] = None if kind == "default" else {**rope, "type": kind}
        return out


class LlavaOneVision15Config(PreTrainedConfig):
    """The whole model's settings, laid out as the released config.json."""

    model_type = MODEL_TYPE
    sub_configs_defaults = {
        "vision_config": SubConfigSpec(config_class=RiceVisionConfig),
        "text_config": SubConfigSpec(config_class=LlavaOneVision15TextConfig),
    }

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    image_token_id: int = 151655
    video_token_id: int = 151656
    vocab_size: int = 152064
    tie_word_embeddings: bool = False

    def to_diff_dict(self) -> dict[str, Any]:
        # Every key, written out: the upstream config classes have other defaults (4B sizes,
        # rope_theta 5e6), so a key left out as "default here" would mean something else there.
        out = self.to_dict()
        self._remove_keys_not_serialized(out)
        out.pop("_name_or_path", None)
        self.dict_dtype_to_str(out)
        return out


class LlavaOneVision15PreTrainedModel(PreTrainedModel):
    config: LlavaOneVision15Config
    config_class = LlavaOneVision15Config
    base_model_prefix = "model"
    input_modalities = ["image", "video", "text"]  # noqa: RUF012 (the base class types it so)
    supports_gradient_checkpointing = True
    _no_split_modules = ["RiceBlock", "Qwen3DecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, RiceVisionModel):
            # Upstream: class token ~ hidden**-0.5 * N(0, 1), its rotary entry ~ N(0, 1).
            init.normal_(module.class_embedding, mean=0.0, std=module.config.hidden_size**-0.5)
            init.normal_(module.class_pos_emb, mean=0.0, std=1.0)
        elif isinstance(module, RiceRotary):
            init.copy_(module.inv_freq, module.frequencies())


class RiceRotary(nn.Module):
    """Per-axis rotary angles `position * inv_freq` (theta 10000 over `dim` channels)."""

    inv_freq: torch.Tensor

    def __init__(self, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.theta = dim, theta
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))

    def forward(self, length: int) -> torch.Tensor:
        """(length, dim / 2) angles, always in fp32: upstream creates its `inv_freq` buffer in fp32
        and a loaded model keeps it so whatever the weights' dtype, so its angles (the class
        token's included) are fp32 in every released setting; a cast model must not change that."""
        inv_freq = self.inv_freq.float()
        positions = torch.arange(length, device=inv_freq.device, dtype=torch.float)
        return torch.outer(positions, inv_freq)


class RicePatchEmbed(nn.Module):
    """One 2-D conv over each flattened `in_channels x patch x patch` row."""

    def __init__(self, config: RiceVisionConfig) -> None:
        super().__init__()
        self.patch_size, self.in_channels, self.embed_dim = (
            config.patch_size,
            config.in_channels,
            config.hidden_size,
        )
        size = (config.patch_size, config.patch_size)
        self.proj = nn.Conv2d(
            config.in_channels, config.hidden_size, kernel_size=size, stride=size, bias=False
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.view(-1, self.in_channels, self.patch_size, self.patch_size)
        return self.proj(pixels.to(self.proj.weight.dtype)).view(-1, self.embed_dim)


class RiceMlp(nn.Module):
    def __init__(self, config: RiceVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class RiceBlock(GradientCheckpointingLayer):
    """Pre-norm block; the norms' epsilon is upstream's fixed 1e-5 (not `layer_norm_eps`)."""

    def __init__(self, config: RiceVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-5)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-5)
        self.attn = VisionAttention(config)  # type: ignore[arg-type]  # reads embed_dim, num_heads
        self.mlp = RiceMlp(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        max_seqlen: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(
            self.norm1(hidden_states),
            cu_seqlens=cu_seqlens,
            position_embeddings=position_embeddings,
            max_seqlen=max_seqlen,
            **kwargs,
        )
        return hidden_states + self.mlp(self.norm2(hidden_states))


class RicePatchMerger(nn.Module):
    """LayerNorm, then an MLP over each run of merge² consecutive patches (one merge window)."""

    def __init__(self, config: RiceVisionConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size),
            nn.GELU(),
            nn.Linear(self.hidden_size, config.text_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


def window_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(patches, 2) row/column of every patch, patches in merge-window order, frames repeated."""
    rows = []
    for t, h, w in grid_thw.tolist():
        hpos = torch.arange(h).unsqueeze(1).expand(-1, w)
        wpos = torch.arange(w).unsqueeze(0).expand(h, -1)
        pair = [
            p.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()
            for p in (hpos, wpos)
        ]
        rows.append(torch.stack(pair, dim=-1).repeat(t, 1))
    return torch.cat(rows)


class RiceVisionModel(LlavaOneVision15PreTrainedModel):
    """RICE-ViT: pixels (patches, C*p*p) and `grid_thw` to merged features (patches / merge², text
    width) in `pooler_output`, the unmerged patch features in `last_hidden_state`."""

    config: RiceVisionConfig  # type: ignore[assignment]
    config_class = RiceVisionConfig  # type: ignore[assignment]
    _no_split_modules = ["RiceBlock"]

    def __init__(self, config: RiceVisionConfig) -> None:
        super().__init__(config)
        head_dim = config.hidden_size // config.num_heads
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = RicePatchEmbed(config)
        self.rotary_pos_emb = RiceRotary(head_dim // 2)
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.class_pos_emb = nn.Parameter(torch.empty(1, head_dim // 2))
        self.pre_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.blocks = nn.ModuleList([RiceBlock(config) for _ in range(config.depth)])
        self.merger = RicePatchMerger(config)
        self.gradient_checkpointing = False
        self.post_init()

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def rot_pos_emb(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """(patches, head_dim / 2) fp32 rotary angles: row angles then column angles."""
        positions = window_positions(grid_thw, self.spatial_merge_size).to(
            self.rotary_pos_emb.inv_freq.device
        )
        table = self.rotary_pos_emb(int(grid_thw[:, 1:].max()))
        return table[positions].flatten(1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        grid_thw: torch.Tensor,
        group_sizes: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        """`group_sizes`: how many consecutive images (rows of `grid_thw`) make each group, the images
        upstream would have sent through the tower in one call (one sample's); None: one group, as
        a plain upstream call. The class-token removal is applied per group (see the module
        docstring); the attention is per segment either way, so grouping changes nothing else."""
        groups = segment_groups(grid_thw, group_sizes)
        patches = self.patch_embed(hidden_states)
        angles = self.rot_pos_emb(grid_thw)
        lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).tolist()
        order, cu_seqlens = class_token_order(lengths, patches.device)
        segments = len(lengths)
        cls = self.class_embedding.to(patches.dtype).expand(segments, -1)
        x = torch.cat([patches, cls])[order]
        # Cast after the expand, as upstream copies the entry into each segment's fp32 row: the
        # segments' gradients then add up in the parameter's dtype, not in fp32.
        angles = torch.cat([angles, self.class_pos_emb.expand(segments, -1).to(angles.dtype)])[order]
        x = self.pre_layernorm(x)
        emb = torch.cat((angles, angles), dim=-1)
        position_embeddings = (emb.cos(), emb.sin())
        max_seqlen = max(lengths) + 1 if is_flash_attention_requested(self.config) else None
        for block in self.blocks:
            x = block(
                x, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings, max_seqlen=max_seqlen
            )
        x = self.drop_class_tokens(x, lengths, groups)
        return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=self.merger(x))

    def drop_class_tokens(
        self, x: torch.Tensor, lengths: Sequence[int], groups: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Upstream's removal, per group of `groups[g]` consecutive segments (None: one group): the
        group's segment `i` takes rows `[S + cu[i] + 1, S + cu[i+1] + 1)` of the class-token-inserted
        sequence, `S` the group's first row and `cu` its own offsets without class tokens (see the
        module docstring). A group's slices are contiguous: rows S + 1 .. S + its patches."""
        keep, row, first = [], 0, 0
        for count in [len(lengths)] if groups is None else groups:
            patches = sum(lengths[first : first + count])
            keep.append(x[row + 1 : row + 1 + patches])
            row += patches + count
            first += count
        return keep[0] if len(keep) == 1 else torch.cat(keep)


def segment_groups(grid_thw: torch.Tensor, group_sizes: Sequence[int] | None) -> list[int] | None:
    """Images per group -> segments (frames) per group; checked to cover every image once."""
    if group_sizes is None:
        return None
    sizes = [int(n) for n in group_sizes]
    if any(n < 0 for n in sizes) or sum(sizes) != len(grid_thw):
        raise ValueError(f"group sizes {sizes} do not split {len(grid_thw)} images")
    frames = grid_thw[:, 0].tolist()
    out, first = [], 0
    for n in sizes:
        out.append(int(sum(frames[first : first + n])))
        first += n
    return out


def class_token_order(lengths: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row of `cat([patches, class tokens])` goes so that every segment reads
    `[class token, its patches]`, and the int32 cu_seqlens of that sequence."""
    total, order, cu = sum(lengths), [], [0]
    start = 0
    for i, length in enumerate(lengths):
        order.append(torch.tensor([total + i]))
        order.append(torch.arange(start, start + length))
        start += length
        cu.append(cu[-1] + length + 1)
    return torch.cat(order).to(device), torch.tensor(cu, dtype=torch.int32, device=device)


def _features(output: BaseModelOutputWithPooling) -> torch.Tensor:
    pooled = output.pooler_output
    if pooled is None:
        raise ValueError("vision features without a pooler_output")
    return pooled if torch.is_tensor(pooled) else torch.cat(list(pooled))


class LlavaOneVision15Model(LlavaOneVision15PreTrainedModel):
    """The tower and the decoder; vision features replace the image / video placeholder tokens."""

    def __init__(self, config: LlavaOneVision15Config) -> None:
        super().__init__(config)
        self.visual = RiceVisionModel._from_config(config.vision_config)
        self.language_model = Qwen3Model._from_config(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        """One tower call over every image; `pooler_output` split per image (as Qwen2-VL's)."""
        out = self.visual(pixel_values.to(self.visual.dtype), grid_thw=image_grid_thw)
        sizes = (image_grid_thw.prod(-1) // self.visual.spatial_merge_size**2).tolist()
        out.pooler_output = torch.split(out.pooler_output, sizes)
        return out

    def get_video_features(
        self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        return self.get_image_features(pixel_values_videos, video_grid_thw)

    def _scatter(
        self, input_ids: torch.Tensor, embeds: torch.Tensor, token: int, features: torch.Tensor
    ) -> torch.Tensor:
        mask = input_ids == token
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(
                f"{int(mask.sum())} placeholder tokens {token} but {features.shape[0]} vision features"
            )
        features = features.to(embeds.device, embeds.dtype)
        return embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), features)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """As Qwen2-VL's forward (features computed here, or passed in as `mm_encoder_outputs`),
        with the decoder's plain 1-D `position_ids`."""
        if mm_encoder_outputs is not None and (pixel_values is not None or pixel_values_videos is not None):
            raise ValueError("pass pixel values or mm_encoder_outputs, not both")
        encoded = dict(mm_encoder_outputs or {})
        if pixel_values is not None and image_grid_thw is not None:
            encoded["image"] = self.get_image_features(pixel_values, image_grid_thw)
        if pixel_values_videos is not None and video_grid_thw is not None:
            encoded["video"] = self.get_video_features(pixel_values_videos, video_grid_thw)
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        for kind, token in (("image", self.config.image_token_id), ("video", self.config.video_token_id)):
            if encoded.get(kind) is not None:
                if input_ids is None:
                    raise ValueError("vision features need input_ids to find their placeholders")
                inputs_embeds = self._scatter(input_ids, inputs_embeds, token, _features(encoded[kind]))
        return self.language_model(
            input_ids=None,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )


class LlavaOneVision15ForConditionalGeneration(LlavaOneVision15PreTrainedModel, GenerationMixin):
    """The model and its LM head (`lm_head`, untied in the released checkpoints)."""

    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    # The class name released folders' config.json `architectures` gives (upstream's remote code): what
    # the trainer's export writes there, so serving stacks that know the released model know its export.
    released_architecture = "LLaVAOneVision1_5_ForConditionalGeneration"

    def __init__(self, config: LlavaOneVision15Config) -> None:
        super().__init__(config)
        self.model = LlavaOneVision15Model(config)
        text = config.get_text_config()
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def visual(self) -> RiceVisionModel:
        return self.model.visual

    @property
    def language_model(self) -> Qwen3Model:
        return self.model.language_model

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.get_text_config().vocab_size
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states)


# The released checkpoint's names (what upstream's save_pretrained under 4.53 writes): `visual.*`
# for the tower, `model.*` for the decoder. Loading renames them; saving renames them back.
_RELEASED_NAMES: list[WeightConverter | WeightRenaming] = [
    WeightRenaming(source_patterns=r"^visual", target_patterns="model.visual"),
    WeightRenaming(
        source_patterns=r"^model(?!\.(language_model|visual))", target_patterns="model.language_model"
    ),
]


def _register() -> None:
    """Auto classes and checkpoint renames, once per process (a second import is a no-op)."""
    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(VISION_MODEL_TYPE, RiceVisionConfig, exist_ok=True)
        AutoConfig.register(TEXT_MODEL_TYPE, LlavaOneVision15TextConfig, exist_ok=True)
        AutoConfig.register(MODEL_TYPE, LlavaOneVision15Config, exist_ok=True)
        AutoModel.register(LlavaOneVision15Config, LlavaOneVision15Model, exist_ok=True)
        AutoModelForCausalLM.register(
            LlavaOneVision15Config, LlavaOneVision15ForConditionalGeneration, exist_ok=True
        )
        AutoModelForImageTextToText.register(
            LlavaOneVision15Config, LlavaOneVision15ForConditionalGeneration, exist_ok=True
        )
    name = LlavaOneVision15ForConditionalGeneration.__name__
    if get_checkpoint_conversion_mapping(name) is None:
        register_checkpoint_conversion_mapping(name, _RELEASED_NAMES)


_register()
