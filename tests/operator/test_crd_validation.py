"""Hostile or mistaken specs are refused twice: by the models (local runs) and by the API server (the CRDs).

Each case below is one spec edit, the field it breaks and words of the message. The fast tests
validate with the pydantic models; the cluster tests apply the generated CRDs to the real local
kube-apiserver and create each CR as a dry run, so what is checked is what `kubectl apply` meets.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_fixtures import PACKJOB, SFTJOB
from pydantic import ValidationError

from packtrain.core.config import (
    MAX_FRAMES_CEILING,
    MAX_LENGTH_CEILING,
    MAX_PIXELS_CEILING,
    SEQUENCES_PER_SHARD_CEILING,
)
from packtrain.core.sft_config import MAX_NUM_WORKERS
from packtrain.operator.api import (
    MOUNT_PATH_MESSAGE,
    OUTPUT_MOUNT_MESSAGE,
    PARENT_SEGMENT,
    QUANTITY_PATTERN,
    SUB_PATH_MESSAGE,
    UNIQUE_MOUNTS_MESSAGE,
    PackJobSpec,
    SFTJobSpec,
)

REPO = Path(__file__).resolve().parents[2]
Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Edit:
    """An edit that sets `spec.<dotted path>`, creating maps on the way."""

    def edit(spec: dict[str, Any]) -> None:
        node: Any = spec
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    return edit


VOLUME = {"name": "datasets", "claimName": "datasets", "mountPath": "/datasets"}


def _volume(sub_path: str) -> Edit:
    def edit(spec: dict[str, Any]) -> None:
        spec["volumes"] = [{**VOLUME, "subPath": sub_path}]

    return edit


def _mounted_at(*paths: str) -> Edit:
    def edit(spec: dict[str, Any]) -> None:
        spec["volumes"] = [{**VOLUME, "name": f"v{i}", "mountPath": p} for i, p in enumerate(paths)]

    return edit


# (kind, edit, the field the server names, words of its message, words of the models' message)
CASES: dict[str, tuple[str, Edit, str, str, str]] = {
    "cpu lots": (
        "PackJob",
        _set("workers.resources.requests.cpu", "lots"),
        "spec.workers.resources.requests.cpu",
        "should match",
        "should match pattern",
    ),
    "negative memory": (
        "PackJob",
        _set("workers.resources.limits.memory", "-8Gi"),
        "spec.workers.resources.limits.memory",
        "should match",
        "should match pattern",
    ),
    "sft cpu lots": (
        "SFTJob",
        _set("resources.cpu", "lots"),
        "spec.resources.cpu",
        "should match",
        "should match",
    ),
    "sft memory 8GB": (
        "SFTJob",
        _set("resources.memory", "8GB"),
        "spec.resources.memory",
        "should match",
        "should match",
    ),
    "output subPath escapes": (
        "PackJob",
        _set("output.subPath", "../../etc"),
        "spec.output.subPath",
        SUB_PATH_MESSAGE,
        SUB_PATH_MESSAGE,
    ),
    "output subPath absolute": (
        "PackJob",
        _set("output.subPath", "/etc"),
        "spec.output.subPath",
        SUB_PATH_MESSAGE,
        SUB_PATH_MESSAGE,
    ),
    "volume subPath escapes": (
        "PackJob",
        _volume("team-a/../../other"),
        "spec.volumes[0].subPath",
        SUB_PATH_MESSAGE,
        SUB_PATH_MESSAGE,
    ),
    "checkpoint subPath escapes": (
        "SFTJob",
        _set("volumes.checkpoints.subPath", ".."),
        "spec.volumes.checkpoints.subPath",
        SUB_PATH_MESSAGE,
        SUB_PATH_MESSAGE,
    ),
    # A claim over the image's own code (the venv, /usr) would run the CR author's code in an allowed image.
    "volume over the image's venv": (
        "PackJob",
        _mounted_at("/opt/packtrain"),
        "spec.volumes[0].mountPath",
        MOUNT_PATH_MESSAGE,
        MOUNT_PATH_MESSAGE,
    ),
    "volume over /usr": (
        "PackJob",
        _mounted_at("/usr"),
        "spec.volumes[0].mountPath",
        MOUNT_PATH_MESSAGE,
        MOUNT_PATH_MESSAGE,
    ),
    "volume over the config": (
        "PackJob",
        _mounted_at("/etc/packtrain"),
        "spec.volumes[0].mountPath",
        MOUNT_PATH_MESSAGE,
        MOUNT_PATH_MESSAGE,
    ),
    "volume into /usr by a dot segment": (
        "PackJob",
        _mounted_at("/datasets/../usr/lib"),
        "spec.volumes[0].mountPath",
        MOUNT_PATH_MESSAGE,
        MOUNT_PATH_MESSAGE,
    ),
    "volume at /": ("PackJob", _mounted_at("/"), "spec.volumes[0].mountPath", "should match", "should match"),
    "output over the operator's /tmp": (
        "PackJob",
        _set("output.mountPath", "/tmp"),
        "spec.output.mountPath",
        MOUNT_PATH_MESSAGE,
        MOUNT_PATH_MESSAGE,
    ),
    "output over the trainer's home": (
        "PackJob",
        _set("output.mountPath", "/home/packtrain"),
        "spec.output.mountPath",
        MOUNT_PATH_MESSAGE,
        MOUNT_PATH_MESSAGE,
    ),
    "output at the trainer's checkpoints": (
        "PackJob",
        _set("output.mountPath", "/checkpoints"),
        "spec.output.mountPath",
        OUTPUT_MOUNT_MESSAGE,
        OUTPUT_MOUNT_MESSAGE,
    ),
    "two volumes at one path": (
        "PackJob",
        _mounted_at("/datasets", "/datasets"),
        "spec.volumes",
        UNIQUE_MOUNTS_MESSAGE,
        UNIQUE_MOUNTS_MESSAGE,
    ),
    "a volume at the output's path": (
        "PackJob",
        _mounted_at("/data"),
        "spec.volumes",
        UNIQUE_MOUNTS_MESSAGE,
        UNIQUE_MOUNTS_MESSAGE,
    ),
    "minPixels over maxPixels": (
        "PackJob",
        _set("model.minPixels", 1_000_000),
        "spec.model.minPixels",
        "minPixels must not exceed maxPixels",
        "minPixels (1000000) must not exceed maxPixels (401408)",
    ),
    "video minPixels over maxPixels": (
        "PackJob",
        lambda s: s["model"].update(videoMinPixels=50_000, videoMaxPixels=40_000),
        "spec.model.videoMinPixels",
        "videoMinPixels must not exceed videoMaxPixels",
        "videoMinPixels (50000) must not exceed videoMaxPixels (40000)",
    ),
    "empty imagePlaceholder": (
        "PackJob",
        _set("source.fieldMap.imagePlaceholder", ""),
        "spec.source.fieldMap.imagePlaceholder",
        "at least 1 chars long",
        "at least 1 character",
    ),
    "empty videoPlaceholder": (
        "PackJob",
        _set("source.fieldMap.videoPlaceholder", ""),
        "spec.source.fieldMap.videoPlaceholder",
        "at least 1 chars long",
        "at least 1 character",
    ),
    "maxLength 10**9": (
        "PackJob",
        _set("packing.maxLength", 10**9),
        "spec.packing.maxLength",
        f"less than or equal to {MAX_LENGTH_CEILING}",
        f"less than or equal to {MAX_LENGTH_CEILING}",
    ),
    "maxPixels over the ceiling": (
        "PackJob",
        _set("model.maxPixels", MAX_PIXELS_CEILING + 1),
        "spec.model.maxPixels",
        f"less than or equal to {MAX_PIXELS_CEILING}",
        f"less than or equal to {MAX_PIXELS_CEILING}",
    ),
    "maxFrames over the ceiling": (
        "PackJob",
        _set("model.maxFrames", 10**6),
        "spec.model.maxFrames",
        f"less than or equal to {MAX_FRAMES_CEILING}",
        f"less than or equal to {MAX_FRAMES_CEILING}",
    ),
    "sequencesPerShard over the ceiling": (
        "PackJob",
        _set("packing.sequencesPerShard", 10**7),
        "spec.packing.sequencesPerShard",
        f"less than or equal to {SEQUENCES_PER_SHARD_CEILING}",
        f"less than or equal to {SEQUENCES_PER_SHARD_CEILING}",
    ),
    "numWorkers over the ceiling": (
        "SFTJob",
        _set("data.numWorkers", 10_000),
        "spec.data.numWorkers",
        f"less than or equal to {MAX_NUM_WORKERS}",
        f"less than or equal to {MAX_NUM_WORKERS}",
    ),
}
MODELS = {"PackJob": (PACKJOB, PackJobSpec), "SFTJob": (SFTJOB, SFTJobSpec)}


def _spec(kind: str, edit: Edit) -> dict[str, Any]:
    spec = copy.deepcopy(MODELS[kind][0]["spec"])
    edit(spec)
    return spec


@pytest.mark.parametrize("case", list(CASES))
def test_the_models_refuse(case: str) -> None:
    kind, edit, _, _, words = CASES[case]
    with pytest.raises(ValidationError) as refused:
        MODELS[kind][1].model_validate(_spec(kind, edit))
    assert words in str(refused.value), str(refused.value)


@pytest.mark.parametrize("quantity", [0, 2, "2", "500m", "8Gi", "1.5Gi", "1e3", "0.5", ".5", "100M", "+1"])
def test_real_quantities_pass(quantity: int | str) -> None:
    spec = _spec("PackJob", _set("workers.resources.requests.cpu", quantity))
    assert PackJobSpec.model_validate(spec).workers.resources is not None


@pytest.mark.parametrize("sub_path", ["packs/demo", "a/.b/c", "..hidden", "a/...", "team-a/"])
def test_relative_sub_paths_inside_the_claim_pass(sub_path: str) -> None:
    PackJobSpec.model_validate(_spec("PackJob", _volume(sub_path)))
    PackJobSpec.model_validate(_spec("PackJob", _set("output.subPath", sub_path)))


@pytest.mark.parametrize(
    "path", ["/datasets", "/mnt/team-a", "/data/models", "/optional", "/usrdata", "/.cache", "/data/..x"]
)
def test_mount_paths_outside_the_image_pass(path: str) -> None:
    PackJobSpec.model_validate(_spec("PackJob", _mounted_at(path)))
    PackJobSpec.model_validate(_spec("PackJob", _set("output.mountPath", path)))


def test_every_mount_the_operator_adds_is_refused_as_the_output_mount() -> None:
    """The reserved folders cover the builders' own mounts, in packer and trainer pods alike."""
    from packtrain.operator import builders
    from packtrain.operator.settings import OperatorDefaults

    pack = PackJobSpec.model_validate(_spec("PackJob", _mounted_at("/datasets")))
    sft = SFTJobSpec.model_validate(_spec("SFTJob", _set("volumes.model", {"claimName": "models"})))
    data = builders.data_source(sft, pack, None)
    pods = [
        builders.pack_job("p", "ns", pack, "convert", OperatorDefaults())["spec"]["template"]["spec"],
        builders.pytorch_job("s", "ns", sft, data, OperatorDefaults())["spec"]["pytorchReplicaSpecs"][
            "Master"
        ]["template"]["spec"],
    ]
    own = {m["mountPath"] for pod in pods for m in pod["containers"][0]["volumeMounts"]}
    own -= {pack.output.mount_path, data.mount_path, "/datasets"}  # the CR's own claims
    own.add(builders.TERMINATION_LOG)
    assert {"/etc/packtrain", "/tmp", "/dev/shm", "/checkpoints", "/models"} <= own
    for path in own:
        with pytest.raises(ValidationError):
            PackJobSpec.model_validate(_spec("PackJob", _set("output.mountPath", path)))


def test_the_crd_carries_the_models_rules() -> None:
    """One source: the CRD's pattern is the models' regex, its CEL rule the same `..` test."""
    crd = yaml.safe_load((REPO / "crds" / "packtrain.dev_packjobs.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    cpu = spec["workers"]["properties"]["resources"]["properties"]["requests"]["additionalProperties"]
    assert cpu["pattern"] == QUANTITY_PATTERN and cpu["x-kubernetes-int-or-string"] is True
    for sub_path in (
        spec["output"]["properties"]["subPath"],
        spec["volumes"]["items"]["properties"]["subPath"],
    ):
        (rule,) = sub_path["x-kubernetes-validations"]
        assert rule["message"] == SUB_PATH_MESSAGE and PARENT_SEGMENT in rule["rule"]
    rules = [r["rule"] for r in spec["model"]["x-kubernetes-validations"]]
    assert "!has(self.minPixels) || !has(self.maxPixels) || self.minPixels <= self.maxPixels" in rules
    assert (
        "!has(self.videoMinPixels) || !has(self.videoMaxPixels) || self.videoMinPixels <= self.videoMaxPixels"
        in rules
    )


# On the real API server.


@pytest.fixture(scope="module")
def custom(kube_cluster: Any) -> Iterator[Any]:
    from kubernetes import client

    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kube_cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/packjobs.packtrain.dev",
        "crd/sftjobs.packtrain.dev",
    )
    with kube_cluster.api_client() as api:
        yield client.CustomObjectsApi(api)


def _create(custom: Any, kind: str, spec: dict[str, Any]) -> Any:
    plural = {"PackJob": "packjobs", "SFTJob": "sftjobs"}[kind]
    body = {"apiVersion": "packtrain.dev/v1alpha1", "kind": kind, "metadata": {"name": "probe"}, "spec": spec}
    return custom.create_namespaced_custom_object(
        "packtrain.dev", "v1alpha1", "default", plural, body, dry_run="All"
    )


@pytest.mark.cluster
@pytest.mark.parametrize("kind", list(MODELS))
def test_the_api_server_accepts_the_valid_examples(custom: Any, kind: str) -> None:
    _create(custom, kind, copy.deepcopy(MODELS[kind][0]["spec"]))


@pytest.mark.cluster
@pytest.mark.parametrize("case", list(CASES))
def test_the_api_server_refuses_with_a_clear_message(custom: Any, case: str) -> None:
    from kubernetes.client.rest import ApiException

    kind, edit, field, words, _ = CASES[case]
    with pytest.raises(ApiException) as refused:
        _create(custom, kind, _spec(kind, edit))
    assert refused.value.status == 422, refused.value.body
    body = str(refused.value.body)
    assert field in body and words in body, body
