"""Training metrics: a Prometheus `/metrics` endpoint per rank, FLOPs/MFU, NVML GPU stats.

MFU counts the model FLOPs a step really needs: 6 x parameters x tokens for the
matmuls (LM head only on label tokens, as the loss computes it) plus the
attention term from the actual sub-sample lengths (Σ l², causal; in a hybrid
decoder only its full-attention layers, the linear-attention ones add a term
linear in length), and the vision tower's share from its patches and per-frame segments; divided by the
device's dense bf16 peak. GPU gauges come from NVML (GPM SM utilisation on
Hopper and newer when the driver supports it, else the coarse utilisation
rate); on a machine without GPUs they are simply not registered.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from packtrain.core.contract import (
    TRAIN_ATTENTION_IMBALANCE,
    TRAIN_DATA_WAIT,
    TRAIN_EFFECTIVE_TOKENS_PER_SECOND,
    TRAIN_EVAL_LOSS,
    TRAIN_GPU_MEMORY_TOTAL,
    TRAIN_GPU_MEMORY_USED,
    TRAIN_GPU_SM_UTILIZATION,
    TRAIN_INFO,
    TRAIN_LEARNING_RATE,
    TRAIN_LOSS,
    TRAIN_METRIC_PREFIX,
    TRAIN_MFU,
    TRAIN_PADDING_RATIO,
    TRAIN_SAMPLES_PER_SECOND,
    TRAIN_STEP,
    TRAIN_STEP_SECONDS,
    TRAIN_TOKENS_PER_SECOND,
)
from packtrain.core.errors import ConfigError
from packtrain.core.model_folder import family_for_model_type
from packtrain.core.progress import METRICS_ANY_PORT

if TYPE_CHECKING:  # imported where used: the device benchmark reads the FLOPs model without it
    from prometheus_client import Gauge

    from packtrain.trainer.data.batch import Batch

PEAK_BF16_TFLOPS = {  # dense, per GPU
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
}


def device_peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Dense bf16 peak of the device; None when unknown (e.g. CPU), so MFU is not reported."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs estimate needs from the model config and parameter counts."""

    llm_params: int
    lm_head_params: int
    vision_params: int
    layers: int
    attn_dim: int  # heads x head_dim of the language model
    vision_depth: int
    vision_dim: int
    spatial_merge: int
    vision_full_layers: int  # Qwen2.5-VL: only these attend over a whole frame ...
    vision_window: int  # ... the others within windows of this many patches (0: no windows)
    full_attention_layers: int  # decoder layers with softmax attention (Σ l²): all but linear ones
    linear_attention_layers: int  # Qwen3.5's Gated DeltaNet layers: state mixing linear in length
    linear_flops_per_token: float  # training FLOPs of one such layer's conv-free state mixing, per token
    llm_factor: float = 6.0  # FLOPs per parameter and token: 2 forward + 2 input grads + 2 x trainable share
    vision_factor: float = 6.0  # a wholly frozen tower runs forward only (under no_grad): 2
    # RICE-ViT (LLaVA-OneVision-1.5): a class token runs with each image's (frame's) patches, and the
    # merger is counted apart, per merged token (elsewhere it is in vision_params, per patch).
    vision_class_tokens: int = 0
    merger_params: int = 0
    merger_factor: float = 6.0

    @classmethod
    def from_model(cls, hf: Any, counts: dict[str, int]) -> ModelShape:
        text = hf.config.text_config
        vision = hf.config.vision_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        full = getattr(vision, "fullatt_block_indexes", None)
        window = getattr(vision, "window_size", 0) // vision.patch_size if full is not None else 0
        kinds = list(getattr(text, "layer_types", None) or [])[: text.num_hidden_layers]
        # InternViT names its depth like a text model; its pixel shuffle is InternVL's downsample_ratio.
        depth = getattr(vision, "depth", None) or vision.num_hidden_layers
        merge = getattr(vision, "spatial_merge_size", None) or round(1 / hf.config.downsample_ratio)
        linear = sum(kind == "linear_attention" for kind in kinds)
        class_tokens = family_for_model_type(hf.config.model_type).vision_class_tokens
        tower, merger = _tower_and_merger(hf, counts, apart=class_tokens > 0)
        return cls(
            llm_params=counts["llm"] - _inactive_expert_params(hf, text),
            lm_head_params=counts["lm_head"],
            vision_params=tower["vision"],
            layers=text.num_hidden_layers,
            attn_dim=text.num_attention_heads * head_dim,
            vision_depth=depth,
            vision_dim=getattr(vision, "embed_dim", None) or vision.hidden_size,
            spatial_merge=merge,
            vision_full_layers=depth if full is None else len(full),
            vision_window=window * window,
            full_attention_layers=text.num_hidden_layers - linear,
            linear_attention_layers=linear,
            linear_flops_per_token=_linear_flops_per_token(text) if linear else 0.0,
            llm_factor=_factor(counts, "llm", frozen_forward_only=False),
            vision_factor=_factor(tower, "vision", frozen_forward_only=True),
            vision_class_tokens=class_tokens,
            merger_params=merger["merger"],
            merger_factor=_factor(merger, "merger", frozen_forward_only=True) if class_tokens else 6.0,
        )


def _tower_and_merger(
    hf: Any, counts: dict[str, int], *, apart: bool
) -> tuple[dict[str, int], dict[str, int]]:
    """(vision, vision_trainable) and (merger, merger_trainable) counts: the merger `apart` from the
    tower where the family's tower adds class tokens (`Family.vision_class_tokens`: the merger sees
    the patches only); every other family's merger inside it (zero apart)."""
    merger = list(hf.model.visual.merger.parameters()) if apart else []
    alone = {
        "merger": sum(p.numel() for p in merger),
        "merger_trainable": sum(p.numel() for p in merger if p.requires_grad),
    }
    tower = {
        "vision": counts["vision"] - alone["merger"],
        "vision_trainable": counts.get("vision_trainable", counts["vision"]) - alone["merger_trainable"],
    }
    return tower, alone


def _inactive_expert_params(hf: Any, text: Any) -> int:
    """Mixture of experts: the expert weights a token does not use (each token runs top-k of the
    experts), left out of the per-token matmul FLOPs."""
    experts = getattr(text, "num_experts", None)
    if not experts:
        return 0
    total = sum(p.numel() for name, p in hf.named_parameters() if ".mlp.experts." in name)
    return int(total * (1 - text.num_experts_per_tok / experts))


def _linear_flops_per_token(text: Any, chunk: int = 64) -> float:
    """Training FLOPs (x3 forward) per token of a Gated DeltaNet layer's state mixing, the
    projections and the conv being in the parameter term: per value head, the chunked delta rule
    reads, predicts and updates a d_k x d_v state (3 products) and attends within its chunk (over
    d_k and d_v). An estimate, but linear in length as the layer is."""
    dk, dv, heads = text.linear_key_head_dim, text.linear_value_head_dim, text.linear_num_value_heads
    return 3.0 * 2.0 * heads * (3 * dk * dv + chunk * (dk + dv))


def _factor(counts: dict[str, int], part: str, frozen_forward_only: bool) -> float:
    """Training FLOPs per parameter and token of a part: forward (2), the gradient of its inputs (2)
    and of its trainable weights (2 x their share), so frozen parts and LoRA do not inflate MFU."""
    total, trainable = counts[part], counts.get(f"{part}_trainable", counts[part])
    if trainable == 0 and frozen_forward_only:
        return 2.0
    return 4.0 + 2.0 * trainable / max(total, 1)


def step_flops(shape: ModelShape, batch: Batch) -> float:
    """Training FLOPs (forward + backward = 3x forward) of one micro-batch."""
    info, inputs = batch.info, batch.inputs
    tokens = info.padded_tokens  # padding tokens cost compute too
    flops = shape.llm_factor * shape.llm_params * tokens + 6.0 * shape.lm_head_params * info.num_label_tokens
    if inputs.attention_mask is not None:  # padded rows: each row attends over its padded width
        width = inputs.input_ids.shape[1]
        attn = len(info.seq_lens) * width * width / 2
    else:
        attn = sum(n * n / 2 for n in info.seq_lens)
    flops += 12.0 * shape.full_attention_layers * shape.attn_dim * attn  # causal: half of QK^T and AV, x3
    flops += shape.linear_attention_layers * shape.linear_flops_per_token * tokens
    for grid in (inputs.image_grid_thw, inputs.video_grid_thw):
        if grid is not None:
            flops += vision_grid_flops(shape, grid)
    return flops


def vision_grid_flops(shape: ModelShape, grid: torch.Tensor) -> float:
    """Training FLOPs of the vision tower over media of `grid` (rows t, h, w): the tower's matmuls per
    patch (and per class token), each frame's full attention within itself (4 forward, x3 when it
    trains), and a separately counted merger per merged token."""
    patches = int(grid.prod(-1).sum())
    segments = int(grid[:, 0].sum())
    frame_tokens = (grid[:, 1] * grid[:, 2]).double() + shape.vision_class_tokens
    full = float((frame_tokens**2 * grid[:, 0]).sum())  # each frame attends within itself
    windowed = min(full, patches * shape.vision_window) if shape.vision_window else full
    attn = shape.vision_full_layers * full + (shape.vision_depth - shape.vision_full_layers) * windowed
    attn_factor = 4.0 if shape.vision_factor == 2.0 else 12.0  # forward only, or x3 with its backward
    tower_tokens = patches + shape.vision_class_tokens * segments
    merged = patches / shape.spatial_merge**2
    return (
        shape.vision_factor * shape.vision_params * tower_tokens
        + attn_factor * shape.vision_dim * attn
        + shape.merger_factor * shape.merger_params * merged
    )


class GpuProbe:
    """NVML readings for this rank's GPU; `None` from `open` when there is no usable GPU."""

    def __init__(self, nvml: Any, handle: Any, index: int) -> None:
        self.nvml, self.handle, self.index = nvml, handle, index
        self._gpm_prev: Any = None
        try:
            self.gpm = bool(nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except Exception:
            self.gpm = False

    @classmethod
    def open(cls, device: torch.device) -> GpuProbe | None:
        if device.type != "cuda":
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index or 0
            try:
                uuid = str(torch.cuda.get_device_properties(device).uuid)
                handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except Exception:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return cls(pynvml, handle, index)
        except Exception:
            return None

    def sm_utilization(self) -> tuple[float, str] | None:
        """Percent of SMs busy since the last call (GPM), else NVML's utilisation rate (also for
        the first GPM reading, which has no earlier sample to difference against)."""
        nv = self.nvml
        if self.gpm:
            try:
                sample = nv.nvmlGpmSampleAlloc()
                nv.nvmlGpmSampleGet(self.handle, sample)
                prev, self._gpm_prev = self._gpm_prev, sample
                if prev is not None:
                    req = nv.c_nvmlGpmMetricsGet_t()
                    req.version = nv.NVML_GPM_METRICS_GET_VERSION
                    req.numMetrics = 1
                    req.sample1, req.sample2 = prev, sample
                    req.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
                    nv.nvmlGpmMetricsGet(req)
                    nv.nvmlGpmSampleFree(prev)
                    return float(req.metrics[0].value), "gpm"
            except Exception:
                self.gpm = False
        try:
            return float(nv.nvmlDeviceGetUtilizationRates(self.handle).gpu), "utilization"
        except Exception:
            return None

    def memory(self) -> tuple[int, int] | None:
        try:
            info = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
            return int(info.used), int(info.total)
        except Exception:
            return None


# The per-step gauges: (full name, help). Each is set from the record key its name ends in
# (`packtrain_train_loss` <- "loss"), the key the JSON log lines use too.
STEP_GAUGES: tuple[tuple[str, str], ...] = (
    (TRAIN_TOKENS_PER_SECOND, "Token slots processed per second (incl. padding)."),
    (TRAIN_EFFECTIVE_TOKENS_PER_SECOND, "Non-padding tokens per second."),
    (TRAIN_PADDING_RATIO, "Fraction of processed token slots that are padding."),
    (TRAIN_SAMPLES_PER_SECOND, "Training samples per second."),
    (TRAIN_STEP_SECONDS, "Wall time of the last optimizer step."),
    (TRAIN_LOSS, "Loss of the last step (global token mean)."),
    (TRAIN_EVAL_LOSS, "Token-mean loss over the evaluation set at the last evaluation."),
    (TRAIN_LEARNING_RATE, "Current learning rate."),
    (TRAIN_DATA_WAIT, "Time the last step waited for data."),
    (TRAIN_STEP, "Optimizer steps completed."),
    (TRAIN_ATTENTION_IMBALANCE, "Max/mean attention cost across ranks (plan)."),
)
# NVML gauges: record key -> (full name, help, labels beyond rank and gpu).
GPU_GAUGES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "gpu_sm_utilization": (
        TRAIN_GPU_SM_UTILIZATION,
        "SM utilisation of this rank's GPU (source: gpm or utilization rate).",
        ("source",),
    ),
    "gpu_memory_used": (TRAIN_GPU_MEMORY_USED, "GPU memory in use (NVML).", ()),
    "gpu_memory_total": (TRAIN_GPU_MEMORY_TOTAL, "GPU memory size (NVML).", ()),
}


class TrainMetrics:
    """Per-rank gauges; served on `port` when given (each rank on port + local rank). `self.port`: the
    port served, which differs from `port` only where METRICS_ANY_PORT allowed another."""

    def __init__(self, rank: int, device: torch.device, port: int | None = None) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()
        self.rank = str(rank)
        self.port = port
        self.g: dict[str, Gauge] = {
            name.removeprefix(TRAIN_METRIC_PREFIX): Gauge(name, doc, ["rank"], registry=self.registry)
            for name, doc in STEP_GAUGES
        }
        self.probe = GpuProbe.open(device)
        self.peak: float | None = None
        if self.probe is not None:
            for key, (name, doc, extra) in GPU_GAUGES.items():
                self.g[key] = Gauge(name, doc, ["rank", "gpu", *extra], registry=self.registry)
        if port is not None:
            self.port = self._serve(port, os.environ.get(METRICS_ANY_PORT) == "1")

    def _serve(self, port: int, any_port: bool) -> int:
        """Serve /metrics on `port`, else (taken, and `any_port`) on one the OS picks: bound first,
        then reported, so two runs starting together cannot both be told the same port is free."""
        from prometheus_client import start_http_server

        try:
            server, _ = start_http_server(port, registry=self.registry)
        except OSError as exc:  # another run (or program) serves there: say which port, and the fix
            if not (any_port and exc.errno == errno.EADDRINUSE):
                raise ConfigError(
                    f"cannot serve /metrics on port {port} (training.metricsPort + local rank): "
                    f"{exc.strerror or exc}; another run or program is using it. Set training.metricsPort "
                    "(spec.metricsPort of an SFTJob) to a free port, or null to serve no metrics"
                ) from exc
            server, _ = start_http_server(0, registry=self.registry)
        return int(server.server_port)

    def info(self, **labels: str) -> None:
        """What this run chose (attention backend, mode, options), as labels of a gauge fixed at 1."""
        from prometheus_client import Gauge

        names = ["rank", *sorted(labels)]
        gauge = Gauge(TRAIN_INFO, "Choices of this run, as labels (value 1).", names, registry=self.registry)
        gauge.labels(rank=self.rank, **labels).set(1)

    def enable_mfu(self, peak_tflops: float | None) -> None:
        self.peak = peak_tflops
        if peak_tflops is not None and "mfu" not in self.g:
            from prometheus_client import Gauge

            self.g["mfu"] = Gauge(
                TRAIN_MFU, "Estimated model FLOPs utilisation.", ["rank"], registry=self.registry
            )

    def update(self, values: dict[str, float]) -> dict[str, float]:
        """Set the step gauges (and read the GPU); returns what was recorded, for logs."""
        out = dict(values)
        for key, value in values.items():
            if key in self.g and key not in ("mfu",) and not key.startswith("gpu_"):
                self.g[key].labels(rank=self.rank).set(value)
        if self.peak is not None and "flops_per_second" in values:
            out["mfu"] = values["flops_per_second"] / (self.peak * 1e12)
            self.g["mfu"].labels(rank=self.rank).set(out["mfu"])
        if self.probe is not None:
            gpu = str(self.probe.index)
            sm = self.probe.sm_utilization()
            if sm is not None:
                self.g["gpu_sm_utilization"].labels(rank=self.rank, gpu=gpu, source=sm[1]).set(sm[0])
                out["gpu_sm_utilization"] = sm[0]
            mem = self.probe.memory()
            if mem is not None:
                self.g["gpu_memory_used"].labels(rank=self.rank, gpu=gpu).set(mem[0])
                self.g["gpu_memory_total"].labels(rank=self.rank, gpu=gpu).set(mem[1])
                out["gpu_memory_used_bytes"] = mem[0]
        return out


class Stopwatch:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.t = now - self.t, now
        return elapsed
