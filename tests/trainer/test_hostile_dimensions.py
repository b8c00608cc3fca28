"""Hostile model sizes at the trainer's commands: `model.configOverrides` and model.path's own
config.json (untrusted input too) hold layers, heads, widths and vision sizes that are zero,
negative, not whole numbers, absurdly large or inconsistent. `packtrain train --plan` and
`packtrain train` refuse each with exit 2 and one line naming the key and its value, within a
second or two and a bounded memory, before anything loops over or divides by it (before this,
1e8 layers never returned, 4,000 took over a minute, 0 heads was a ZeroDivisionError traceback
and a negative hidden size "fit"). A family that contradicts the folder is exit 2 too, and a
folder's family is read from its config.json when model.family is left out.

Every case runs the real CLI in a subprocess, measured by a parent of its own.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.measure import one_line, run_measured
from support.paths import MODELS

PACKTRAIN = str(Path(sys.executable).parent / "packtrain")
SECONDS = 20.0  # the CLI starts in about a second; the old planner took over 60 s for 4,000 layers
PEAK_MIB = 1024.0  # a refused config builds nothing (a plan of the largest allowed model included)


def job(tmp: Path, model: Path, data: Path | None = None, **model_keys: Any) -> Path:
    spec = {
        "data": {"path": str(data or tmp / "no-pack"), "numWorkers": 0},
        "model": {"path": str(model), "init": "random", **model_keys},
        "training": {"maxSteps": 1, "outputDir": str(tmp / "out")},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def folder_with(tmp: Path, family: str, change: dict[str, Any]) -> Path:
    """A copy of a shared model folder whose config.json has `change` merged (nested keys by key)."""
    folder = tmp / f"{family}-hostile"
    shutil.copytree(MODELS / family, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def plan_args(gpu_memory: str = "80Gi") -> list[str]:
    """`--plan` for 16 GPUs of `gpu_memory`, 8 a host, 4,096-token sequences."""
    sizes = ["--world-size", "16", "--gpus-per-host", "8", "--max-length", "4096"]
    return ["--plan", "--gpu-memory", gpu_memory, *sizes]


PLAN = plan_args()

# (family folder, configOverrides, what the one line must name). One per kind of number: layer
# counts, widths, heads, vocabulary, vision tower, MoE routing, index lists, a mapping that is none.
OVERRIDES = [
    ("qwen2-vl", {"num_hidden_layers": 100_000_000}, "num_hidden_layers is 100000000"),
    ("qwen2-vl", {"num_hidden_layers": 4000}, "num_hidden_layers is 4000"),
    ("qwen2-vl", {"num_hidden_layers": 1e8}, "num_hidden_layers is 100000000.0"),
    ("qwen2-vl", {"num_hidden_layers": "1e8"}, "num_hidden_layers is '1e8'"),
    ("qwen2-vl", {"num_attention_heads": 0}, "num_attention_heads is 0"),
    ("qwen2-vl", {"hidden_size": -1536}, "hidden_size is -1536"),
    ("qwen2-vl", {"intermediate_size": True}, "intermediate_size is True"),
    ("qwen2-vl", {"vocab_size": 1 << 40}, "vocab_size is 1099511627776"),
    ("qwen2-vl", {"vision_config": {"depth": 0}}, "vision_config.depth is 0"),
    ("qwen2-vl", {"vision_config": {"patch_size": 100000}}, "vision_config.patch_size is 100000"),
    ("qwen2.5-vl", {"vision_config": {"spatial_merge_size": 0}}, "vision_config.spatial_merge_size is 0"),
    ("qwen3-vl", {"text_config": {"head_dim": -128}}, "text_config.head_dim is -128"),
    ("qwen3-vl", {"text_config": []}, "text_config must be a mapping"),
    ("qwen3.5", {"text_config": {"full_attention_interval": 0}}, "text_config.full_attention_interval is 0"),
    ("qwen3.5", {"text_config": {"linear_num_value_heads": 0}}, "text_config.linear_num_value_heads is 0"),
    ("qwen3.5", {"text_config": {"num_experts": 1 << 20}}, "text_config.num_experts is 1048576"),
    (
        "qwen3.5",
        {"text_config": {"layer_types": ["linear_attention"] * 100_000}},
        "text_config.layer_types must be a list",
    ),
    ("qwen3-vl", {"vision_config": {"deepstack_visual_indexes": [5, -1]}}, "deepstack_visual_indexes"),
]

# Keys each within its bounds that do not fit together: checked on config.json with the overrides merged.
INCONSISTENT = [
    ("qwen2-vl", {"num_key_value_heads": 5}, "num_key_value_heads 5 does not divide num_attention_heads 12"),
    ("qwen2-vl", {"hidden_size": 1000}, "hidden_size 1000 is not a multiple of num_attention_heads 12"),
    (
        "qwen2-vl",
        {"vision_config": {"embed_dim": 1000}},
        "num_heads 16 does not divide vision_config.embed_dim",
    ),
    ("qwen2-vl", {"vision_config": {"mlp_ratio": 0}}, "vision_config.mlp_ratio is 0"),
    ("qwen2.5-vl", {"vision_config": {"out_hidden_size": 64}}, "out_hidden_size 64 is not the decoder's"),
    ("qwen2.5-vl", {"vision_config": {"window_size": 8}}, "vision_config.window_size 8 is under"),
    ("qwen3.5", {"text_config": {"linear_num_value_heads": 33}}, "linear_num_key_heads 16 does not divide"),
    ("qwen3.5", {"text_config": {"layer_types": ["full_attention"] * 31}}, "layer_types must be a list"),
    ("qwen3.5", {"text_config": {"layer_types": ["sliding"] * 32}}, "layer_types may hold only"),
    ("qwen3-vl", {"vision_config": {"deepstack_visual_indexes": [30]}}, "each from 0 to 23"),
]


@pytest.mark.parametrize("family,overrides,named", OVERRIDES + INCONSISTENT)
def test_plan_refuses_hostile_overrides_at_once(tmp_path: Path, family: str, overrides: Any, named: str):
    code, out, err, seconds, peak = run_measured(
        [PACKTRAIN, "train", "-c", str(job(tmp_path, MODELS / family, configOverrides=overrides)), *PLAN]
    )
    line = one_line(code, err, out)
    assert line.startswith("packtrain train: configuration error:") and named in line, line
    assert seconds < SECONDS and peak < PEAK_MIB, (seconds, peak)


# model.path's own config.json with the same kinds of numbers (no overrides at all).
FOLDER_CONFIGS = [
    ("qwen2-vl", {"num_hidden_layers": 100_000_000}, "num_hidden_layers is 100000000"),
    ("qwen2-vl", {"num_attention_heads": 0}, "num_attention_heads is 0"),
    ("qwen2-vl", {"hidden_size": -1536}, "hidden_size is -1536"),
    ("qwen2-vl", {"num_key_value_heads": None}, "num_key_value_heads is None"),
    ("qwen2.5-vl", {"vision_config": {"depth": 1e9}}, "vision_config.depth is 1000000000.0"),
    ("qwen3-vl", {"text_config": {"num_key_value_heads": 7}}, "num_key_value_heads 7 does not divide"),
    ("qwen3.5", {"vision_config": "none"}, "vision_config must be a mapping"),
]


@pytest.mark.parametrize("family,change,named", FOLDER_CONFIGS)
def test_plan_refuses_a_folder_whose_config_json_is_hostile(tmp_path: Path, family, change, named):
    folder = folder_with(tmp_path, family, change)
    code, out, err, seconds, peak = run_measured(
        [PACKTRAIN, "train", "-c", str(job(tmp_path, folder)), *PLAN]
    )
    line = one_line(code, err, out)
    assert named in line and "model.path's config.json" in line, line
    assert seconds < SECONDS and peak < PEAK_MIB, (seconds, peak)


def test_training_refuses_before_it_builds_anything(tmp_path: Path, pack_dir: Path) -> None:
    """`packtrain train` on a real pack: the sizes are checked at start-up on every machine (GPU or
    not, planCheck on or off), before the data is read or a model built."""
    for name, folder, keys in (
        ("folder", folder_with(tmp_path, "qwen2-vl", {"num_hidden_layers": 100_000_000}), {}),
        ("merged", MODELS / "qwen2-vl", {"configOverrides": {"num_key_value_heads": 5}}),
        ("overrides", MODELS / "qwen2-vl", {"configOverrides": {"num_attention_heads": 0}}),
    ):
        case = tmp_path / name
        case.mkdir()
        spec = yaml.safe_load(job(case, folder, pack_dir, **keys).read_text())
        spec["training"]["planCheck"] = False
        (case / "job.yaml").write_text(yaml.safe_dump(spec))
        code, out, err, seconds, peak = run_measured([PACKTRAIN, "train", "-c", str(case / "job.yaml")])
        line = one_line(code, err, out)
        assert "num_" in line and "configuration error" in line, line
        assert not (case / "out" / "checkpoints").exists()
        assert seconds < 60 and peak < 2048, (name, seconds, peak)  # torch is imported, nothing built


def test_the_largest_model_allowed_plans_as_fast_as_a_small_one(tmp_path: Path) -> None:
    """The plan's cost does not grow with the layer count: 1,024 layers (the ceiling) with every
    suggestion computed (it cannot fit 80 GiB) costs what 28 layers do."""
    times = {}
    for layers in (28, 1024):
        case = tmp_path / str(layers)
        case.mkdir()
        path = job(case, MODELS / "qwen2-vl", configOverrides={"num_hidden_layers": layers})
        small_gpus = plan_args("1Gi")  # nothing fits: every suggestion is planned
        code, out, err, seconds, peak = run_measured(
            [PACKTRAIN, "train", "-c", str(path), *small_gpus, "--json"]
        )
        assert code in (0, 2) and "Traceback" not in err, err[-2000:]
        plan = json.loads(out.strip().splitlines()[-1])
        assert plan["model"]["family"] == "qwen2-vl" and plan["refusal"] is not None
        times[layers] = seconds
        assert peak < PEAK_MIB, peak
    assert times[1024] < 2 * times[28] + 2.0, times


def test_a_family_that_contradicts_the_folder_is_refused(tmp_path: Path) -> None:
    code, out, err, _, _ = run_measured(
        [PACKTRAIN, "train", "-c", str(job(tmp_path, MODELS / "qwen3.5", family="qwen2-vl")), *PLAN]
    )
    line = one_line(code, err, out)
    assert "model.family is qwen2-vl" in line and "qwen3.5" in line, line


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "qwen3.5"])
def test_the_plan_takes_the_family_from_the_folder(tmp_path: Path, family: str) -> None:
    code, out, err, _, _ = run_measured(
        [PACKTRAIN, "train", "-c", str(job(tmp_path, MODELS / family)), *PLAN, "--json"]
    )
    assert code in (0, 2) and "Traceback" not in err, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["model"]["family"] == family


def test_overrides_within_bounds_still_plan(tmp_path: Path) -> None:
    """The bounds refuse nothing a real job sets: the quickstart's tiny model and a 72B-sized one."""
    tiny_vision = {"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 64}
    for overrides in (
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vision_config": tiny_vision},
        {"hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
         "num_key_value_heads": 8, "vocab_size": 152064, "vision_config": {"hidden_size": 8192}},
    ):  # fmt: skip
        path = job(tmp_path, MODELS / "qwen2-vl", configOverrides=overrides)
        code, out, err, _, _ = run_measured([PACKTRAIN, "train", "-c", str(path), *PLAN, "--json"])
        assert code in (0, 2) and "Traceback" not in err and "configuration error" not in err, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1])["model"]["parameters"] > 0
