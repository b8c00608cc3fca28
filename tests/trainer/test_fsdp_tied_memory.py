"""FSDP2 with the LM head tied to the embedding: one unit of their own, gathered only around the lookup
and around the loss, its gradient the sum of both uses; and the export streamed to disk a piece at a
time, the same bytes `save_file` writes, whatever the world size.

The per-rank memory this saves is measured by `tests/bench/bench_scale_memory.py --family qwen2-vl`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import fsdp_tied_job
import pytest
import torch
from safetensors.torch import load_file, save, save_file
from torchrun_job import torchrun_script

from packtrain.trainer.distributed import DistEnv
from packtrain.trainer.state import export

JOB = Path(fsdp_tied_job.__file__)


@pytest.fixture(scope="module", params=["tied", "untied"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    """The tiny Qwen2-VL on 2 FSDP ranks and in one process: exported, then trained 3 steps."""
    out = tmp_path_factory.mktemp(request.param)
    untied = ["--untied"] if request.param == "untied" else []
    proc = torchrun_script(JOB, 2, "--out", str(out), *untied, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = argparse.Namespace(out=out, steps=3, untied=bool(untied))
    fsdp_tied_job.run(args, DistEnv(), torch.device("cpu"))
    return torch.load(out / "world-2.pt"), torch.load(out / "world-1.pt"), out


def test_two_fsdp_ranks_train_the_tied_weight_as_one_process(runs):
    """Same losses, gradients and weights after 3 SGD steps: the tied weight's gradient, reduce-
    scattered after each of its two uses, is the sum of both, as autograd makes it in one process
    (to fp32 rounding, measured against each tensor's largest entry: a use left out or counted
    twice would be off by about the gradient itself)."""
    two, one, out = runs
    assert two["tied"] == one["tied"] == (out.name.startswith("tied"))
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-6)
    assert two["grads"].keys() == one["grads"].keys()
    for name, value in one["grads"].items():
        assert _off(two["grads"][name], value) <= 1e-5, name
    initial = _exported(out / "export-1-fp32")["model.embed_tokens.weight"]
    tied = "hf.model.language_model.embed_tokens.weight"
    assert _off(one["weights"][tied], initial) > 0.1, "the tied weight did not move"
    assert two["weights"].keys() == one["weights"].keys()
    for name, value in one["weights"].items():
        assert _off(two["weights"][name], value) <= 1e-4, name


def _off(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, over `b`'s largest entry."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _exported(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(json.loads((folder / export.INDEX).read_text())["weight_map"].values())):
        out |= load_file(folder / name)
    return out


def test_the_tied_weight_is_whole_only_around_its_two_uses(runs):
    """While each decoder layer runs its forward and its backward, and when the lookup's backward
    starts, the tied weight (untied: the embedding) is sharded on every rank: gathered around the
    lookup and the loss only, not held through the step. The loss's gradient is reduce-scattered
    before the layers' backward; the lookup's backward needs no weight and reduce-scatters its
    rows' gradient itself."""
    two, _, _ = runs
    seen = two["seen"]
    assert len(seen) == 3 * 5  # 3 steps: 2 layers' forwards and backwards, the lookup's backward
    assert [where for where, whole in seen if whole] == []
    assert {where for where, _ in seen} >= {"layer 0 backward", "lookup backward"}


def test_the_streamed_export_is_what_save_file_writes_whatever_the_world_size(runs):
    """The export of 2 FSDP ranks is the export of one process byte for byte (fp32 and bf16), each
    shard the bytes `save_file` writes of its tensors, and no tensor was gathered whole on any rank:
    the sharded rows went to rank 0 a piece at a time."""
    two, one, out = runs
    for dtype in ("fp32", "bf16"):
        a, b = out / f"export-2-{dtype}", out / f"export-1-{dtype}"
        index = json.loads((a / export.INDEX).read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) >= 3 and index == json.loads((b / export.INDEX).read_text())
        # Tied: saved once, as save_pretrained does.
        assert ("lm_head.weight" in index["weight_map"]) == (not two["tied"])
        for name in files:
            data = (a / name).read_bytes()
            assert data == (b / name).read_bytes(), name
            assert data == save(load_file(a / name), metadata={"format": "pt"}), name
        assert not list(a.glob(".shard-*"))
    assert two["gathered_whole"] == []


def test_the_shard_writer_writes_the_bytes_save_file_writes(tmp_path):
    """Mixed dtypes (ordered by dtype, then name, in the file), views, a scalar, an empty tensor, a
    shard limit that splits them, and the index `save_pretrained` writes."""
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensors = {
        "b.weight": base[:, 2:5],  # not contiguous
        "a.bias": torch.linspace(-1, 1, 7, dtype=torch.bfloat16),
        "z.count": torch.tensor(3, dtype=torch.int64),
        "m.empty": torch.zeros(0, 4, dtype=torch.float16),
        "c.mask": torch.tensor([True, False, True]),
        "d.big": torch.randn(40, 8, generator=torch.Generator().manual_seed(0)),
    }
    writer = export.ShardWriter(tmp_path, limit=200)
    writer.add(dict(list(tensors.items())[:3]))
    writer.add(dict(list(tensors.items())[3:]))
    names = writer.close()
    index = json.loads((tmp_path / export.INDEX).read_text())
    assert names == sorted(set(index["weight_map"].values())) and len(names) == 2
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name in names:
        loaded = load_file(tmp_path / name)
        save_file({k: tensors[k].contiguous() for k in loaded}, tmp_path / "reference", {"format": "pt"})
        assert (tmp_path / name).read_bytes() == (tmp_path / "reference").read_bytes(), name
        assert all(torch.equal(v, tensors[k]) for k, v in loaded.items())
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert not list(tmp_path.glob(".shard-*"))


def test_only_a_conversion_that_renames_is_streamed():
    """A unit is streamed tensor by tensor only when the conversion hands back the very tensors it
    was given (renamed); one that makes new tensors gets the unit gathered whole."""
    local = {"hf.a.weight": torch.zeros(4, 3), "hf.a.bias": torch.zeros(4)}
    assert export.renames(lambda unit: {"x." + k: v for k, v in unit.items()}, local) == {
        "x.hf.a.weight": "hf.a.weight",
        "x.hf.a.bias": "hf.a.bias",
    }
    assert export.renames(lambda unit: {k: v.t() for k, v in unit.items()}, local) is None
    assert export.renames(lambda unit: {"one": next(iter(unit.values()))}, local) is None
