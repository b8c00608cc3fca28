"""Hostile model sizes at the operator, which every team shares: an SFTJob's configOverrides and the
config.json its PackJob reported (model.path's, untrusted too) are checked once, before anything loops
over or divides by them. A reconcile refuses them with a Failed condition naming the key and value
(InvalidSpec for the overrides alone, InvalidConfiguration for the merged config), creates nothing and
returns in milliseconds; before, 4,000 layers stalled it for over a minute, 1e8 layers never returned,
0 heads raised ZeroDivisionError and a negative hidden size "fit". The plan's own cost does not grow
with the layer count, and `packtrain render` / `packtrain run` refuse the same specs with exit 2.
"""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.paths import MODELS
from test_handlers import FakeKube, sft_step

from packtrain.core.errors import ConfigError
from packtrain.core.memory_plan import PlanInputs, plan_memory, refusal
from packtrain.core.model_size import (
    TEXT_LIMITS,
    VISION_LIMITS,
    ModelDims,
    deep_merge,
    model_dims,
    param_counts,
    planning_config,
    read_config,
    tensors,
)
from packtrain.operator import status as st

PACKTRAIN = str(Path(sys.executable).parent / "packtrain")
RECONCILE_SECONDS = 0.5  # a reconcile with any sizes (measured: a few ms)


def _ready(kube: FakeKube, packjob: dict[str, Any], sizes: dict[str, Any]) -> None:
    packjob["status"] = {"phase": "Succeeded", "outputPath": "/data/packs/demo", "modelSizes": sizes}
    kube.put("packjobs", packjob)


def _refused(kube: FakeKube, sftjob: dict[str, Any]) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    status = sft_step(kube, sftjob)
    seconds = time.perf_counter() - start
    assert status["phase"] == "Failed" and kube.created == [], status
    return st.get_condition(status["conditions"], "Ready"), seconds


SIZES = planning_config(read_config(MODELS / "qwen2.5-vl"))

OVERRIDES = [
    ({"num_hidden_layers": 100_000_000}, "num_hidden_layers is 100000000"),
    ({"num_hidden_layers": 4000}, "num_hidden_layers is 4000"),
    ({"num_hidden_layers": 1e8}, "num_hidden_layers is 100000000.0"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0"),
    ({"hidden_size": -2048}, "hidden_size is -2048"),
    ({"vocab_size": 10**12}, "vocab_size is 1000000000000"),
    ({"num_key_value_heads": 3, "num_attention_heads": 16}, "num_key_value_heads 3 does not divide"),
    ({"text_config": "large"}, "text_config must be a mapping"),
    ({"vision_config": {"depth": 10**6}}, "vision_config.depth is 1000000"),
    ({"vision_config": {"spatial_merge_size": 0}}, "vision_config.spatial_merge_size is 0"),
    (
        {"vision_config": {"fullatt_block_indexes": list(range(10**5))}},
        "vision_config.fullatt_block_indexes must be",
    ),
]


@pytest.mark.parametrize("overrides,named", OVERRIDES)
def test_hostile_overrides_fail_the_sftjob_at_once(sftjob, packjob, overrides: Any, named: str) -> None:
    kube = FakeKube()
    _ready(kube, packjob, SIZES)
    sftjob["spec"]["model"]["configOverrides"] = overrides
    ready, seconds = _refused(kube, sftjob)
    assert ready["reason"] == "InvalidSpec" and f"spec.model.configOverrides: {named}" in ready["message"]
    assert "delete and re-create" in ready["message"]
    assert seconds < RECONCILE_SECONDS, seconds


FOLDER_CONFIGS = [
    ({"num_hidden_layers": 100_000_000}, {}, "num_hidden_layers is 100000000"),
    ({"num_attention_heads": 0}, {}, "num_attention_heads is 0"),
    ({"hidden_size": -2048}, {}, "hidden_size is -2048"),
    ({"num_key_value_heads": None}, {}, "num_key_value_heads is None"),
    ({"vision_config": {"depth": "32"}}, {}, "vision_config.depth is '32'"),
    ({}, {"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 16"),
    ({}, {"hidden_size": 1000}, "hidden_size 1000 is not a multiple of num_attention_heads 16"),
    ({}, {"vision_config": {"window_size": 4}}, "vision_config.window_size 4 is under"),
]


@pytest.mark.parametrize("change,overrides,named", FOLDER_CONFIGS)
def test_a_hostile_folder_config_fails_the_sftjob(sftjob, packjob, change, overrides, named: str) -> None:
    """The sizes the PackJob reported from model.path's config.json, with the SFTJob's overrides
    merged: refused as the trainer would refuse them at start-up (InvalidConfiguration), no GPU asked."""
    kube = FakeKube()
    _ready(kube, packjob, deep_merge(SIZES, change))
    sftjob["spec"]["model"] = {"path": packjob["spec"]["model"]["path"], "configOverrides": overrides}
    ready, seconds = _refused(kube, sftjob)
    assert ready["reason"] == "InvalidConfiguration" and named in ready["message"], ready
    assert "model.path's config.json with model.configOverrides" in ready["message"]
    assert seconds < RECONCILE_SECONDS, seconds


def test_the_largest_allowed_model_reconciles_in_milliseconds(sftjob, packjob) -> None:
    """At the ceilings (1,024 layers, a 4M vocabulary), refused for memory with every suggestion planned."""
    kube = FakeKube()
    _ready(kube, packjob, SIZES)
    sftjob["spec"]["model"]["configOverrides"] = {"num_hidden_layers": 1024, "vocab_size": 1 << 22}
    ready, seconds = _refused(kube, sftjob)
    assert ready["reason"] == "InsufficientGPUMemory", ready
    assert seconds < RECONCILE_SECONDS, seconds


def _timed_refusal(d: ModelDims) -> float:
    x = PlanInputs(world_size=16, gpus_per_host=8, gpu_memory=1 << 30, max_length=4096)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        assert refusal(d, plan_memory(d, x)) is not None  # every suggestion planned: ~130 plans
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3.5"])
def test_the_plan_costs_the_same_for_40_and_1024_layers(family: str) -> None:
    text = "text_config" if family == "qwen3.5" else None
    dims = {}
    for layers in (40, 1024):
        sizes: dict[str, Any] = {"num_hidden_layers": layers}
        if text:  # Qwen3.5's 3:1 hybrid pattern, one kind per layer
            sizes["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
        config = read_config(MODELS / family, {text: sizes} if text else sizes)
        dims[layers] = model_dims(config)
    small, large = _timed_refusal(dims[40]), _timed_refusal(dims[1024])
    assert large < 3 * small + 0.05, (small, large)  # the per-layer walk made it ~25x


def _moe(family: str) -> dict[str, Any]:
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    dense = "qwen3.5" if family == "qwen3.5-moe" else "qwen3-vl"
    config = read_config(MODELS / dense, {"text_config": moe})
    if family == "qwen3-vl-moe":
        config["text_config"].update(mlp_only_layers=[0, 5], decoder_sparse_step=2)
    return {**config, "model_type": family.replace(".", "_").replace("-", "_")}


@pytest.mark.parametrize(
    "family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5", "qwen3.5-moe", "qwen3-vl-moe"]
)
def test_counting_each_kind_of_layer_once_equals_walking_every_tensor(family: str) -> None:
    """`param_counts` multiplies one layer of each kind (attention or linear attention, dense or
    expert MLP) by how many there are; that equals summing every tensor of the model."""
    config = _moe(family) if family.endswith("moe") else read_config(MODELS / family)
    d = model_dims(config, family)
    every = list(tensors(d))
    counts = param_counts(d)
    assert counts.total == sum(t.numel for t in every)
    for part in ("vision", "merger", "llm", "embeddings"):
        assert counts.by_part[part] == sum(t.numel for t in every if t.part == part)


# Values a hostile config might hold for any number: none fits every key, several fit none.
HOSTILE_VALUES = [
    0,
    -1,
    1,
    3,
    7,
    10**8,
    2**63,
    1e8,
    0.5,
    math.nan,
    math.inf,
    "64",
    None,
    True,
    [],
    {},
    [1, 2],
]


def test_any_config_plans_or_is_one_config_error() -> None:
    """The check is total: over random hostile values at every bounded key, index list and section of
    every family's config, `model_dims` returns sizes within the bounds or raises ConfigError (never
    ZeroDivisionError, TypeError, ...), and a reconcile on them never raises."""
    rng = random.Random(32)
    keys = [(None, k) for k in TEXT_LIMITS] + [("text_config", k) for k in TEXT_LIMITS]
    keys += [("vision_config", k) for k in VISION_LIMITS]
    keys += [("text_config", k) for k in ("layer_types", "mlp_only_layers")]
    keys += [("vision_config", k) for k in ("deepstack_visual_indexes", "fullatt_block_indexes", "mlp_ratio")]
    keys += [(None, "text_config"), (None, "vision_config")]
    bases = {f: read_config(MODELS / f) for f in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5")}
    outcomes = {"planned": 0, "refused": 0}
    for _ in range(600):
        family = rng.choice(sorted(bases))
        config = copy.deepcopy(bases[family])
        for section, key in rng.sample(keys, rng.randint(1, 3)):
            value = rng.choice(HOSTILE_VALUES)
            target = config if section is None else config.setdefault(section, {})
            if isinstance(target, dict):
                target[key] = copy.deepcopy(value)
        try:
            d = model_dims(config)
        except ConfigError:
            outcomes["refused"] += 1
            continue
        outcomes["planned"] += 1
        assert 1 <= d.layers <= 1024 and 1 <= d.heads <= 1024 and d.heads % d.kv_heads == 0
        assert 1 <= d.hidden <= 65536 and 1 <= d.vocab <= 1 << 22 and 1 <= d.vision_depth <= 256
        assert param_counts(d).total > 0
    assert outcomes["planned"] > 20 and outcomes["refused"] > 300, outcomes


def test_a_reconcile_never_raises_on_random_sizes(sftjob, packjob) -> None:
    rng = random.Random(7)
    for _ in range(60):
        sizes = copy.deepcopy(SIZES)
        key = rng.choice([*TEXT_LIMITS, "vision_config"])
        sizes[key] = rng.choice(HOSTILE_VALUES)
        kube = FakeKube()
        _ready(kube, copy.deepcopy(packjob), sizes)
        status = sft_step(kube, copy.deepcopy(sftjob))  # raises nothing, whatever the sizes
        assert status["phase"] in ("Failed", "Pending"), status


def _manifest(tmp: Path, model: Path, overrides: dict[str, Any]) -> Path:
    """A PackJob and an SFTJob on it, for 1 GPU, with local paths (`render --allow-unmounted`)."""
    docs = [
        {
            "apiVersion": "packtrain.dev/v1alpha1",
            "kind": "PackJob",
            "metadata": {"name": "p"},
            "spec": {
                "source": {"paths": [str(tmp / "data.json")]},
                "model": {"path": str(model)},
                "packing": {"maxLength": 2048},
                "output": {"claimName": "packtrain-data"},
            },
        },
        {
            "apiVersion": "packtrain.dev/v1alpha1",
            "kind": "SFTJob",
            "metadata": {"name": "s"},
            "spec": {
                "data": {"packJobRef": "p"},
                "model": {"path": str(model), "init": "random", "configOverrides": overrides},
                "resources": {"nodes": 1, "gpusPerNode": 1, "gpuMemory": "80Gi"},
                "volumes": {"checkpoints": {"claimName": "packtrain-checkpoints"}},
            },
        },
    ]
    path = tmp / "jobs.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def _one_line(result: subprocess.CompletedProcess) -> str:
    """The error's one line (exit 2, no traceback), after any warnings `render` says first."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    *before, line = result.stderr.strip().splitlines()
    assert all(": warning: " in b for b in before), result.stderr
    return line


def _run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([PACKTRAIN, *args], capture_output=True, text=True, timeout=300)
    return result, time.monotonic() - start


@pytest.mark.parametrize("command", ["render", "run"])
def test_render_and_run_refuse_hostile_overrides(tmp_path: Path, command: str) -> None:
    path = _manifest(tmp_path, MODELS / "qwen2-vl", {"num_hidden_layers": 100_000_000})
    extra = ["--allow-unmounted"] if command == "render" else ["--output", str(tmp_path / "out")]
    result, seconds = _run(command, str(path), *extra)
    line = _one_line(result)
    assert "configOverrides" in line and "num_hidden_layers is 100000000" in line, line
    assert seconds < 30 and not (tmp_path / "out").exists(), seconds  # nothing packed, nothing trained


@pytest.mark.parametrize("command", ["render", "run"])
def test_render_and_run_refuse_a_folder_whose_config_json_is_hostile(tmp_path: Path, command: str) -> None:
    """`run` refuses before it packs anything (it would otherwise pack, then fail at the trainer's start)."""
    folder = tmp_path / "model"
    shutil.copytree(MODELS / "qwen2-vl", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    extra = ["--allow-unmounted"] if command == "render" else ["--output", str(tmp_path / "out")]
    result, seconds = _run(command, str(_manifest(tmp_path, folder, {})), *extra)
    line = _one_line(result)
    assert "SFTJob s" in line and "num_attention_heads is 0" in line, line
    assert seconds < 30 and not (tmp_path / "out").exists(), seconds


@pytest.mark.cluster
def test_the_api_server_refuses_overrides_out_of_bounds_and_keeps_the_rest(api, namespace: str) -> None:
    """The CRD bounds the known keys of configOverrides (minimum / maximum) and keeps every other key
    as written (free-form), so `kubectl apply` refuses 1e8 layers before any controller sees it."""
    from cluster_operator import create, get, rejected, sftjob

    body = sftjob("huge", "p")
    body["spec"]["model"]["configOverrides"] = {"num_hidden_layers": 100_000_000}
    assert "spec.model.configOverrides.num_hidden_layers: Invalid value" in rejected(api, namespace, body)
    body["spec"]["model"]["configOverrides"] = {"vision_config": {"spatial_merge_size": 0}}
    assert "configOverrides.vision_config.spatial_merge_size: Invalid value" in rejected(api, namespace, body)
    body["spec"]["model"]["configOverrides"] = {"text_config": {"num_attention_heads": 1e8}}
    assert "configOverrides.text_config.num_attention_heads: Invalid value" in rejected(api, namespace, body)
    kept = {
        "num_hidden_layers": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "text_config": {"head_dim": 32, "anything": "else"},
        "vision_config": {"depth": 2, "fullatt_block_indexes": [1]},
    }
    body = sftjob("tiny", "p")
    body["spec"]["model"]["configOverrides"] = kept
    create(api, namespace, body)
    assert get(api, namespace, "sftjobs", "tiny")["spec"]["model"]["configOverrides"] == kept
