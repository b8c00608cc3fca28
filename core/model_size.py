"""A model's parameters from its config.json alone: every tensor, its part, and what LoRA adds.

The memory planner (`memory_plan.py`) runs before any model exists: on the operator, which cannot
read the model folder and has no torch, and at the trainer's start-up, before a possibly
hundred-GB model is built. So the shapes of every family's modules are written down here, from
transformers' modeling code, and `ModelDims` holds the config numbers they depend on: a small
JSON-able record a PackJob can carry to the operator. The tests check the counts against
`sum(p.numel())` of the real transformers models built on the meta device, freeze and LoRA included.

Missing config keys take the transformers config classes' defaults (`_TEXT_DEFAULTS`,
`_VISION_DEFAULTS`; a test checks them against the classes); LLaVA-OneVision-1.5's, which transformers
has no class of the released layout for, are upstream's config classes' (its 4B sizes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeGuard

from packtrain.core.errors import ConfigError
from packtrain.core.families import FAMILIES, ModuleLayout
from packtrain.core.model_folder import ModelFolder
from packtrain.core.model_folder import deep_merge as deep_merge  # re-exported: the trainer merges with it

# Module kinds of the vision tower (`VisionDims.kind`) and the decoder (`ModelDims.text_kind`).
VISION_KINDS = ("qwen2", "qwen2.5", "qwen3", "internvit", "rice")
TEXT_KINDS = ("qwen2", "qwen3", "qwen3.5")
_FAMILY_KINDS = {  # family -> (text kind, vision kind)
    "qwen2-vl": ("qwen2", "qwen2"),
    "qwen2.5-vl": ("qwen2", "qwen2.5"),
    "qwen3-vl": ("qwen3", "qwen3"),
    "qwen3-vl-moe": ("qwen3", "qwen3"),
    "qwen3.5": ("qwen3.5", "qwen3"),
    "qwen3.5-moe": ("qwen3.5", "qwen3"),
    "internvl": ("qwen2", "internvit"),  # the decoder: text_config.model_type (`INTERNVL_TEXT`)
    "llava-onevision-1.5": ("qwen3", "rice"),
}
LLAVA_OV = "llava-onevision-1.5"
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2-vl": {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
                 "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8},
    "qwen3-vl": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                 "head_dim": 128, "attention_bias": False},
    "qwen3.5": {"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
                "head_dim": 256, "attention_bias": False, "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                "linear_num_value_heads": 32, "full_attention_interval": 4},
    "qwen3.5-moe": {"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                    "attention_bias": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                    "full_attention_interval": 4, "moe_intermediate_size": 512,
                    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256},
    "qwen3-vl-moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                     "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                     "head_dim": 128, "attention_bias": False, "decoder_sparse_step": 1,
                     "moe_intermediate_size": 1408, "num_experts_per_tok": 4, "num_experts": 60},
}  # fmt: skip
_TEXT_DEFAULTS["qwen2.5-vl"] = _TEXT_DEFAULTS["qwen2-vl"]
# InternVL's decoder is whatever text_config.model_type names (InternVLConfig's default: qwen2); the
# ones planned here, with the defaults of their transformers config classes.
INTERNVL_TEXT: dict[str, dict[str, Any]] = {
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "head_dim": 128, "attention_bias": False},
}  # fmt: skip
_TEXT_DEFAULTS["internvl"] = INTERNVL_TEXT["qwen2"]
# LLaVA-OneVision-1.5: upstream's text config class defaults are Qwen3-4B's sizes (the released 8B
# config.json sets every size explicitly); its RICE-ViT defaults are RICE-ViT-L, the tower of
# every release, its merger writing `text_hidden_size` (the 4B's 2560 by default).
_TEXT_DEFAULTS[LLAVA_OV] = {
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": False,
}  # fmt: skip
# InternVLConfig's own keys: the pixel-shuffle ratio (0.5: 2x2 patches per token) and a tied LM head,
# which transformers 5 applies whatever text_config says.
_TOP_DEFAULTS: dict[str, dict[str, Any]] = {
    "internvl": {"downsample_ratio": 0.5, "tie_word_embeddings": True}
}
_QWEN3_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                 "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                 "out_hidden_size": 3584, "num_position_embeddings": 2304}  # fmt: skip
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2-vl": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16,
                 "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "qwen2.5-vl": {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16,
                   "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                   "out_hidden_size": 3584},
    "qwen3-vl": {**_QWEN3_VISION, "deepstack_visual_indexes": [8, 16, 24]},
    "qwen3.5": {**_QWEN3_VISION, "deepstack_visual_indexes": []},
}  # fmt: skip
_VISION_DEFAULTS["qwen3-vl-moe"] = _VISION_DEFAULTS["qwen3-vl"]
_VISION_DEFAULTS["internvl"] = {  # InternVLVisionConfig: InternViT-300M
    "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
    "attention_bias": False, "use_qk_norm": False, "norm_type": "layer_norm", "image_size": [448, 448],
    "patch_size": [14, 14], "num_channels": 3, "use_mask_token": False,
    "use_absolute_position_embeddings": True, "use_mean_pooling": True,
}  # fmt: skip
INTERNVIT_NORMS = ("layer_norm", "rms_norm")
_VISION_DEFAULTS["qwen3.5-moe"] = _VISION_DEFAULTS["qwen3.5"]
_VISION_DEFAULTS[LLAVA_OV] = {  # RiceConfig
    "depth": 24, "embed_dim": 1024, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
    "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 1,
    "text_hidden_size": 2560,
}  # fmt: skip

# Inclusive bounds of a config's numbers, text and vision: several times the largest released
# model's (Qwen's largest: 94 layers, hidden 8192, 512 experts, a 248k vocabulary), yet finite, so
# that no config can make the planner, the model build or anything sized by them run away.
# `dimension_problems` holds every config to them before anything loops over or divides by a number.
TEXT_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 65536),
    "intermediate_size": (1, 262144),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 1024),
    "linear_num_key_heads": (1, 1024),
    "linear_num_value_heads": (1, 1024),
    "linear_key_head_dim": (1, 1024),
    "linear_value_head_dim": (1, 1024),
    "linear_conv_kernel_dim": (1, 64),
    "full_attention_interval": (1, 1024),
    "num_experts": (1, 1024),
    "num_local_experts": (1, 1024),
    "num_experts_per_tok": (1, 1024),
    "moe_intermediate_size": (1, 262144),
    "shared_expert_intermediate_size": (0, 262144),
    "decoder_sparse_step": (1, 1024),
}
VISION_LIMITS: dict[str, tuple[int, int]] = {
    "depth": (1, 256),
    "embed_dim": (1, 65536),
    "hidden_size": (1, 65536),
    "intermediate_size": (1, 262144),
    "num_heads": (1, 1024),
    "out_hidden_size": (1, 65536),
    "text_hidden_size": (1, 65536),  # RICE-ViT's merger output (LLaVA-OneVision-1.5)
    "patch_size": (1, 128),
    "temporal_patch_size": (1, 16),
    "in_channels": (1, 16),
    "in_chans": (1, 16),
    "spatial_merge_size": (1, 16),
    "num_position_embeddings": (1, 1 << 20),
    "window_size": (1, 65536),
    # InternViT's names (InternVLVisionConfig); image_size and patch_size may be a pair there
    "num_hidden_layers": (1, 256),
    "num_attention_heads": (1, 1024),
    "num_channels": (1, 16),
    "image_size": (1, 16384),
}
_PAIRS = frozenset({"image_size", "patch_size"})  # InternViT: an int or a (height, width) pair
MAX_MERGE = 16  # InternVL's 1 / downsample_ratio (2 in every release), as VISION_LIMITS' spatial_merge_size
MAX_MLP_RATIO = 64  # Qwen2-VL's vision MLP width over its embedding width (4 in every release)
# Keys a config may set to null: derived or checked by another rule (head_dim from the hidden size, the
# dense MLP width where layers are experts, the expert count of a MoE family, Qwen2-VL's tower width).
_NULLABLE = {
    "text_config": frozenset({"head_dim", "intermediate_size", "num_experts", "num_local_experts"}),
    "vision_config": frozenset({"embed_dim"}),
}
_INDEX_LISTS = {  # list keys holding layer or block indexes: section -> key -> the count they index
    "text_config": {"mlp_only_layers": "num_hidden_layers"},
    "vision_config": {"deepstack_visual_indexes": "depth", "fullatt_block_indexes": "depth"},
}
_LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class ModelDims:
    """The config numbers a model's parameter shapes and activations depend on (JSON-able, flat)."""

    family: str
    vocab: int
    hidden: int
    intermediate: int  # dense MLP width (0 when every layer is a mixture of experts)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # the LM head is the token embedding
    attention_bias: bool  # q/k/v (and o in Qwen3) biases; Qwen2's q/k/v always have one
    linear_layer_indexes: tuple[int, ...]  # Qwen3.5's Gated DeltaNet layers (the others: full attention)
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int
    experts: int  # mixture of experts: experts per MoE layer (0: dense)
    experts_per_token: int
    expert_intermediate: int
    shared_expert_intermediate: int  # Qwen3.5-MoE's always-on shared expert (0: none)
    moe_layer_indexes: tuple[int, ...]  # decoder layers whose MLP is the expert block
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    vision_out: int  # the merger's output width (the decoder's hidden size)
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    merge_size: int
    vision_positions: int  # Qwen3-VL / Qwen3.5 learned position embeddings (0: none)
    deepstack: int  # Qwen3-VL DeepStack mergers
    # Set only where a family has more than one decoder or an InternViT tower (defaults: the Qwen
    # families', so a record written before them still reads).
    text_type: str = ""  # the decoder's kind (InternVL: qwen2 or qwen3); "": the family's
    image_size: int = (
        0  # InternViT: the tile side in pixels, (image_size / patch_size)² patches + a cls token
    )
    vision_rms_norm: bool = False  # InternViT: RMSNorm blocks (norm_type rms_norm) rather than LayerNorm
    vision_qk_norm: bool = False  # InternViT: an RMSNorm over q and over k (use_qk_norm)
    vision_qkv_bias: bool = False  # InternViT: q/k/v biases (attention_bias)
    vision_final_norm: bool = False  # InternViT without mean pooling: a LayerNorm after the blocks
    vision_mask_token: bool = False  # InternViT: a learned mask token (use_mask_token)

    @property
    def tile_patches(self) -> int:
        """InternViT: the tokens one tile runs through the tower (its patches and the cls token)."""
        return (self.image_size // self.patch_size) ** 2 + 1 if self.image_size else 0

    @property
    def linear_layers(self) -> int:
        return len(self.linear_layer_indexes)

    @property
    def moe_layers(self) -> int:
        return len(self.moe_layer_indexes)

    @property
    def text_kind(self) -> str:
        return self.text_type or _FAMILY_KINDS[self.family][0]

    @property
    def vision_kind(self) -> str:
        return _FAMILY_KINDS[self.family][1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ModelDims:
        """The record `to_dict` wrote (a PackJob's status carries it); ConfigError if incomplete."""
        names = [f.name for f in fields(cls) if f.name in doc or f.default is MISSING]
        missing = [n for n in names if n not in doc]
        if missing or doc.get("family") not in _FAMILY_KINDS:
            raise ConfigError(f"model dimensions lack {missing or ['a known family']}: re-run the pack")
        values: dict[str, Any] = {n: tuple(doc[n]) if isinstance(doc[n], list) else doc[n] for n in names}
        return cls(**values)


def _section(config: Mapping[str, Any], key: str, family: str, flat_text: bool) -> dict[str, Any]:
    """text_config or vision_config over the class defaults (Qwen2-VL's text keys may sit at the top)."""
    defaults = (_TEXT_DEFAULTS if key == "text_config" else _VISION_DEFAULTS)[family]
    if family == "internvl" and key == "text_config":
        defaults = INTERNVL_TEXT.get(_text_type(config), {})
    top = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")} if flat_text else {}
    return {**defaults, **top, **dict(config.get(key) or {})}


def _text_type(config: Mapping[str, Any]) -> Any:
    """InternVL's decoder: text_config.model_type, qwen2 when it names none (InternVLConfig's default)."""
    text = config.get("text_config")
    return (text.get("model_type") if isinstance(text, Mapping) else None) or "qwen2"


def _top(config: Mapping[str, Any], family: str, key: str) -> Any:
    """A top-level config key of a family with its own (InternVL's), over its config class default."""
    return config.get(key, _TOP_DEFAULTS.get(family, {}).get(key))


def _side(value: Any) -> int | None:
    """InternViT's image_size / patch_size as one side: an int, or a square (n, n) pair; else None."""
    if isinstance(value, list | tuple) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return value if _whole(value) else None


def _merge_of(ratio: Any) -> int | None:
    """InternVL's pixel shuffle merges 1 / downsample_ratio patches a side: a whole number from 1 to
    MAX_MERGE (the projector's width is int(1 / ratio)², the shuffle's reshape needs it exact)."""
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        return None
    merge = round(1 / ratio)
    return merge if merge <= MAX_MERGE and abs(merge * ratio - 1) < 1e-9 else None


def _layer_types(text: Mapping[str, Any], layers: int) -> list[str]:
    kinds = text.get("layer_types")
    if kinds:
        return list(kinds)[:layers]
    interval = int(text.get("full_attention_interval", 4))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _moe_layers(family: str, text: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """Qwen3.5-MoE: every layer; Qwen3-VL-MoE: every `decoder_sparse_step`-th not in `mlp_only_layers`."""
    if family == "qwen3.5-moe":
        return tuple(range(layers))
    if family != "qwen3-vl-moe":
        return ()
    only, step = set(text.get("mlp_only_layers") or []), int(text.get("decoder_sparse_step", 1))
    return tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)


def _whole(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A config value as a message quotes it: one short line, whatever it holds."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else f"{text[:37]}..."


def _range_problems(section: Mapping[str, Any], name: str, at: str, pairs: bool = False) -> list[str]:
    """Each bounded key a whole number within its bounds (with `pairs`, `_PAIRS` keys a pair of them)."""
    out = []
    limits = TEXT_LIMITS if name == "text_config" else VISION_LIMITS
    for key, (low, high) in limits.items():
        value = section.get(key)
        if key not in section or (value is None and key in _NULLABLE[name]):
            continue
        pair = pairs and key in _PAIRS
        values = value if pair and isinstance(value, list) and len(value) == 2 else [value]
        if not all(_whole(v) and low <= v <= high for v in values):
            what = " (or a pair of them)" if pair else ""
            out.append(f"{at}{key} is {_shown(value)}: it must be a whole number from {low} to {high}{what}")
    return out


def _internvl_top_problems(config: Mapping[str, Any], at: str) -> list[str]:
    """InternVLConfig's own numbers: the pixel-shuffle ratio (wherever it is set, overrides alone too)."""
    if "downsample_ratio" in config and _merge_of(config["downsample_ratio"]) is None:
        return [
            f"{at}downsample_ratio is {_shown(config['downsample_ratio'])}: it must be 1 / n for a whole n "
            f"from 1 to {MAX_MERGE} (0.5: 2x2 patches per token)"
        ]
    return []


def _list_problems(section: Mapping[str, Any], name: str, at: str, full: bool) -> list[str]:
    """Index lists within the count they index (its ceiling without `full`), layer_types of known kinds."""
    out = []
    limits = TEXT_LIMITS if name == "text_config" else VISION_LIMITS
    for key, count_key in _INDEX_LISTS[name].items():
        value = section.get(key)
        count = section.get(count_key) if full else None
        top = count if _whole(count) else limits[count_key][1]
        if value is not None and not (
            isinstance(value, list) and len(value) <= top and all(_whole(i) and 0 <= i < top for i in value)
        ):
            out.append(f"{at}{key} must be a list of {count_key} indexes, each from 0 to {top - 1}")
    kinds = section.get("layer_types") if name == "text_config" else None
    layers = section.get("num_hidden_layers") if full else None
    if kinds is not None and not (
        isinstance(kinds, list)
        and len(kinds) <= TEXT_LIMITS["num_hidden_layers"][1]
        and all(isinstance(k, str) and len(k) <= 64 for k in kinds)
        and (not _whole(layers) or len(kinds) == layers)
    ):
        out.append(f"{at}layer_types must be a list of one attention kind (a name) per layer")
    return out


def _divides(section: Mapping[str, Any], part: str, whole: str, at: str) -> list[str]:
    a, b = section.get(part), section.get(whole)
    if _whole(a) and _whole(b) and a > 0 and b % a:
        return [f"{at}{part} {a} does not divide {at}{whole} {b}: set {part} to a divisor of {whole}"]
    return []


def _pair_problems(text: Mapping[str, Any], at: str) -> list[str]:
    """Rules between two keys of one section (checked wherever both are set, overrides alone too)."""
    out = _divides(text, "num_key_value_heads", "num_attention_heads", at)
    out += _divides(text, "linear_num_key_heads", "linear_num_value_heads", at)
    k, experts = text.get("num_experts_per_tok"), text.get("num_experts") or text.get("num_local_experts")
    if _whole(k) and _whole(experts) and k > experts:
        out.append(f"{at}num_experts_per_tok {k} is more than the {experts} experts: route to at most all")
    return out


def _text_rules(t: Mapping[str, Any], family: str, at: str) -> list[str]:
    """The decoder's rules on a resolved text section (the family's defaults under it)."""
    out = _pair_problems(t, at)
    if not t.get("head_dim") and t["hidden_size"] % t["num_attention_heads"]:
        out.append(
            f"{at}hidden_size {t['hidden_size']} is not a multiple of {at}num_attention_heads "
            f"{t['num_attention_heads']} (no head_dim is set): make it one, or set head_dim"
        )
    if family.startswith("qwen3.5") and any(k not in _LAYER_KINDS for k in t.get("layer_types") or []):
        out.append(f"{at}layer_types may hold only {' and '.join(_LAYER_KINDS)}")
    if family.endswith("-moe") and not (t.get("num_experts") or t.get("num_local_experts")):
        out.append(f"{at}num_experts is not set: a mixture-of-experts model needs 1 to 1024 experts")
    layers = t["num_hidden_layers"]
    if len(_moe_layers(family, t, layers)) < layers and not t.get("intermediate_size"):
        out.append(f"{at}intermediate_size is not set: the dense MLP layers need one from 1 to 262144")
    return out


def _vision_rules(v: Mapping[str, Any], text_hidden: int, family: str, at: str) -> list[str]:
    """The vision tower's rules on a resolved vision section: whole heads, a merger that feeds the decoder."""
    qwen2 = family == "qwen2-vl"
    width = "embed_dim" if qwen2 and v.get("embed_dim") else "hidden_size"
    out = _divides(v, "num_attention_heads" if family == "internvl" else "num_heads", width, at)
    ratio = v.get("mlp_ratio")
    if qwen2 and not (
        isinstance(ratio, int | float)
        and not isinstance(ratio, bool)
        and 0 < ratio <= MAX_MLP_RATIO
        and int(v[width] * ratio) >= 1
    ):
        out.append(
            f"{at}mlp_ratio is {_shown(ratio)}: it must be a number above 0 and at most {MAX_MLP_RATIO}"
        )
    if family == "internvl":
        return out
    if family == LLAVA_OV:
        out += _rice_rules(v, at)
    merger = "hidden_size" if qwen2 else "text_hidden_size" if family == LLAVA_OV else "out_hidden_size"
    if v[merger] != text_hidden:
        out.append(
            f"{at}{merger} {v[merger]} is not the decoder's hidden_size {text_hidden}: the merger feeds the "
            "decoder, so set them equal"
        )
    window, step = v.get("window_size"), v["patch_size"] * v["spatial_merge_size"]
    if family == "qwen2.5-vl" and _whole(window) and window < step:
        out.append(f"{at}window_size {window} is under patch_size x spatial_merge_size ({step}): raise it")
    return out


def _rice_rules(v: Mapping[str, Any], at: str) -> list[str]:
    """RICE-ViT: its attention is `embed_dim` wide, everything around it `hidden_size` (they must be
    one width); its 2-D rotary halves each head twice (rows, columns), so a head is a multiple of 4
    wide; its patch embedding is a 2-D conv over one frame (temporal_patch_size 1)."""
    out = []
    width, heads, embed = v["hidden_size"], v["num_heads"], v.get("embed_dim")
    if embed is not None and embed != width:
        out.append(
            f"{at}embed_dim {embed} is not {at}hidden_size {width}: RICE-ViT's attention and blocks "
            "share one width, so set them equal"
        )
    if width % heads == 0 and (width // heads) % 4:
        out.append(
            f"{at}hidden_size / num_heads is {width // heads}: RICE-ViT's 2-D rotary needs a head width "
            "that is a multiple of 4"
        )
    if v["temporal_patch_size"] != 1:
        out.append(
            f"{at}temporal_patch_size is {v['temporal_patch_size']}: RICE-ViT embeds one frame a patch"
        )
    return out


def _internvit_rules(v: Mapping[str, Any], merge: int, at: str) -> list[str]:
    """InternViT on square tiles: a whole number of patches a side, and of merged patches (the pixel
    shuffle reshapes the patch grid by `merge`), position rows within bounds, a known norm."""
    image, patch = _side(v["image_size"]), _side(v["patch_size"])
    if image is None or patch is None:
        return [f"{at}image_size and patch_size must be square (one number, or a pair of equal ones)"]
    if image % patch:
        return [f"{at}image_size {image} is not a whole number of patch_size {patch} patches"]
    grid, out = image // patch, []
    if grid % merge:
        out.append(
            f"{at}image_size / patch_size ({grid} patches a side) is not a whole number of merged patches "
            f"(1 / downsample_ratio = {merge}): make them one"
        )
    if grid * grid + 1 > VISION_LIMITS["num_position_embeddings"][1]:
        out.append(f"{at}image_size / patch_size gives {grid * grid} patches a tile: too many positions")
    if v.get("norm_type") not in INTERNVIT_NORMS:
        out.append(
            f"{at}norm_type is {_shown(v.get('norm_type'))}: it must be one of {', '.join(INTERNVIT_NORMS)}"
        )
    return out


def dimension_problems(config: Any, family: str | None = None, at: str = "") -> list[str]:
    """What is wrong with a model config's numbers: each one present is a whole number within its
    bounds (`TEXT_LIMITS`, `VISION_LIMITS`), index lists within their counts, and keys that must agree
    do. With `family`, `config` is a whole config.json (overrides merged) and is checked as the
    family's defaults complete it; without, it is `model.configOverrides` alone, checked key by key.
    Pure and cheap (no loop runs longer than a bound), so every reader runs it before any other."""
    if not isinstance(config, Mapping):
        return [f"{at or 'the config '}must be a mapping of config.json keys, not {_shown(config)}"]
    sections = {name: config.get(name) for name in ("text_config", "vision_config") if name in config}
    bad = [
        f"{at}{name} must be a mapping, not {_shown(v)}"
        for name, v in sections.items()
        if not isinstance(v, Mapping)
    ]
    if bad:
        return bad
    flat = family is None or family in ("qwen2-vl", "qwen2.5-vl")
    views: list[tuple[str, Mapping[str, Any], str]] = [("text_config", config, at)] if flat else []
    views += [(name, sec, f"{at}{name}.") for name, sec in sections.items() if isinstance(sec, Mapping)]
    pairs = family in (None, "internvl")
    out = _internvl_top_problems(config, at) if pairs else []
    for name, view, where in views:
        out += _range_problems(view, name, where, pairs=pairs and name == "vision_config")
        out += _list_problems(view, name, where, full=False)
    if out or family is None:
        return out + [
            p for name, view, where in views if name == "text_config" for p in _pair_problems(view, where)
        ]
    return _whole_config_problems(config, family, at, flat)


def _whole_config_problems(config: Mapping[str, Any], family: str, at: str, flat: bool) -> list[str]:
    """The rules between keys of a whole config.json, the family's defaults under it."""
    text_at = f"{at}text_config." if "text_config" in config else at
    if family == "internvl" and _text_type(config) not in INTERNVL_TEXT:
        return [
            f"{text_at}model_type is {_shown(_text_type(config))}: packtrain plans InternVL with a "
            f"{' or '.join(INTERNVL_TEXT)} decoder"
        ]
    text = _section(config, "text_config", family, flat_text=flat)
    vision = _section(config, "vision_config", family, flat_text=False)
    out = _list_problems(text, "text_config", text_at, full=True)
    out += _list_problems(vision, "vision_config", f"{at}vision_config.", full=True)
    out += _text_rules(text, family, text_at)
    out += _vision_rules(vision, text["hidden_size"], family, f"{at}vision_config.")
    if family == "internvl":
        merge = _merge_of(_top(config, family, "downsample_ratio"))
        out += _internvit_rules(vision, merge or 1, f"{at}vision_config.")
    return out


def limits_schema() -> dict[str, Any]:
    """The bounds as JSON Schema properties of `model.configOverrides` (top-level text keys, as flat
    Qwen2-VL configs hold them, and the two sub-configs), so the API server refuses an SFTJob whose
    overrides break one; every other key stays free-form."""

    def bounded(limits: Mapping[str, tuple[int, int]], part: str) -> dict[str, Any]:
        return {
            k: {
                "type": "integer",
                "minimum": lo,
                "maximum": hi,
                "description": f"config.json's {k} ({part}).",
            }
            for k, (lo, hi) in limits.items()
        }

    def section(limits: Mapping[str, tuple[int, int]], part: str) -> dict[str, Any]:
        return {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": bounded(limits, part),
            "description": f"Keys of the {part} config.",
        }

    return {
        **bounded(TEXT_LIMITS, "the text model, where a flat config holds it at the top"),
        "text_config": section(TEXT_LIMITS, "text model"),
        "vision_config": section(VISION_LIMITS, "vision tower"),
    }


def _family_of(config: Mapping[str, Any], family: str | None) -> str:
    """`family`, else the one `model_type` names; ConfigError when they disagree or neither is planned."""
    model_type = config.get("model_type")
    named = next((f.name for f in FAMILIES.values() if f.model_type == model_type), None)
    if family in FAMILIES and model_type is not None and FAMILIES[family].model_type != model_type:
        raise ConfigError(
            f"model.family is {family} but the model's config.json is a {_shown(model_type)} model: set "
            f"model.family to {named or 'its family'}, or leave it out to take it from config.json"
        )
    name = family or named
    if name not in _FAMILY_KINDS:
        raise ConfigError(f"config.json model_type {_shown(model_type)} is no family packtrain plans")
    return name


def model_dims(config: Mapping[str, Any], family: str | None = None) -> ModelDims:
    """`ModelDims` of a config.json dict (configOverrides already merged); family from `model_type`.
    ConfigError naming the first number `dimension_problems` refuses, before any is used."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"the model's config must be a mapping of config.json keys, not {_shown(config)}")
    name = _family_of(config, family)
    problems = dimension_problems(config, name)
    if problems:
        raise ConfigError(
            f"the model's config (model.path's config.json with model.configOverrides): {problems[0]}"
            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        )
    text = _section(config, "text_config", name, flat_text=name in ("qwen2-vl", "qwen2.5-vl"))
    vision = _section(config, "vision_config", name, flat_text=False)
    layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    is_35 = name.startswith("qwen3.5")
    kinds = _layer_types(text, layers) if is_35 else []
    linear = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    moe = _moe_layers(name, text, layers)
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if name == "internvl":
        tied = _top(config, name, "tie_word_embeddings")
    return ModelDims(
        family=name,
        vocab=int(text["vocab_size"]),
        hidden=hidden,
        intermediate=int(text.get("intermediate_size") or 0) if len(moe) < layers else 0,
        layers=layers,
        heads=heads,
        kv_heads=int(text["num_key_value_heads"]),
        head_dim=int(text.get("head_dim") or hidden // heads),
        tied=bool(tied),
        attention_bias=bool(text.get("attention_bias", name in ("qwen2-vl", "qwen2.5-vl"))),
        linear_layer_indexes=linear,
        linear_k_heads=int(text.get("linear_num_key_heads", 0)) if linear else 0,
        linear_v_heads=int(text.get("linear_num_value_heads", 0)) if linear else 0,
        linear_k_dim=int(text.get("linear_key_head_dim", 0)) if linear else 0,
        linear_v_dim=int(text.get("linear_value_head_dim", 0)) if linear else 0,
        conv_kernel=int(text.get("linear_conv_kernel_dim", 0)) if linear else 0,
        experts=int(text.get("num_experts") or text.get("num_local_experts") or 0) if moe else 0,
        experts_per_token=int(text.get("num_experts_per_tok", 0)) if moe else 0,
        expert_intermediate=int(text.get("moe_intermediate_size", 0)) if moe else 0,
        shared_expert_intermediate=int(text.get("shared_expert_intermediate_size", 0)) if moe else 0,
        moe_layer_indexes=moe,
        **(
            _internvit_fields(config, vision, hidden)
            if name == "internvl"
            else _rice_fields(vision)
            if name == LLAVA_OV
            else _qwen_vision_fields(name, vision)
        ),
    )


def _qwen_vision_fields(name: str, vision: Mapping[str, Any]) -> dict[str, Any]:
    """The Qwen vision towers' `ModelDims` fields."""
    qwen2 = name == "qwen2-vl"
    v_hidden = int(vision.get("embed_dim") or vision["hidden_size"]) if qwen2 else int(vision["hidden_size"])
    return {
        "vision_depth": int(vision["depth"]),
        "vision_hidden": v_hidden,
        "vision_intermediate": int(v_hidden * vision["mlp_ratio"])
        if qwen2
        else int(vision["intermediate_size"]),
        "vision_heads": int(vision["num_heads"]),
        "vision_out": int(vision["hidden_size"]) if qwen2 else int(vision["out_hidden_size"]),
        "patch_size": int(vision["patch_size"]),
        "temporal_patch_size": int(vision["temporal_patch_size"]),
        "in_channels": int(vision.get("in_channels") or vision.get("in_chans") or 3),
        "merge_size": int(vision["spatial_merge_size"]),
        "vision_positions": int(vision.get("num_position_embeddings", 0)) if name.startswith("qwen3") else 0,
        "deepstack": len(vision.get("deepstack_visual_indexes") or []) if name.startswith("qwen3-vl") else 0,
    }


def _rice_fields(vision: Mapping[str, Any]) -> dict[str, Any]:
    """RICE-ViT's `ModelDims` fields (LLaVA-OneVision-1.5): one frame a patch, the merger writing
    `text_hidden_size` (checked equal to the decoder's hidden size)."""
    return {
        "vision_depth": int(vision["depth"]),
        "vision_hidden": int(vision["hidden_size"]),
        "vision_intermediate": int(vision["intermediate_size"]),
        "vision_heads": int(vision["num_heads"]),
        "vision_out": int(vision["text_hidden_size"]),
        "patch_size": int(vision["patch_size"]),
        "temporal_patch_size": 1,
        "in_channels": int(vision.get("in_channels") or 3),
        "merge_size": int(vision["spatial_merge_size"]),
        "vision_positions": 0,
        "deepstack": 0,
    }


def _internvit_fields(
    config: Mapping[str, Any], vision: Mapping[str, Any], text_hidden: int
) -> dict[str, Any]:
    """InternVL's `ModelDims` fields: InternViT (checked square by `_internvit_rules`) and its decoder's kind;
    the projector writes the decoder's width."""
    image, patch = int(_side(vision["image_size"]) or 0), int(_side(vision["patch_size"]) or 1)
    positions = (image // patch) ** 2 + 1 if vision.get("use_absolute_position_embeddings") else 0
    return {
        "vision_depth": int(vision["num_hidden_layers"]),
        "vision_hidden": int(vision["hidden_size"]),
        "vision_intermediate": int(vision["intermediate_size"]),
        "vision_heads": int(vision["num_attention_heads"]),
        "vision_out": text_hidden,
        "patch_size": patch,
        "temporal_patch_size": 1,
        "in_channels": int(vision["num_channels"]),
        "merge_size": _merge_of(_top(config, "internvl", "downsample_ratio")) or 1,
        "vision_positions": positions,
        "deepstack": 0,
        "text_type": str(_text_type(config)),
        "image_size": image,
        "vision_rms_norm": vision["norm_type"] == "rms_norm",
        "vision_qk_norm": bool(vision.get("use_qk_norm")),
        "vision_qkv_bias": bool(vision.get("attention_bias")),
        "vision_final_norm": not vision.get("use_mean_pooling", True),
        "vision_mask_token": bool(vision.get("use_mask_token")),
    }


@dataclass(frozen=True)
class Tensor:
    """One parameter: its name in the Hugging Face model, element count, part, and (for an
    nn.Linear's weight) the layer's (in, out) features, which is what a LoRA adapter adds to."""

    name: str
    numel: int
    part: str  # vision, merger, llm or embeddings (Family.modules)
    linear: tuple[int, int] | None = None


def _linear(prefix: str, part: str, n_in: int, n_out: int, bias: bool) -> Iterator[Tensor]:
    yield Tensor(f"{prefix}.weight", n_in * n_out, part, (n_in, n_out))
    if bias:
        yield Tensor(f"{prefix}.bias", n_out, part)


def _norm(prefix: str, part: str, width: int, bias: bool) -> Iterator[Tensor]:
    yield Tensor(f"{prefix}.weight", width, part)
    if bias:
        yield Tensor(f"{prefix}.bias", width, part)


def _internvit_layer(d: ModelDims, i: int) -> Iterator[Tensor]:
    """One InternViT layer (InternVLVisionLayer): separate q/k/v, the optional qk RMSNorms over the
    whole width, two norms, a GELU MLP and the two layer-scale vectors."""
    p, e, inner = f"model.vision_tower.encoder.layer.{i}", d.vision_hidden, d.vision_intermediate
    yield Tensor(f"{p}.lambda_1", e, "vision")
    yield Tensor(f"{p}.lambda_2", e, "vision")
    for name in ("q_proj", "k_proj", "v_proj"):
        yield from _linear(f"{p}.attention.{name}", "vision", e, e, d.vision_qkv_bias)
    yield from _linear(f"{p}.attention.projection_layer", "vision", e, e, True)
    if d.vision_qk_norm:
        yield Tensor(f"{p}.attention.q_norm.weight", e, "vision")
        yield Tensor(f"{p}.attention.k_norm.weight", e, "vision")
    yield from _linear(f"{p}.mlp.fc1", "vision", e, inner, True)
    yield from _linear(f"{p}.mlp.fc2", "vision", inner, e, True)
    yield from _norm(f"{p}.layernorm_before", "vision", e, not d.vision_rms_norm)
    yield from _norm(f"{p}.layernorm_after", "vision", e, not d.vision_rms_norm)


def _internvit_outside(d: ModelDims) -> Iterator[Tensor]:
    """InternViT's embeddings (cls token, optional mask token, patch conv, positions), its final
    LayerNorm without mean pooling, and the projector: a LayerNorm and two linears over the pixel
    shuffle's merge² x width features."""
    e, p = d.vision_hidden, "model.vision_tower"
    yield Tensor(f"{p}.embeddings.cls_token", e, "vision")
    if d.vision_mask_token:
        yield Tensor(f"{p}.embeddings.mask_token", e, "vision")
    yield Tensor(
        f"{p}.embeddings.patch_embeddings.projection.weight", e * d.in_channels * d.patch_size**2, "vision"
    )
    yield Tensor(f"{p}.embeddings.patch_embeddings.projection.bias", e, "vision")
    if d.vision_positions:
        yield Tensor(f"{p}.embeddings.position_embeddings", d.vision_positions * e, "vision")
    if d.vision_final_norm:
        yield from _norm(f"{p}.layernorm", "vision", e, True)
    merged, q = e * d.merge_size**2, "model.multi_modal_projector"
    yield from _norm(f"{q}.layer_norm", "merger", merged, True)
    yield from _linear(f"{q}.linear_1", "merger", merged, d.vision_out, True)
    yield from _linear(f"{q}.linear_2", "merger", d.vision_out, d.vision_out, True)


def _vision_block(d: ModelDims, i: int) -> Iterator[Tensor]:
    if d.vision_kind == "internvit":
        yield from _internvit_layer(d, i)
        return
    p, e, inner = f"model.visual.blocks.{i}", d.vision_hidden, d.vision_intermediate
    layer_norm = d.vision_kind != "qwen2.5"  # Qwen2.5-VL's blocks use RMSNorm (no bias)
    yield from _norm(f"{p}.norm1", "vision", e, layer_norm)
    yield from _norm(f"{p}.norm2", "vision", e, layer_norm)
    yield from _linear(f"{p}.attn.qkv", "vision", e, 3 * e, True)
    yield from _linear(f"{p}.attn.proj", "vision", e, e, True)
    if d.vision_kind in ("qwen2", "rice"):
        yield from _linear(f"{p}.mlp.fc1", "vision", e, inner, True)
        yield from _linear(f"{p}.mlp.fc2", "vision", inner, e, True)
    elif d.vision_kind == "qwen2.5":
        yield from _linear(f"{p}.mlp.gate_proj", "vision", e, inner, True)
        yield from _linear(f"{p}.mlp.up_proj", "vision", e, inner, True)
        yield from _linear(f"{p}.mlp.down_proj", "vision", inner, e, True)
    else:
        yield from _linear(f"{p}.mlp.linear_fc1", "vision", e, inner, True)
        yield from _linear(f"{p}.mlp.linear_fc2", "vision", inner, e, True)


def _merger(d: ModelDims, prefix: str, postshuffle: bool) -> Iterator[Tensor]:
    e, merged = d.vision_hidden, d.vision_hidden * d.merge_size**2
    if d.vision_kind in ("qwen2", "qwen2.5", "rice"):
        yield from _norm(f"{prefix}.ln_q", "merger", e, d.vision_kind != "qwen2.5")
        yield from _linear(f"{prefix}.mlp.0", "merger", merged, merged, True)
        yield from _linear(f"{prefix}.mlp.2", "merger", merged, d.vision_out, True)
        return
    yield from _norm(f"{prefix}.norm", "merger", merged if postshuffle else e, True)
    yield from _linear(f"{prefix}.linear_fc1", "merger", merged, merged, True)
    yield from _linear(f"{prefix}.linear_fc2", "merger", merged, d.vision_out, True)


def _patch_embed(d: ModelDims) -> Iterator[Tensor]:
    if d.vision_kind == "internvit":  # with the projector: all of the vision side outside its layers
        yield from _internvit_outside(d)
        return
    e = d.vision_hidden
    conv = e * d.in_channels * d.temporal_patch_size * d.patch_size**2
    yield Tensor("model.visual.patch_embed.proj.weight", conv, "vision")
    if d.vision_kind == "rice":  # a class token (and its rotary entry) per image, the pre-LayerNorm
        yield Tensor("model.visual.class_embedding", e, "vision")
        yield Tensor("model.visual.class_pos_emb", e // d.vision_heads // 2, "vision")
        yield from _norm("model.visual.pre_layernorm", "vision", e, True)
    if d.vision_kind == "qwen3":
        yield Tensor("model.visual.patch_embed.proj.bias", e, "vision")
        yield Tensor("model.visual.pos_embed.weight", d.vision_positions * e, "vision")


def _mergers(d: ModelDims) -> Iterator[Tensor]:
    if d.vision_kind == "internvit":  # its projector comes with `_patch_embed`
        return
    yield from _merger(d, "model.visual.merger", postshuffle=False)
    for j in range(d.deepstack):
        yield from _merger(d, f"model.visual.deepstack_merger_list.{j}", postshuffle=True)


def vision_tensors(d: ModelDims) -> Iterator[Tensor]:
    """The vision tower: patch embedding (a Conv3d; InternViT's a Conv2d), position embedding, blocks
    and mergers (InternVL's projector)."""
    yield from _patch_embed(d)
    for i in range(d.vision_depth):
        yield from _vision_block(d, i)
    yield from _mergers(d)


def _attention(d: ModelDims, p: str) -> Iterator[Tensor]:
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    qkv_bias = d.attention_bias or d.text_kind == "qwen2"
    gate = 2 if d.text_kind == "qwen3.5" else 1  # Qwen3.5's q_proj also writes the output gate
    yield from _linear(f"{p}.q_proj", "llm", h, gate * q, qkv_bias)
    yield from _linear(f"{p}.k_proj", "llm", h, kv, qkv_bias)
    yield from _linear(f"{p}.v_proj", "llm", h, kv, qkv_bias)
    yield from _linear(f"{p}.o_proj", "llm", q, h, d.attention_bias and d.text_kind != "qwen2")
    if d.text_kind != "qwen2":
        yield Tensor(f"{p}.q_norm.weight", d.head_dim, "llm")
        yield Tensor(f"{p}.k_norm.weight", d.head_dim, "llm")


def _linear_attention(d: ModelDims, p: str) -> Iterator[Tensor]:
    """Qwen3.5's Gated DeltaNet (transformers' Qwen3_5GatedDeltaNet)."""
    h, nv = d.hidden, d.linear_v_heads
    key, value = d.linear_k_heads * d.linear_k_dim, nv * d.linear_v_dim
    conv = 2 * key + value
    yield Tensor(f"{p}.dt_bias", nv, "llm")
    yield Tensor(f"{p}.A_log", nv, "llm")
    yield Tensor(f"{p}.conv1d.weight", conv * d.conv_kernel, "llm")
    yield Tensor(f"{p}.norm.weight", d.linear_v_dim, "llm")
    yield from _linear(f"{p}.out_proj", "llm", value, h, False)
    yield from _linear(f"{p}.in_proj_qkv", "llm", h, conv, False)
    yield from _linear(f"{p}.in_proj_z", "llm", h, value, False)
    yield from _linear(f"{p}.in_proj_b", "llm", h, nv, False)
    yield from _linear(f"{p}.in_proj_a", "llm", h, nv, False)


def _mlp(p: str, h: int, inner: int) -> Iterator[Tensor]:
    yield from _linear(f"{p}.gate_proj", "llm", h, inner, False)
    yield from _linear(f"{p}.up_proj", "llm", h, inner, False)
    yield from _linear(f"{p}.down_proj", "llm", inner, h, False)


def _experts(d: ModelDims, p: str) -> Iterator[Tensor]:
    """The expert block: a router (a plain parameter, not an nn.Linear) and fused expert weights."""
    h, e, inner = d.hidden, d.experts, d.expert_intermediate
    yield Tensor(f"{p}.gate.weight", e * h, "llm")
    yield Tensor(f"{p}.experts.gate_up_proj", e * 2 * inner * h, "llm")
    yield Tensor(f"{p}.experts.down_proj", e * h * inner, "llm")
    if d.shared_expert_intermediate:
        yield from _mlp(f"{p}.shared_expert", h, d.shared_expert_intermediate)
        yield from _linear(f"{p}.shared_expert_gate", "llm", h, 1, False)


def _layer(d: ModelDims, i: int, linear: bool, moe: bool) -> Iterator[Tensor]:
    p = f"model.language_model.layers.{i}"
    if linear:
        yield from _linear_attention(d, f"{p}.linear_attn")
    else:
        yield from _attention(d, f"{p}.self_attn")
    if moe:
        yield from _experts(d, f"{p}.mlp")
    else:
        yield from _mlp(f"{p}.mlp", d.hidden, d.intermediate)
    yield Tensor(f"{p}.input_layernorm.weight", d.hidden, "llm")
    yield Tensor(f"{p}.post_attention_layernorm.weight", d.hidden, "llm")


def decoder_layer(d: ModelDims, i: int) -> Iterator[Tensor]:
    """One decoder layer's tensors, in transformers' names."""
    return _layer(d, i, i in d.linear_layer_indexes, i in d.moe_layer_indexes)


def _root(d: ModelDims) -> Iterator[Tensor]:
    """What lies outside every decoder layer and vision block (FSDP's root unit)."""
    yield from _patch_embed(d)
    yield from _mergers(d)
    yield Tensor("model.language_model.embed_tokens.weight", d.vocab * d.hidden, "embeddings")
    yield Tensor("model.language_model.norm.weight", d.hidden, "llm")
    if not d.tied:
        yield Tensor("lm_head.weight", d.vocab * d.hidden, "embeddings")


def tensors(d: ModelDims) -> Iterator[Tensor]:
    """Every parameter of the model (a tied LM head once: it is the token embedding)."""
    yield from vision_tensors(d)
    yield Tensor("model.language_model.embed_tokens.weight", d.vocab * d.hidden, "embeddings")
    for i in range(d.layers):
        yield from decoder_layer(d, i)
    yield Tensor("model.language_model.norm.weight", d.hidden, "llm")
    if not d.tied:
        yield Tensor("lm_head.weight", d.vocab * d.hidden, "embeddings")


def blocks(d: ModelDims) -> Iterator[tuple[int, list[Tensor]]]:
    """The decoder layers and vision blocks as (how many, the tensors of one): all vision blocks are
    alike and a decoder layer is one of at most four kinds (attention or linear attention, a dense
    or an expert MLP), so whatever sums over the model costs the same for 4 layers as for 1,000."""
    if d.vision_depth:
        yield d.vision_depth, list(_vision_block(d, 0))
    linear, moe = set(d.linear_layer_indexes), set(d.moe_layer_indexes)
    both = len(linear & moe)
    kinds = {(True, True): both, (True, False): len(linear) - both, (False, True): len(moe) - both}
    kinds[(False, False)] = d.layers - sum(kinds.values())
    for (is_linear, is_moe), count in kinds.items():
        if count > 0:
            yield count, list(_layer(d, 0, is_linear, is_moe))


def lora_target_regex(target_modules: Iterable[str], vision: bool, modules: ModuleLayout) -> str:
    """PEFT `target_modules` as one regex (PEFT full-matches it against each module's name): a
    module in the language model (and, with `vision`, the vision tower) whose last name part
    matches one of `target_modules`; where those parts sit is the family's `modules`."""
    scopes = [modules.lora_llm] + ([modules.lora_vision] if vision else [])
    names = "|".join(f"(?:{p})" for p in target_modules)
    return f"(?:{'|'.join(scopes)})(?:.*\\.)?(?:{names})"


@dataclass(frozen=True)
class LoraShape:
    """What the parameter count needs from `model.lora`."""

    rank: int
    target_modules: tuple[str, ...]
    vision: bool


@dataclass(frozen=True)
class ParamCounts:
    """Element counts of a model as it trains: total, trainable, and the pieces FSDP handles apart."""

    total: int  # every parameter, LoRA adapters included
    trainable: int
    by_part: dict[str, int]  # base parameters per part (vision, merger, llm, embeddings)
    trainable_by_part: dict[str, int]  # trainable ones (adapters count in their module's part)
    adapters: int  # LoRA A and B matrices (0 without LoRA)
    largest_block: int  # the biggest decoder layer or vision block (adapters included): FSDP gathers one
    largest_block_trainable: int
    root: int  # outside every decoder layer and vision block: FSDP's root unit (embeddings, head, merger)
    root_trainable: int

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


def frozen_parts(freeze: Iterable[str]) -> set[str]:
    """`llm` takes the embeddings and LM head with it (as the trainer's `param_groups.frozen_parts`)."""
    parts = set(freeze)
    return parts | {"embeddings"} if "llm" in parts else parts


def param_counts(d: ModelDims, freeze: Iterable[str] = (), lora: LoraShape | None = None) -> ParamCounts:
    """Counts as `param_groups.freeze` and `lora.apply` leave the model: with LoRA only adapters train
    (each targeted nn.Linear(in, out) gets rank x (in + out)); a frozen part's adapters do not."""
    frozen = frozen_parts(freeze)
    target = (
        re.compile(lora_target_regex(lora.target_modules, lora.vision, FAMILIES[d.family].modules))
        if lora
        else None
    )
    by_part = {p: 0 for p in ("vision", "merger", "llm", "embeddings")}
    trains_by_part = dict(by_part)
    total = trainable = adapters = 0
    root, biggest = [0, 0], [0, 0]  # [elements, trainable] of one unit
    units = [(1, list(_root(d)), True), *((n, unit, False) for n, unit in blocks(d))]
    for times, unit, is_root in units:
        size = [0, 0]
        for t in unit:
            extra = 0
            adapted = target is not None and t.linear and target.fullmatch(t.name.removesuffix(".weight"))
            if adapted and lora is not None and t.linear is not None:
                extra = lora.rank * (t.linear[0] + t.linear[1])
            trains = extra if target is not None else t.numel
            trains = 0 if t.part in frozen else trains
            by_part[t.part] += t.numel * times
            trains_by_part[t.part] += trains * times
            adapters += extra * times
            size = [size[0] + t.numel + extra, size[1] + trains]
        total, trainable = total + size[0] * times, trainable + size[1] * times
        root, biggest = (size, biggest) if is_root else (root, max(biggest, size))
    return ParamCounts(
        total, trainable, by_part, trains_by_part, adapters, biggest[0], biggest[1], root[0], root[1]
    )


def read_config(folder: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A model folder's config.json with `overrides` merged; ConfigError naming what is missing
    (`ModelFolder.config`: pass that where the folder is read for more than this)."""
    return ModelFolder(folder, overrides).config


_TEXT_KEYS = frozenset(
    {
        *("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
        *("num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "layer_types"),
        *("full_attention_interval", "linear_num_key_heads", "linear_num_value_heads"),
        *("linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts"),
        *("num_local_experts", "num_experts_per_tok", "moe_intermediate_size"),
        *("shared_expert_intermediate_size", "mlp_only_layers", "decoder_sparse_step"),
        "model_type",  # InternVL's text_config: which decoder
    }
)
_VISION_KEYS = frozenset(
    {
        *("depth", "embed_dim", "hidden_size", "mlp_ratio", "intermediate_size", "num_heads"),
        *("out_hidden_size", "patch_size", "temporal_patch_size", "in_channels", "in_chans"),
        *("spatial_merge_size", "num_position_embeddings", "deepstack_visual_indexes"),
        *("num_hidden_layers", "num_attention_heads", "attention_bias", "use_qk_norm", "norm_type"),
        *("image_size", "num_channels", "use_mask_token", "use_absolute_position_embeddings"),
        *("use_mean_pooling", "text_hidden_size"),
    }
)


def planning_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a config.json `model_dims` reads, and only those: what a PackJob reports to the
    operator (a termination message holds 4 KiB), which merges an SFTJob's configOverrides into it
    as the trainer merges them into config.json."""
    out: dict[str, Any] = {k: v for k, v in config.items() if k in _TEXT_KEYS or k == "downsample_ratio"}
    for key, keep in (("text_config", _TEXT_KEYS), ("vision_config", _VISION_KEYS)):
        if isinstance(config.get(key), Mapping):
            out[key] = {k: v for k, v in config[key].items() if k in keep}
    return out
