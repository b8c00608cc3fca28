"""What a Git edit of a job does when Argo CD syncs it, on the local cluster with the real operator.

The sync is Argo CD's own engine: ``gitops-sync`` (tests/e2e/gitops, built by its build.sh from
``github.com/argoproj/gitops-engine`` at the version Argo CD v3.2 pins) reads a folder of
manifests, the stand-in for the Git repository, and runs ``engine.Sync`` on it, which honours each
manifest's ``argocd.argoproj.io/sync-options`` and prunes tracked objects that left the folder, as
an Argo CD Application would. What it does not run is Argo CD's application controller (refresh,
auto-sync, retries) or its UI; a sync here is one "Sync" button press.

Each test is one application in a namespace of its own, and a series of commits to its folder:

- ``suspend`` is the one mutable field: a commit that releases a suspended SFTJob syncs in place;
- an edit of any other field (``spec.packing.maxLength``): a plain sync fails with the API server's
  immutability message and changes nothing; ``Replace=true`` alone fails the same way;
- ``Force=true,Replace=true``: the job is deleted and re-created, its old children are
  garbage-collected, and the new one runs anew: a PackJob every stage with the new maximum length,
  an SFTJob a new PyTorchJob that continues from the checkpoints the old one left on the claim;
- name by content: a new PackJob (and, since ``data.packJobRef`` is immutable too, a new SFTJob)
  runs beside the old ones until a sync with pruning deletes the old ones and their children.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster.controlplane import ClusterUnavailable
from cluster.fixture import built_or_skip
from e2e_harness import GROUP, REPO, VERSION, Harness, free_port, quickstart_docs, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BUILD = REPO / "tests" / "e2e" / "gitops" / "build.sh"
APP = "train"
SYNC_OPTIONS = "argocd.argoproj.io/sync-options"
REPLACE = "Force=true,Replace=true"
DATA_CLAIM = "packtrain-data"
PACK_TIMEOUT = 300
TRAIN_TIMEOUT = 480
# The message of the CRDs' immutability rules (operator/api/common.py), as the API server returns it.
IMMUTABLE = "spec.{field} is immutable: delete the {kind} and create it again to change it"


def _build_gitops_sync() -> Path:
    """Run build.sh, which rebuilds ``gitops-sync`` when main.go, go.mod, go.sum or Go changed (a
    few minutes) and otherwise only compares its stamp, so a test never runs a stale binary."""
    res = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True)
    if res.returncode == 0:
        return Path(res.stdout.strip().splitlines()[-1])
    why = res.stderr.strip().splitlines()[-1:] or [f"exit {res.returncode}"]
    # Exit 3: building is impossible here (no go command, no module proxy), recorded in UNAVAILABLE.
    raise ClusterUnavailable(
        f"gitops-sync cannot be built: {why[0]} (`bash {BUILD.relative_to(REPO)}`)",
        impossible=res.returncode == 3,
    )


@pytest.fixture(scope="module")
def gitops_sync(request: pytest.FixtureRequest) -> Path:
    """The ``gitops-sync`` binary, up to date with its sources (CI builds it ahead in ``.ci/run``)."""
    return built_or_skip(_build_gitops_sync, "GITOPS TESTS", request.config)


@dataclass
class Sync:
    """One sync's outcome: gitops-sync's exit status and the per-resource results Argo CD would show."""

    rc: int
    resources: list[dict[str, str]]
    error: str

    def result(self, kind: str, name: str) -> dict[str, str]:
        return next(r for r in self.resources if (r["kind"], r["name"]) == (kind, name))


@dataclass
class Repo:
    """An application's folder in "Git": each commit replaces its manifests; each sync applies them."""

    h: Harness
    binary: Path
    folder: Path
    ns: str
    # The SFTJobs' metricsPort, not the default: other runs on this machine may hold it.
    metrics_port: int = field(default_factory=free_port)
    transcript: list[str] = field(default_factory=list)

    def commit(self, message: str, *docs: dict[str, Any]) -> None:
        (self.folder / "jobs.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
        self.transcript.append(f"# commit: {message}")

    def sync(self, prune: bool = False) -> Sync:
        args = [
            str(self.binary),
            "--kubeconfig",
            str(self.h.cp.kubeconfig),
            "--namespace",
            self.ns,
            "--app",
            APP,
        ]
        res = subprocess.run(
            [*args, *(["--prune"] if prune else []), str(self.folder)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode in (0, 1), f"gitops-sync failed to run:\n{res.stderr[-4000:]}"
        out = json.loads(res.stdout)
        sync = Sync(res.returncode, out["resources"], out.get("error", ""))
        self.transcript.append(f"$ gitops-sync{' --prune' if prune else ''}  -> exit {sync.rc} {sync.error}")
        self.transcript += [
            f"  {r['kind']}/{r['name']}: {r['status']}: {' / '.join(r['message'].splitlines())}"
            for r in sync.resources
        ]
        return sync

    def diagnostics(self) -> str:
        return "\n".join(self.transcript) + "\n" + self.h.diagnostics(self.ns)

    def wait_phase(self, plural: str, name: str, phases: tuple[str, ...], timeout: float) -> str:
        return self.h.wait_phase(plural, self.ns, name, phases, timeout)

    def get(self, plural: str, name: str) -> dict[str, Any]:
        return self.h.get(plural, self.ns, name)


@pytest.fixture()
def new_repo(
    e2e: Harness, gitops_sync: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[[str], Repo]]:
    """``new_repo(ns)``: a namespace with the quickstart's claims and an empty application folder."""
    repos: list[Repo] = []

    def make(ns: str) -> Repo:
        e2e.namespace_with_claims(ns)
        folder = tmp_path / ns
        folder.mkdir()
        repos.append(Repo(e2e, gitops_sync, folder, ns))
        return repos[-1]

    yield make
    with capsys.disabled():
        for r in repos:
            print(f"\n[{r.ns}]\n" + "\n".join(r.transcript))


def packjob(name: str, max_length: int, sync_options: str | None = None) -> dict[str, Any]:
    """The quickstart's PackJob on its text chats only (a pack in seconds), one convert worker."""
    doc = next(d for d in quickstart_docs() if d["kind"] == "PackJob")
    doc["metadata"] = {
        "name": name,
        **({"annotations": {SYNC_OPTIONS: sync_options}} if sync_options else {}),
    }
    doc["spec"]["source"] = {"paths": ["../shared/datasets/text-sft/fastchat/*.json"]}
    doc["spec"]["packing"]["maxLength"] = max_length
    doc["spec"]["workers"] = {"count": 1}
    return doc


def sftjob(repo: Repo, name: str, pack: str, suspend: bool) -> dict[str, Any]:
    """The quickstart's tiny SFTJob, two steps long."""
    doc = next(d for d in quickstart_docs() if d["kind"] == "SFTJob")
    doc["metadata"] = {"name": name}
    doc["spec"]["data"]["packJobRef"] = pack
    doc["spec"]["metricsPort"] = repo.metrics_port
    doc["spec"]["training"].update(maxSteps=2, warmup=1, checkpointEvery=2)
    doc["spec"]["suspend"] = suspend
    return doc


def names(repo: Repo, plural: str) -> list[str]:
    """Names of the namespace's objects of one of packtrain's kinds."""
    items = repo.h.custom.list_namespaced_custom_object(GROUP, VERSION, repo.ns, plural)["items"]
    return sorted(o["metadata"]["name"] for o in items)


def owned(repo: Repo, owner_uid: str) -> list[str]:
    """Kind/name of the namespace's Jobs, ConfigMaps and PyTorchJobs whose owner has this uid."""
    h, ns = repo.h, repo.ns
    objs = [
        ("Job", j.metadata.name, j.metadata.owner_references) for j in h.batch.list_namespaced_job(ns).items
    ]
    objs += [
        ("ConfigMap", c.metadata.name, c.metadata.owner_references)
        for c in h.core.list_namespaced_config_map(ns).items
    ]
    owners = lambda m: [o.get("uid") for o in m.get("ownerReferences") or []]  # noqa: E731
    pytorchjobs = h.custom.list_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs")["items"]
    return sorted(
        [f"{kind}/{name}" for kind, name, refs in objs if any(o.uid == owner_uid for o in refs or [])]
        + [f"PyTorchJob/{p['metadata']['name']}" for p in pytorchjobs if owner_uid in owners(p["metadata"])]
    )


def pack_max_length(repo: Repo, folder: str) -> int:
    """``max_length`` in the manifest the PackJob's pods wrote for the pack in `folder` on the data claim."""
    return int(
        json.loads((repo.h.pvc_dir(repo.ns, DATA_CLAIM) / folder / "manifest.json").read_text())["max_length"]
    )


def ready(repo: Repo, plural: str, name: str) -> dict[str, str]:
    """The object's Ready condition."""
    return next(c for c in repo.get(plural, name)["status"]["conditions"] if c["type"] == "Ready")


def force_replace(repo: Repo, message: str, kind: str, name: str, *docs: dict[str, Any]) -> str:
    """Commit `docs` (the job among them annotated Force=true,Replace=true) and sync: Argo CD deletes
    and re-creates the job. Returns the new object's uid once the old one's children are gone."""
    plural = f"{kind.lower()}s"
    old_uid = repo.get(plural, name)["metadata"]["uid"]
    repo.commit(message, *docs)
    replaced = repo.sync()
    assert replaced.rc == 0 and replaced.result(kind, name)["status"] == "Synced", repo.diagnostics()
    assert "replaced" in replaced.result(kind, name)["message"]
    new_uid = str(repo.get(plural, name)["metadata"]["uid"])
    assert new_uid != old_uid
    wait_for(
        f"the old {kind}'s children to be garbage-collected",
        lambda: not owned(repo, old_uid),
        timeout=60,
        diagnostics=repo.diagnostics,
    )
    return new_uid


def run_pack(repo: Repo, *docs: dict[str, Any]) -> Sync:
    """Commit and sync `docs` into an empty namespace; wait for the first (a PackJob) to succeed."""
    repo.commit(f"create {', '.join(d['metadata']['name'] for d in docs)}", *docs)
    sync = repo.sync()
    assert sync.rc == 0 and {r["status"] for r in sync.resources} == {"Synced"}, repo.diagnostics()
    name = docs[0]["metadata"]["name"]
    assert repo.wait_phase("packjobs", name, ("Succeeded", "Failed"), PACK_TIMEOUT) == "Succeeded", (
        repo.diagnostics()
    )
    return sync


def test_suspend_is_synced_in_place(new_repo: Callable[[str], Repo]) -> None:
    repo = new_repo("gitops-suspend")
    run_pack(repo, packjob("pack", 1024), sftjob(repo, "train", "pack", suspend=True))
    assert repo.wait_phase("sftjobs", "train", ("Suspended",), 120) == "Suspended"
    before = repo.get("sftjobs", "train")["metadata"]

    repo.commit("release the training", packjob("pack", 1024), sftjob(repo, "train", "pack", suspend=False))
    released = repo.sync()
    assert released.rc == 0 and released.result("SFTJob", "train")["status"] == "Synced", repo.diagnostics()
    after = repo.get("sftjobs", "train")["metadata"]
    assert (after["uid"], after["generation"]) == (before["uid"], before["generation"] + 1)
    assert repo.wait_phase("sftjobs", "train", ("Succeeded", "Failed"), TRAIN_TIMEOUT) == "Succeeded", (
        repo.diagnostics()
    )


def test_an_edit_of_an_immutable_field_fails_to_sync_and_changes_nothing(
    new_repo: Callable[[str], Repo],
) -> None:
    repo = new_repo("gitops-refused")
    run_pack(repo, packjob("pack", 1024))
    old = repo.get("packjobs", "pack")
    children = owned(repo, old["metadata"]["uid"])
    assert len(children) == 4 and pack_max_length(repo, "pack") == 1024, children  # 3 stage Jobs, 1 ConfigMap
    for options in (None, "Replace=true"):
        repo.commit(f"maxLength 2048, sync-options {options}", packjob("pack", 2048, options))
        refused = repo.sync()
        assert refused.rc == 1 and refused.result("PackJob", "pack")["status"] == "SyncFailed", (
            repo.diagnostics()
        )
        assert (
            IMMUTABLE.format(field="packing", kind="PackJob") in refused.result("PackJob", "pack")["message"]
        )
        live = repo.get("packjobs", "pack")
        assert live["metadata"]["uid"] == old["metadata"]["uid"]
        assert live["metadata"]["generation"] == old["metadata"]["generation"]
        assert live["spec"]["packing"]["maxLength"] == 1024 and live["status"]["phase"] == "Succeeded"
        assert owned(repo, old["metadata"]["uid"]) == children


def test_force_replace_recreates_the_job_from_scratch(new_repo: Callable[[str], Repo]) -> None:
    repo = new_repo("gitops-replace")
    run_pack(repo, packjob("pack", 1024))
    children = owned(repo, repo.get("packjobs", "pack")["metadata"]["uid"])

    # The new PackJob runs its stages anew, but the pack folder on the claim (by default the
    # PackJob's name) outlives the object, and the packer will not write a pack of another
    # configuration over it: the edit fails, saying so, and the old pack is left intact.
    force_replace(
        repo, "maxLength 2048 with Force=true,Replace=true", "PackJob", "pack", packjob("pack", 2048, REPLACE)
    )
    assert repo.wait_phase("packjobs", "pack", ("Succeeded", "Failed"), PACK_TIMEOUT) == "Failed", (
        repo.diagnostics()
    )
    refused = ready(repo, "packjobs", "pack")
    assert refused["reason"] == "InvalidConfiguration", refused
    assert "already holds a pack made with a different configuration" in refused["message"], refused
    assert pack_max_length(repo, "pack") == 1024

    # So the edit names a new folder as well; then the re-created PackJob packs with the new length.
    edited = packjob("pack", 2048, REPLACE)
    edited["spec"]["output"]["subPath"] = "pack-2048"
    new_uid = force_replace(
        repo, "maxLength 2048 into subPath pack-2048, Force=true,Replace=true", "PackJob", "pack", edited
    )
    assert repo.wait_phase("packjobs", "pack", ("Succeeded", "Failed"), PACK_TIMEOUT) == "Succeeded", (
        repo.diagnostics()
    )
    assert repo.get("packjobs", "pack")["status"]["outputPath"] == "/data/pack-2048"
    assert pack_max_length(repo, "pack-2048") == 2048 and pack_max_length(repo, "pack") == 1024
    assert owned(repo, new_uid) == children  # every stage ran again, under the new object


def test_force_replace_retrains_an_sftjob(new_repo: Callable[[str], Repo]) -> None:
    repo = new_repo("gitops-retrain")
    train = sftjob(repo, "train", "pack", suspend=False)
    train["metadata"]["annotations"] = {SYNC_OPTIONS: REPLACE}
    run_pack(repo, packjob("pack", 1024), train)
    assert repo.wait_phase("sftjobs", "train", ("Succeeded", "Failed"), TRAIN_TIMEOUT) == "Succeeded", (
        repo.diagnostics()
    )
    children = owned(repo, repo.get("sftjobs", "train")["metadata"]["uid"])
    assert "PyTorchJob/train" in children

    train["spec"]["training"]["maxSteps"] = 3
    new_uid = force_replace(
        repo, "maxSteps 3 with Force=true,Replace=true", "SFTJob", "train", packjob("pack", 1024), train
    )
    assert repo.wait_phase("sftjobs", "train", ("Succeeded", "Failed"), TRAIN_TIMEOUT) == "Succeeded", (
        repo.diagnostics()
    )
    assert owned(repo, new_uid) == children, repo.diagnostics()  # a new PyTorchJob trained the new spec
    progress = repo.get("sftjobs", "train")["status"]["progress"]
    assert (progress["step"], progress["maxSteps"]) == (3, 3), progress
    # Same name, same checkpoint folder: the new job continues from the old one's newest checkpoint
    # (training.resume, on by default) rather than from step 0.
    logs = sorted(repo.h.pod_dir(repo.ns, "train-master-0").glob("*.log"))
    summaries = [
        json.loads(line)
        for log in logs
        for line in log.read_text().splitlines()
        if line.startswith("{") and '"steps_this_run"' in line
    ]
    assert summaries and summaries[-1]["steps_this_run"] == 1 and summaries[-1]["resumed_from"], summaries


def test_name_by_content_runs_beside_the_old_job_until_pruned(new_repo: Callable[[str], Repo]) -> None:
    repo = new_repo("gitops-rename")
    run_pack(repo, packjob("pack", 1024), sftjob(repo, "train", "pack", suspend=True))
    assert repo.wait_phase("sftjobs", "train", ("Suspended",), 120) == "Suspended"
    old = {
        kind: repo.get(plural, name)["metadata"]["uid"]
        for kind, plural, name in (("PackJob", "packjobs", "pack"), ("SFTJob", "sftjobs", "train"))
    }
    assert owned(repo, old["SFTJob"]) == ["ConfigMap/train-train-config", "PyTorchJob/train"]

    # Re-pointing the SFTJob at a new PackJob is itself an edit of an immutable field...
    repo.commit(
        "pack-v2, train re-pointed at it",
        packjob("pack-v2", 4096),
        sftjob(repo, "train", "pack-v2", suspend=False),
    )
    repointed = repo.sync()
    assert repointed.rc == 1 and repointed.result("SFTJob", "train")["status"] == "SyncFailed", (
        repo.diagnostics()
    )
    assert IMMUTABLE.format(field="data", kind="SFTJob") in repointed.result("SFTJob", "train")["message"]
    # ... so the SFTJob is named by content too. Without pruning the old jobs stay, beside the new ones.
    repo.commit(
        "pack-v2 and train-v2", packjob("pack-v2", 4096), sftjob(repo, "train-v2", "pack-v2", suspend=False)
    )
    beside = repo.sync()
    assert beside.rc == 0, repo.diagnostics()
    assert {beside.result(k, n)["status"] for k, n in (("PackJob", "pack"), ("SFTJob", "train"))} == {
        "PruneSkipped"
    }
    assert repo.wait_phase("packjobs", "pack-v2", ("Succeeded", "Failed"), PACK_TIMEOUT) == "Succeeded", (
        repo.diagnostics()
    )
    assert pack_max_length(repo, "pack-v2") == 4096 and pack_max_length(repo, "pack") == 1024
    assert repo.wait_phase("sftjobs", "train-v2", ("Succeeded", "Failed"), TRAIN_TIMEOUT) == "Succeeded", (
        repo.diagnostics()
    )
    assert all(owned(repo, uid) for uid in old.values())
    kept = {
        n: repo.get(p, n)["metadata"]["uid"] for p, n in (("packjobs", "pack-v2"), ("sftjobs", "train-v2"))
    }

    pruned = repo.sync(prune=True)
    assert pruned.rc == 0, repo.diagnostics()
    assert {pruned.result(k, n)["status"] for k, n in (("PackJob", "pack"), ("SFTJob", "train"))} == {
        "Pruned"
    }
    # Deletion is not instant: the jobs' finalizers and the garbage collector each take a turn.
    wait_for(
        "the pruned jobs and their children to be deleted",
        lambda: (
            not any(owned(repo, uid) for uid in old.values())
            and names(repo, "packjobs") == ["pack-v2"]
            and names(repo, "sftjobs") == ["train-v2"]
        ),
        timeout=60,
        diagnostics=repo.diagnostics,
    )
    for plural, name in (("packjobs", "pack-v2"), ("sftjobs", "train-v2")):
        live = repo.get(plural, name)
        assert live["metadata"]["uid"] == kept[name] and live["status"]["phase"] == "Succeeded"
