"""CRDs generated from the pydantic models: up to date, structural, and saying what users need."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_fixtures import PACKJOB, SFTJOB

from packtrain.operator import crdgen
from packtrain.operator.api import QUANTITY_PATTERN, PackJob, PackJobSpec, SFTJob, SFTJobSpec

REPO = Path(__file__).resolve().parents[2]
KINDS = [PackJob, SFTJob]


def _schema(kind: type[PackJob] | type[SFTJob]) -> dict[str, Any]:
    return crdgen.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: Any, path: str = "") -> Any:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_checked_in_crds_are_up_to_date() -> None:
    stale = crdgen.stale(REPO / "crds")
    assert not stale, f"{[str(p) for p in stale]} out of date: run `packtrain crds --out crds` and commit"


def test_stale_detects_an_edit(tmp_path: Path) -> None:
    crdgen.write_all(tmp_path)
    assert crdgen.stale(tmp_path) == []
    path = tmp_path / crdgen.filename(PackJob)
    path.write_text(path.read_text().replace("Converting", "Convertin"))
    assert crdgen.stale(tmp_path) == [path]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.KIND)
def test_crd_is_a_valid_kubernetes_object(kind: type[PackJob] | type[SFTJob]) -> None:
    kubernetes_validate.validate(crdgen.crd(kind), "1.34.0", strict=True)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.KIND)
def test_schema_is_structural(kind: type[PackJob] | type[SFTJob]) -> None:
    """No $ref/anyOf/allOf/additionalProperties:false/title; every property node typed or explicitly
    free-form."""
    for path, node in _walk(_schema(kind)):
        if path.endswith("/x-kubernetes-validations") or "/x-kubernetes-validations[" in path:
            continue
        if "/default" in path:
            continue
        for banned in ("$ref", "anyOf", "allOf", "oneOf", "title", "$defs", "const", "nullable"):
            assert banned not in node, f"{kind.KIND}{path}: {banned}"
        if node.get("additionalProperties") is False:
            pytest.fail(f"{kind.KIND}{path}: additionalProperties false")
        parent = path.rsplit("/", 2)
        if len(parent) >= 2 and parent[-2] in ("properties",) or path.endswith("/items"):
            assert (
                "type" in node
                or node.get("x-kubernetes-int-or-string")
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), f"{kind.KIND}{path} has no type"


def test_names_columns_and_status_subresource() -> None:
    pj, sft = crdgen.crd(PackJob), crdgen.crd(SFTJob)
    assert pj["metadata"]["name"] == "packjobs.packtrain.dev"
    assert pj["spec"]["names"]["shortNames"] == ["pj"] and sft["spec"]["names"]["shortNames"] == ["sft"]
    for crd in (pj, sft):
        version = crd["spec"]["versions"][0]
        assert crd["spec"]["scope"] == "Namespaced" and version["name"] == "v1alpha1"
        assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in pj["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Stage", "Done%", "Samples", "Rejected", "Fill", "Age"]
    columns = {c["name"]: c["jsonPath"] for c in sft["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Step", "Max", "Loss", "Backend", "Nodes", "GPUs", "Age"]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.KIND)
def test_printer_columns_point_at_schema_fields(kind: type[PackJob] | type[SFTJob]) -> None:
    schema = _schema(kind)
    for column in kind.PRINTER_COLUMNS:
        if column["jsonPath"].startswith(".metadata"):
            continue
        node = schema
        for part in column["jsonPath"].strip(".").split("."):
            assert part in node.get("properties", {}), (
                f"{column['name']}: {column['jsonPath']} not in the schema"
            )
            node = node["properties"][part]
        assert node["type"] == column["type"], column


def test_embedded_configs_come_from_the_packer_and_trainer_models() -> None:
    spec = _schema(PackJob)["properties"]["spec"]["properties"]
    assert set(spec["packing"]["properties"]["algorithm"]["enum"]) == {"bfd", "next_fit", "swift", "knapsack"}
    assert spec["packing"]["properties"]["maxLength"]["default"] == 4096
    assert spec["packing"]["default"] == {}  # so the API server fills in the nested defaults
    assert spec["source"]["required"] == ["paths"]
    sft = _schema(SFTJob)["properties"]["spec"]["properties"]
    assert sft["training"]["properties"]["maxSteps"]["minimum"] == 1
    assert sft["model"]["properties"]["configOverrides"]["x-kubernetes-preserve-unknown-fields"] is True
    assert sft["backend"]["enum"] == ["pytorchjob", "trainjob"] and sft["backend"]["default"] == "pytorchjob"
    assert sft["resources"]["properties"]["cpu"] == {
        "description": "CPU request and limit per pod, e.g. 16 or 15500m.",
        "x-kubernetes-int-or-string": True,
        "pattern": QUANTITY_PATTERN,
        "maxLength": 64,
        "minimum": 0,
    }
    lr = sft["training"]["properties"]["lr"]
    assert lr["minimum"] == 0 and lr["exclusiveMinimum"] is True


def test_immutability_rules_name_each_field() -> None:
    rules = _schema(PackJob)["properties"]["spec"]["x-kubernetes-validations"]
    fields = {r["fieldPath"].lstrip(".") for r in rules if "oldSelf" in r["rule"]}
    assert fields == {"source", "model", "packing", "output", "workers", "volumes", "queueName"}
    sft_rules = _schema(SFTJob)["properties"]["spec"]["x-kubernetes-validations"]
    sft_fields = {r["fieldPath"].lstrip(".") for r in sft_rules if "oldSelf" in r["rule"]}
    assert "suspend" not in sft_fields and {"data", "training", "resources", "backend"} <= sft_fields
    assert all("immutable" in r["message"] for r in rules + sft_rules if "oldSelf" in r["rule"])
    data_rule = next(r for r in sft_rules if r["fieldPath"] == ".data")
    assert data_rule["rule"] == "has(self.data.path) != has(self.data.packJobRef)"


def test_root_rule_limits_the_name_length() -> None:
    rule = _schema(PackJob)["x-kubernetes-validations"][0]
    assert rule["rule"] == "size(self.metadata.name) <= 45"


def test_examples_validate_with_the_models() -> None:
    PackJobSpec.model_validate(PACKJOB["spec"])
    SFTJobSpec.model_validate(SFTJOB["spec"])


def test_crd_yaml_has_the_generated_header() -> None:
    text = (REPO / "crds" / crdgen.filename(SFTJob)).read_text()
    assert text.startswith("# Generated by `packtrain crds`")
    assert yaml.safe_load(text)["kind"] == "CustomResourceDefinition"


def test_kubectl_explain_has_a_description_for_every_field() -> None:
    """Each property of both CRDs says what it is (`kubectl explain packjob.spec.packing.seed`)."""
    # The API server refuses a schema for metadata; kubectl explain shows ObjectMeta's own documentation.
    STANDARD = {"PackJob.metadata", "SFTJob.metadata"}  # noqa: N806
    missing: list[str] = []

    def walk(node: dict, path: str) -> None:
        for key, child in (node.get("properties") or {}).items():
            if not child.get("description") and f"{path}.{key}" not in STANDARD:
                missing.append(f"{path}.{key}")
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    for kind in (PackJob, SFTJob):
        walk(crdgen.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"], kind.KIND)
    assert missing == [], f"fields without a description: {missing}"
