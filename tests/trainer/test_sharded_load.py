"""Loading without any rank holding the whole model: the model is built on the meta device, sharded
by FSDP2, and each rank reads only its own rows of each checkpoint tensor (or initialises only its
rows of a random init that is the same at every world size).

1, 2 and 4 gloo ranks under torchrun (`sharded_load_worker.py`) load a real sharded bf16 Hugging
Face folder; what the ranks hold, put together, must be exactly what `from_pretrained` loads.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import vlm_fixtures as fx
from conftest import job_spec, write_job
from safetensors.torch import load_file, save_file
from torchrun_job import torchrun_script

from packtrain.core.errors import ConfigError
from packtrain.core.model_spec import family_for_model_type
from packtrain.core.sft_config import LoraSpec, load_train_config
from packtrain.trainer.loop import train
from packtrain.trainer.model import lora
from packtrain.trainer.model.build import build_model, load_config
from packtrain.trainer.model.init_weights import cast_frozen, materialize
from packtrain.trainer.model.weights import INDEX

WORKER = Path(__file__).with_name("sharded_load_worker.py")
WORLDS = (1, 2, 4)
SEED = 3


def _save_folder(family: str, out: Path, seed: int = 7) -> Path:
    """A tiny random model saved as transformers saves it, in bf16, in several shards with an index,
    beside the family's tokenizer and processor files."""
    model = build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], seed=seed)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="200KB")
    for f in fx.FOLDER[family].iterdir():
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    assert (out / INDEX).is_file() and len(list(out.glob("*.safetensors"))) > 1
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: _save_folder(family, root / family) for family in ("qwen2-vl", "qwen3.5")}


def _jobs(folders: dict[str, Path]) -> list[dict[str, Any]]:
    return [
        {"name": "pre2", "family": "qwen2-vl", "model": str(folders["qwen2-vl"]), "init": "pretrained",
         "weights": str(folders["qwen2-vl"])},
        {"name": "pre35", "family": "qwen3.5", "model": str(folders["qwen3.5"]), "init": "pretrained",
         "weights": str(folders["qwen3.5"])},
        {"name": "rand2", "family": "qwen2-vl", "model": str(fx.FOLDER["qwen2-vl"]), "init": "random",
         "weights": None, "seed": SEED},
        {"name": "lora35", "family": "qwen3.5", "model": str(fx.FOLDER["qwen3.5"]), "init": "random",
         "weights": None, "seed": SEED, "lora": True, "frozen_bf16": True},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ranks(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """world size -> job name -> what each rank saved (one torchrun per world size, on demand)."""

    @functools.cache
    def run(world: int) -> dict[str, list[dict[str, Any]]]:
        out = tmp_path_factory.mktemp(f"world{world}")
        (out / "jobs.json").write_text(json.dumps(_jobs(folders)))
        proc = torchrun_script(WORKER, world, str(out / "jobs.json"), str(out))
        assert proc.returncode == 0, proc.stderr[-4000:]
        return {
            job["name"]: [
                torch.load(out / f"{job['name']}-rank{r}.pt", weights_only=False) for r in range(world)
            ]
            for job in _jobs(folders)
        }

    return run


def _assemble(saved: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The full tensors from every rank's pieces, checking each element is held by exactly one rank."""
    full: dict[str, torch.Tensor] = {}
    for name, (_, shape, local) in saved[0]["params"].items():
        tensor = torch.zeros(shape, dtype=local.dtype)
        held = torch.zeros(shape, dtype=torch.int64)
        for rank in saved:
            box, _, part = rank["params"][name]
            where = tuple(slice(a, b) for a, b in box)
            tensor[where] = part
            held[where] += 1
        assert bool((held == 1).all()), f"{name}: elements held by {held.unique().tolist()} ranks"
        full[name] = tensor
    return full


def _reference(folder: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return dict(model.named_parameters())


def _assert_equal(mine: dict[str, torch.Tensor], reference: dict[str, Any]) -> None:
    assert mine.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(mine[name], value.detach()), name


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_holds_exactly_its_rows_of_what_from_pretrained_loads(ranks, folders, world):
    for job, family in (("pre2", "qwen2-vl"), ("pre35", "qwen3.5")):
        saved = ranks(world)[job]
        _assert_equal(_assemble(saved), _reference(folders[family]))
        assert all(rank["tied"] == (family == "qwen2-vl") for rank in saved)
        for rank in saved:
            # Each rank read its own rows only: the bytes that came out of the files are exactly
            # those of its shards (bf16 on disk), every tensor once (a tied head is not read twice).
            held = sum(local.numel() for _, _, local in rank["params"].values())
            assert rank["recorded_bytes"] == rank["report"]["bytes_read"] == 2 * held
            assert rank["report"]["tensors_read"] == rank["unique_params"]
        total = sum(t.numel() * t.element_size() for t in _checkpoint(folders[family]).values())
        assert sum(rank["recorded_bytes"] for rank in saved) == total


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("world", WORLDS)
def test_random_init_is_the_same_model_at_every_world_size(ranks, world, shared_dir):
    reference = build_model(fx.FOLDER["qwen2-vl"], init="random", overrides=fx.TINY["qwen2-vl"], seed=SEED)
    saved = ranks(world)["rand2"]
    _assert_equal(_assemble(saved), dict(reference.named_parameters()))
    assert all(rank["tied"] for rank in saved)
    for rank in saved:  # rotary frequencies exact, not left empty by the meta build
        for name, buffer in reference.named_buffers():
            assert torch.equal(rank["buffers"][name], buffer), name


def _lora_reference() -> torch.nn.Module:
    hf = build_model(fx.FOLDER["qwen3.5"], init="random", overrides=fx.TINY["qwen3.5"], seed=SEED, empty=True)
    lora.apply(hf, LoraSpec(rank=4, alpha=8), fx.FOLDER["qwen3.5"])
    cast_frozen(hf, torch.bfloat16)
    materialize(hf, "cpu", weights=None, seed=SEED)
    return hf


@pytest.mark.parametrize("world", WORLDS)
def test_lora_on_a_meta_model_inits_adapters_as_peft_and_base_as_without_lora(ranks, world, shared_dir):
    reference = _lora_reference()
    full = _assemble(ranks(world)["lora35"])
    _assert_equal(full, dict(reference.named_parameters()))
    adapters_b = [v for k, v in full.items() if ".lora_B." in k]
    adapters_a = [v for k, v in full.items() if ".lora_A." in k]
    assert adapters_b and all(bool((b == 0).all()) for b in adapters_b)  # PEFT: B starts at zero
    assert adapters_a and all(a.dtype == torch.float32 and a.abs().sum() > 0 for a in adapters_a)
    # The base weights are the plain model's random init (seeded by name, PEFT's wrapping removed),
    # stored in bf16 because they are frozen.
    plain = dict(
        build_model(
            fx.FOLDER["qwen3.5"], init="random", overrides=fx.TINY["qwen3.5"], seed=SEED
        ).named_parameters()
    )
    for name, value in full.items():
        if ".lora_" not in name:
            assert value.dtype == torch.bfloat16
            assert torch.equal(value, plain[name.replace(".base_layer", "")].detach().to(torch.bfloat16)), (
                name
            )


def _hf_class(family: str) -> Any:
    return getattr(transformers, family_for_model_type(load_config(fx.FOLDER[family]).model_type).model_class)


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_buffers_after_a_meta_build_equal_a_normal_build(family, shared_dir):
    config = load_config(fx.FOLDER[family], fx.TINY[family])
    normal = _hf_class(family)._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    built = build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], seed=1)
    normal_buffers, built_buffers = dict(normal.named_buffers()), dict(built.named_buffers())
    assert normal_buffers.keys() == built_buffers.keys() and normal_buffers
    for name, buffer in normal_buffers.items():
        assert torch.equal(built_buffers[name], buffer), name
    assert not any(p.is_meta for p in built.parameters())
    normal_tied = normal.lm_head.weight is normal.model.language_model.embed_tokens.weight
    assert (built.lm_head.weight is built.model.language_model.embed_tokens.weight) == normal_tied


def test_random_init_is_deterministic_and_follows_the_seed(shared_dir):
    def build(seed: int) -> dict[str, torch.Tensor]:
        return build_model(
            fx.FOLDER["qwen3.5"], init="random", overrides=fx.TINY["qwen3.5"], seed=seed
        ).state_dict()

    first, again, other = build(5), build(5), build(6)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first if k.endswith("q_proj.weight"))
    a_log = [v for k, v in first.items() if k.endswith("A_log")]  # Qwen3.5's own init: log U(0.01, 16)
    assert a_log and all(bool((v > torch.log(torch.tensor(0.01))).all()) for v in a_log)


def _rewrite(folder: Path, out: Path, change: Any) -> Path:
    """A copy of `folder` as one file, its tensors passed through `change` (a dict -> dict)."""
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors", INDEX))
    save_file(change(_checkpoint(folder)), out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_released_and_current_module_names_both_load_like_from_pretrained(folders, tmp_path):
    """Released Qwen2-VL checkpoints name the decoder `model.layers.*` and the tower `visual.*`, and
    transformers 5 still saves them so (it renames on load and back on save); checkpoints written
    with the module names (`model.language_model.*`, `model.visual.*`) load as well."""
    saved = _checkpoint(folders["qwen2-vl"])
    assert any(k.startswith("visual.") for k in saved) and any(k.startswith("model.layers.") for k in saved)

    def current(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        def rename(key: str) -> str:
            if key.startswith("visual."):
                return "model." + key
            return key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key

        return {rename(k): v for k, v in state.items()}

    modern = _rewrite(folders["qwen2-vl"], tmp_path / "current", current)
    reference = _reference(folders["qwen2-vl"])
    for folder in (folders["qwen2-vl"], modern):
        built = build_model(folder, init="pretrained")
        _assert_equal(dict(built.named_parameters()), reference)
        assert built.lm_head.weight is built.model.language_model.embed_tokens.weight
    _assert_equal(dict(build_model(modern, init="pretrained").named_parameters()), _reference(modern))


def test_missing_and_unexpected_tensors_are_refused_by_name(folders, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"  # as saved; the error names the model's parameter
    missing = _rewrite(
        folders["qwen2-vl"], tmp_path / "missing", lambda s: {k: v for k, v in s.items() if k != name}
    )
    with pytest.raises(
        ConfigError, match=r"1 missing \(e\.g\. \['model\.language_model\.layers\.1\.mlp\.down_proj"
    ):
        build_model(missing, init="pretrained")
    extra = _rewrite(
        folders["qwen2-vl"], tmp_path / "extra", lambda s: {**s, "model.surplus.weight": torch.zeros(2)}
    )
    with pytest.raises(
        ConfigError, match=r"1 unexpected \(e\.g\. \['model\.surplus\.weight'\]\).*model\.init: random"
    ):
        build_model(extra, init="pretrained")
    with pytest.raises(
        ConfigError,
        match=r"has shape \(64, 128\) but the model's .* is \(64, 96\); remove model.configOverrides",
    ):
        build_model(
            folders["qwen2-vl"], init="pretrained", overrides={"text_config": {"intermediate_size": 96}}
        )


def test_frozen_bf16_halves_frozen_weights_and_keeps_fp32_masters(shared_dir):
    def held(frozen: torch.dtype | None) -> tuple[int, dict[torch.dtype, int]]:
        hf = build_model(fx.FOLDER["qwen3.5"], init="random", overrides=fx.TINY["qwen3.5"], empty=True)
        lora.apply(hf, LoraSpec(rank=4, alpha=8), fx.FOLDER["qwen3.5"])
        if frozen is not None:
            cast_frozen(hf, frozen)
        report = materialize(hf, "cpu", weights=None, seed=0)
        dtypes: dict[torch.dtype, int] = {}
        for p in hf.parameters():
            if p.requires_grad:
                assert p.dtype == torch.float32  # trainable: fp32 masters
            dtypes[p.dtype] = dtypes.get(p.dtype, 0) + p.numel()
        return report.local_bytes, dtypes

    fp32_bytes, _ = held(None)
    bf16_bytes, dtypes = held(torch.bfloat16)
    trainable = dtypes[torch.float32]
    assert bf16_bytes == fp32_bytes - 2 * dtypes[torch.bfloat16]
    assert bf16_bytes < 0.6 * fp32_bytes and trainable < dtypes[torch.bfloat16]


def test_frozen_bf16_trains_with_lora_and_is_refused_with_fp32_compute(pack_dir, tmp_path):
    spec = job_spec(
        pack_dir, tmp_path / "run", maxSteps=1, dtype="bf16", checkpointAtEnd=False, saveFinal=False
    )
    spec["spec"]["model"].update(lora={"rank": 4, "alpha": 8}, frozenDtype="bf16")
    summary = train(load_train_config(write_job(tmp_path / "job.yaml", spec)), log=lambda _: None)
    assert summary["steps"] == 1 and summary["final_loss"] == summary["final_loss"]  # not NaN
    spec["spec"]["training"]["dtype"] = "fp32"
    with pytest.raises(ConfigError, match="frozenDtype bf16 needs bf16 compute"):
        train(load_train_config(write_job(tmp_path / "fp32.yaml", spec)), log=lambda _: None)
