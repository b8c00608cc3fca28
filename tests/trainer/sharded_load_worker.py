"""One rank of the sharded-load tests, under torchrun (gloo): each job of the JSON file given is
built empty, sharded with FSDP2 (as training shards it; a single process keeps it whole), given
its weights, and what this rank then holds is saved for the test to put together.

Every tensor the loader takes out of a safetensors file passes through a recording wrapper, so
the bytes a rank read are counted outside the loader's own bookkeeping.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from vlm_fixtures import TINY  # noqa: E402

from packtrain.core.sft_config import LoraSpec  # noqa: E402
from packtrain.trainer import distributed  # noqa: E402
from packtrain.trainer.model import lora, weights  # noqa: E402
from packtrain.trainer.model.build import VLMForTraining, build_model  # noqa: E402
from packtrain.trainer.model.init_weights import cast_frozen, local_part, materialize  # noqa: E402

READ = {"bytes": 0}


class _Recorded:
    """A safetensors handle or slice whose tensors are counted as they come out."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> _Recorded:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def get_slice(self, name: str) -> _Recorded:
        return _Recorded(self.inner.get_slice(name))

    def get_tensor(self, name: str) -> torch.Tensor:
        return _count(self.inner.get_tensor(name))

    def __getitem__(self, box: Any) -> torch.Tensor:
        return _count(self.inner[box])


def _count(tensor: torch.Tensor) -> torch.Tensor:
    READ["bytes"] += tensor.numel() * tensor.element_size()
    return tensor


def _open(path: Any, framework: str) -> _Recorded:
    return _Recorded(_SAFE_OPEN(path, framework=framework))


_SAFE_OPEN = weights.safe_open
weights.safe_open = _open  # type: ignore[assignment]


def run(job: dict[str, Any], env: distributed.DistEnv, out: Path) -> None:
    device = torch.device("cpu")
    hf = build_model(
        job["model"],
        init=job["init"],
        overrides=TINY[job["family"]] if job["init"] == "random" else None,
        seed=job.get("seed", 0),
        empty=True,
    )
    if job.get("lora"):
        lora.apply(hf, LoraSpec(rank=4, alpha=8), job["model"])
    if job.get("frozen_bf16"):
        cast_frozen(hf, torch.bfloat16)
    core = VLMForTraining(hf, "sdpa", always_run_vision=env.distributed)
    reports: list[Any] = []
    READ["bytes"] = 0
    seed = job.get("seed", 0)
    fill = lambda m: reports.append(materialize(m, device, weights=job["weights"], seed=seed))  # noqa: E731
    distributed.parallelize(core, "fsdp", env, device, fill=fill)
    held = {}
    for name, p in hf.named_parameters():
        local, box = local_part(p)
        held[name] = ([(s.start, s.stop) for s in box], tuple(p.shape), local.detach().clone())
    torch.save(
        {
            "params": held,
            "buffers": {name: b.clone() for name, b in hf.named_buffers()},
            "tied": hf.lm_head.weight is hf.model.language_model.embed_tokens.weight,
            "report": asdict(reports[0]),
            "recorded_bytes": READ["bytes"],
            "unique_params": len(dict.fromkeys(hf.parameters())),
        },
        out / f"{job['name']}-rank{env.rank}.pt",
    )


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    env = distributed.environ()
    distributed.init(env, torch.device("cpu"))
    try:
        for job in jobs:
            run(job, env, out)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
