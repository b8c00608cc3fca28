"""Reconcilers against an in-memory API: what gets created, when, and only once."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from packtrain.operator import handlers, names, progress, rbac
from packtrain.operator.api import GROUP, VERSION
from packtrain.operator.settings import OperatorDefaults

DEFAULTS = OperatorDefaults(packer_image="packer:test", trainer_image="trainer:test")
RESOURCES = {
    "Job": ("batch", "jobs"),
    "ConfigMap": ("", "configmaps"),
    "PyTorchJob": ("kubeflow.org", "pytorchjobs"),
    "TrainJob": ("trainer.kubeflow.org", "trainjobs"),
}


class FakeKube:
    """The `handlers.Kube` surface over dicts; records creates and refuses what RBAC would refuse."""

    def __init__(self, missing_apis: frozenset[str] = frozenset()) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.created: list[str] = []
        self.pod_list: dict[str, list[dict[str, Any]]] = {}
        self.missing_apis = missing_apis

    def get(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert rbac.allows(rbac.RULES, group, plural, "get"), f"RBAC lacks get {group}/{plural}"
        return copy.deepcopy(self.objects.get((plural, namespace, name)))

    def list(self, group: str, version: str, plural: str, namespace: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(v) for (p, ns, _), v in self.objects.items() if p == plural and ns == namespace]

    def create(self, body: dict[str, Any]) -> bool:
        group, plural = RESOURCES[body["kind"]]
        assert rbac.allows(rbac.RULES, group, plural, "create"), f"RBAC lacks create {group}/{plural}"
        if plural in self.missing_apis:
            raise ApiException(status=404, reason="Not Found")
        key = (plural, body["metadata"]["namespace"], body["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = copy.deepcopy(body)
        self.created.append(f"{body['kind']}/{body['metadata']['name']}")
        return True

    def read(self, body: dict[str, Any]) -> dict[str, Any] | None:
        group, plural = RESOURCES[body["kind"]]
        assert rbac.allows(rbac.RULES, group, plural, "get"), f"RBAC lacks get {group}/{plural}"
        return copy.deepcopy(
            self.objects.get((plural, body["metadata"]["namespace"], body["metadata"]["name"]))
        )

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.pod_list.get(selector, [])

    def put(self, plural: str, body: dict[str, Any]) -> None:
        self.objects[(plural, body["metadata"]["namespace"], body["metadata"]["name"])] = copy.deepcopy(body)


def complete(kube: FakeKube, name: str, succeeded: int = 1) -> None:
    job = kube.objects[("jobs", "ml", name)]
    job["status"] = {"succeeded": succeeded, "conditions": [{"type": "Complete", "status": "True"}]}


def step(kube: FakeKube, body: dict[str, Any]) -> dict[str, Any]:
    body["status"] = handlers.reconcile_packjob(kube, body, DEFAULTS)  # type: ignore[arg-type]
    return body["status"]


def test_packjob_walks_its_stages_creating_each_job_once(packjob: dict[str, Any]) -> None:
    kube = FakeKube()
    assert step(kube, packjob)["phase"] == "Converting"
    assert kube.created == ["ConfigMap/demo-pack-config", "Job/demo-convert"]
    job = kube.objects[("jobs", "ml", "demo-convert")]
    owner = job["metadata"]["ownerReferences"][0]
    assert (
        owner["kind"] == "PackJob"
        and owner["uid"] == packjob["metadata"]["uid"]
        and owner["controller"] is True
    )
    assert step(kube, packjob)["phase"] == "Converting"  # a second event (or a restart) creates nothing
    assert kube.created == ["ConfigMap/demo-pack-config", "Job/demo-convert"]
    complete(kube, "demo-convert", 4)
    assert step(kube, packjob)["phase"] == "Planning"
    complete(kube, "demo-plan")
    kube.pod_list[f"{names.JOB_NAME_LABEL}=demo-plan"] = [
        {
            "status": {
                "containerStatuses": [
                    {
                        "name": "packer",
                        "state": {
                            "terminated": {
                                "exitCode": 0,
                                "message": json.dumps({"stage": "plan", "packed": 7, "fill_ratio": 0.9}),
                            }
                        },
                    }
                ]
            }
        }
    ]
    assert step(kube, packjob)["phase"] == "Materializing"
    complete(kube, "demo-materialize", 4)
    status = step(kube, packjob)
    assert status["phase"] == "Succeeded" and status["stats"] == {"samplesPacked": 7, "fillRatio": 0.9}
    assert kube.created == [
        "ConfigMap/demo-pack-config",
        "Job/demo-convert",
        "Job/demo-plan",
        "Job/demo-materialize",
    ]


def test_spec_the_models_reject_fails_without_creating(packjob: dict[str, Any]) -> None:
    packjob["spec"]["model"].update(minFrames=10, maxFrames=2)
    kube = FakeKube()
    status = step(kube, packjob)
    assert status["phase"] == "Failed" and kube.created == []
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert (
        failed["reason"] == "InvalidSpec"
        and "minFrames (10) must not exceed maxFrames (2)" in failed["message"]
    )


def sft_step(kube: FakeKube, body: dict[str, Any]) -> dict[str, Any]:
    body["status"] = handlers.reconcile_sftjob(kube, body, DEFAULTS)  # type: ignore[arg-type]
    return body["status"]


def test_sftjob_waits_for_its_packjob_then_creates_one_pytorchjob(
    sftjob: dict[str, Any], packjob: dict[str, Any]
) -> None:
    kube = FakeKube()
    status = sft_step(kube, sftjob)
    assert status["phase"] == "WaitingForData" and kube.created == []
    assert next(c for c in status["conditions"] if c["type"] == "DataReady")["reason"] == "PackJobNotFound"
    packjob["status"] = {"phase": "Materializing"}
    kube.put("packjobs", packjob)
    status = sft_step(kube, sftjob)
    assert status["phase"] == "WaitingForData" and "Materializing" in status["conditions"][0]["message"]
    packjob["status"] = {"phase": "Succeeded", "outputPath": "/data/packs/demo"}
    kube.put("packjobs", packjob)
    status = sft_step(kube, sftjob)
    assert kube.created == ["ConfigMap/demo-sft-train-config", "PyTorchJob/demo-sft"]
    assert status["phase"] == "Pending" and status["dataPath"] == "/data/packs/demo"
    ptj = kube.objects[("pytorchjobs", "ml", "demo-sft")]
    assert ptj["metadata"]["ownerReferences"][0]["kind"] == "SFTJob"
    ptj["status"] = {"conditions": [{"type": "Running", "status": "True", "reason": "PyTorchJobRunning"}]}
    assert sft_step(kube, sftjob)["phase"] == "Running"
    assert kube.created == ["ConfigMap/demo-sft-train-config", "PyTorchJob/demo-sft"]
    ptj["status"]["conditions"].append(
        {"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}
    )
    kube.pod_list[f"{names.SFTJOB_LABEL}=demo-sft"] = [
        {
            "status": {
                "containerStatuses": [
                    {
                        "name": "pytorch",
                        "state": {
                            "terminated": {
                                "exitCode": 0,
                                "message": json.dumps({"steps": 1000, "final_loss": 0.5}),
                            }
                        },
                    }
                ]
            }
        }
    ]
    status = sft_step(kube, sftjob)
    assert status["phase"] == "Succeeded" and status["progress"]["step"] == 1000
    assert status["progress"]["maxSteps"] == 1000 and status["progress"]["loss"] == 0.5


def test_missing_kubeflow_api_is_a_retryable_error_with_advice(sftjob: dict[str, Any]) -> None:
    import kopf

    sftjob["spec"]["data"] = {"path": "/data/packs/x"}
    sftjob["spec"]["volumes"]["data"] = {"claimName": "packs"}
    kube = FakeKube(missing_apis=frozenset({"pytorchjobs"}))
    with pytest.raises(kopf.TemporaryError, match="install the Kubeflow training-operator CRDs"):
        sft_step(kube, sftjob)


def test_trainjob_backend(sftjob: dict[str, Any]) -> None:
    sftjob["spec"].update(backend="trainjob", data={"path": "/data/packs/x"})
    sftjob["spec"]["volumes"]["data"] = {"claimName": "packs"}
    kube = FakeKube()
    sft_step(kube, sftjob)
    assert kube.created == ["ConfigMap/demo-sft-train-config", "TrainJob/demo-sft"]


def test_handlers_register_with_kopf() -> None:
    import kopf

    registry = kopf.get_default_registry()
    resources = {h.selector.plural or h.selector.any_name for h in registry._changing.get_all_handlers()}
    assert {"packjobs", "sftjobs"} <= resources
    watched = {h.selector.plural or h.selector.any_name for h in registry._watching.get_all_handlers()}
    assert {"jobs", "pytorchjobs", "trainjobs", "packjobs"} <= watched
    assert not registry._spawning.get_all_handlers(), "timers/daemons would put finalizers on every resource"
    assert (GROUP, VERSION) == ("packtrain.dev", "v1alpha1")


def test_write_status_retries_on_conflict_and_posts_no_event_for_the_lost_write(
    packjob: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kopf

    kube = FakeKube()
    packjob["metadata"]["resourceVersion"] = "1"
    fresh = copy.deepcopy(packjob)
    fresh["metadata"]["resourceVersion"] = "2"
    kube.put("packjobs", fresh)
    writes: list[str] = []

    def patch_status(plural: str, ns: str, name: str, status: dict[str, Any], rv: str) -> None:
        writes.append(rv)
        if rv != "2":
            raise ApiException(status=409, reason="Conflict")

    posted: list[str] = []
    monkeypatch.setattr(kube, "patch_status", patch_status, raising=False)
    monkeypatch.setattr(kopf, "event", lambda body, type, reason, message: posted.append(reason))
    handlers.write_status(kopf.Memo(kube=kube, defaults=DEFAULTS), "packjobs", packjob)
    assert writes == ["1", "2"] and posted == ["Converting"]
    assert kube.created == ["ConfigMap/demo-pack-config", "Job/demo-convert"]  # the retry created nothing new


METRICS_TEXT = """# HELP packtrain_train_step Optimizer steps completed.
# TYPE packtrain_train_step gauge
packtrain_train_step{rank="0"} 42.0
packtrain_train_step{rank="1"} 42.0
# HELP packtrain_train_loss Loss of the last step (global token mean).
# TYPE packtrain_train_loss gauge
packtrain_train_loss{rank="0"} 1.5
packtrain_train_loss{rank="1"} 9.0
"""


def scrape_progress(kube: FakeKube, namespace: str, name: str) -> dict[str, Any] | None:
    """One `update_progress`, as the operator's progress loop runs it."""
    import asyncio

    from packtrain.operator import scrape

    async def run() -> dict[str, Any] | None:
        async with scrape.session() as client:
            return await progress.update_progress(kube, client, namespace, name, handlers.common.now)  # type: ignore[arg-type]

    return asyncio.run(run())


def test_progress_is_scraped_from_the_master_pod(sftjob: dict[str, Any]) -> None:
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = METRICS_TEXT.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sftjob["spec"]["metricsPort"] = server.server_address[1]
        sftjob["status"] = {"phase": "Running"}
        kube = FakeKube()
        kube.put("sftjobs", sftjob)
        merged: list[dict[str, Any]] = []
        kube.merge_status = lambda plural, ns, name, status: merged.append(status)  # type: ignore[attr-defined]
        worker = {
            "metadata": {"labels": {"training.kubeflow.org/replica-type": "worker"}},
            "status": {"phase": "Running", "podIP": "127.0.0.2"},
        }
        master = {
            "metadata": {"labels": {"training.kubeflow.org/replica-type": "master"}},
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        }
        kube.pod_list[f"{names.SFTJOB_LABEL}=demo-sft"] = [worker, master]
        progress = scrape_progress(kube, "ml", "demo-sft")
        assert progress is not None and progress["step"] == 42 and progress["loss"] == 1.5
        assert progress["maxSteps"] == 1000 and merged == [{"progress": progress}]
        kube.pod_list[f"{names.SFTJOB_LABEL}=demo-sft"] = [worker]
        assert scrape_progress(kube, "ml", "demo-sft") is None
    finally:
        server.shutdown()


# The Status body the API server sends with a ResourceQuota refusal (403), as the local cluster returns it.
QUOTA_REFUSAL = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": 'jobs.batch "demo-convert" is forbidden: exceeded quota: no-jobs, requested: '
    "count/jobs.batch=1, "
    "used: count/jobs.batch=0, limited: count/jobs.batch=0",
    "reason": "Forbidden",
    "details": {"name": "demo-convert", "group": "batch", "kind": "jobs"},
    "code": 403,
}


class RefusingKube(FakeKube):
    """Refuses to create `kind` with `status`, as the API server does (body: a JSON Status string)."""

    def __init__(self, kind: str, status: int, body: dict[str, Any]) -> None:
        super().__init__()
        self.refuse, self.status, self.body = kind, status, body

    def create(self, body: dict[str, Any]) -> bool:
        if body["kind"] == self.refuse:
            exc = ApiException(status=self.status, reason="Forbidden" if self.status == 403 else "Invalid")
            exc.body = json.dumps(self.body)
            raise exc
        return super().create(body)


@pytest.mark.parametrize("code", [403, 422])
def test_a_refused_child_fails_the_packjob_with_the_servers_message(
    packjob: dict[str, Any], code: int
) -> None:
    kube = RefusingKube("Job", code, {**QUOTA_REFUSAL, "code": code})
    status = step(kube, packjob)
    assert status["phase"] == "Failed" and status["completionTime"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "ChildRefused"
    assert failed["message"].startswith(f"the API server refused to create Job demo-convert ({code} ")
    assert "exceeded quota: no-jobs" in failed["message"] and "re-create the PackJob" in failed["message"]
    event = handlers.common.st.transition_event(None, None, status)
    assert event is not None and event[:2] == ("Warning", "ChildRefused")
    assert step(kube, packjob) == status  # terminal: nothing is retried


def test_a_refused_training_job_fails_the_sftjob(sftjob: dict[str, Any]) -> None:
    sftjob["spec"]["data"] = {"path": "/data/packs/x"}
    sftjob["spec"]["volumes"]["data"] = {"claimName": "packs"}
    kube = RefusingKube(
        "PyTorchJob", 403, {**QUOTA_REFUSAL, "message": "pytorchjobs.kubeflow.org is forbidden"}
    )
    status = sft_step(kube, sftjob)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert status["phase"] == "Failed" and failed["reason"] == "ChildRefused"
    assert "PyTorchJob demo-sft (403 Forbidden): pytorchjobs.kubeflow.org is forbidden" in failed["message"]
