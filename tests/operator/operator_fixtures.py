"""Shared pieces of the operator tests: a PackJob and an SFTJob as a user would write them, golden files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

GOLDEN = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("PACKTRAIN_UPDATE_GOLDEN") == "1"

PACKJOB: dict[str, Any] = {
    "apiVersion": "packtrain.dev/v1alpha1",
    "kind": "PackJob",
    "metadata": {
        "name": "demo",
        "namespace": "ml",
        "uid": "0b1c2d3e-0000-4000-8000-000000000001",
        "generation": 1,
    },
    "spec": {
        "source": {"paths": ["/data/datasets/demo/*.jsonl"], "format": "sharegpt"},
        "model": {"family": "qwen2-vl", "path": "/data/models/Qwen2-VL-2B-Instruct", "maxPixels": 401408},
        "packing": {"maxLength": 4096, "seed": 7},
        "output": {"claimName": "packtrain-data", "subPath": "packs/demo"},
        "workers": {"count": 4, "resources": {"requests": {"cpu": 2, "memory": "8Gi"}}},
    },
}

SFTJOB: dict[str, Any] = {
    "apiVersion": "packtrain.dev/v1alpha1",
    "kind": "SFTJob",
    "metadata": {
        "name": "demo-sft",
        "namespace": "ml",
        "uid": "0b1c2d3e-0000-4000-8000-000000000002",
        "generation": 1,
    },
    "spec": {
        "data": {"packJobRef": "demo"},
        "model": {"path": "/data/models/Qwen2-VL-2B-Instruct"},
        "training": {"maxSteps": 1000, "lr": 2e-5},
        "resources": {"nodes": 2, "gpusPerNode": 8, "cpu": 64, "memory": "512Gi"},
        "volumes": {"checkpoints": {"claimName": "packtrain-checkpoints"}},
        "queueName": "gpu-queue",
    },
}


def assert_golden(name: str, obj: Any) -> None:
    """Compare with tests/operator/golden/<name>.yaml (PACKTRAIN_UPDATE_GOLDEN=1 rewrites it)."""
    path = GOLDEN / f"{name}.yaml"
    text = yaml.safe_dump(obj, sort_keys=False, width=110)
    if UPDATE_GOLDEN:
        path.write_text(text)
    assert path.is_file(), f"missing golden file {path}: run with PACKTRAIN_UPDATE_GOLDEN=1 and review it"
    assert yaml.safe_load(path.read_text()) == obj, (
        f"{path} differs from the builder's output; if the change is intended, "
        "rerun with PACKTRAIN_UPDATE_GOLDEN=1 and review the diff"
    )
