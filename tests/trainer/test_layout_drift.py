"""A pack cannot drift from the processor unnoticed (transformers 5.25 changed the Qwen3-VL video layout).

The drift is made real, not mocked: a `sitecustomize` on the subprocess's path puts back transformers
5.24's Qwen3-VL text expansion (the base `ProcessorMixin.get_text_with_replacements`, which keeps the
chat template's outer vision pair around the per-frame groups). Under it, `pack run` stops at its
probes and `train` refuses a pack made without it; without it, both agree and the manifest records
the layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.paths import DEMO, MODELS
from vlm_fixtures import TINY

from packtrain.core.families import FAMILIES
from packtrain.core.layout import family_layout

PACKTRAIN = str(Path(sys.executable).parent / "packtrain")
QWEN3 = MODELS / "qwen3-vl"
OLD_LAYOUT_SHIM = """
from transformers.models.qwen3_vl import processing_qwen3_vl as qwen3
from transformers.processing_utils import ProcessorMixin

qwen3.Qwen3VLProcessor.get_text_with_replacements = ProcessorMixin.get_text_with_replacements
"""


def run(*args: str, shim: Path | None = None) -> subprocess.CompletedProcess:
    env = os.environ | {"COLUMNS": "200", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if shim is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH")) if p)
        env["PACKTRAIN_CACHE_DIR"] = str(shim / "cache")  # no agreement remembered from the real one
    return subprocess.run([PACKTRAIN, *args], capture_output=True, text=True, timeout=600, env=env)


def exit_two(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("old-transformers")
    (folder / "sitecustomize.py").write_text(OLD_LAYOUT_SHIM)
    return folder


def _pack_config(tmp: Path) -> Path:
    spec = {
        "source": {"paths": [str(DEMO / "mllm_video_demo.json")]},
        "model": {"family": "qwen3-vl", "path": str(QWEN3), "maxFrames": 8, "videoMaxPixels": 32 * 32 * 64},
        "packing": {"maxLength": 2048},
    }
    path = tmp / "pack.yaml"
    path.write_text(yaml.safe_dump({"kind": "PackJob", "metadata": {"name": "v"}, "spec": spec}))
    return path


@pytest.fixture(scope="module")
def video_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("video-pack")
    out = tmp / "pack"
    result = run(
        "pack", "run", "-c", str(_pack_config(tmp)), "-o", str(out), "--workers", "1", "--no-progress"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _train(tmp: Path, pack: Path, shim: Path | None = None) -> subprocess.CompletedProcess:
    spec = {
        "data": {"path": str(pack), "numWorkers": 0},
        "model": {
            "path": str(QWEN3),
            "family": "qwen3-vl",
            "init": "random",
            "configOverrides": TINY["qwen3-vl"],
        },
        "training": {"maxSteps": 1, "outputDir": str(tmp / "run")},
    }
    job = tmp / "sft.yaml"
    job.write_text(yaml.safe_dump({"kind": "SFTJob", "metadata": {"name": "s"}, "spec": spec}))
    return run("train", "-c", str(job), shim=shim)


def test_the_manifest_records_the_layout_and_transformers(video_pack: Path) -> None:
    import transformers

    manifest = json.loads((video_pack / "manifest.json").read_text())
    assert manifest["layout"] == family_layout(FAMILIES["qwen3-vl"])
    assert manifest["layout"]["video"].startswith("(<t seconds><|vision_start|>")  # no outer pair
    assert manifest["transformers"] == transformers.__version__
    assert manifest["counts"]["packed"] > 0


def test_pack_run_stops_when_the_processor_writes_another_layout(tmp_path: Path, shim: Path) -> None:
    result = run(
        "pack",
        "run",
        "-c",
        str(_pack_config(tmp_path)),
        "-o",
        str(tmp_path / "o"),
        "--no-progress",
        shim=shim,
    )
    err = exit_two(result)
    assert "'video' probe" in err and "Qwen3VLProcessor" in err and "transformers>=5.25" in err
    assert "<|vision_start|><0." in err  # the processor's outer pair, shown where the ids part
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_train_refuses_a_pack_its_processor_would_not_write(
    tmp_path: Path, video_pack: Path, shim: Path
) -> None:
    err = exit_two(_train(tmp_path, video_pack, shim=shim))
    assert "this trainer's processor" in err and "re-pack" in err
    assert "(<t seconds><|vision_start|><|video_pad|>*<|vision_end|>)+" in err  # the pack's
    assert "<|vision_start|>(<t seconds><|vision_start|><|video_pad|>*<|vision_end|>)+<|vision_end|>" in err


def test_train_refuses_a_pack_of_an_older_layout(tmp_path: Path, video_pack: Path) -> None:
    """A pack made under 5.24's layout (recorded so) or by a packtrain that recorded none."""
    import shutil

    for layout in (
        "<|vision_start|>(<t seconds><|vision_start|><|video_pad|>*<|vision_end|>)+<|vision_end|>",
        None,
    ):
        pack = tmp_path / f"pack-{layout is None}"
        shutil.copytree(video_pack, pack)
        manifest = json.loads((pack / "manifest.json").read_text())
        if layout is None:
            del manifest["layout"]
        else:
            manifest["layout"]["video"] = layout
        (pack / "manifest.json").write_text(json.dumps(manifest))
        err = exit_two(_train(tmp_path, pack))
        assert ("records no media token layout" in err) if layout is None else (layout in err)


def test_the_declared_transformers_floor_is_the_one_the_probes_name() -> None:
    """pyproject's requirement and the floor the messages and CI's floor run use are one fact."""
    import tomllib

    from packtrain.core.layout import TRANSFORMERS_FLOOR

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert f"transformers>={TRANSFORMERS_FLOOR}" in project["dependencies"]
