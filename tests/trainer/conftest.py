"""Fixtures for trainer tests: a real pack of the demo data, and tiny-model job files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from support.paths import DEMO, SHARED
from vlm_fixtures import FOLDER, TINY

from packtrain.core.config import PackConfig
from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan

torch.set_num_threads(2)


def make_pack(
    out: Path, family: str = "qwen2-vl", max_length: int = 512, media_storage: str = "original"
) -> Path:
    """Pack the multimodal demo sets plus short text chats with the real packer."""
    cfg = PackConfig.model_validate(
        {
            "source": {
                "paths": [
                    str(DEMO / "mllm_demo.json"),
                    str(DEMO / "mllm_video_demo.json"),
                    str(SHARED / "datasets" / "text-sft" / "fastchat" / "*.json"),
                ]
            },
            "model": {
                "family": family,
                "path": str(FOLDER[family]),
                "maxPixels": 48 * 28 * 28,
                "videoMaxPixels": 16 * 28 * 28,
                "maxFrames": 8,
            },
            "packing": {"maxLength": max_length, "sequencesPerShard": 16, "mediaStorage": media_storage},
        }
    )
    convert(cfg, out, 0, 1)
    plan(cfg, out)
    materialize(cfg, out, 0, 1)
    return out


@pytest.fixture(scope="session")
def pack_dir(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> Path:
    return make_pack(tmp_path_factory.mktemp("pack") / "qwen2-vl")


def job_spec(data: Path, output: Path, family: str = "qwen2-vl", **training: Any) -> dict[str, Any]:
    """An SFTJob manifest for a tiny random-init model (cluster-only keys included, as on a cluster)."""
    return {
        "apiVersion": "packtrain.io/v1alpha1",
        "kind": "SFTJob",
        "metadata": {"name": "tiny"},
        "spec": {
            "image": "ghcr.io/example/packtrain:latest",
            "resources": {"gpusPerWorker": 1},
            "suspend": False,
            "data": {"path": str(data), "numWorkers": 1},
            "model": {"path": str(FOLDER[family]), "init": "random", "configOverrides": TINY[family]},
            "training": {"maxSteps": 2, "lr": 1e-3, "outputDir": str(output), **training},
        },
    }


def write_job(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def straight_and_resumed(spec: dict[str, Any], tmp_path: Path) -> tuple[dict, dict, Path]:
    """Train `spec` straight to the end, then again from only its step-2 checkpoint (an interrupted run)."""
    from packtrain.core.sft_config import load_train_config
    from packtrain.trainer.loop import train

    straight = train(load_train_config(write_job(tmp_path / "a.yaml", spec)), log=lambda _: None)
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / "step-00000002", resumed_dir / "checkpoints" / "step-00000002"
    )
    spec["spec"]["training"]["outputDir"] = str(resumed_dir)
    resumed = train(load_train_config(write_job(tmp_path / "b.yaml", spec)), log=lambda _: None)
    return straight, resumed, resumed_dir
