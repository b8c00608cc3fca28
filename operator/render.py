"""`packtrain render FILE.yaml [--values VALUES.yaml]`: the objects the operator would create, as YAML.

A reviewer reads what a PackJob or SFTJob turns into before it reaches a cluster, as
with `helm template`: the ConfigMaps, stage Jobs and training job come from the
operator's own builders, with the settings the chart hands the operator (its
Deployment's environment, computed here from the chart's values), and the chart's
`policy` is applied first. An SFTJob is rendered as if its PackJob had succeeded.
Children carry no ownerReferences: the operator adds them with the parent's uid.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from . import builders, policy
from .commands import EXIT_CONFIG, PACK_STAGES
from .local_run import load_documents

CHART = Path(__file__).resolve().parents[1] / "charts" / "packtrain"


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
        raise ValueError(f"no chart at {chart} (values.yaml missing): pass --chart, the charts/packtrain "
                         "folder of a packtrain checkout")
    values = _yaml_map(chart / "values.yaml")
    for path in overrides:
        values = deep_merge(values, _yaml_map(path))
    return values, str(_yaml_map(chart / "Chart.yaml").get("appVersion", ""))


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
    }
    for pool in ("cpu", "gpu"):
        settings = values["pools"][pool]
        env[f"PACKTRAIN_{pool.upper()}_NODE_SELECTOR"] = json.dumps(settings.get("nodeSelector") or {})
        env[f"PACKTRAIN_{pool.upper()}_TOLERATIONS"] = json.dumps(settings.get("tolerations") or [])
        env[f"PACKTRAIN_{pool.upper()}_RESOURCES"] = json.dumps(settings.get("resources") or {})
    identity = values["workloadSecurityContext"]
    for key, name in (("runAsUser", "RUN_AS_USER"), ("runAsGroup", "RUN_AS_GROUP"), ("fsGroup", "FS_GROUP")):
        env[f"PACKTRAIN_{name}"] = str(identity[key])
    return env


def render(path: Path, defaults: builders.OperatorDefaults, namespace: str | None = None) -> list[dict]:
    """Every child of every PackJob and SFTJob in `path`; ValueError naming what to fix."""
    packs, sfts = load_documents(path)
    refused = [
        policy.summary(f"{kind} {doc.name}", violations)
        for kind, docs in (("PackJob", packs), ("SFTJob", sfts))
        for doc in docs
        if (violations := policy.check(doc.spec, defaults))
    ]
    if refused:
        raise ValueError("\n".join(refused))
    objects: list[dict] = []
    pack_specs = {p.name: p.spec for p in packs}
    for p in packs:
        ns = namespace or p.namespace
        objects.append(builders.pack_config_map(p.name, ns, p.spec))
        objects += [builders.pack_job(p.name, ns, p.spec, stage, defaults) for stage in PACK_STAGES]
    for s in sfts:
        ns = namespace or s.namespace
        ref = s.spec.data.pack_job_ref
        data = builders.data_source(s.spec, pack_specs.get(ref) if ref else None, None)
        objects.append(builders.train_config_map(s.name, ns, s.spec, data))
        objects.append(builders.training_job(s.name, ns, s.spec, data, defaults))
    return objects


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMaps' config files) as literal blocks, readable in a review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objects: Sequence[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="packtrain render",
        description="Print, as multi-document YAML, every object the operator would create for the "
        "PackJobs and SFTJobs in FILE, with the settings the chart gives it.",
    )
    ap.add_argument("file", type=Path, metavar="FILE.yaml")
    ap.add_argument(
        "-f", "--values", type=Path, action="append", default=[], metavar="VALUES.yaml",
        help="chart values merged over the chart's values.yaml, as `helm -f` does (repeatable)",
    )  # fmt: skip
    ap.add_argument("--chart", type=Path, default=CHART, help="the chart folder (default: %(default)s)")
    ap.add_argument("-n", "--namespace", help="namespace of the objects (default: each manifest's, else default)")
    args = ap.parse_args(argv)
    try:
        values, app_version = chart_values(args.chart, args.values)
        defaults = builders.OperatorDefaults.from_env(operator_env(values, app_version))
        objects = render(args.file, defaults, args.namespace)
    except (KeyError, TypeError) as exc:
        print(f"packtrain render: the values lack the chart's key {exc}: check them against "
              f"{args.chart / 'values.yaml'}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        print(f"packtrain render: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_CONFIG
    except ValueError as exc:
        print(f"packtrain render: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(dump(objects))
    return 0
