"""`packtrain render FILE.yaml [--values VALUES.yaml]`: the objects the operator would create, as YAML.

A reviewer reads what a PackJob or SFTJob turns into before it reaches a cluster, as
with `helm template`: the ConfigMaps, stage Jobs and training job come from the
operator's own builders, with the settings the chart hands the operator (its
Deployment's environment, computed here from the chart's values), and the chart's
`policy` is applied first. An SFTJob is rendered as if its PackJob had succeeded; one whose
PackJob is not in FILE needs `--pack-claim` to say where that pack lives. Other objects in FILE
(a PersistentVolumeClaim, say) are printed unchanged, as `helm template` shows them. The merged
values are checked against the chart's `values.schema.json`, as Helm checks them. What would only fail
in the pods is refused too (`handoff.py`): paths on no claim the pods mount, and a training job whose
GPU memory plan does not fit.
Children carry no ownerReferences: the operator adds them with the parent's uid.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from packtrain.core.contract import PACK_STAGES
from packtrain.core.errors import EXIT_CONFIG
from packtrain.operator import builders, handoff, policy
from packtrain.operator.api import MAX_NAME_LENGTH, PackJobSpec, PackOutput, SFTJobSpec
from packtrain.operator.manifests import Manifests, Named, load_manifests
from packtrain.operator.settings import OperatorDefaults

CHART = Path(__file__).resolve().parents[1] / "charts" / "packtrain"

# What the API server refuses, checked here so a spec `kubectl apply` (or the operator's create of a
# child) would refuse does not render: apimachinery's DNS-1123 label, DNS-1123 subdomain and label value.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
MAX_OBJECT_NAME = 253  # a DNS-1123 subdomain
MAX_LABEL_VALUE = 63  # a Job's name is also its pods' batch.kubernetes.io/job-name label
MAX_CONFIG_MAP_BYTES = 1024 * 1024  # ValidateConfigMap: every key and value of data, together


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`helm -f` semantics: maps merge key by key, anything else replaces, and null removes the key."""
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _yaml_map(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a values file is a YAML mapping, got a {type(doc).__name__}")
    return doc


def chart_values(chart: Path, overrides: Sequence[Path] = ()) -> tuple[dict[str, Any], str]:
    """The chart's values with each override merged over them in order, and the chart's appVersion."""
    if not (chart / "values.yaml").is_file():
        raise ValueError(
            f"no chart at {chart} (values.yaml missing): pass --chart, the charts/packtrain "
            "folder of a packtrain checkout"
        )
    values = _yaml_map(chart / "values.yaml")
    for path in overrides:
        values = deep_merge(values, _yaml_map(path))
    check_schema(chart, values)
    return values, str(_yaml_map(chart / "Chart.yaml").get("appVersion", ""))


def check_schema(chart: Path, values: Mapping[str, Any]) -> None:
    """The chart's values.schema.json, as `helm template` applies it; ValueError naming each bad key."""
    import jsonschema

    schema_path = chart / "values.schema.json"
    if not schema_path.is_file():
        return
    schema = json.loads(schema_path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(values), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        lines = [
            f"  at {'.'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}" for e in errors
        ]
        raise ValueError(f"the values do not match {schema_path}:\n" + "\n".join(lines))


def _image(image: Mapping[str, Any], app_version: str) -> str:
    return f"{image['repository']}:{image.get('tag') or app_version}"


def operator_env(values: Mapping[str, Any], app_version: str) -> dict[str, str]:
    """The environment the chart's Deployment gives the operator (templates/deployment.yaml).

    tests/operator/test_render.py renders the chart with Helm and compares, so the two cannot drift.
    """
    images = values["workloadImages"]
    env = {
        "PACKTRAIN_PACKER_IMAGE": _image(images["packer"], app_version),
        "PACKTRAIN_TRAINER_IMAGE": _image(images["trainer"], app_version),
        "PACKTRAIN_POLICY": json.dumps(values.get("policy") or {}),
        "PACKTRAIN_JOB_TTL_SECONDS": json.dumps(values["operator"].get("jobTTLSecondsAfterFinished")),
        "PACKTRAIN_DEADLINES": json.dumps(values["operator"].get("deadlines") or {}),
    }
    for pool in ("cpu", "gpu"):
        settings = values["pools"][pool]
        env[f"PACKTRAIN_{pool.upper()}_NODE_SELECTOR"] = json.dumps(settings.get("nodeSelector") or {})
        env[f"PACKTRAIN_{pool.upper()}_TOLERATIONS"] = json.dumps(settings.get("tolerations") or [])
        env[f"PACKTRAIN_{pool.upper()}_RESOURCES"] = json.dumps(settings.get("resources") or {})
    env["PACKTRAIN_SHM_SIZE_LIMIT"] = str(values["trainerShmSizeLimit"])
    identity = values["workloadSecurityContext"]
    for key, name in (("runAsUser", "RUN_AS_USER"), ("runAsGroup", "RUN_AS_GROUP"), ("fsGroup", "FS_GROUP")):
        env[f"PACKTRAIN_{name}"] = str(identity[key])
    return env


def pack_claim(value: str) -> PackOutput:
    """`CLAIM[:SUBPATH]` of `--pack-claim`: where a PackJob not in FILE wrote its pack."""
    claim, _, sub_path = value.partition(":")
    try:
        return PackOutput(claim_name=claim, sub_path=sub_path or None)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not CLAIM[:SUBPATH]: {exc}") from exc


def render(
    path: Path,
    defaults: OperatorDefaults,
    namespace: str | None = None,
    pack_output: PackOutput | None = None,
    allow_unmounted: bool = False,
    notes: list[str] | None = None,
) -> list[dict]:
    """Every object of `path` that is not ours, then every child of its PackJobs and SFTJobs; ValueError
    naming what to fix. An SFTJob whose PackJob is not in `path` reads `pack_output`'s claim. Paths on no
    claim the pods mount are refused, or with `allow_unmounted` added to `notes` as warnings; so is a job
    whose GPU memory plan does not fit, and an SFTJob that could not be planned is a note."""
    found = load_manifests(path, keep_others=True)
    packs, sfts = found.packs, found.sfts
    missing = sorted(
        {ref for s in sfts if (ref := s.spec.data.pack_job_ref) and ref not in {p.name for p in packs}}
    )
    if missing and pack_output is None:
        raise ValueError(
            f"an SFTJob refers to PackJob {', '.join(missing)}, which {path} does not define: add it "
            "to the file, or pass --pack-claim CLAIM[:SUBPATH] to render as if it wrote there"
        )
    refused = [
        problem
        for kind, docs in (("PackJob", packs), ("SFTJob", sfts))
        for doc in docs
        for problem in name_problems(kind, doc.name)
    ]
    refused += [
        policy.summary(f"{kind} {doc.name}", violations)
        for kind, docs in (("PackJob", packs), ("SFTJob", sfts))
        for doc in docs
        if (violations := policy.check(doc.spec, defaults))
    ]
    if refused:
        raise ValueError("\n".join(refused))
    pack_specs = {p.name: p.spec for p in packs}
    if pack_output is not None:
        # Only the output section of a PackJob decides where its pack is (builders.data_source).
        fields: dict[str, Any] = {"output": pack_output}  # unvalidated: no source or model is known
        pack_specs.update({ref: PackJobSpec.model_construct(**fields) for ref in missing})
    children, gaps = _children(found, pack_specs, defaults, namespace)
    problems = [problem for obj in children for problem in child_problems(obj)]
    if problems:
        raise ValueError("\n".join(problems))
    notes = [] if notes is None else notes
    if gaps and not allow_unmounted:
        raise ValueError("\n".join(gaps))
    notes += [f"warning: {gap}" for gap in gaps]
    plans = [handoff.memory_plan(s.name, s.spec, _pack_of(s.spec, packs), defaults.policy) for s in sfts]
    if refusals := [r for r, _ in plans if r]:
        raise ValueError("\n".join(refusals))
    notes += [f"note: {note}" for _, note in plans if note]
    return [*found.others, *children]


def _pack_of(spec: SFTJobSpec, packs: Sequence[Named]) -> PackJobSpec | None:
    """The SFTJob's PackJob when the file defines it (a `--pack-claim` one has no model to plan with)."""
    return next((p.spec for p in packs if p.name == spec.data.pack_job_ref), None)


def _children(
    found: Manifests,
    pack_specs: Mapping[str, PackJobSpec],
    defaults: OperatorDefaults,
    namespace: str | None,
) -> tuple[list[dict], list[str]]:
    """The children of every PackJob and SFTJob, and one line per job whose paths its pods cannot see."""
    objects: list[dict] = []
    gaps: list[str] = []
    for p in found.packs:
        ns = namespace or p.namespace
        jobs = [builders.pack_job(p.name, ns, p.spec, stage, defaults) for stage in PACK_STAGES]
        objects += [builders.pack_config_map(p.name, ns, p.spec), *jobs]
        gaps.append(handoff.pack_unmounted(p.name, p.spec, jobs))
    for s in found.sfts:
        ns = namespace or s.namespace
        ref = s.spec.data.pack_job_ref
        data = builders.data_source(s.spec, pack_specs.get(ref) if ref else None, None)
        job = builders.training_job(s.name, ns, s.spec, data, defaults)
        objects += [builders.train_config_map(s.name, ns, s.spec, data), job]
        gaps.append(handoff.sft_unmounted(s.name, s.spec, job, data.mount_path))
    return objects, [g for g in gaps if g]


def name_problems(kind: str, name: object) -> list[str]:
    """What is wrong with a PackJob's or SFTJob's metadata.name, one line each with what to change."""
    text = str(name)
    problems = []
    if len(text) > MAX_NAME_LENGTH:
        problems.append(
            f"{kind} {text}: metadata.name has {len(text)} characters; shorten it to at most "
            f"{MAX_NAME_LENGTH} (the CRD's rule: it prefixes the names of the Jobs, pods and Services "
            "the operator creates)"
        )
    if not re.fullmatch(_DNS_LABEL, text):
        problems.append(
            f"{kind} {text!r}: metadata.name must be lowercase letters, digits and '-', starting and ending "
            "with a letter or digit (a DNS-1123 label: it names the pods' hostnames)"
        )
    elif kind == "SFTJob" and not text[0].isalpha():
        problems.append(
            f"{kind} {text}: metadata.name must start with a letter: the training operator names Services "
            "after it, and a Service name is a DNS-1035 label"
        )
    return problems


def _labelled(obj: Any) -> list[dict]:
    """Every `metadata` map of `obj` (its own and its pod templates') that carries labels."""
    if isinstance(obj, list):
        return [m for item in obj for m in _labelled(item)]
    if not isinstance(obj, dict):
        return []
    found = (
        [obj["metadata"]] if isinstance(obj.get("metadata"), dict) and obj["metadata"].get("labels") else []
    )
    return found + [m for key, value in obj.items() if key != "metadata" for m in _labelled(value)]


def child_problems(obj: Mapping[str, Any]) -> list[str]:
    """What the API server would refuse in a child the operator creates: its name, labels and size."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    problems = []
    longest = MAX_LABEL_VALUE if kind == "Job" else MAX_OBJECT_NAME
    if len(name) > longest or not _DNS_SUBDOMAIN.fullmatch(name):
        problems.append(
            f"{kind} {name}: not a valid name (a DNS-1123 subdomain of at most {longest} characters)"
        )
    for meta in _labelled(obj):
        for key, value in meta["labels"].items():
            if len(str(value)) > MAX_LABEL_VALUE or not _LABEL_VALUE.fullmatch(str(value)):
                problems.append(
                    f"{kind} {name}: label {key}={value!r} is not a label value (at most {MAX_LABEL_VALUE} "
                    "letters, digits, '-', '_' or '.', starting and ending with a letter or digit): change "
                    "the field it comes from"
                )
    if kind == "ConfigMap":
        size = sum(len(k.encode()) + len(v.encode()) for k, v in obj.get("data", {}).items())
        if size > MAX_CONFIG_MAP_BYTES:
            problems.append(
                f"ConfigMap {name}: {size} bytes of data, over Kubernetes' {MAX_CONFIG_MAP_BYTES} (1 MiB): "
                "shorten the spec it carries (its source paths and maps, say)"
            )
    return problems


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMaps' config files) as literal blocks, readable in a review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objects: Sequence[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=110)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="packtrain render",
        description="Print, as multi-document YAML, every object the operator would create for the "
        "PackJobs and SFTJobs in FILE, with the settings the chart gives it. Other objects in FILE are "
        "printed unchanged first; an SFTJob is rendered as if its PackJob had succeeded.",
    )
    ap.add_argument("file", type=Path, metavar="FILE.yaml", help="PackJobs and SFTJobs (multi-document YAML)")
    ap.add_argument(
        "-f", "--values", type=Path, action="append", default=[], metavar="VALUES.yaml",
        help="chart values merged over the chart's values.yaml, as `helm -f` does (repeatable; "
        "default: none)",
    )  # fmt: skip
    ap.add_argument("--chart", type=Path, default=CHART, help="the chart folder (default: %(default)s)")
    ap.add_argument(
        "-n", "--namespace", help="namespace of the objects (default: each manifest's, else default)"
    )
    ap.add_argument(
        "--pack-claim", type=pack_claim, metavar="CLAIM[:SUBPATH]",
        help="for an SFTJob whose PackJob is not in FILE: render it as if that PackJob had written its pack "
        "to this claim (mounted at /data), under SUBPATH (default: the PackJob's name)",
    )  # fmt: skip
    ap.add_argument(
        handoff.ALLOW_UNMOUNTED, action="store_true",
        help="render a spec whose paths lie on no claim its pods mount, with a warning (default: refuse it, "
        "exit 2): for paths the image or the nodes provide",
    )  # fmt: skip
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    notes: list[str] = []  # warnings and notes, said before an error too
    try:
        values, app_version = chart_values(args.chart, args.values)
        defaults = OperatorDefaults.from_env(operator_env(values, app_version))
        objects = render(args.file, defaults, args.namespace, args.pack_claim, args.allow_unmounted, notes)
    except (KeyError, TypeError) as exc:
        print(
            f"packtrain render: the values lack the chart's key {exc}: check them against "
            f"{args.chart / 'values.yaml'}",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    except OSError as exc:
        print(f"packtrain render: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_CONFIG
    except ValueError as exc:
        _say(notes)
        print(f"packtrain render: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    _say(notes)
    sys.stdout.write(dump(objects))
    return 0


def _say(notes: Sequence[str]) -> None:
    for note in notes:
        print(f"packtrain render: {note}", file=sys.stderr)
