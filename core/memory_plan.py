"""How much GPU memory a training job needs, per GPU and per host, before any GPU is spent.

Pure arithmetic over `model_size` (torch-free: the operator runs it before it creates the
PyTorchJob, the trainer at start-up before it builds the model, `packtrain train --plan` on a
laptop). The trainer keeps fp32 weights (the AdamW master weights) and fp32 AdamW m and v, and
computes in bf16 under autocast on GPUs; FSDP2 (`trainer/distributed.py`) shards weights,
gradients and optimizer state over all ranks and gathers each decoder layer / vision block in
bf16 (`MixedPrecisionPolicy(param_dtype)`) for its forward and backward. Per GPU, in bytes
(P: parameters, T: trainable, F = P - T frozen, N: world size, w: frozen bytes per element):

    parameters      DDP 4T + wF                  FSDP (4T + wF) / N
    gradients       DDP 4T (+ 4T bucket copies)  FSDP 4T / N
    optimizer       DDP 8T (AdamW m, v)          FSDP 8T / N
    compute copies  DDP 2T (autocast's bf16 weight cache) + 2 x frozen weights on the autograd path
                        (cast per op and kept by backward; none with activation checkpointing)
                    FSDP 2 x 2 x largest block (this one and the prefetched next, bf16)
                         + 2 x root (embeddings, LM head, merger: gathered for the whole step)
                         + 2 x largest trainable unit (its unsharded bf16 gradient before the
                           reduce-scatter: the root's LM head gradient lives through backward)
    activations     decoder: `layer_activation_bytes` x tokens x layers (+ 2 x 4h x tokens: the
                        embedding output and the final norm's); vision: `vision_block_bytes` x
                        patches x blocks, patches = vision_share x tokens x merge_size² (a pack
                        does not record its vision share: VISION_SHARE by default); InternVL: whole
                        448-pixel tiles, each (448/14)² + 1 = 1,025 tokens through the tower for its
                        256 decoder tokens, plus the pixel shuffle and projector per decoder token;
                        RICE-ViT (LLaVA-OneVision-1.5): a class token per image beside its patches
                        (`RICE_CLASS_TOKEN_SHARE`) and the pre-LayerNorm's fp32 input
    logits          1.25 x chunk x vocab x (4 + 2 under bf16): one chunk's fp32 logits (and their bf16
                    matmul output) at a time, `training.lossChunkTokens` rows
    reserve         RESERVE_BYTES + RESERVE_FRACTION of the rest (CUDA context, NCCL, fragmentation)

Activation checkpointing keeps each decoder layer's fp32 input (4h bytes a token) and recomputes
one layer at a time in backward: L x 4h + one layer's activations. A frozen vision tower runs
without autograd and keeps nothing. It is an estimate (a band, checked against measured CPU runs
by `tests/trainer/test_memory_plan.py`), not an allocator trace.

Context parallelism (`training.contextParallel: C`) splits each packed row over C consecutive ranks
(a zigzag split), so "tokens" above are a rank's max_length x sequences / C, with these exceptions:

    weights, grads, AdamW   unchanged: FSDP shards over the whole world (data x context ranks), DDP
                            replicates
    full attention          per rank tokens / C; Ulysses' all-to-all hands the kernel all tokens of
                            heads / C heads, the same bytes, except K/V heads, repeated to lcm(kv, C)
                            heads where C does not divide them: the kernel's k, v count lcm(kv, C)
    linear attention        Qwen3.5's Gated DeltaNet layers exchange heads the same way (conv and
                            delta rule over all tokens of 1/C of the heads): tokens / C too
    vision                  the row's images are dealt out over the group in runs of about equal patch
                            counts: counted as exactly 1/C of the patches a rank
    logits                  unchanged, one loss chunk (fewer rows when a rank holds fewer tokens)
    all-to-all buffers      one layer's send copies at a time: b(2q + 2kv) x tokens / C (a linear
                            layer's q, k, v, a, b out and its output back), or the row's gathered vision
                            features b x vision_out x vision tokens, the larger; the row's padding to a
                            multiple of 2C tokens is not counted
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from packtrain.core.errors import ConfigError
from packtrain.core.families import FAMILIES
from packtrain.core.model_size import LoraShape, ModelDims, ParamCounts, param_counts

GIB = 1 << 30
RESERVE_BYTES = 2 * GIB  # CUDA context, cuBLAS workspaces, NCCL buffers
RESERVE_FRACTION = 0.05  # allocator fragmentation
# The share of a packed sequence's tokens assumed to be vision tokens (each one merge_size² patches
# through the vision tower) when the pack does not say: an image-heavy SFT mix.
VISION_SHARE = 0.5
# One loss chunk's logits live at a time (the chunked loss recomputes them in backward): fp32 rows,
# plus the bf16 matmul output under autocast; x1.25 for the softmax gradient's temporaries (a CPU
# run of the loss alone peaks at ~1.2x one fp32 chunk over the LM head's weight gradient).
LOGITS_OVERHEAD = 1.25
# RICE-ViT runs a class token with each image's patches. The plan does not know how many images a
# row holds, so it counts them as the smallest image the processor writes by default (min_pixels
# 56x56: 4x4 = 16 patches): one more tower row per 16 patches, an upper bound (a typical image has
# hundreds of patches, so the real share is far under 1%).
RICE_CLASS_TOKEN_SHARE = 1 / 16
# The context-parallel degrees a refusal tries, fewest ranks a row first (each must divide the world
# size and the attention heads); more only splits a row over more than one 8-GPU host's NVLink.
CONTEXT_PARALLEL_DEGREES = (2, 4, 8)
Strategy = Literal["ddp", "fsdp"]


@dataclass(frozen=True)
class PlanInputs:
    """Everything the estimate reads besides the model: the job's choices and the hardware."""

    world_size: int = 1
    gpus_per_host: int = 1
    strategy: Strategy = "ddp"
    bf16: bool = True  # autocast compute (GPU default); False: fp32 compute (CPU)
    activation_checkpointing: bool = False
    vision_checkpointing: bool = False
    max_length: int = 4096  # tokens per packed sequence (the pack's maxLength)
    sequences: int = 1  # sequences per micro-batch (training.microBatchSequences)
    loss_chunk_tokens: int = 1024  # 0: every label token at once
    vision_share: float = VISION_SHARE
    frozen_bytes: int = 4  # bytes per frozen parameter (fp32)
    gpu_memory: int | None = None  # bytes per GPU; None: no fit check
    freeze: tuple[str, ...] = ()
    lora: LoraShape | None = None
    context_parallel: int = 1  # ranks one packed row is split over (training.contextParallel)
    packed: bool = True  # training.mode packed (False: padded, where context parallelism does not apply)

    @property
    def tokens(self) -> int:
        """Tokens of a micro-batch, the whole rows (what a context-parallel group holds together)."""
        return self.max_length * self.sequences

    @property
    def rank_tokens(self) -> float:
        """Tokens of a micro-batch one rank holds: 1/contextParallel of each row."""
        return self.tokens / self.context_parallel


def layer_activation_bytes(d: ModelDims, linear: bool, bf16: bool, context_parallel: int = 1) -> float:
    """Bytes autograd keeps per token for one decoder layer (cf. Korthikanti et al. 2022, "Reducing
    Activation Recomputation", whose 34h assumes GELU MLPs and dropout; here SwiGLU, GQA, RMSNorm,
    no dropout, flash-style attention that keeps no scores). With b the compute bytes (2 bf16, 4
    fp32) and a residual stream in fp32 (the fp32 embedding output):
      2 RMSNorms: 2 x (4h input + 4h normalised)                              = 16h
      linear inputs: autocast casts per op, so q, k, v, gate, up each keep
        their own b·h copy (fp32: one shared per block)                       = b·h x (5 | 2)
      attention: rotary q, k and their rotate_half copies 2b(q + kv), kernel
        inputs and output b(2q + 2kv), o_proj input counted in the output     = b(4q + 4kv)
      SwiGLU MLP: gate out, silu out, up out, down input                      = 4b·i
    Qwen3's q/k norms add (b + 4)(q + kv); Qwen3.5's output gate 3b·q. A Gated DeltaNet layer
    keeps its projections' outputs, the conv in and out, the gated norm's fp32 input and gate:
    b(3·conv + 2v) + 12v (+ linear inputs b·h x (4 | 1)). A MoE MLP keeps, for each of the k experts
    a token goes to, its input and gate/up/act/down tensors: b·k(h + 5·i_e), plus the shared expert.
    Under context parallelism C the attention kernel's k and v have lcm(kv_heads, C) heads (Ulysses
    repeats K/V heads C does not divide), per token a rank holds."""
    b, h = (2 if bf16 else 4), d.hidden
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    kernel_kv = math.lcm(d.kv_heads, context_parallel) * d.head_dim
    total = 16.0 * h
    if linear:
        key, value = d.linear_k_heads * d.linear_k_dim, d.linear_v_heads * d.linear_v_dim
        conv = 2 * key + value
        total += b * h * (4 if bf16 else 1) + b * (3 * conv + 2 * value) + 12 * value
    else:
        total += b * h * (3 if bf16 else 1) + b * (2 * q + 2 * kv) + b * (2 * q + 2 * kernel_kv)
        if d.text_kind != "qwen2":
            total += (b + 4) * (q + kv)
        if d.text_kind == "qwen3.5":
            total += 3 * b * q
    total += b * h * (2 if bf16 else 1)
    if d.experts:
        total += b * d.experts_per_token * (h + 5 * d.expert_intermediate) + 4 * d.experts
        if d.shared_expert_intermediate:
            total += 4 * b * d.shared_expert_intermediate
    else:
        total += 4 * b * d.intermediate
    return total


def vision_block_bytes(d: ModelDims, bf16: bool) -> float:
    """Bytes kept per patch for one vision block: two norms with their fp32 input (16e), linear
    inputs (qkv, proj, fc1 or gate/up, fc2 or down: b·e x (4 | 3) + b·i), the qkv output and rotary q,
    k copies (b·5e), attention inputs and output (b·4e), the MLP's hidden tensors (b·i x 2, SwiGLU 3)."""
    b, e, i = (2 if bf16 else 4), d.vision_hidden, d.vision_intermediate
    if d.vision_kind == "internvit":
        return _internvit_layer_bytes(d, b)
    swiglu = d.vision_kind == "qwen2.5"
    inputs = b * e * ((4 if swiglu else 3) if bf16 else 3) + b * i
    return 16.0 * e + inputs + b * 9 * e + b * i * (3 if swiglu else 2)


def _internvit_layer_bytes(d: ModelDims, b: int) -> float:
    """Bytes kept per tile token (patch or cls) for one InternViT layer: two norms with their fp32
    input (16e), linear inputs (q, k, v and proj each its own b·e under autocast, one shared by q/k/v
    in fp32; fc2's b·i), the q, k, v outputs (b·3e), attention inputs and output (b·4e), the two
    layer-scale products' inputs (b·2e), fc1's output before GELU (b·i); qk norms (b + 4)·2e."""
    e, i = d.vision_hidden, d.vision_intermediate
    inputs = b * e * (4 if b == 2 else 2) + b * i
    total = 16.0 * e + inputs + b * 3 * e + b * 4 * e + b * 2 * e + b * i
    return total + ((b + 4) * 2 * e if d.vision_qk_norm else 0)


def _internvit_tower_tokens(d: ModelDims, vision_tokens: float) -> tuple[float, float]:
    """InternVL: (tiles, tokens through the tower) of `vision_tokens` decoder tokens: a tile writes
    (grid / merge)² tokens and runs grid² patches + its cls token through every layer."""
    grid = d.image_size // d.patch_size
    tiles = vision_tokens / max((grid // d.merge_size) ** 2, 1)
    return tiles, tiles * d.tile_patches


def _projector_bytes(d: ModelDims, b: int, trains: bool) -> float:
    """Per decoder vision token, InternVL's pixel shuffle and projector: the shuffle's contiguous copy
    of merge² features (b·m²e, transient), the LayerNorm's fp32 input and output (8·m²e), linear_1's
    input (b·m²e), its output and GELU's (2b·h). Frozen, under no_grad: only the shuffle's copy and
    one of these at a time."""
    merged = d.vision_hidden * d.merge_size**2
    if not trains:
        return 2.0 * b * merged
    return b * merged + 8.0 * merged + b * merged + 2.0 * b * d.vision_out


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU bytes by row (the table `--plan` prints), and whether they fit."""

    rows: dict[str, float]
    counts: ParamCounts
    inputs: PlanInputs

    @property
    def total(self) -> float:
        return sum(self.rows.values())

    @property
    def per_host(self) -> float:
        return self.total * min(self.inputs.gpus_per_host, self.inputs.world_size)

    @property
    def fits(self) -> bool:
        return self.inputs.gpu_memory is None or self.total <= self.inputs.gpu_memory


def _state_rows(c: ParamCounts, x: PlanInputs) -> dict[str, float]:
    """Weights, gradients, AdamW state and the bf16 compute copies (see the module docstring)."""
    t, f = c.trainable, c.frozen
    fsdp = x.strategy == "fsdp" and x.world_size > 1
    n = x.world_size if fsdp else 1
    rows = {
        "parameters (fp32 master)": (4.0 * t + x.frozen_bytes * f) / n,
        "gradients (fp32)": 4.0 * t / n,
        "AdamW m, v (fp32)": 8.0 * t / n,
    }
    if x.strategy == "ddp" and x.world_size > 1:
        rows["DDP gradient buckets"] = 4.0 * t
    cb = 2 if x.bf16 else 4
    if fsdp:
        gathered = 2 * cb * c.largest_block + cb * c.root
        # unsharded bf16 gradients of a unit until its reduce-scatter (the root's LM head's from the first
        # backward step on); the fp32 reduce copy comes once the activations are freed
        unsharded = cb * max(c.largest_block_trainable, c.root_trainable)
        rows["FSDP gathered + unsharded grads"] = gathered + unsharded
    elif x.bf16:
        # autocast's cache keeps a bf16 copy of each trainable weight for the step; frozen weights on
        # the autograd path are cast per op and kept by backward unless their layer is recomputed
        frozen_on_path = 0 if x.activation_checkpointing else f - _silent_vision(c)
        rows["bf16 compute copies"] = 2.0 * (t + max(frozen_on_path, 0))
    return rows


def _silent_vision(c: ParamCounts) -> int:
    """Frozen elements that run without autograd: a vision tower with nothing to train (and its
    merger too when that trains nothing either)."""
    tower = c.by_part["vision"] if c.trainable_by_part["vision"] == 0 else 0
    merger = c.by_part["merger"] if tower and c.trainable_by_part["merger"] == 0 else 0
    return tower + merger


def _activation_rows(d: ModelDims, c: ParamCounts, x: PlanInputs) -> dict[str, float]:
    """Decoder, vision tower and loss activations of one micro-batch on one rank (its 1/C of each
    row under context parallelism)."""
    tokens, cp = x.rank_tokens, x.context_parallel
    full = layer_activation_bytes(d, linear=False, bf16=x.bf16, context_parallel=cp) * tokens
    lin = layer_activation_bytes(d, linear=True, bf16=x.bf16) * tokens if d.linear_layers else 0.0
    if x.activation_checkpointing:
        decoder = d.layers * 4.0 * d.hidden * tokens + max(full, lin)
    else:
        decoder = (d.layers - d.linear_layers) * full + d.linear_layers * lin
    decoder += 2 * 4.0 * d.hidden * tokens  # the embedding output and the final norm's
    patches = x.vision_share * tokens * d.merge_size**2
    outside = 0.0  # what the tower keeps outside its blocks: InternVL's projector, RICE's pre-LayerNorm
    trains = c.trainable_by_part["vision"] > 0
    if d.vision_kind == "internvit":  # whole tiles (cls token included) through the tower
        patches = _internvit_tower_tokens(d, x.vision_share * tokens)[1]
        projector_trains = trains or c.trainable_by_part["merger"] > 0
        outside = _projector_bytes(d, 2 if x.bf16 else 4, projector_trains) * x.vision_share * tokens
    elif d.vision_kind == "rice":  # class tokens; the pre-LayerNorm keeps its fp32 input when it trains
        patches *= 1 + RICE_CLASS_TOKEN_SHARE
        outside = (4.0 * d.vision_hidden if trains else 0.0) * patches
    block = vision_block_bytes(d, x.bf16)
    if not trains:  # under no_grad: one block's tensors at a time
        vision = block * patches
    elif x.vision_checkpointing:
        vision = (d.vision_depth * 4.0 * d.vision_hidden + block) * patches
    else:
        vision = d.vision_depth * block * patches
    vision += outside
    chunk = min(x.loss_chunk_tokens or tokens, tokens)
    rows = {
        "activations: decoder": decoder,
        "activations: vision": vision,
        "logits (loss chunk)": LOGITS_OVERHEAD * chunk * d.vocab * (4 + (2 if x.bf16 else 0)),
    }
    if cp > 1:
        rows["context-parallel all-to-all buffers"] = _context_parallel_buffers(d, x)
    return rows


def _context_parallel_buffers(d: ModelDims, x: PlanInputs) -> float:
    """Transient buffers of context parallelism, one at a time: the contiguous send copies of one
    layer's all-to-alls (attention: q, k, v in, the output back, K/V heads repeated to lcm(kv, C);
    Gated DeltaNet: q, k, v, a, b in, the output back), or the row's vision features gathered on every
    rank of the group (and their gradient summed back)."""
    b = 2 if x.bf16 else 4
    q, kv = d.heads * d.head_dim, math.lcm(d.kv_heads, x.context_parallel) * d.head_dim
    layer = 2.0 * q + 2 * kv
    if d.linear_layers:
        key, value = d.linear_k_heads * d.linear_k_dim, d.linear_v_heads * d.linear_v_dim
        layer = max(layer, 2.0 * key + 2 * value + 2 * d.linear_v_heads)
    features = d.vision_out * x.vision_share * x.tokens
    return b * max(layer * x.rank_tokens, features)


def plan_memory(d: ModelDims, x: PlanInputs) -> MemoryPlan:
    """The per-GPU estimate of a job: states, activations, and the runtime reserve."""
    counts = param_counts(d, x.freeze, x.lora)
    rows = {**_state_rows(counts, x), **_activation_rows(d, counts, x)}
    rows["reserve (CUDA, NCCL, fragmentation)"] = RESERVE_BYTES + RESERVE_FRACTION * sum(rows.values())
    return MemoryPlan(rows=rows, counts=counts, inputs=x)


DEFAULT_LORA = LoraShape(
    16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False
)


def _min_nodes(d: ModelDims, x: PlanInputs, most: int = 128) -> int | None:
    """The fewest nodes (of gpus_per_host GPUs) that fit the job under FSDP, else None (worlds its
    contextParallel does not divide passed over)."""
    per = max(x.gpus_per_host, 1)
    for nodes in range(max(x.world_size // per, 1), most + 1):
        y = replace(x, world_size=nodes * per, strategy="fsdp")
        if y.world_size % x.context_parallel == 0 and plan_memory(d, y).fits:
            return nodes
    return None


def _max_length_that_fits(d: ModelDims, x: PlanInputs) -> int | None:
    length = x.max_length // 2
    while length >= 256:
        if plan_memory(d, replace(x, max_length=length)).fits:
            return length
        length //= 2
    return None


Change = tuple[str, Callable[[PlanInputs], PlanInputs]]


def _fsdp(x: PlanInputs) -> PlanInputs:
    return replace(x, strategy="fsdp")


def _checkpointing(x: PlanInputs) -> PlanInputs:
    return replace(x, activation_checkpointing=True, vision_checkpointing=True)


def _lora(x: PlanInputs) -> PlanInputs:
    return replace(x, lora=DEFAULT_LORA)


def _changes(x: PlanInputs) -> list[Change]:
    """The changes to the job a user can make that apply to it, cheapest in throughput first."""
    changes: list[Change] = []
    if x.strategy == "ddp" and x.world_size > 1:
        changes.append(("training.strategy: fsdp", _fsdp))
    if not (x.activation_checkpointing and x.vision_checkpointing):
        changes.append(("training.activationCheckpointing and visionCheckpointing: true", _checkpointing))
    if x.lora is None:
        changes.append(("model.lora: {} (rank-16 adapters, the base frozen)", _lora))
    return changes


def head_problem(d: ModelDims, n: int) -> str | None:
    """Why Ulysses cannot split the model's heads `n` ways (the trainer's check at start-up), else None:
    query heads it does not divide, K/V heads that repeated to lcm(kv, n) no longer divide the query
    heads, or a Gated DeltaNet layer's key / value heads it does not divide."""
    if d.heads % n:
        return f"does not divide the model's {d.heads} attention heads (num_attention_heads)"
    if d.heads % math.lcm(d.kv_heads, n):
        return (
            f"cannot spread the model's {d.kv_heads} key/value heads evenly over its {d.heads} query heads "
            f"in {n} groups (num_key_value_heads)"
        )
    if d.linear_layers and (d.linear_k_heads % n or d.linear_v_heads % n):
        return (
            f"does not divide the {d.linear_k_heads} key and {d.linear_v_heads} value heads of the "
            "linear-attention layers (linear_num_key_heads, linear_num_value_heads)"
        )
    return None


def context_parallel_degrees(d: ModelDims, x: PlanInputs) -> list[int]:
    """The training.contextParallel values a refusal may suggest: more than the job's, dividing its
    world size and the model's heads (Ulysses splits heads); none for padded rows."""
    if not x.packed or not FAMILIES[d.family].context_parallel:
        return []
    return [
        n
        for n in CONTEXT_PARALLEL_DEGREES
        if n > x.context_parallel and x.world_size % n == 0 and head_problem(d, n) is None
    ]


def _tiers(x: PlanInputs, force_fsdp: bool = False) -> list[tuple[list[str], PlanInputs]]:
    """The job with none, then one after another, of the changes that keep every weight trained
    (fsdp, checkpointing): what context parallelism is tried with, fewest changes first."""
    y = _fsdp(x) if force_fsdp else x
    tiers: list[tuple[list[str], PlanInputs]] = [([], y)]
    for what, f in _changes(y):
        if f is not _lora:
            y = f(y)
            tiers.append(([*tiers[-1][0], what], y))
    return tiers


def _split_rows(d: ModelDims, x: PlanInputs) -> tuple[list[str], PlanInputs] | None:
    """The least that fits the job at its world size by splitting its rows over more ranks: the
    fewest changes besides, then the fewest ranks a row; None when no degree fits."""
    for names, y in _tiers(x):
        for n in context_parallel_degrees(d, y):
            z = replace(y, context_parallel=n)
            if plan_memory(d, z).fits:
                return [f"training.contextParallel: {n}", *names], z
    return None


def _nodes_split(d: ModelDims, x: PlanInputs, most: int) -> tuple[int, list[str], PlanInputs] | None:
    """The fewest nodes, at most `most`, that fit the job under FSDP with its rows split over 2, 4 or 8
    ranks (checkpointing added where that takes fewer nodes), else None."""
    per = max(x.gpus_per_host, 1)
    best: tuple[int, list[str], PlanInputs] | None = None
    for names, y in _tiers(x, force_fsdp=True):
        for nodes in range(max(x.world_size // per, 1), (best[0] - 1 if best else most) + 1):
            wider = replace(y, world_size=nodes * per)
            z = next(
                (
                    replace(wider, context_parallel=n)
                    for n in context_parallel_degrees(d, wider)
                    if plan_memory(d, replace(wider, context_parallel=n)).fits
                ),
                None,
            )
            if z is not None:
                best = (nodes, [f"training.contextParallel: {z.context_parallel}", *names], z)
                break
    return best


def _split_step_of(d: ModelDims) -> Callable[[PlanInputs], PlanInputs]:
    """Context parallelism as a step in a chain of changes: the fewest ranks a row that fit, else the
    most (a job with no degree to offer left as it is)."""

    def split(x: PlanInputs) -> PlanInputs:
        degrees = context_parallel_degrees(d, x)
        fit = next((n for n in degrees if plan_memory(d, replace(x, context_parallel=n)).fits), None)
        return replace(x, context_parallel=fit or degrees[-1]) if degrees else x

    return split


def suggestions(d: ModelDims, x: PlanInputs) -> list[str]:
    """What would make a job that does not fit fit, with its per-GPU total: each change alone, else the
    changes together, in order; its rows split over more ranks (training.contextParallel, with fsdp and
    checkpointing as needed); more GPUs, with context parallelism where that takes fewer nodes; a
    shorter maxLength. A chain of changes splits the rows before it turns to LoRA, which trains less."""
    changes = _changes(x)
    alone = [
        f"{what} ({gib(plan_memory(d, f(x)).total)} per GPU)"
        for what, f in changes
        if plan_memory(d, f(x)).fits
    ]
    split = _split_rows(d, x)
    if split is not None:
        first, *rest = split[0]
        with_ = f" with {', '.join(rest)}" if rest else ""
        alone.append(f"{first}{with_} ({gib(plan_memory(d, split[1]).total)} per GPU)")
    wider: list[str] = []
    nodes = _min_nodes(d, x)
    more = None if split is not None else _nodes_split(d, x, most=nodes - 1 if nodes else 128)
    if more is not None:
        count, names, y = more
        wider.append(
            f"resources.nodes: {count} with fsdp, {', '.join(names)} "
            f"({y.world_size} GPUs, {gib(plan_memory(d, y).total)})"
        )
    if nodes is not None:
        y = replace(x, world_size=nodes * max(x.gpus_per_host, 1), strategy="fsdp")
        wider.append(
            f"resources.nodes: {nodes} with fsdp ({y.world_size} GPUs, {gib(plan_memory(d, y).total)})"
        )
    length = _max_length_that_fits(d, x)
    if length is not None:
        shorter = plan_memory(d, replace(x, max_length=length)).total
        wider.append(f"a pack with packing.maxLength {length} ({gib(shorter)})")
    if len(alone) > (split is not None) or len(wider) > (more is not None):  # a change without splitting
        return alone + wider
    return alone + _chain(d, x, changes, split is None) + wider


def _chain(d: ModelDims, x: PlanInputs, changes: list[Change], split_rows: bool) -> list[str]:
    """The changes applied one after another until the job fits (its rows split before LoRA where
    `split_rows`), with the nodes it then takes when none does; [] when nothing fits."""
    names: list[str] = []
    y = x
    step: Change = ("training.contextParallel", _split_step_of(d))
    steps = [c for c in changes if c[1] is not _lora] + [step] * split_rows
    steps += [c for c in changes if c[1] is _lora]
    for what, f in steps:
        if f is step[1]:
            if not context_parallel_degrees(d, y):
                continue
            what = f"{what}: {f(y).context_parallel}"
        y, names = f(y), [*names, what]
        if plan_memory(d, y).fits:
            return [f"all of {'; '.join(names)} ({gib(plan_memory(d, y).total)} per GPU)"]
    if not names:
        return []
    nodes = _min_nodes(d, y)
    return [f"all of {'; '.join(names)}; and resources.nodes: {nodes}"] if nodes is not None else []


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def refusal(d: ModelDims, plan: MemoryPlan) -> str | None:
    """Why the job cannot fit its GPUs and what to change; None when it fits (or nothing to check)."""
    x = plan.inputs
    if plan.fits or x.gpu_memory is None:
        return None
    fixes = suggestions(d, x)
    fix = "; or ".join(fixes) if fixes else "a smaller model, or GPUs with more memory"
    return (
        f"the job needs about {gib(plan.total)} per GPU but its GPUs have {gib(x.gpu_memory)} "
        f"({x.world_size} GPUs, {x.strategy}, maxLength {x.max_length}{context_parallel_note(x)}): it "
        f"would run out of memory. Change one of: {fix}"
    )


def context_parallel_note(x: PlanInputs) -> str:
    """ ", contextParallel C: T tokens a GPU" for a plan that splits its rows, else ""."""
    if x.context_parallel == 1:
        return ""
    return f", contextParallel {x.context_parallel}: {x.rank_tokens:.0f} tokens a GPU"


def unsplit_family(name: str) -> str:
    """Why a family's rows stay whole on one rank, and what to set."""
    able = ", ".join(f.name for f in FAMILIES.values() if f.context_parallel)
    return (
        f"{name} rows cannot be split over ranks yet (its vision tower takes tiles or images grouped per "
        f"sample, or its router's load-balancing loss covers a whole micro-batch); the families that can: "
        f"{able}. Set training.contextParallel: 1"
    )


def context_parallel_problem(
    context_parallel: int, *, world_size: int, world: str, dims: ModelDims | None, packed: bool
) -> str | None:
    """Why a job cannot split its rows over `context_parallel` ranks, naming what to set; None when it
    can (or does not split). `world` says where world_size comes from; `dims` is the model (None where
    it is not known, and its heads go unchecked)."""
    n = context_parallel
    if n <= 1:
        return None
    if not packed:
        return (
            f"training.contextParallel {n} splits packed rows over ranks, but training.mode is padded (one "
            "sample a row): set training.mode: packed, or training.contextParallel: 1"
        )
    if dims is not None and not FAMILIES[dims.family].context_parallel:
        return f"training.contextParallel {n}: {unsplit_family(dims.family)}"
    ok = [
        m
        for m in range(1, min(world_size, 64) + 1)
        if world_size % m == 0 and (dims is None or head_problem(dims, m) is None)
    ]
    choose = (
        f"set training.contextParallel to one of {', '.join(map(str, ok))}"
        if len(ok) > 1
        else "set training.contextParallel: 1"
    )
    if world_size % n:
        return (
            f"training.contextParallel {n} does not divide the world size {world_size} ({world}): the "
            f"world is data-parallel x contextParallel ranks; {choose}, or make the world a multiple of {n}"
        )
    heads = head_problem(dims, n) if dims is not None else None
    if heads is not None:
        return (
            f"training.contextParallel {n} {heads}: Ulysses attention splits heads over a row's ranks; "
            f"{choose}"
        )
    return None


_UNITS = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
    "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}  # fmt: skip


def parse_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes quantity (`141Gi`, `80G`) or a size like `80GiB`; ConfigError otherwise."""
    text = str(quantity).strip()
    number = text.rstrip("kKMGTiB")
    unit = text[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ConfigError(f"GPU memory {quantity!r} is not a size: write it like 80Gi, 141Gi or 80GiB")
    return int(value * _UNITS[unit])


def job_inputs(
    training: Any,
    model: Any,
    *,
    world_size: int,
    gpus_per_host: int,
    gpu_memory: int | None,
    max_length: int,
    bf16: bool = True,
) -> PlanInputs:
    """PlanInputs of a job's `training` and `model` sections (the trainer's TrainingSpec and
    TrainModelSpec, read by attribute: the core imports neither): options, freeze, LoRA and
    context parallelism."""
    lora = model.lora
    frozen_dtype = getattr(model, "frozen_dtype", None)  # model.frozenDtype, where the trainer has it
    return PlanInputs(
        world_size=world_size,
        gpus_per_host=gpus_per_host,
        strategy=training.strategy,
        bf16=bf16 if training.dtype == "auto" else training.dtype == "bf16",
        activation_checkpointing=training.activation_checkpointing,
        vision_checkpointing=training.vision_checkpointing,
        max_length=max_length,
        sequences=training.micro_batch_sequences if training.mode == "packed" else training.padded_batch_size,
        loss_chunk_tokens=training.loss_chunk_tokens,
        frozen_bytes=2 if frozen_dtype == "bf16" else 4,
        gpu_memory=gpu_memory,
        freeze=tuple(model.freeze),
        lora=LoraShape(lora.rank, tuple(lora.target_modules), lora.vision) if lora else None,
        context_parallel=training.context_parallel,
        packed=training.mode == "packed",
    )
