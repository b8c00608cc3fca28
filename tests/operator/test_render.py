"""`packtrain render`: the operator's own builders, with the settings the chart gives the operator, policy
first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart.helm import CHART
from chart.helm import render as helm_render
from helm_python.errors import HelmValuesError

from packtrain.core.contract import PACK_STAGES
from packtrain.core.errors import EXIT_CONFIG
from packtrain.operator import builders, cli, render
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.settings import OperatorDefaults

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
# The quickstart's relative ../shared paths are for `packtrain run`: render names them as paths no pod
# volume holds, and this flag renders it regardless (tests/operator/test_render_handoff.py checks that).
LOCAL_PATHS = "--allow-unmounted"

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "custom": {
        "workloadImages": {
            "packer": {"repository": "registry.example.com/pt/packer", "tag": "2"},
            "trainer": {"repository": "registry.example.com/pt/trainer"},
        },
        "pools": {
            "cpu": {
                "nodeSelector": {"pool": "batch"},
                "tolerations": [{"key": "batch", "operator": "Exists"}],
                "resources": {"requests": {"cpu": "3", "memory": "5Gi"}},
            },
            "gpu": {"nodeSelector": {"packtrain.dev/pool": None, "gpu": "h100"}, "tolerations": []},
        },
        "workloadSecurityContext": {"runAsUser": 1234},
        "policy": {
            "allowedImages": ["registry.example.com/*"],
            "allowTolerations": True,
            "maxPackWorkers": 4,
        },
    },
}


def deployment_env(values: dict[str, Any]) -> dict[str, Any]:
    deployment = next(o for o in helm_render(values) if o["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if e["name"].startswith("PACKTRAIN_")}


def parsed(env: dict[str, str]) -> dict[str, Any]:
    return {k: json.loads(v) if v[:1] in "[{" else v for k, v in env.items()}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_operator_env_is_what_the_chart_gives_the_operator(name: str, tmp_path: Path) -> None:
    """render's values → environment mirrors templates/deployment.yaml, for defaults and overrides alike."""
    override = tmp_path / "values.yaml"
    override.write_text(yaml.safe_dump(VALUE_SETS[name]))
    values, app_version = render.chart_values(CHART, [override])
    assert parsed(render.operator_env(values, app_version)) == parsed(deployment_env(VALUE_SETS[name]))


def expected_quickstart(defaults: OperatorDefaults) -> list[dict[str, Any]]:
    """What the operator's builders make of the quickstart (its SFTJob as if the PackJob succeeded)."""
    pack_doc, sft_doc = yaml.safe_load_all(QUICKSTART.read_text())
    pack = PackJobSpec.model_validate(pack_doc["spec"])
    sft = SFTJobSpec.model_validate(sft_doc["spec"])
    name, ns = "quickstart", "default"
    data = builders.data_source(sft, pack, None)
    return [
        builders.pack_config_map(name, ns, pack),
        *(builders.pack_job(name, ns, pack, stage, defaults) for stage in PACK_STAGES),
        builders.train_config_map(name, ns, sft, data),
        builders.training_job(name, ns, sft, data, defaults),
    ]


def test_quickstart_renders_what_the_builders_produce(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["render", str(QUICKSTART), LOCAL_PATHS]) == 0
    out = capsys.readouterr().out
    defaults = OperatorDefaults.from_env(deployment_env({}))
    assert list(yaml.safe_load_all(out)) == expected_quickstart(defaults)
    assert "packjob.yaml: |" in out  # config files stay readable
    kinds = [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out)]
    assert kinds[-1] == ("PyTorchJob", "quickstart")


def hostile(tmp_path: Path) -> Path:
    docs = list(yaml.safe_load_all(QUICKSTART.read_text()))
    docs[0]["spec"]["workers"]["image"] = "evil.example.com/miner:1"
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def test_a_spec_the_policy_refuses_exits_2_naming_field_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["render", str(hostile(tmp_path))]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == ""  # nothing half-rendered to pipe into kubectl
    assert "PackJob quickstart refused" in err
    assert 'spec.workers.image "evil.example.com/miner:1"' in err and "policy.allowedImages" in err


def test_values_that_allow_it_render_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = tmp_path / "allow.yaml"
    values.write_text("policy:\n  allowedImages: ['evil.example.com/*']\n")
    assert cli.main(["render", str(hostile(tmp_path)), "--values", str(values), LOCAL_PATHS]) == 0
    jobs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d["kind"] == "Job"]
    assert {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in jobs} == {
        "evil.example.com/miner:1"
    }


def test_values_override_the_chart_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VALUE_SETS["custom"]))
    assert cli.main(["render", str(QUICKSTART), "-f", str(values), "-n", "team-a", LOCAL_PATHS]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    convert = next(d for d in docs if d["metadata"]["name"] == "quickstart-convert")
    pod = convert["spec"]["template"]["spec"]
    assert convert["metadata"]["namespace"] == "team-a"
    assert pod["containers"][0]["image"] == "registry.example.com/pt/packer:2"
    assert pod["nodeSelector"] == {"packtrain.dev/pool": "cpu", "pool": "batch"}  # maps merge, as in Helm
    train = next(d for d in docs if d["kind"] == "PyTorchJob")
    # The quickstart trains without GPUs (gpusPerNode: 0): on the CPU pool, with its requests.
    master = train["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert master["nodeSelector"] == {"packtrain.dev/pool": "cpu", "pool": "batch"}
    assert master["tolerations"] == [{"key": "batch", "operator": "Exists"}]
    assert master["containers"][0]["resources"]["requests"] == {"cpu": "3", "memory": "5Gi"}


def test_deep_merge_is_helms() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1, "e": {"f": 1}}
    assert render.deep_merge(base, {"a": {"c": [3]}, "d": None, "e": {"g": 2}}) == {
        "a": {"b": 1, "c": [3]},
        "e": {"f": 1, "g": 2},
    }


def test_configuration_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_values = tmp_path / "bad.yaml"
    bad_values.write_text("policy:\n  allowTolerance: true\n")
    assert cli.main(["render", str(QUICKSTART), "--values", str(bad_values)]) == EXIT_CONFIG
    assert "'allowTolerance' was unexpected" in capsys.readouterr().err
    assert cli.main(["render", str(tmp_path / "missing.yaml")]) == EXIT_CONFIG
    assert cli.main(["render", str(QUICKSTART), "--chart", str(tmp_path)]) == EXIT_CONFIG
    assert "pass --chart" in capsys.readouterr().err


def test_render_loads_neither_kopf_nor_kubernetes_nor_torch(tmp_path: Path) -> None:
    out = tmp_path / "out.yaml"
    code = (
        "import sys, contextlib, io; from packtrain.operator import cli; buf = io.StringIO()\n"
        f"argv = ['render', {str(QUICKSTART)!r}, {LOCAL_PATHS!r}]\n"
        "with contextlib.redirect_stdout(buf): rc = cli.main(argv)\n"
        f"open({str(out)!r}, 'w').write(buf.getvalue())\n"
        "bad = [m for m in ('kopf', 'kubernetes', 'torch') if m in sys.modules]; assert rc == 0 and not "
        "bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert "kind: PyTorchJob" in out.read_text()


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"pools": {"cpu": 3}}, "at pools.cpu: 3 is not of type 'object'"),
        ({"policy": None}, "'policy' is a required property"),
        ({"policy": {"maxGpusPerNode": "8"}}, "at policy.maxGpusPerNode: '8' is not of type 'integer'"),
        (
            {"policy": {"allowTolerance": True}},
            "at policy: Additional properties are not allowed ('allowTolerance'",
        ),
    ],
)
def test_values_helm_refuses_exit_2_naming_the_key(
    values: dict[str, Any], where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The chart's values.schema.json, as Helm applies it: no traceback, no manifest Helm would not render."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    assert cli.main(["render", str(QUICKSTART), "--values", str(path)]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == "" and where in err and "values.schema.json" in err, err
    assert "Traceback" not in err
    with pytest.raises(HelmValuesError, match="schema"):  # helm template refuses the same values
        helm_render(values)


def _sft_only(tmp_path: Path) -> Path:
    _, sft = yaml.safe_load_all(QUICKSTART.read_text())
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(sft))
    return path


def test_an_sftjob_whose_packjob_is_elsewhere_needs_pack_claim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _sft_only(tmp_path)
    assert cli.main(["render", str(path)]) == EXIT_CONFIG
    assert "pass --pack-claim CLAIM[:SUBPATH]" in capsys.readouterr().err
    assert cli.main(["render", str(path), "--pack-claim", "team-data:packs/qs", LOCAL_PATHS]) == 0
    (config, job) = yaml.safe_load_all(capsys.readouterr().out)
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    data = next(v for v in pod["volumes"] if v["name"] == "data")
    assert data["persistentVolumeClaim"] == {"claimName": "team-data", "readOnly": True}
    assert yaml.safe_load(config["data"]["sftjob.yaml"])["spec"]["data"]["path"] == "/data/packs/qs"
    # Without SUBPATH the pack is under the PackJob's name, as the PackJob's own default.
    assert cli.main(["render", str(path), "--pack-claim", "team-data", LOCAL_PATHS]) == 0
    (config, _) = yaml.safe_load_all(capsys.readouterr().out)
    assert yaml.safe_load(config["data"]["sftjob.yaml"])["spec"]["data"]["path"] == "/data/quickstart"


def test_other_objects_are_printed_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "packtrain-data"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}},
    }
    path = tmp_path / "with-claim.yaml"
    path.write_text(yaml.safe_dump_all([claim, *yaml.safe_load_all(QUICKSTART.read_text())], sort_keys=False))
    assert cli.main(["render", str(path), LOCAL_PATHS]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    defaults = OperatorDefaults.from_env(deployment_env({}))
    assert docs == [claim, *expected_quickstart(defaults)]


def _quickstart_with(
    tmp_path: Path, pack: dict[str, Any], sft: dict[str, Any], name: str = "qs.yaml"
) -> Path:
    """The quickstart with `pack` and `sft` merged over its PackJob and SFTJob documents."""
    docs = [
        render.deep_merge(doc, change)
        for doc, change in zip(yaml.safe_load_all(QUICKSTART.read_text()), (pack, sft), strict=True)
    ]
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return path


def _renamed(tmp_path: Path, pack_name: str, sft_name: str) -> Path:
    return _quickstart_with(
        tmp_path,
        {"metadata": {"name": pack_name}},
        {"metadata": {"name": sft_name}, "spec": {"data": {"packJobRef": pack_name}}},
    )


def test_names_the_api_server_refuses_exit_2_one_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CRD's 45-character rule and the DNS forms the children's names need, checked before rendering."""
    longest = "a" * 45
    assert cli.main(["render", str(_renamed(tmp_path, longest, longest)), LOCAL_PATHS]) == 0
    assert all(
        line.startswith("packtrain render: warning: ") for line in capsys.readouterr().err.splitlines()
    )
    assert cli.main(["render", str(_renamed(tmp_path, longest + "b", "Team.Run"))]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.removeprefix("packtrain render: ").splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith(
        f"PackJob {longest}b: metadata.name has 46 characters; shorten it to at most 45"
    )
    assert lines[1].startswith("SFTJob 'Team.Run': metadata.name must be lowercase letters, digits and '-'")
    # A digit may start a pod hostname but not a Service name, which the training operator derives.
    assert cli.main(["render", str(_renamed(tmp_path, "1pack", "1sft"))]) == EXIT_CONFIG
    lines = capsys.readouterr().err.removeprefix("packtrain render: ").splitlines()
    assert lines == [
        "SFTJob 1sft: metadata.name must start with a letter: the training operator names Services after "
        "it, and a Service name is a DNS-1035 label"
    ]


def test_a_child_the_api_server_refuses_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A queue name that is no label value, and a ConfigMap over 1 MiB, are refused before kubectl sees
    them."""
    queue = _quickstart_with(tmp_path, {}, {"spec": {"queueName": "team a"}})
    assert cli.main(["render", str(queue)]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    assert "PyTorchJob quickstart: label kueue.x-k8s.io/queue-name='team a' is not a label value" in err
    paths = [f"/data/{'x' * 1000}/{n}.json" for n in range(1100)]
    big = _quickstart_with(tmp_path, {"spec": {"source": {"paths": paths}}}, {})
    assert cli.main(["render", str(big)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "ConfigMap quickstart-pack-config: " in err and "over Kubernetes' 1048576 (1 MiB)" in err
    fits = _quickstart_with(tmp_path, {"spec": {"source": {"paths": paths[:900]}}}, {})
    assert cli.main(["render", str(fits), LOCAL_PATHS]) == 0


def test_crd_ceilings_are_checked_through_the_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pydantic models the CRDs are generated from refuse what the API server's schema would."""
    volumes = [{"name": f"v{n}", "claimName": "c", "mountPath": f"/mnt/v{n}"} for n in range(17)]
    path = _quickstart_with(tmp_path, {"spec": {"volumes": volumes}}, {})
    assert cli.main(["render", str(path)]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == "" and "PackJob quickstart is invalid" in err and "spec.volumes" in err.replace("\n", " ")
