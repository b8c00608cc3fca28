"""A model built without memory, then given its weights where it will train, shard by shard.

`build_model` creates the model's parameters on the meta device (its buffers, such as the rotary
`inv_freq`, are computed for real: they are small and not in checkpoints). LoRA, freezing and
FSDP2's `fully_shard` all work on that empty model, so `materialize` runs last: every rank
allocates only what it holds (its FSDP2 shard of each parameter, or the whole model without
FSDP), then fills it

- from pretrained safetensors (`weights.Checkpoint`), reading only its own rows of each tensor,
  so no rank ever holds the whole model in host memory; or
- by random init, one module at a time on the CPU: each module's parameters are created whole,
  seeded from `training.seed` and the module's name, initialised by the model's own
  `_init_weights` (LoRA adapters as PEFT initialises them), and the rank keeps its rows. The
  same seed gives the same model at every world size, on every device, in every run.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from packtrain.core.errors import ConfigError
from packtrain.trainer.model import param_groups
from packtrain.trainer.model.lora import ADAPTER, is_lora_layer
from packtrain.trainer.model.weights import FLOAT_DTYPES, Checkpoint, ReadStats, match_names

PEFT_WRAPPED = ".base_layer"  # where PEFT moves the wrapped layer's own parameters


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the meta device as it is registered; buffers
    stay real (accelerate's `init_empty_weights(include_buffers=False)`), so the rotary
    frequencies the model computes in its constructor are exact without being recomputed."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@dataclass(frozen=True)
class LoadReport:
    """What `materialize` did on this rank (benchmarks read it beside the process's peak memory)."""

    source: str  # "pretrained" or "random"
    tensors_read: int  # checkpoint tensors this rank sliced
    bytes_read: int  # bytes those slices copied: about the rank's share of the checkpoint
    initialised: int  # parameters randomly initialised (all of them at random init; adapters)
    local_bytes: int  # bytes of the parameters this rank holds
    seconds: float


def plain_name(name: str) -> str:
    """A parameter's name in the model without PEFT's wrapping (as checkpoints name it)."""
    return name.replace(PEFT_WRAPPED, "")


def local_part(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank holds of `param` and where it sits in the full tensor (one slice per
    dimension): an FSDP2 DTensor's local shard, else the whole parameter."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param, tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> int:
    """Frozen floating-point parameters stored in `dtype` (in place, before `materialize`): their
    fp32 copy would only be cast down for every forward. Returns the bytes this saves on the full
    model. Tied parameters stay tied; the model's `_keep_in_fp32_modules` are left as they are."""
    hf: Any = param_groups.hf_model(model)
    keep = set(getattr(hf, "_keep_in_fp32_modules", None) or ()) | set(
        getattr(hf, "_keep_in_fp32_modules_strict", None) or ()
    )
    cast: dict[int, nn.Parameter] = {}
    saved = 0
    for module_name, module in hf.named_modules(remove_duplicate=False):
        for name, p in list(module._parameters.items()):
            if p is None or p.requires_grad or not p.is_floating_point() or p.dtype == dtype:
                continue
            if keep & set(f"{module_name}.{name}".split(".")):
                continue
            if id(p) not in cast:
                cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                saved += p.numel() * (p.element_size() - cast[id(p)].element_size())
            module._parameters[name] = cast[id(p)]
    return saved


def _slots(model: nn.Module, store: str) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, tensor) of every parameter or buffer slot, shared ones once per module."""
    return [
        (module, name, t)
        for module in model.modules()
        for name, t in getattr(module, store).items()
        if t is not None
    ]


def _empty(model: nn.Module, device: torch.device) -> None:
    """Allocate every parameter on `device` (FSDP2 modules: only this rank's shard) and put back
    the real buffers and the ties that `to_empty` replaces."""
    buffers = _slots(model, "_buffers")
    params = _slots(model, "_parameters")
    model.to_empty(device=device)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer.to(device)
    first: dict[int, tuple[nn.Module, str]] = {}
    for module, name, p in params:  # plain `to_empty` gives each module its own copy of a tied weight
        owner, owner_name = first.setdefault(id(p), (module, name))
        module._parameters[name] = owner._parameters[owner_name]


def materialize(
    model: nn.Module, device: torch.device | str, *, weights: str | Path | None, seed: int
) -> LoadReport:
    """Give a meta-built model (possibly sharded by FSDP2, possibly with LoRA adapters) its
    weights on `device`: the pretrained ones from the `weights` folder, or (None) random init
    seeded by `seed`; adapters always start as PEFT starts them."""
    start = time.perf_counter()
    device = torch.device(device)
    if not any(p.is_meta for p in model.parameters()):
        raise ValueError("materialize expects a model built on the meta device (build_model(empty=True))")
    hf: Any = param_groups.hf_model(model)
    checkpoint = Checkpoint.open(weights) if weights is not None else None
    try:
        # A checkpoint that does not fit fails before anything is allocated.
        plan = plan_load(hf, checkpoint, _adapters(init_units(hf))) if checkpoint else {}
        _empty(model, device)
        units = init_units(hf)  # after `_empty`: it replaced the parameter objects
        with torch.no_grad():
            loaded = load_pretrained(hf, checkpoint, plan, _adapters(units)) if checkpoint else set()
            initialised = sum(unit.run(seed, skip=loaded) for unit in units)
    finally:
        if checkpoint is not None:
            checkpoint.close()
    stats = checkpoint.stats if checkpoint is not None else ReadStats()
    local = sum(local_part(p)[0].numel() * p.element_size() for p in dict.fromkeys(model.parameters()))
    return LoadReport(
        source="random" if weights is None else "pretrained",
        tensors_read=stats.tensors,
        bytes_read=stats.bytes,
        initialised=initialised,
        local_bytes=local,
        seconds=time.perf_counter() - start,
    )


def _adapters(units: list[InitUnit]) -> set[int]:
    """ids of the LoRA adapter parameters (no checkpoint of the base model holds them)."""
    return {id(p) for unit in units if unit.adapter for p in unit.params.values()}


def _wanted(hf: nn.Module, skip: set[int]) -> tuple[dict[str, tuple[str, ...]], dict[str, nn.Parameter]]:
    """The parameters to read (but those in `skip`), by their first plain name: every name each
    has (a tied LM head has two), and the parameter."""
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        if id(p) not in skip:
            aliases.setdefault(id(p), []).append(plain_name(name))
            params[id(p)] = p
    wanted = {names[0]: tuple(names) for names in aliases.values()}
    return wanted, {names[0]: params[key] for key, names in aliases.items()}


def plan_load(hf: PreTrainedModel, checkpoint: Checkpoint, skip: set[int]) -> dict[str, str]:
    """Model parameter name -> the checkpoint tensor holding it, for every parameter but those in
    `skip` (adapters), names and shapes checked (on the meta model: before anything is allocated)."""
    wanted, by_name = _wanted(hf, skip)
    found = match_names(checkpoint, hf, wanted)
    for name, stored in found.items():
        if checkpoint.shape(stored) != tuple(by_name[name].shape):
            raise ConfigError(
                f"checkpoint tensor {stored} has shape {checkpoint.shape(stored)} but the model's "
                f"{name} is {tuple(by_name[name].shape)}; remove model.configOverrides that change its size"
            )
        if by_name[name].is_floating_point() and checkpoint.dtype(stored) not in FLOAT_DTYPES:
            raise ConfigError(
                f"checkpoint tensor {stored} is {checkpoint.dtype(stored)}, not floating point, but the "
                f"model's {name} is; point model.path at this model's own weights"
            )
    return found


def load_pretrained(hf: nn.Module, checkpoint: Checkpoint, plan: dict[str, str], skip: set[int]) -> set[int]:
    """Fill each parameter of `plan` with this rank's rows of its checkpoint tensor, file by file;
    returns the ids of the parameters filled."""
    by_name = _wanted(hf, skip)[1]
    where = {stored: name for name, stored in plan.items()}
    for stored in checkpoint.by_file(where):
        local, box = local_part(by_name[where[stored]])
        if local.numel():
            local.copy_(checkpoint.read(stored, box))
    return {id(by_name[name]) for name in plan}


def derived_seed(seed: int, name: str) -> int:
    """A seed for one module from the run's seed and the module's name: independent of how many
    ranks there are and of which modules came before it."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class InitUnit:
    """Parameters initialised together by one call: a module's own (by its model's
    `_init_weights`), or a LoRA layer's adapters (by PEFT's `reset_lora_parameters`)."""

    name: str  # what seeds it (PEFT's wrapping removed, so a base layer inits as without LoRA)
    module: nn.Module
    init: Callable[[nn.Module], object]
    params: dict[tuple[nn.Module, str], nn.Parameter]  # (owning module, attribute) -> parameter
    adapter: bool = False

    def run(self, seed: int, skip: set[int]) -> int:
        """Create the unit's parameters whole on the CPU, initialise them, copy in this rank's
        rows; the number of parameters initialised."""
        todo = {slot: p for slot, p in self.params.items() if id(p) not in skip}
        if not todo:
            return 0
        temps = {
            slot: nn.Parameter(torch.full(p.shape, float("nan"), dtype=_init_dtype(p.dtype)), False)
            for slot, p in todo.items()
        }
        for (owner, attr), temp in temps.items():
            owner._parameters[attr] = temp
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derived_seed(seed, self.name))
                self.init(self.module)
                reset = getattr(self.module, "reset_parameters", None)
                if callable(reset) and any(t.isnan().any() for t in temps.values()):
                    reset()  # what its constructor did, for a module `_init_weights` leaves alone
        finally:
            for (owner, attr), p in todo.items():
                owner._parameters[attr] = p
        for slot, p in todo.items():
            if temps[slot].isnan().any():
                raise RuntimeError(f"no initialisation for parameter {slot[1]} of {self.name}")
            local, box = local_part(p)
            local.copy_(temps[slot][box])
        return len(todo)


def _init_dtype(dtype: torch.dtype) -> torch.dtype:
    """Initialise in fp32 at least: a bf16-stored (frozen) weight gets the fp32 init's values, cast."""
    return torch.promote_types(dtype, torch.float32)


def init_units(hf: PreTrainedModel) -> list[InitUnit]:
    """Every parameter of `hf` in exactly one unit, in module order (tied weights once); each
    module's init is that of the nearest (sub-)model above it, as `initialize_weights` dispatches."""
    units: list[InitUnit] = []
    seen: set[int] = set()

    def visit(module: nn.Module, name: str, owner: PreTrainedModel) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        if is_lora_layer(module):
            adapters = {
                (sub, attr): p
                for child, sub_module in module.named_children()
                if child.startswith("lora_")
                for sub in sub_module.modules()
                for attr, p in sub._parameters.items()
                if p is not None
            }
            seen.update(id(p) for p in adapters.values())
            units.append(InitUnit(f"{plain_name(name)}:lora", module, _reset_lora, adapters, adapter=True))
        own = {
            (module, attr): p for attr, p in module._parameters.items() if p is not None and id(p) not in seen
        }
        seen.update(id(p) for p in own.values())
        if own:
            units.append(InitUnit(plain_name(name), module, owner._init_weights, own))
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, owner)

    visit(hf, "", hf)
    return units


def _reset_lora(layer: nn.Module) -> None:
    """PEFT's own adapter init (A: kaiming-uniform, B: zeros), as `lora.apply` configures it."""
    from peft.tuners.lora import LoraLayer  # loaded already: `layer` is one

    assert isinstance(layer, LoraLayer)
    layer.reset_lora_parameters(ADAPTER, True)
