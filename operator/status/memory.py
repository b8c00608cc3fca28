"""An SFTJob's GPU memory plan before its training job exists: fits, refused, or not plannable.

The operator cannot read the model folder (it sits on a claim only pods mount), so it plans from
what a PackJob reported: its convert stage records model.path's config.json, trimmed to the sizes
the planner reads (`status.modelSizes`). An SFTJob on that PackJob (`data.packJobRef`) with the
same `model.path` is the same folder (it mounts the PackJob's claim at the same path), so the
operator merges the SFTJob's configOverrides into those sizes as the trainer merges them into
config.json, and plans with the pack's maxLength. Otherwise it says it could not plan; the
trainer's own start-up plan still refuses, with exit 2, a job that cannot fit.
Context parallelism is checked here too, as the trainer checks it at start-up: the world
(resources.nodes x gpusPerNode) and, once the sizes are known, the attention heads must divide by
training.contextParallel, and only packed rows split.
Pure: the handler reads, this decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packtrain.core.errors import ConfigError
from packtrain.core.memory_plan import (
    context_parallel_note,
    context_parallel_problem,
    gib,
    job_inputs,
    plan_memory,
    refusal,
)
from packtrain.core.model_size import ModelDims, deep_merge, model_dims
from packtrain.operator import policy
from packtrain.operator.api import PackJobSpec, SFTJobSpec

START_UP_NOTE = "the trainer plans at start-up and exits 2 (a configuration error) if the job does not fit"


@dataclass(frozen=True)
class MemoryVerdict:
    """`status.memoryPlan`, and why the job cannot fit its GPUs (None: it fits, or was not planned)."""

    status: dict[str, Any]
    refusal: str | None = None
    invalid: str | None = None  # the model's sizes break a bound: the trainer would exit 2 on them

    @property
    def planned(self) -> bool:
        return bool(self.status.get("planned"))


def context_parallel_refusal(spec: SFTJobSpec, dims: ModelDims | None = None) -> str | None:
    """Why the SFTJob cannot split its rows over training.contextParallel ranks, naming what to set:
    a world (resources.nodes x gpusPerNode, one process a node without GPUs) it does not divide,
    padded rows, or, with the model's `dims` known, attention heads it does not divide; else None."""
    res = spec.resources
    world = f"resources.nodes {res.nodes} x gpusPerNode {res.gpus_per_node}"
    if res.gpus_per_node == 0:
        world = f"resources.nodes {res.nodes}, one process each without GPUs"
    return context_parallel_problem(
        spec.training.context_parallel,
        world_size=res.nodes * max(res.gpus_per_node, 1),
        world=world,
        dims=dims,
        packed=spec.training.mode == "packed",
    )


def _unplanned(message: str) -> MemoryVerdict:
    return MemoryVerdict(
        {"planned": False, "message": f"not planned before start: {message}; {START_UP_NOTE}"}
    )


def _sizes(spec: SFTJobSpec, pack_spec: PackJobSpec | None, pack_status: Mapping[str, Any] | None) -> Any:
    """The PackJob's recorded sizes when they are this SFTJob's model, else why not (a str)."""
    ref = spec.data.pack_job_ref
    if ref is None or pack_spec is None:
        return (
            f"the operator cannot read model.path {spec.model.path!r}; it plans from a PackJob "
            "(data.packJobRef) with the same model.path"
        )
    sizes = (pack_status or {}).get("modelSizes")
    if not isinstance(sizes, Mapping):
        return f"PackJob {ref} recorded no model sizes (its model.path has no readable config.json)"
    if pack_spec.model.path != spec.model.path:
        return (
            f"model.path {spec.model.path!r} is not PackJob {ref}'s model.path "
            f"{pack_spec.model.path!r}, whose sizes the operator knows"
        )
    return sizes


def memory_verdict(
    spec: SFTJobSpec,
    rules: policy.Policy,
    pack_spec: PackJobSpec | None,
    pack_status: Mapping[str, Any] | None,
) -> MemoryVerdict:
    """Plan the job's memory per GPU against resources.gpuMemory (default: policy.gpuMemory)."""
    res = spec.resources
    if res.gpus_per_node == 0:
        return MemoryVerdict(
            {"planned": False, "message": "no GPUs (resources.gpusPerNode 0): nothing to plan"}
        )
    sizes = _sizes(spec, pack_spec, pack_status)
    if isinstance(sizes, str):
        return _unplanned(sizes)
    assert pack_spec is not None  # _sizes found the PackJob's
    quantity = res.gpu_memory or rules.gpu_memory
    try:
        dims = model_dims(deep_merge(sizes, spec.model.config_overrides), spec.model.family)
    except ConfigError as exc:  # before anything loops over or divides by the sizes
        return MemoryVerdict({"planned": False, "message": f"not planned: {exc}"}, invalid=str(exc))
    if (split := context_parallel_refusal(spec, dims)) is not None:
        return MemoryVerdict({"planned": False, "message": f"not planned: {split}"}, invalid=split)
    try:
        memory = int(policy.quantity(quantity))
    except (ConfigError, ValueError, TypeError, KeyError) as exc:
        return _unplanned(f"the model sizes do not plan ({exc})")
    x = job_inputs(
        spec.training,
        spec.model,
        world_size=res.nodes * res.gpus_per_node,
        gpus_per_host=res.gpus_per_node,
        gpu_memory=memory,
        max_length=pack_spec.packing.max_length,
    )
    plan = plan_memory(dims, x)
    source = "resources.gpuMemory" if res.gpu_memory else "the chart's policy.gpuMemory"
    status = {
        "planned": True,
        "fits": plan.fits,
        "perGpuBytes": round(plan.total),
        "perHostBytes": round(plan.per_host),
        "gpuMemoryBytes": memory,
        "message": f"about {gib(plan.total)} per GPU of {quantity} ({source}), "
        f"{gib(plan.per_host)} per node; maxLength {x.max_length} from PackJob {spec.data.pack_job_ref}"
        f"{context_parallel_note(x)}",
    }
    return MemoryVerdict(status, refusal(dims, plan))
