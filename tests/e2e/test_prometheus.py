"""A real Prometheus scrapes the quickstart, and every dashboard query and alert is evaluated against it.

Prometheus (Debian's package, fetched by tests/cluster/build.sh) scrapes the operator and the
trainer pods with the scrape configs Prometheus Operator would generate from the chart's own
ServiceMonitor and PodMonitor (rendered by Helm with this harness's release), and loads the
chart's PrometheusRule. Then each query of the shipped Grafana dashboard (template variables
substituted as Grafana does) must return series with values over the run, and each alert must
be evaluated by Prometheus' rule engine without error, its expression returning a vector and
its signal (the part before the threshold) returning series.

CPU only: the trainer exports `packtrain_gpu_*` only where NVML sees a GPU, and the quickstart
trains with `gpusPerNode: 0`. So the SM-utilization panel and alert are asserted empty here,
together with every `packtrain_gpu_*` series; if any GPU series was scraped, they must return
series like the rest. MFU needs a device peak, so the SFTJob declares one (`training.peakTflops`),
as a user on an unlisted device would.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart.helm import CHART, render
from cluster.controlplane import free_port
from cluster.prometheus import (
    Prometheus,
    pod_monitor_scrape_config,
    pod_targets,
    seconds,
    service_monitor_scrape_config,
    service_targets,
)
from e2e_harness import RELEASE, RELEASE_NS, Harness, of_kind, quickstart_docs, table, wait_for

pytestmark = pytest.mark.cluster

NS = "observed"
NAME = "quickstart"
SCRAPE = "2s"
# Short windows, so the alerts evaluate over the few minutes of a quickstart.
RULE_VALUES = {
    "enabled": True,
    "stalledTraining": {"window": "1m", "for": "0s"},
    "dataWait": {"window": "1m", "for": "0s"},
    "smUtilization": {"window": "1m", "for": "0s"},
}
GPU_METRIC = re.compile(r"\bpacktrain_gpu_[a-z0-9_]+")
COMPARISON = re.compile(r"^(?P<signal>.+?)\s*(?:==|!=|<=|>=|<|>)\s*[0-9.]+$")


@dataclass
class ObservedRun:
    prom: Prometheus
    start: float
    end: float
    step: float
    targets_seen: list[dict[str, Any]] = field(default_factory=list)
    rules: list[dict[str, Any]] = field(default_factory=list)

    def series(self, expr: str) -> list[dict[str, Any]]:
        """Series of `expr` over the run that hold at least one finite value."""
        result = self.prom.query_range(expr, self.start, self.end, self.step)
        return [s for s in result if any(math.isfinite(float(v)) for _, v in s["values"])]


def _quickstart(metrics_port: int) -> str:
    docs = quickstart_docs()
    sft = of_kind(docs, "SFTJob")
    sft["spec"]["metricsPort"] = metrics_port  # not the default: other runs on this machine may hold it
    sft["spec"]["training"].update(maxSteps=6, checkpointEvery=6, peakTflops=0.5)
    return yaml.safe_dump_all(docs)


@pytest.fixture(scope="module")
def observed(
    e2e: Harness, prometheus_tools: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Any:
    exe, _ = prometheus_tools
    monitors = {"interval": SCRAPE, "scrapeTimeout": "1s"}
    objects = render(
        {
            "metrics": {
                "serviceMonitor": {"enabled": True, **monitors},
                "podMonitor": {"enabled": True, **monitors},
                "prometheusRule": RULE_VALUES,
            }
        },
        release=RELEASE,
        namespace=RELEASE_NS,
    )
    service_monitor, pod_monitor = of_kind(objects, "ServiceMonitor"), of_kind(objects, "PodMonitor")
    rule = of_kind(objects, "PrometheusRule")
    work = tmp_path_factory.mktemp("prometheus")
    rules_file = work / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    operator_sd, trainer_sd = work / "operator.json", work / "trainer.json"
    prom = Prometheus(
        exe,
        work,
        [
            service_monitor_scrape_config(service_monitor, operator_sd),
            pod_monitor_scrape_config(pod_monitor, trainer_sd),
        ],
        rule_files=[rules_file],
    )
    container = e2e.deployment["spec"]["template"]["spec"]["containers"][0]
    operator_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    service = of_kind(objects, "Service")["metadata"]["name"]
    prom.discover(
        operator_sd,
        lambda: service_targets(e2e.core, service_monitor, {service: f"127.0.0.1:{operator_port}"}),
    )
    prom.discover(trainer_sd, lambda: pod_targets(e2e.core, pod_monitor))
    prom.start()
    try:
        e2e.namespace_with_claims(NS)
        start = time.time()
        targets_seen: list[dict[str, Any]] = []
        e2e.cp.kubectl("apply", "-n", NS, "-f", "-", input=_quickstart(free_port()))
        assert e2e.wait_phase("packjobs", NS, NAME, ("Succeeded", "Failed"), 300) == "Succeeded", (
            e2e.diagnostics(NS)
        )

        def trained() -> bool:
            targets_seen.extend(t for t in prom.active_targets() if t["health"] == "up")
            return e2e.phase("sftjobs", NS, NAME) in ("Succeeded", "Failed")

        wait_for(
            f"sftjobs {NS}/{NAME} to finish",
            trained,
            timeout=480,
            every=1,
            diagnostics=lambda: e2e.diagnostics(NS),
        )
        assert e2e.phase("sftjobs", NS, NAME) == "Succeeded", e2e.diagnostics(NS)
        time.sleep(2 * seconds(SCRAPE))  # the last scrapes and rule evaluations land
        run = ObservedRun(prom, start, time.time(), seconds(SCRAPE), targets_seen, prom.rule_groups())
        yield run
    finally:
        prom.stop()


def dashboard() -> dict[str, Any]:
    return dict(json.loads((CHART / "files" / "grafana-dashboard.json").read_text()))


def grafana(expr: str, namespace: str, scrape: float) -> str:
    """Substitute the dashboard's variables as Grafana does for one selected namespace."""
    rate_interval = (
        f"{int(max(4 * scrape, scrape + scrape))}s"  # max(4 x scrape, step + scrape), step = scrape
    )
    return expr.replace("$__rate_interval", rate_interval).replace("$namespace", re.escape(namespace))


def _gpu_scraped(run: ObservedRun) -> bool:
    return bool(run.series('count by (__name__) ({__name__=~"packtrain_gpu_.+"})'))


def test_prometheus_scrapes_what_the_chart_monitors_select(e2e: Harness, observed: ObservedRun) -> None:
    up = {
        (t["labels"].get("job"), t["labels"].get("namespace"), t["labels"].get("pod"))
        for t in observed.targets_seen
    }
    assert ("packtrain-metrics", RELEASE_NS, None) in up, observed.targets_seen
    trainer = [t for t in observed.targets_seen if t["labels"].get("namespace") == NS]
    assert trainer, f"the trainer pod was never scraped: {observed.targets_seen}"
    child = e2e.get("sftjobs", NS, NAME)["status"]["trainingJob"]["name"]
    assert {t["labels"]["pod"] for t in trainer} == {f"{child}-master-0"}
    assert {t["labels"]["job"] for t in trainer} == {f"{RELEASE_NS}/{RELEASE}-trainer"}
    for t in observed.targets_seen:
        host = urllib.parse.urlsplit(t["scrapeUrl"]).hostname
        assert host and ipaddress.ip_address(host).is_loopback, t["scrapeUrl"]


def test_every_dashboard_query_returns_series(
    observed: ObservedRun, capsys: pytest.CaptureFixture[str]
) -> None:
    board = dashboard()
    variable = next(v for v in board["templating"]["list"] if v["name"] == "namespace")
    metric = re.fullmatch(r"label_values\((\w+), namespace\)", variable["definition"])
    assert metric, variable["definition"]
    values = observed.prom.api(
        "label/namespace/values", **{"match[]": metric.group(1)}, start=observed.start, end=observed.end
    )
    assert NS in values, f"the namespace variable does not offer {NS}: {values}"

    gpu = _gpu_scraped(observed)
    rows, empty = [], []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = grafana(target["expr"], NS, observed.step)
            found = observed.series(expr)
            if GPU_METRIC.search(expr) and not gpu:
                assert not found, (panel["title"], found)
                rows.append((panel["title"], target["refId"], "none: no GPU on this run (CPU)"))
                continue
            if not found:
                empty.append(f"{panel['title']} [{target['refId']}]: {expr}")
            rows.append((panel["title"], target["refId"], f"{len(found)} series"))
    with capsys.disabled():
        print("\n" + table(("dashboard panel", "query", "over the quickstart run"), rows))
    assert not empty, "dashboard queries that returned no series:\n" + "\n".join(empty)


def test_alert_rules_evaluate_against_the_scrape(
    observed: ObservedRun, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = [r for g in observed.rules for r in g["rules"]]
    assert {r["name"] for r in rules} == {
        "PacktrainTrainingStalled",
        "PacktrainDataWaitDominating",
        "PacktrainLowSMUtilization",
    }
    gpu = _gpu_scraped(observed)
    mid = (observed.start + observed.end) / 2
    rows = []
    for r in rules:
        # Prometheus' rule engine ran it, without error.
        assert r["health"] == "ok" and not r.get("lastError"), r
        assert not r["lastEvaluation"].startswith("0001-"), r
        assert observed.prom.query(r["query"], at=mid)["resultType"] == "vector", r["query"]
        signal = COMPARISON.match(r["query"])
        assert signal, f"{r['name']}: expected `<signal> <comparison> <threshold>`: {r['query']}"
        found = observed.series(signal.group("signal"))
        if GPU_METRIC.search(r["query"]) and not gpu:
            assert not found, (r["name"], found)
            rows.append((r["name"], "none: no GPU on this run (CPU)", r["state"]))
            continue
        assert found, f"{r['name']}: its signal returned no series: {signal.group('signal')}"
        rows.append((r["name"], f"{len(found)} series", r["state"]))
    with capsys.disabled():
        print("\n" + table(("alert", "signal over the run", "state at the end"), rows))
