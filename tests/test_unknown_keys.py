"""A misspelt key is refused by every entry point the same way: exit 2, one line naming the key and
the closest valid one, never a default taken silently. Driven as a user types it (the `packtrain`
command in a subprocess, real model folders), plus the operator's own validation path."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.paths import MODELS
from test_first_hour import QWEN2, TINY, chats, one_line_error, packtrain

from packtrain.core.config import PACK_CLUSTER_KEYS, PackConfig
from packtrain.core.sft_config import SFT_CLUSTER_KEYS, SFTSpecCore
from packtrain.operator import handlers
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.manifests import load_manifests
from packtrain.operator.settings import OperatorDefaults

API = "packtrain.dev/v1alpha1"
DEFAULTS = OperatorDefaults(packer_image="packer:test", trainer_image="trainer:test")
PAKCING = "unknown key spec.pakcing (did you mean packing?)"
TRAINNIG = "unknown key spec.trainnig (did you mean training?)"
HIDEN = (
    "unknown key model.configOverrides.hiden_size: Qwen2VLConfig has no such setting "
    "(did you mean hidden_size?)"
)
HIDEN_MODEL = {"path": str(QWEN2), "init": "random", "configOverrides": TINY | {"hiden_size": 64}}


def _data(folder: Path) -> Path:
    data = folder / "chats.json"
    data.write_text(json.dumps(chats(3)))
    return data


def pack_job(folder: Path, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "PackJob",
        "metadata": {"name": "demo"},
        "spec": {
            "source": {"paths": [str(_data(folder))]},
            "model": {"path": str(QWEN2)},
            "output": {"claimName": "data"},
            **spec,
        },
    }


def sft_job(model: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "SFTJob",
        "metadata": {"name": "demo"},
        "spec": {
            "data": {"packJobRef": "demo"},
            "model": model or {"path": str(QWEN2), "init": "random", "configOverrides": TINY},
            "training": {"maxSteps": 1},
            "resources": {"gpusPerNode": 0},
            "volumes": {"checkpoints": {"claimName": "ckpt"}},
            **spec,
        },
    }


def write(path: Path, *docs: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump_all(docs))
    return path


def single_error(result: Any) -> str:
    err = one_line_error(result, 2)
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_pack_run_refuses_a_misspelt_section(tmp_path: Path) -> None:
    job = write(tmp_path / "pack.yaml", pack_job(tmp_path, pakcing={"maxLength": 99}))
    out = tmp_path / "out"
    err = single_error(packtrain("pack", "run", "-c", str(job), "-o", str(out), "--workers", "1"))
    assert f"{job}: {PAKCING}" in err
    assert not out.exists()  # refused before anything was packed


def test_pack_run_names_a_misspelt_key_inside_a_section_and_of_the_manifest(tmp_path: Path) -> None:
    bare = write(tmp_path / "bare.yaml", pack_job(tmp_path, packing={"maxLenght": 99})["spec"])
    err = single_error(packtrain("pack", "run", "-c", str(bare), "-o", str(tmp_path / "out")))
    assert "unknown key packing.maxLenght (did you mean maxLength?)" in err
    whole = pack_job(tmp_path)
    whole["metdata"] = whole.pop("metadata")
    job = write(tmp_path / "job.yaml", whole)
    err = single_error(packtrain("pack", "plan", "-c", str(job), "-o", str(tmp_path / "out")))
    assert "unknown key metdata (did you mean metadata?)" in err


def test_train_refuses_a_misspelt_section(tmp_path: Path) -> None:
    job = sft_job(trainnig={"lr": 0.1})
    job["spec"]["data"] = {"path": str(tmp_path / "no-pack")}
    err = single_error(packtrain("train", "-c", str(write(tmp_path / "sft.yaml", job))))
    assert TRAINNIG in err


def test_train_refuses_a_config_override_the_model_would_ignore(tmp_path: Path) -> None:
    job = sft_job(HIDEN_MODEL)
    job["spec"]["data"] = {"path": str(tmp_path / "no-pack")}
    err = single_error(packtrain("train", "-c", str(write(tmp_path / "sft.yaml", job))))
    assert HIDEN in err


def test_a_text_key_at_the_top_of_a_nested_config_says_where_it_goes(tmp_path: Path) -> None:
    """Qwen3-VL's config.json nests its text settings: a flat hidden_size would be kept and ignored."""
    model = {"path": str(MODELS / "qwen3-vl"), "init": "random", "configOverrides": {"hidden_size": 64}}
    job = sft_job(model, data={"path": str(tmp_path / "no-pack")})
    err = single_error(packtrain("train", "-c", str(write(tmp_path / "sft.yaml", job))))
    assert "unknown key model.configOverrides.hidden_size: Qwen3VLConfig has no such setting" in err
    assert "(did you mean text_config.hidden_size or vision_config.hidden_size?)" in err
    model["configOverrides"] = {"text_config": {"hidden_size": 64}, "vision_config": {"dpeth": 2}}
    err = single_error(packtrain("train", "-c", str(write(tmp_path / "sft.yaml", job))))
    assert "unknown key model.configOverrides.vision_config.dpeth: Qwen3VLVisionConfig" in err
    assert "(did you mean depth?)" in err and "text_config" not in err


def test_render_refuses_a_misspelt_section(tmp_path: Path) -> None:
    job = write(tmp_path / "job.yaml", pack_job(tmp_path, pakcing={"maxLength": 99}))
    result = packtrain("render", str(job))
    assert f"{job}: PackJob demo is invalid: {PAKCING}" in single_error(result) and result.stdout == ""


@pytest.mark.parametrize(
    ("sft", "message"),
    [
        (sft_job(trainnig={"lr": 0.1}), TRAINNIG),
        (sft_job(HIDEN_MODEL), HIDEN),
    ],
    ids=["section", "config-override"],
)
def test_run_refuses_before_packing(tmp_path: Path, sft: dict[str, Any], message: str) -> None:
    job = write(tmp_path / "job.yaml", pack_job(tmp_path), sft)
    result = packtrain("run", str(job), "--output", str(tmp_path / "runs"), "--workers", "1")
    assert f"SFTJob demo is invalid: {message}" in single_error(result)
    assert not (tmp_path / "runs").exists()


def test_the_operator_refuses_with_the_message_the_cli_gives(tmp_path: Path) -> None:
    """A CR the API server kept (an old CRD without the schema) fails as `render` refuses it."""
    doc = pack_job(tmp_path, pakcing={"maxLength": 99})
    body = {**doc, "metadata": {"name": "demo", "namespace": "ns", "generation": 1}}
    status = handlers.reconcile_packjob(None, body, DEFAULTS)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert f"invalid PackJob spec: {PAKCING}. Fix it" in failed["message"]
    with pytest.raises(ValueError, match=rf"is invalid: {re.escape(PAKCING)}$"):
        load_manifests(write(tmp_path / "job.yaml", doc))


def test_cluster_only_keys_are_the_api_spec_less_what_the_local_commands_read() -> None:
    def keys(model: Any) -> set[str]:
        return {f.alias or n for n, f in model.model_fields.items()}

    assert keys(PackJobSpec) - keys(PackConfig) == PACK_CLUSTER_KEYS
    assert keys(SFTJobSpec) - keys(SFTSpecCore) == SFT_CLUSTER_KEYS
