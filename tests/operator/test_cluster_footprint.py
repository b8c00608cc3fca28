"""What the operator costs the cluster it runs on (tests/cluster): the permissions of its ServiceAccount,
gauges that forget deleted jobs, and the API requests of one quickstart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_operator import (
    DURATION,
    GROUP,
    OPERATOR_NS,
    OPERATOR_SA,
    VERSION,
    Operator,
    create,
    custom,
    metric,
    packjob,
    phase,
    pytorchjob_of,
    report_pytorchjob,
    sftjob,
    wait_for,
)
from kubernetes import client

pytestmark = pytest.mark.cluster


def test_operator_service_account_is_not_admin(kube_cluster: Any, operator: Operator) -> None:
    who = f"--as=system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"
    assert (
        kube_cluster.kubectl("auth", "can-i", "create", "jobs.batch", who, check=False).stdout.strip()
        == "yes"
    )
    for verb, resource in (
        ("delete", "jobs.batch"),
        ("get", "secrets"),
        ("create", "pods"),
        ("delete", "packjobs"),
    ):
        out = kube_cluster.kubectl("auth", "can-i", verb, resource, who, check=False).stdout.strip()
        assert out == "no", f"{verb} {resource}: {out}"


def test_gauges_drop_deleted_jobs(api: client.ApiClient, namespace: str, operator: Operator) -> None:
    body = packjob("doomed", count=1)
    body["spec"]["workers"]["podAnnotations"][DURATION] = "60"
    create(api, namespace, body)
    wait_for("PackJob doomed to convert", lambda: phase(api, namespace, "packjobs", "doomed") == "Converting")
    converting = wait_for(
        "the gauge",
        lambda: metric(operator.metrics(), "packtrain_operator_jobs", kind="PackJob", phase="Converting"),
    )
    custom(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, "packjobs", "doomed")
    wait_for(
        "the deleted PackJob to leave the gauge",
        lambda: (
            metric(operator.metrics(), "packtrain_operator_jobs", kind="PackJob", phase="Converting")
            == converting - 1
        ),
    )


def test_api_requests_of_one_quickstart(
    kube_cluster: Any,
    api: client.ApiClient,
    namespace: str,
    operator: Operator,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> None:
    """What one quickstart (a PackJob of 2 workers, an SFTJob training on it) costs the API server,
    counted by a proxy between the operator and the API server; reads come from the watch cache."""
    from api_counter import ApiCounter

    counter = ApiCounter(kube_cluster.server, kube_cluster.pki_dir / "ca.crt").start()
    config = yaml.safe_load(operator_kubeconfig.read_text())
    config["clusters"][0]["cluster"] = {"server": f"http://127.0.0.1:{counter.port}"}
    proxied = tmp_path / "kubeconfig"
    proxied.write_text(yaml.safe_dump(config))
    operator.stop()
    counted = Operator(proxied, tmp_path / "operator.log")
    try:
        counted.start()
        time.sleep(3)  # startup: discovery, the initial lists, the watches
        startup = counter.reset()
        create(api, namespace, packjob("qs", count=2))
        body = sftjob("qs-sft", "qs")
        del body["spec"]["queueName"]
        create(api, namespace, body)
        wait_for("the PyTorchJob", lambda: pytorchjob_of(api, namespace, "qs-sft"), timeout=120)
        report_pytorchjob(api, namespace, "qs-sft", ("Running", "PyTorchJobRunning", "running"))
        wait_for("SFTJob Running", lambda: phase(api, namespace, "sftjobs", "qs-sft") == "Running")
        report_pytorchjob(api, namespace, "qs-sft", ("Succeeded", "PyTorchJobSucceeded", "done"))
        wait_for("SFTJob Succeeded", lambda: phase(api, namespace, "sftjobs", "qs-sft") == "Succeeded")
        time.sleep(3)  # late events (pods finishing, garbage) settle
        run = counter.reset()
    finally:
        counted.stop()
        counter.stop()
        operator.start()
    rows = "\n".join(f"  {n:4d}  {what}" for what, n in sorted(run.items(), key=lambda kv: -kv[1]))
    print(f"API requests: startup {sum(startup.values())}, one quickstart {sum(run.values())}\n{rows}")
    assert not any(
        what.startswith(("get ", "list ")) and "packjobs" in what or what.startswith("list pods")
        for what in run
    ), run
    assert sum(run.values()) < 60, rows
