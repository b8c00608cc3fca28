"""The model families packtrain speaks: one entry each, holding every fact that differs between them.

An entry names the Hugging Face classes, the processor defaults (patch and
merge sizes, normalization, the resize, frame-sampling and video-text rules),
where the parts of the model sit (for freezing, per-part learning rates and
LoRA) and the special tokens by *name*. Token ids are never written here: they are
read from a model folder's tokenizer files (`families.model_spec`). A model
folder's own preprocessor configs override the defaults, as `AutoProcessor`
does. This module is plain data (no torch, no transformers), so the packer's
config, the operator's CRD schema and the trainer all read the same entries.
Adding a family is one entry here plus its parity and equivalence tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

from packtrain.core import record_json

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

QWEN_TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)
QWEN_DEFAULT_SYSTEM = "You are a helpful assistant."

QWEN35_TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN35_TOOLS_OUTRO = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must "
    "be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n- If there is no function call available, answer the question like normal with "
    "your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# stride: Qwen2VLVideoProcessor; linspace: Qwen3VLVideoProcessor; shifted: InternVLVideoProcessor (evenly
# spaced, each from the middle of its stretch).
FrameSampling = Literal["stride", "linspace", "shifted"]
# frame: size bounds per frame; volume: over frames x height x width; tile: each frame one square tile.
VideoResize = Literal["frame", "volume", "tile"]
# patches: an image is a grid of patches whose size follows the image (Qwen); tiles: fixed square tiles
# chosen by aspect ratio, plus a thumbnail (InternVL).
VisionInput = Literal["patches", "tiles"]
# mrope: 3-D (time, height, width) rotary positions per sample; 1d: text positions restarting per sample.
Positions = Literal["mrope", "1d"]
# json: Qwen2.5's `<tool_call>` + JSON object; xml: Qwen3.5's `<function=...>` + `<parameter=...>` blocks.
ToolStyle = Literal["json", "xml"]


@dataclass(frozen=True)
class ModuleLayout:
    """Where the parts of a family's model sit: submodule paths from its `model_class` (module lists
    are expanded by the trainer; a path may also name one parameter, such as a vision tower's class
    token), as plain strings so this module needs no torch.

    The four parts are what `model.freeze` and `training.lrMultipliers` name; every parameter must
    fall under one of them (the trainer refuses a model with parameters outside every part).
    """

    vision: tuple[str, ...]  # the vision tower's patch embedding and blocks
    merger: tuple[str, ...]  # the projector(s) into the language model
    llm: tuple[str, ...]  # decoder layers and final norm
    embeddings: tuple[str, ...]  # token embeddings and LM head
    # The vision side's submodules in forward order: the prefix of it with nothing to train runs
    # without autograd.
    vision_chain: tuple[str, ...]
    # Module-name regex prefixes of the parts LoRA adapters may go into (never the embeddings, the LM
    # head or the patch-embedding conv); PEFT writes the regex into adapter_config.json.
    lora_llm: str
    lora_vision: str

    def part(self, name: str) -> tuple[str, ...]:
        """The submodule paths of part `name` (vision, merger, llm or embeddings)."""
        if name not in ("vision", "merger", "llm", "embeddings"):
            raise KeyError(f"no model part {name!r}")
        paths: tuple[str, ...] = getattr(self, name)
        return paths


_LORA_LLM = r"model\.language_model\."
# The vision tower's blocks and mergers, Qwen3-VL's DeepStack ones included.
_LORA_VISION = r"model\.visual\.(?:blocks|merger|deepstack_merger_list)\."
_LLM = ("model.language_model.layers", "model.language_model.norm")
_EMBEDDINGS = ("model.language_model.embed_tokens", "lm_head")


@dataclass(frozen=True)
class Tiling:
    """How a tiled family (InternVL) cuts an image: the canvas of `tile_size` squares whose aspect
    ratio is closest to the image's, between `min_tiles` and `max_tiles` of them, plus a thumbnail of the
    whole image when there is more than one; each tile is `(tile_size / patch_size)² / merge²` tokens.
    A video frame is one tile, written `frame_prefix` (1-based `n`) + its vision run, frames joined by
    `frame_separator`. The processor config's `min_patches` / `max_patches` / `size` override these."""

    tile_size: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True
    frame_prefix: str = "Frame{n}: "
    frame_separator: str = "\n"


@dataclass(frozen=True)
class Family:
    """Static description of one model family (defaults of its HF processor and model classes)."""

    name: str  # the `model.family` value
    model_type: str  # config.json `model_type`
    model_class: str  # the transformers class the trainer builds
    tokenizer_class: str  # dotted path; imported directly because AutoTokenizer pulls in torch
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int  # image size rule bounds when the folder gives none
    max_pixels: int
    video_min_pixels: int | None  # None: the image bounds (no separate video processor defaults)
    video_max_pixels: int | None
    frame_sampling: FrameSampling  # stride: Qwen2VLVideoProcessor; linspace: Qwen3VLVideoProcessor
    video_resize: VideoResize  # frame: bounds per frame; volume: bounds over frames x height x width
    video_timestamps: bool  # one `<t seconds>` + vision block per temporal group (Qwen3-VL)
    time_scaled_rope: bool  # temporal mRoPE ids in seconds (Qwen2.5-VL `tokens_per_second`)
    deepstack: bool  # vision features injected into early LLM layers (Qwen3-VL)
    modules: ModuleLayout  # where freezing, per-part learning rates and LoRA find each part
    vision_input: VisionInput = "patches"  # the pixel pipeline
    positions: Positions = "mrope"  # the position rule of the language model
    tiling: Tiling | None = None  # tiles only
    # The token a video's vision runs are filled with: its own pad (Qwen), or the image context token
    # (InternVL writes a video as one image tile per frame; its template's `<video>` is only a placeholder).
    video_fill: Literal["video_pad", "image_pad"] = "video_pad"
    # Whether the LM head is tied is said by `text_config` when the top level does not say it (InternVL:
    # transformers' top-level default would tie it; `model_folder` writes the decoder's choice out).
    tie_from_text_config: bool = False
    # Where `model_class` lives: None for transformers; else a packtrain module that implements the
    # architecture itself (a family transformers has no class for) and registers its config type.
    model_module: str | None = None
    videos: bool = True  # False: a video is a per-sample reject (the model has no video path)
    # The tower's output for an image depends on the other images of its call (LLaVA-OneVision-1.5's
    # class-token offset): the trainer's one tower call takes the images grouped per packed sample.
    vision_groups_by_sample: bool = False
    # Tokens the tower adds to each image before its blocks (RICE-ViT's class token): the tower's
    # FLOPs count them, and its merger (which drops them) is counted apart from the tower.
    vision_class_tokens: int = 0
    # Whether the trainer can split one packed row over ranks (training.contextParallel): a tower of
    # patches whose features it can deal out per image, and no router whose load-balancing loss is
    # over a whole micro-batch. The trainer, the planner and the operator all read this.
    context_parallel: bool = True
    # Special tokens, by name.
    im_start: str = "<|im_start|>"
    assistant_header: str = "<|im_start|>assistant\n"  # rendered text that opens an assistant turn
    turn_end: str = "<|im_end|>"  # rendered text that closes a turn (trained on for assistant turns)
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    image_pad: str = "<|image_pad|>"
    video_pad: str = "<|video_pad|>"
    pad_token: str = "<|endoftext|>"
    default_system: str = QWEN_DEFAULT_SYSTEM
    # Turn/vision structure a record's text must not contain; grounding tokens like <|box_start|> stay
    # allowed.
    reserved_tokens: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_pad|>")
    tool_style: ToolStyle = "json"  # how tool signatures and calls are written (the template's `tools` form)

    @property
    def token_names(self) -> dict[str, str]:
        """Role -> token text of the tokens whose ids a model folder must define."""
        return {
            "im_start": self.im_start,
            "turn_end": self.turn_end,
            "vision_start": self.vision_start,
            "vision_end": self.vision_end,
            "image_pad": self.image_pad,
            "video_pad": self.video_pad,
            "pad": self.pad_token,
        }

    def tool_call_text(self, value: str) -> str:
        """An assistant function-call turn, as the family's template writes it.

        json: the value verbatim. xml: `value` must be a JSON object `{"name", "arguments"}`
        (arguments an object, or a string holding one); ValueError otherwise (a
        `record_json.RecordJSONError` when its JSON is over a record's limits).
        """
        if self.tool_style == "json":
            return f"<tool_call>\n{value}\n</tool_call>"
        name, arguments = _tool_call(value)
        params = "".join(
            f"<parameter={k}>\n{_parameter_text(v)}\n</parameter>\n" for k, v in arguments.items()
        )
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    def observation_text(self, value: str) -> str:
        """A tool result; it becomes a user turn (the VL templates have no tool role)."""
        return f"<tool_response>\n{value}\n</tool_response>"

    def system_with_tools(self, system: str | None, tools: list[Any]) -> str:
        """The system prompt carrying tool signatures, as the family's template renders `tools`
        (json: Qwen2.5's text template, the default system prompt first; xml: Qwen3.5's, the
        record's system prompt after the tools, none by default)."""
        lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        if self.tool_style == "json":
            return (system or self.default_system) + QWEN_TOOLS_INTRO + lines + QWEN_TOOLS_OUTRO
        text = (system or "").strip()
        return QWEN35_TOOLS_INTRO + lines + QWEN35_TOOLS_OUTRO + (f"\n\n{text}" if text else "")


def _tool_call(value: str) -> tuple[str, dict[str, Any]]:
    """Name and arguments of a function call written as a JSON object `{"name", "arguments"}`."""
    try:
        call = record_json.loads(value, "function call")
    except json.JSONDecodeError as exc:
        raise ValueError(f"a function call must be a JSON object with name and arguments ({exc})") from exc
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ValueError("a function call must be a JSON object with a string name")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = record_json.loads(arguments, "function call arguments") if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"function call arguments are a string but not JSON ({exc})") from exc
    if not isinstance(arguments, dict):
        raise ValueError("function call arguments must be a JSON object")
    return call["name"], arguments


def _parameter_text(value: Any) -> str:
    """One argument as the Qwen3.5 template writes it: objects and lists as JSON, the rest as Jinja's
    `string` filter does (Python `str`)."""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


_QWEN_TOKENIZER = "transformers.models.qwen2.tokenization_qwen2.Qwen2Tokenizer"

QWEN2_VL = Family(
    name="qwen2-vl",
    model_type="qwen2_vl",
    model_class="Qwen2VLForConditionalGeneration",
    tokenizer_class=_QWEN_TOKENIZER,
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=CLIP_MEAN,
    image_std=CLIP_STD,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 1280,
    video_min_pixels=None,
    video_max_pixels=None,
    frame_sampling="stride",
    video_resize="frame",
    video_timestamps=False,
    time_scaled_rope=False,
    deepstack=False,
    modules=ModuleLayout(
        vision=("model.visual.patch_embed", "model.visual.blocks"),
        merger=("model.visual.merger",),
        llm=_LLM,
        embeddings=_EMBEDDINGS,
        vision_chain=("model.visual.patch_embed", "model.visual.blocks", "model.visual.merger"),
        lora_llm=_LORA_LLM,
        lora_vision=_LORA_VISION,
    ),
)

# Qwen2.5-VL changes Qwen2-VL only in its classes and its time-scaled video positions.
QWEN2_5_VL = replace(
    QWEN2_VL,
    name="qwen2.5-vl",
    model_type="qwen2_5_vl",
    model_class="Qwen2_5_VLForConditionalGeneration",
    time_scaled_rope=True,
)

QWEN3_VL = Family(
    name="qwen3-vl",
    model_type="qwen3_vl",
    model_class="Qwen3VLForConditionalGeneration",
    tokenizer_class=_QWEN_TOKENIZER,
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=HALF,
    image_std=HALF,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 1280,
    video_min_pixels=128 * 32 * 32,
    video_max_pixels=32 * 32 * 768,
    frame_sampling="linspace",
    video_resize="volume",
    video_timestamps=True,
    time_scaled_rope=False,
    deepstack=True,
    modules=ModuleLayout(
        vision=("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks"),
        merger=("model.visual.merger", "model.visual.deepstack_merger_list"),
        llm=_LLM,
        embeddings=_EMBEDDINGS,
        vision_chain=(
            "model.visual.patch_embed",
            "model.visual.pos_embed",
            "model.visual.blocks",
            "model.visual.deepstack_merger_list",
            "model.visual.merger",
        ),
        lora_llm=_LORA_LLM,
        lora_vision=_LORA_VISION,
    ),
)

# Qwen3.5 (and the Qwen releases on its architecture): Qwen3-VL's processors and vision tower without
# DeepStack, a hybrid decoder (Gated DeltaNet linear-attention + full-attention layers, both under
# `model.language_model.layers`) and its own tokenizer class. Its template has no default system prompt.
QWEN3_5 = replace(
    QWEN3_VL,
    name="qwen3.5",
    model_type="qwen3_5",
    tool_style="xml",
    model_class="Qwen3_5ForConditionalGeneration",
    tokenizer_class="transformers.models.qwen3_5.tokenization_qwen3_5.Qwen3_5Tokenizer",
    deepstack=False,
    modules=ModuleLayout(
        vision=("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks"),
        merger=("model.visual.merger",),
        llm=_LLM,
        embeddings=_EMBEDDINGS,
        vision_chain=(
            "model.visual.patch_embed",
            "model.visual.pos_embed",
            "model.visual.blocks",
            "model.visual.merger",
        ),
        lora_llm=_LORA_LLM,
        lora_vision=r"model\.visual\.(?:blocks|merger)\.",
    ),
)

# The mixture-of-experts variants (Qwen3.5-35B-A3B and its kin, Qwen3-VL-30B-A3B): the dense family's
# tokenizer, processors, vision tower and layout; the experts and the router sit inside the decoder
# layers (the `llm` part), and the trainer adds the router's load-balancing loss over real tokens.
QWEN3_5_MOE = replace(
    QWEN3_5,
    name="qwen3.5-moe",
    model_type="qwen3_5_moe",
    model_class="Qwen3_5MoeForConditionalGeneration",
    context_parallel=False,
)
QWEN3_VL_MOE = replace(
    QWEN3_VL,
    name="qwen3-vl-moe",
    model_type="qwen3_vl_moe",
    model_class="Qwen3VLMoeForConditionalGeneration",
    context_parallel=False,
)

# InternVL3 / InternVL3.5 in transformers' native layout (the `-HF` releases): InternViT over fixed
# 448x448 tiles (a thumbnail after the tiles of a large image), pixel shuffle (0.5: merge 2) and an MLP
# projector into a Qwen2 / Qwen3 decoder with plain 1-D positions. The template writes an image as
# `<IMG_CONTEXT>` and a video as `<video>`; the processor turns them into `<img>` + 256 context tokens per
# tile + `</img>`, and one such block per frame, each after `Frame{n}: `.
INTERNVL = Family(
    name="internvl",
    context_parallel=False,
    model_type="internvl",
    model_class="InternVLForConditionalGeneration",
    tokenizer_class=_QWEN_TOKENIZER,
    patch_size=14,
    merge_size=2,
    temporal_patch_size=1,
    image_mean=IMAGENET_MEAN,
    image_std=IMAGENET_STD,
    min_pixels=448 * 448,
    max_pixels=448 * 448 * 12,
    video_min_pixels=448 * 448,
    video_max_pixels=448 * 448,
    frame_sampling="shifted",
    video_resize="tile",
    video_timestamps=False,
    time_scaled_rope=False,
    deepstack=False,
    vision_input="tiles",
    positions="1d",
    tiling=Tiling(),
    video_fill="image_pad",
    tie_from_text_config=True,
    modules=ModuleLayout(
        vision=("model.vision_tower",),
        merger=("model.multi_modal_projector",),
        llm=_LLM,
        embeddings=_EMBEDDINGS,
        vision_chain=("model.vision_tower", "model.multi_modal_projector"),
        lora_llm=_LORA_LLM,
        lora_vision=r"model\.(?:vision_tower\.encoder\.layer|multi_modal_projector)\.",
    ),
    vision_start="<img>",
    vision_end="</img>",
    image_pad="<IMG_CONTEXT>",
    video_pad="<video>",
    default_system="",
    reserved_tokens=(
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<img>",
        "</img>",
        "<IMG_CONTEXT>",
        "<video>",
    ),
)

# LLaVA-OneVision-1.5 (lmms-lab/LLaVA-OneVision-1.5-*-Instruct): Qwen2.5-VL's tokenizer, template and
# processor (images in 14-pixel patches with temporal_patch_size 1, merged 2x2), a RICE-ViT tower (a
# class token per image, 2-D rotary positions) and a Qwen3-shaped decoder with plain 1-D positions.
# transformers has no class for it and upstream's remote code is never run: packtrain implements it
# (`trainer/model/llava_onevision.py`, parameter names as released). Videos are rejected per sample:
# upstream's model code has no video path (it refuses the processor's video inputs).
LLAVA_ONEVISION_1_5 = replace(
    QWEN2_5_VL,
    context_parallel=False,
    name="llava-onevision-1.5",
    model_type="llavaonevision1_5",
    model_class="LlavaOneVision15ForConditionalGeneration",
    model_module="packtrain.trainer.model.llava_onevision",
    temporal_patch_size=1,
    time_scaled_rope=False,
    positions="1d",
    videos=False,
    max_pixels=1600 * 1600,
    tie_from_text_config=True,
    vision_groups_by_sample=True,
    vision_class_tokens=1,
    # The class token and its rotary entry are parameters of the tower itself (a path may name one).
    modules=ModuleLayout(
        vision=(
            "model.visual.patch_embed",
            "model.visual.class_embedding",
            "model.visual.class_pos_emb",
            "model.visual.pre_layernorm",
            "model.visual.blocks",
        ),
        merger=("model.visual.merger",),
        llm=_LLM,
        embeddings=_EMBEDDINGS,
        vision_chain=(
            "model.visual.patch_embed",
            "model.visual.pre_layernorm",
            "model.visual.blocks",
            "model.visual.merger",
        ),
        lora_llm=_LORA_LLM,
        lora_vision=r"model\.visual\.(?:blocks|merger)\.",
    ),
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        QWEN2_VL,
        QWEN2_5_VL,
        QWEN3_VL,
        QWEN3_5,
        QWEN3_5_MOE,
        QWEN3_VL_MOE,
        INTERNVL,
        LLAVA_ONEVISION_1_5,
    )
}

FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)
