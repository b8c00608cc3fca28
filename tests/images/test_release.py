"""The release workflow (it cannot run here: it needs GitHub's runners and a registry) is linted with
actionlint, built from the Go module proxy into the cache, and agrees with the chart it publishes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from chart.helm import render

from .conftest import REPO

WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
ACTIONLINT = "github.com/rhysd/actionlint/cmd/actionlint"
ACTIONLINT_VERSION = "v1.7.7"


@pytest.fixture(scope="module")
def actionlint() -> Path:
    cache = Path(os.environ.get("PACKTRAIN_CACHE_DIR") or Path.home() / ".cache" / "packtrain")
    bin_dir = cache / "tools" / f"actionlint-{ACTIONLINT_VERSION}"
    binary = bin_dir / "actionlint"
    if binary.is_file():
        return binary
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").is_file() else None)
    if go is None:
        pytest.skip("SKIPPED LOUDLY: no `go` command to build actionlint from the Go module proxy")
    env = {
        **os.environ,
        "GOBIN": str(bin_dir),
        "GOMODCACHE": str(cache / "go" / "mod"),
        "GOCACHE": str(cache / "go" / "build"),
        "GOFLAGS": "-mod=mod",
    }
    proc = subprocess.run(
        [go, "install", f"{ACTIONLINT}@{ACTIONLINT_VERSION}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"building actionlint failed:\n{proc.stderr[-3000:]}"
    return binary


def test_release_workflow_passes_actionlint(actionlint: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(actionlint), str(WORKFLOW)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # It does find problems: a job without runs-on, an unknown expression context.
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  x:\n    steps:\n      - run: echo ${{ nope.value }}\n")
    proc = subprocess.run(
        [str(actionlint), str(bad)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode != 0 and "runs-on" in proc.stdout


def test_release_pushes_what_the_chart_deploys_by_default() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    registry = workflow["env"]["REGISTRY"]
    images = workflow["jobs"]["images"]["strategy"]["matrix"]["image"]
    assert sorted(images) == ["operator", "packer", "trainer"]
    build = next(
        s
        for s in workflow["jobs"]["images"]["steps"]
        if str(s.get("uses", "")).startswith("docker/build-push-action")
    )
    assert build["with"]["platforms"] == "linux/amd64,linux/arm64"
    assert "BASE_IMAGE" not in build["with"]["build-args"], "a release builds on the Dockerfiles' public base"
    app_version = yaml.safe_load((REPO / "charts" / "packtrain" / "Chart.yaml").read_text())["appVersion"]
    deployment = next(o for o in render() if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == f"{registry}/operator:{app_version}"
    assert env["PACKTRAIN_PACKER_IMAGE"] == f"{registry}/packer:{app_version}"
    assert env["PACKTRAIN_TRAINER_IMAGE"] == f"{registry}/trainer:{app_version}"
