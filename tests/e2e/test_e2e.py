"""End to end on the local cluster: `kubectl apply -f examples/quickstart.yaml`, real pods throughout.

The PackJob goes through real Jobs whose pods run the packer (Kubernetes' Job controller, the
scheduler, the node agent running the commands), the SFTJob through a real PyTorchJob that
Kubeflow's training-operator turns into pods that train the tiny model. Fault cases run in the
same harness: a convert worker killed mid-run, the operator killed mid-pipeline, corrupt media.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self
from unittest import mock

import pytest
import yaml
from e2e_harness import (
    GROUP,
    QUICKSTART,
    RESTRICTED,
    VERSION,
    Background,
    Harness,
    MetricsScraper,
    Recorder,
    convert_processes,
    free_port,
    free_trainer_port,
    metric,
    of_kind,
    quickstart_docs,
    table,
    wait_for,
)
from kubernetes import watch
from support.paths import DEMO

pytestmark = pytest.mark.cluster

NAME = "quickstart"
PACK_TIMEOUT = 300
TRAIN_TIMEOUT = 480


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pods_of(h: Harness, ns: str, selector: str) -> list[Any]:
    return sorted(
        h.core.list_namespaced_pod(ns, label_selector=selector).items,
        key=lambda p: p.metadata.creation_timestamp,
    )


def exit_codes(pods: list[Any]) -> list[int | None]:
    out: list[int | None] = []
    for p in pods:
        states = [c.state.terminated for c in p.status.container_statuses or []]
        out.append(states[0].exit_code if states and states[0] else None)
    return out


@dataclass
class QuickstartRun:
    ns: str
    seconds: float
    pack_phases: list[str]
    sft_phases: list[str]
    packjob: dict[str, Any]
    sftjob: dict[str, Any]
    pytorchjob: dict[str, Any]
    manifest_path: Path
    metrics: list[str]
    transcript: list[str]


@pytest.fixture(scope="module")
def quickstart(e2e: Harness) -> QuickstartRun:
    """The quickstart applied unchanged, watched until both jobs are done."""
    ns = "quickstart"
    e2e.namespace_with_claims(ns)
    port = free_trainer_port(of_kind(quickstart_docs(), "SFTJob"))
    t0 = time.monotonic()
    with Recorder(e2e, ns) as rec, MetricsScraper(port) as scraper:
        e2e.cp.kubectl("apply", "-n", ns, "-f", str(QUICKSTART))
        pack_phase = e2e.wait_phase("packjobs", ns, NAME, ("Succeeded", "Failed"), PACK_TIMEOUT)
        assert pack_phase == "Succeeded", e2e.diagnostics(ns)
        sft_phase = e2e.wait_phase("sftjobs", ns, NAME, ("Succeeded", "Failed"), TRAIN_TIMEOUT)
        assert sft_phase == "Succeeded", e2e.diagnostics(ns)
    seconds = time.monotonic() - t0
    packjob = e2e.get("packjobs", ns, NAME)
    sftjob = e2e.get("sftjobs", ns, NAME)
    child = sftjob["status"]["trainingJob"]["name"]
    pytorchjob = dict(e2e.custom.get_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", child))
    out = packjob["status"]["outputPath"]
    mount = packjob["spec"]["output"].get("mountPath", "/data")
    manifest = (
        e2e.pvc_dir(ns, packjob["spec"]["output"]["claimName"])
        / Path(out).relative_to(mount)
        / "manifest.json"
    )
    return QuickstartRun(
        ns,
        seconds,
        rec.sequence("packjobs", NAME),
        rec.sequence("sftjobs", NAME),
        packjob,
        sftjob,
        pytorchjob,
        manifest,
        scraper.samples,
        rec.transcript,
    )


def test_quickstart_end_to_end(
    e2e: Harness, quickstart: QuickstartRun, capsys: pytest.CaptureFixture[str]
) -> None:
    run, ns = quickstart, quickstart.ns
    diag = lambda: e2e.diagnostics(ns)  # noqa: E731

    # The PackJob went through every stage, through real Jobs and pods.
    assert run.pack_phases[-4:] == ["Converting", "Planning", "Materializing", "Succeeded"], (
        run.pack_phases,
        diag(),
    )
    for stage, count in (("convert", 2), ("plan", 1), ("materialize", 2)):
        job = e2e.batch.read_namespaced_job(f"{NAME}-{stage}", ns)
        assert job.status.succeeded == count, (stage, job.status, diag())
        pods = pods_of(e2e, ns, f"batch.kubernetes.io/job-name={NAME}-{stage}")
        assert [p.status.phase for p in pods] == ["Succeeded"] * count, (stage, diag())
        assert {p.spec.node_name for p in pods} == {"cpu-0"}

    # The pack is on the claim, and the status carries the packer's real numbers.
    status = run.packjob["status"]
    stats = status["stats"]
    manifest = json.loads(run.manifest_path.read_text())
    assert status["manifestDigest"] == f"sha256:{sha256(run.manifest_path)}"
    counts = manifest["counts"]
    assert stats["samplesIn"] == counts["input"] == stats["samplesPacked"] + stats["samplesRejected"]
    assert stats["samplesPacked"] == counts["packed"] > 0
    assert stats["samplesRejected"] == counts["rejected"] > 0  # llava-instruct-100's images are not shipped
    rejects = (run.manifest_path.parent / "rejects.jsonl").read_text().splitlines()
    assert len(rejects) == stats["samplesRejected"]
    assert stats["sequences"] == manifest["sequences"] and stats["tokens"] == manifest["tokens"]
    assert 0 < stats["fillRatio"] <= 1

    # All of it ran in a namespace enforcing the restricted Pod Security Standard, as non-root.
    assert e2e.core.read_namespace(ns).metadata.labels.items() >= RESTRICTED.items()
    for pod in pods_of(e2e, ns, "app.kubernetes.io/name=packtrain"):
        assert pod.spec.security_context.run_as_non_root and pod.spec.security_context.run_as_user, (
            pod.metadata.name
        )
        assert pod.spec.automount_service_account_token is False, pod.metadata.name
        for c in pod.spec.containers:
            assert c.security_context.allow_privilege_escalation is False, (pod.metadata.name, c.name)
            assert c.security_context.capabilities.drop == ["ALL"], (pod.metadata.name, c.name)
            assert c.resources.requests.get("cpu") and c.resources.requests.get("memory"), (
                pod.metadata.name,
                c.name,
            )

    # The SFTJob waited for the data, then ran through Kubeflow's own controller.
    assert run.sft_phases[0] == "WaitingForData" and run.sft_phases[-2:] == ["Running", "Succeeded"], (
        run.sft_phases,
        diag(),
    )
    conditions = {c["type"]: c["status"] for c in run.pytorchjob["status"]["conditions"]}
    assert conditions.get("Succeeded") == "True", run.pytorchjob["status"]
    master = pods_of(e2e, ns, "training.kubeflow.org/replica-type=master")
    assert len(master) == 1, diag()
    owner = master[0].metadata.owner_references[0]
    assert (owner.kind, owner.controller) == ("PyTorchJob", True)
    env = {e.name: e.value for e in master[0].spec.containers[0].env}
    assert env.get("PET_NNODES") and env.get("MASTER_ADDR"), env  # set by the training-operator
    assert master[0].spec.node_name == "cpu-0" and exit_codes(master) == [
        0
    ]  # gpusPerNode: 0 runs on the CPU pool
    progress = run.sftjob["status"]["progress"]
    max_steps = of_kind(quickstart_docs(), "SFTJob")["spec"]["training"]["maxSteps"]
    assert progress["step"] == max_steps and progress["loss"] > 0, run.sftjob["status"]
    checkpoints = e2e.pvc_dir(ns, "packtrain-checkpoints") / NAME
    assert any(checkpoints.iterdir()), f"no checkpoints in {checkpoints}"

    # The trainer's /metrics was scraped while it ran.
    assert run.metrics, f"the trainer's /metrics was never reachable\n{diag()}"
    steps = [metric(m, "packtrain_train_step") for m in run.metrics]
    assert any(s and s >= 1 for s in steps), run.metrics[-1]
    assert metric(run.metrics[-1], "packtrain_train_loss") is not None

    rows = [
        ("PackJob phases", " → ".join(run.pack_phases)),
        (
            "samples in / packed / rejected",
            f"{stats['samplesIn']} / {stats['samplesPacked']} / {stats['samplesRejected']}",
        ),
        ("sequences / shards / tokens", f"{stats['sequences']} / {stats['shards']} / {stats['tokens']}"),
        ("fill ratio / padding saved", f"{stats['fillRatio']} / {stats['paddingSaved']}"),
        ("SFTJob phases", " → ".join(run.sft_phases)),
        (
            "PyTorchJob",
            f"{run.pytorchjob['metadata']['name']}: Succeeded, pod {master[0].metadata.name} on "
            f"{master[0].spec.node_name}, created by the training-operator",
        ),
        (
            "steps / final loss / tokens/s",
            f"{progress['step']} / {progress['loss']:.4f} / {progress['tokensPerSecond']:.1f}",
        ),
        (
            "trainer /metrics",
            f"{len(run.metrics)} scrapes during the run, last packtrain_train_step {steps[-1]}",
        ),
        ("wall time (apply → SFTJob Succeeded)", f"{run.seconds:.0f} s"),
    ]
    with capsys.disabled():
        print(
            "\n\n".join(
                ["", "=== kubectl get packjobs,sftjobs during the quickstart run ===", *run.transcript]
            )
        )
        print("\n" + table(("quickstart on the local cluster", ""), rows))


def _write_corrupt_dataset(folder: Path) -> dict[str, str]:
    """Two good samples and three with broken media; returns id -> expected reject reason."""
    demo = DEMO / "mllm_demo_data"
    folder.mkdir(parents=True)
    shutil.copy(demo / "1.jpg", folder / "good.jpg")
    data = (demo / "1.jpg").read_bytes()
    (folder / "truncated.jpg").write_bytes(data[: len(data) // 3])
    (folder / "noise.png").write_bytes(os.urandom(4096))
    (folder / "noise.mp4").write_bytes(os.urandom(8192))
    chat = [
        {"role": "user", "content": "<image>What is shown?"},
        {"role": "assistant", "content": "Two players."},
    ]
    video = [
        {"role": "user", "content": "<video>What happens?"},
        {"role": "assistant", "content": "A baby reads."},
    ]
    records = [
        {"id": "good-image", "messages": chat, "images": ["good.jpg"]},
        {
            "id": "good-text",
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
        },
        {"id": "bad-truncated", "messages": chat, "images": ["truncated.jpg"]},
        {"id": "bad-noise", "messages": chat, "images": ["noise.png"]},
        {"id": "bad-video", "messages": video, "videos": ["noise.mp4"]},
    ]
    (folder / "data.json").write_text(json.dumps(records))
    return {"bad-truncated": "corrupt_media", "bad-noise": "corrupt_media", "bad-video": "corrupt_media"}


def _packjob(name: str, **spec: Any) -> dict[str, Any]:
    doc = of_kind(quickstart_docs(), "PackJob")
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return doc


def test_corrupt_media_is_rejected_listed_and_counted(e2e: Harness, tmp_path: Path) -> None:
    ns = "corrupt"
    e2e.namespace_with_claims(ns)
    # The node agent maps volume paths in commands, not inside config files: the pods read the
    # dataset where this machine has it, as they read the quickstart's ../shared.
    expected = _write_corrupt_dataset(tmp_path / "corrupt-src")
    body = _packjob("corrupt", source={"paths": [str(tmp_path / "corrupt-src" / "data.json")]})
    body["spec"]["packing"]["maxRejectedFraction"] = 1.0  # 3 of 5 rejected on purpose
    e2e.cp.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))
    assert e2e.wait_phase("packjobs", ns, "corrupt", ("Succeeded", "Failed"), PACK_TIMEOUT) == "Succeeded", (
        e2e.diagnostics(ns)
    )
    stats = e2e.get("packjobs", ns, "corrupt")["status"]["stats"]
    assert (stats["samplesIn"], stats["samplesPacked"], stats["samplesRejected"]) == (5, 2, 3), stats
    pack = e2e.pvc_dir(ns, "packtrain-data") / "corrupt"
    rejects = {
        r["id"]: r["reason"] for r in map(json.loads, (pack / "rejects.jsonl").read_text().splitlines())
    }
    assert rejects == expected
    assert json.loads((pack / "manifest.json").read_text())["counts"]["rejected_by_reason"] == {
        "corrupt_media": 3
    }


def test_killed_convert_worker_is_retried_with_identical_result(
    e2e: Harness, quickstart: QuickstartRun
) -> None:
    ns = "killed"
    e2e.namespace_with_claims(ns)
    out_root = e2e.pvc_dir(ns, "packtrain-data")
    e2e.cp.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(_packjob(NAME)))

    def worker_zero() -> int | None:
        e2e.check_operator()
        return next(
            (pid for pid, env in convert_processes(out_root) if env.get("JOB_COMPLETION_INDEX") == "0"), None
        )

    pid = wait_for(
        "convert worker 0 to start",
        worker_zero,
        timeout=120,
        every=0.05,
        diagnostics=lambda: e2e.diagnostics(ns),
    )
    time.sleep(1.0)  # let it get into the work
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pytest.fail(f"convert worker 0 (pid {pid}) finished before it could be killed\n{e2e.diagnostics(ns)}")
    assert e2e.wait_phase("packjobs", ns, NAME, ("Succeeded", "Failed"), PACK_TIMEOUT) == "Succeeded", (
        e2e.diagnostics(ns)
    )
    pods = pods_of(e2e, ns, f"batch.kubernetes.io/job-name={NAME}-convert")
    index0 = [
        p for p in pods if p.metadata.annotations.get("batch.kubernetes.io/job-completion-index") == "0"
    ]
    assert exit_codes(index0) == [137, 0], (exit_codes(pods), e2e.diagnostics(ns))
    job = e2e.batch.read_namespaced_job(f"{NAME}-convert", ns)
    assert (job.status.failed, job.status.succeeded) == (1, 2), job.status
    manifest = out_root / NAME / "manifest.json"
    assert manifest.read_bytes() == quickstart.manifest_path.read_bytes(), "the retried pack differs"
    status = e2e.get("packjobs", ns, NAME)["status"]
    assert status["stats"] == quickstart.packjob["status"]["stats"]


def test_operator_killed_mid_pipeline_finishes_without_duplicates(
    e2e: Harness, quickstart: QuickstartRun
) -> None:
    ns = "restart"
    e2e.namespace_with_claims(ns)
    e2e.cp.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(_packjob(NAME)))
    e2e.wait_phase("packjobs", ns, NAME, ("Converting",), 60)
    assert e2e.operator is not None
    os.killpg(e2e.operator.pid, signal.SIGKILL)  # a crash: no graceful shutdown
    e2e.operator.wait()
    e2e.operator = None
    try:
        wait_for(
            "the convert Job to finish without the operator",
            lambda: (e2e.batch.read_namespaced_job(f"{NAME}-convert", ns).status.succeeded or 0) == 2,
            timeout=PACK_TIMEOUT,
            every=1,
            diagnostics=lambda: e2e.diagnostics(ns),
        )
        assert e2e.phase("packjobs", ns, NAME) == "Converting"  # nobody moved it on
    finally:
        e2e.start_operator()
    assert e2e.wait_phase("packjobs", ns, NAME, ("Succeeded", "Failed"), PACK_TIMEOUT) == "Succeeded", (
        e2e.diagnostics(ns)
    )
    jobs = sorted(j.metadata.name for j in e2e.batch.list_namespaced_job(ns).items)
    assert jobs == [f"{NAME}-convert", f"{NAME}-materialize", f"{NAME}-plan"], jobs
    for stage, count in (("convert", 2), ("plan", 1), ("materialize", 2)):
        pods = pods_of(e2e, ns, f"batch.kubernetes.io/job-name={NAME}-{stage}")
        assert len(pods) == count and exit_codes(pods) == [0] * count, (stage, e2e.diagnostics(ns))
    maps = e2e.core.list_namespaced_config_map(ns, label_selector=f"packtrain.dev/packjob={NAME}").items
    assert len(maps) == 1, [m.metadata.name for m in maps]
    manifest = e2e.pvc_dir(ns, "packtrain-data") / NAME / "manifest.json"
    assert manifest.read_bytes() == quickstart.manifest_path.read_bytes()
    assert e2e.get("packjobs", ns, NAME)["status"]["stats"] == quickstart.packjob["status"]["stats"]


@dataclass
class ProgressWatch(Background):
    """Every SFTJob update a watch delivers: (seconds since start, phase, status.progress)."""

    h: Harness
    ns: str
    name: str
    seen: list[tuple[float, str | None, dict[str, Any]]] = field(default_factory=list)
    _t0: float = 0.0

    def __enter__(self) -> Self:
        self._t0 = time.monotonic()
        return super().__enter__()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for ev in watch.Watch().stream(
                    self.h.custom.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self.ns,
                    "sftjobs",
                    field_selector=f"metadata.name={self.name}",
                    timeout_seconds=2,
                ):
                    status = ev["object"].get("status") or {}
                    self.seen.append(
                        (time.monotonic() - self._t0, status.get("phase"), dict(status.get("progress") or {}))
                    )
                    if self._stop.is_set():
                        return
            except Exception:  # a dropped watch: list again
                time.sleep(0.2)


def test_live_progress_is_scraped_from_the_running_trainer(
    e2e: Harness, quickstart: QuickstartRun, capsys: pytest.CaptureFixture[str]
) -> None:
    """While the SFTJob is Running, `status.progress` comes from the trainer's own /metrics.

    The node agent gives each pod a loopback address that really serves, so the operator scrapes
    the master pod's IP as on a cluster. The operator scrapes every second here (30 s by default)
    and the run is long enough to span many scrapes; a step below maxSteps while Running can only
    come from the live scrape (the final progress comes with the trainer's summary, at the end).
    A second SFTJob trains on the quickstart's pack, as one pack serves many training runs.
    """
    ns, name, max_steps = quickstart.ns, "live", 8
    e2e.stop_operator()
    with mock.patch.dict(os.environ, {"PACKTRAIN_PROGRESS_INTERVAL": "1"}):
        e2e.start_operator()
    sft = of_kind(quickstart_docs(), "SFTJob")
    sft["metadata"]["name"] = name
    sft["spec"]["metricsPort"] = free_port()  # not the default: other runs on this machine may hold it
    sft["spec"]["training"].update(maxSteps=max_steps, checkpointEvery=max_steps)
    with ProgressWatch(e2e, ns, name) as seen:
        e2e.cp.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(sft))
        assert e2e.wait_phase("sftjobs", ns, name, ("Succeeded", "Failed"), TRAIN_TIMEOUT) == "Succeeded", (
            e2e.diagnostics(ns)
        )
    live = [(t, p) for t, phase, p in seen.seen if phase == "Running" and 1 <= p.get("step", 0) < max_steps]
    assert live, (
        f"no status.progress while Running: {[(round(t), ph, p.get('step')) for t, ph, p in seen.seen]}"
        f"\n{e2e.diagnostics(ns)}"
    )
    first, last = live[0], live[-1]
    assert first[1]["maxSteps"] == max_steps and first[1]["loss"] > 0 and first[1]["updatedAt"], first
    done = next(t for t, phase, _ in seen.seen if phase == "Succeeded")
    final = e2e.get("sftjobs", ns, name)["status"]["progress"]
    assert final["step"] == max_steps, final
    with capsys.disabled():
        print(
            "\n"
            + table(
                ("live status.progress (scrape every 1 s)", ""),
                [
                    (f"updates while Running with 1 <= step < {max_steps}", len(live)),
                    (
                        "first / last live step",
                        f"{first[1]['step']} at {first[0]:.1f} s / {last[1]['step']} at {last[0]:.1f} s",
                    ),
                    (f"Succeeded (step {final['step']})", f"{done:.1f} s"),
                ],
            )
        )
