"""`packtrain render` at the cluster hand-off, driven as a user types it: paths the pods cannot see and
jobs that cannot fit their GPUs are refused (exit 2, one line each, what to change), and every
example renders under the chart's default values."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.paths import MODELS
from test_first_hour import packtrain

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# The local-first examples (`packtrain run`): their ../shared paths exist on no pod volume.
LOCAL_FIRST = {
    "quickstart.yaml",
    "qwen3-vl.yaml",
    "qwen3.5.yaml",
    "internvl.yaml",
    "llava-onevision-1.5.yaml",
}
ALLOW = "--allow-unmounted"


def pack_doc(name: str = "demo", **spec: Any) -> dict[str, Any]:
    body = {
        "source": {"paths": ["/data/datasets/train.json"]},
        "model": {"family": "qwen2-vl", "path": "/data/models/qwen2-vl"},
        "output": {"claimName": "packtrain-data"},
    }
    return {"apiVersion": "packtrain.dev/v1alpha1", "kind": "PackJob", "metadata": {"name": name},
            "spec": body | spec}  # fmt: skip


def sft_doc(name: str = "demo", pack: str = "demo", **spec: Any) -> dict[str, Any]:
    body = {
        "data": {"packJobRef": pack},
        "model": {"path": "/data/models/qwen2-vl"},
        "resources": {"gpusPerNode": 0},
        "volumes": {"checkpoints": {"claimName": "packtrain-checkpoints"}},
    }
    return {"apiVersion": "packtrain.dev/v1alpha1", "kind": "SFTJob", "metadata": {"name": name},
            "spec": body | spec}  # fmt: skip


def write(tmp_path: Path, *docs: dict[str, Any], name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def refused(result: Any) -> list[str]:
    """The lines of a render refused with exit 2: nothing on stdout, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr, result.stderr
    return result.stderr.removeprefix("packtrain render: ").splitlines()


def test_cluster_paths_render_without_a_word(tmp_path: Path) -> None:
    result = packtrain("render", str(write(tmp_path, pack_doc(), sft_doc())))
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_a_tmp_path_and_a_relative_path_exit_2_naming_the_volumes_key(tmp_path: Path) -> None:
    job = pack_doc(source={"paths": ["/tmp/demo/train.json", "train.json"]})
    lines = refused(packtrain("render", str(write(tmp_path, job))))
    assert len(lines) == 1, lines
    assert (
        "PackJob demo: source.paths[0] '/tmp/demo/train.json', source.paths[1] 'train.json' are on no "
        in lines[0]
    )
    assert "model.path" not in lines[0]  # /data/models is on the output claim
    assert "`volumes: [{name: datasets, claimName: my-claim, mountPath: /datasets}]`" in lines[0]
    assert "then write them under /datasets" in lines[0] and ALLOW in lines[0]


def test_the_suggested_volume_is_the_fix(tmp_path: Path) -> None:
    """A path whose top folder a claim may cover: the snippet mounts it there, and pasted in, it renders."""
    job = pack_doc(source={"paths": ["/mnt/corpus/train.json"], "mediaRoot": "/mnt/corpus/media"})
    (line,) = refused(packtrain("render", str(write(tmp_path, job))))
    assert "source.paths[0] '/mnt/corpus/train.json', source.mediaRoot '/mnt/corpus/media' are" in line
    snippet = re.search(r"`(volumes: .*?)`", line)
    assert snippet is not None and "the paths stay as written" in line
    job["spec"] |= yaml.safe_load(snippet.group(1))
    assert job["spec"]["volumes"][0]["mountPath"] == "/mnt"
    result = packtrain("render", str(write(tmp_path, job)))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    convert = next(d for d in yaml.safe_load_all(result.stdout) if d["kind"] == "Job")
    mounts = convert["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "datasets", "mountPath": "/mnt", "readOnly": True} in mounts


def test_an_sftjob_model_outside_its_mounts_names_volumes_model(tmp_path: Path) -> None:
    doc = write(tmp_path, pack_doc(), sft_doc(model={"path": "/tmp/qwen2-vl"}))
    (line,) = refused(packtrain("render", str(doc)))
    assert line.startswith("SFTJob demo: model.path '/tmp/qwen2-vl' is on no volume its pods mount"), line
    assert "claims at /checkpoints, /data" in line
    assert "`volumes: {model: {claimName: my-claim}}`" in line and "write model.path under /models" in line


def test_allow_unmounted_renders_with_a_warning(tmp_path: Path) -> None:
    job = write(tmp_path, pack_doc(source={"paths": ["/tmp/demo/train.json"]}))
    result = packtrain("render", str(job), ALLOW)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("packtrain render: warning: PackJob demo: source.paths[0] '/tmp/demo/")
    assert len(result.stderr.splitlines()) == 1
    assert [d["kind"] for d in yaml.safe_load_all(result.stdout)][:2] == ["ConfigMap", "Job"]


def big_job(tmp_path: Path) -> Path:
    """Full fine-tuning of the real Qwen2.5-VL config on one 8 GiB GPU: far too big. Its model folder is
    a local one, so `--allow-unmounted` is needed to get to the plan."""
    model = str(MODELS / "qwen2.5-vl")
    pack = pack_doc("big", model={"family": "qwen2.5-vl", "path": model}, packing={"maxLength": 4096})
    sft = sft_doc("big", "big", model={"path": model}, resources={"gpusPerNode": 1, "gpuMemory": "8Gi"})
    return write(tmp_path, pack, sft)


def test_a_job_that_cannot_fit_exits_2_with_train_plans_message(tmp_path: Path) -> None:
    path = big_job(tmp_path)
    result = packtrain("render", str(path), ALLOW)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    lines = [line.removeprefix("packtrain render: ") for line in result.stderr.splitlines()]
    assert lines[0].startswith("warning: PackJob big: ")  # the local model folder: allowed, and said
    assert lines[1].startswith("warning: SFTJob big: ")
    sft_only = write(tmp_path, list(yaml.safe_load_all(path.read_text()))[1], name="sft.yaml")
    plan = packtrain("train", "-c", str(sft_only), "--plan", "--json", "--max-length", "4096")
    assert plan.returncode == 2, plan.stderr
    message = json.loads(plan.stdout)["refusal"]
    assert message.startswith("the job needs about ")
    assert lines[2:] == [f"SFTJob big: {message}"]


def test_a_job_that_fits_renders(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all(big_job(tmp_path).read_text()))
    docs[1]["spec"]["resources"]["gpuMemory"] = "1000Gi"
    result = packtrain("render", str(write(tmp_path, *docs)), ALLOW)
    assert result.returncode == 0, result.stderr
    assert [line.split(": ")[1] for line in result.stderr.splitlines()] == ["warning", "warning"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_under_the_default_policy(example: Path) -> None:
    local = example.name in LOCAL_FIRST
    args = [ALLOW] if local else []
    result = packtrain("render", str(example), "--pack-claim", "packtrain-data", *args, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert ("warning: " in result.stderr) == local, result.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(result.stdout)}
    assert "PyTorchJob" in kinds


def test_trainer_pods_get_a_capped_memory_shm_and_a_memory_limit(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("trainerShmSizeLimit: 4Gi\n")
    for extra, size in (([], "16Gi"), (["-f", str(values)], "4Gi")):
        result = packtrain("render", str(write(tmp_path, pack_doc(), sft_doc())), *extra)
        assert result.returncode == 0, result.stderr
        job = next(d for d in yaml.safe_load_all(result.stdout) if d["kind"] == "PyTorchJob")
        pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}} in pod["volumes"]
        resources = pod["containers"][0]["resources"]
        assert resources["limits"]["memory"] == resources["requests"]["memory"]
