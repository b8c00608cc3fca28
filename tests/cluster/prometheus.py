"""A real Prometheus for tests, scraping what the chart's ServiceMonitor and PodMonitor select.

The binary is Debian's ``prometheus`` package, fetched by ``build.sh``. Debian builds it without
Kubernetes service discovery, so the discovery step is done here: every pod (or Service) of the
monitor's namespaces is listed from the API and handed to Prometheus as a file-based discovery
target carrying the ``__meta_kubernetes_*`` labels Kubernetes discovery would give it. The
relabelling that Prometheus Operator generates from the monitor (label selector, port name,
``namespace``/``pod``/``service``/``job`` labels) then runs in Prometheus itself, unchanged.

One deviation, for this harness only: the node agent runs pods as local processes, so a pod's
metrics port listens on loopback, and a pod IP outside 127.0.0.0/8 is rewritten to 127.0.0.1
(Prometheus never scrapes another address).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .controlplane import ClusterUnavailable, _die_with_parent, free_port, tail

Target = dict[str, Any]


def locate_prometheus(bin_dir: Path) -> tuple[Path, Path]:
    """(prometheus, promtool) from the build cache, or ClusterUnavailable saying why."""
    exe, tool = bin_dir / "prometheus", bin_dir / "promtool"
    if exe.is_file() and tool.is_file():
        return exe, tool
    marker = bin_dir.parent / "UNAVAILABLE-prometheus"
    if marker.is_file():
        raise ClusterUnavailable(
            f"Prometheus cannot be had on this machine: {marker.read_text().strip()}", impossible=True
        )
    raise ClusterUnavailable(
        f"no prometheus in {bin_dir}: run `bash tests/cluster/build.sh`", impossible=False
    )


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def seconds(duration: str) -> float:
    """A Prometheus duration (``15s``, ``1m30s``) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * units[u] for n, u in parts)


def _selector_keeps(kind: str, match_labels: dict[str, str]) -> list[dict[str, Any]]:
    """Prometheus Operator's `keep` rules for a monitor's matchLabels (`kind`: pod or service)."""
    return [
        {
            "action": "keep",
            "source_labels": [
                f"__meta_kubernetes_{kind}_label_{_sanitize(k)}",
                f"__meta_kubernetes_{kind}_labelpresent_{_sanitize(k)}",
            ],
            "regex": f"({re.escape(v)});true",
        }
        for k, v in sorted(match_labels.items())
    ]


def _endpoint_options(endpoint: dict[str, Any], job: str, sd_file: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "job_name": job,
        "metrics_path": endpoint.get("path", "/metrics"),
        "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}],
    }
    for key, prom_key in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout")):
        if key in endpoint:
            cfg[prom_key] = endpoint[key]
    return cfg


def pod_monitor_scrape_config(monitor: dict[str, Any], sd_file: Path) -> dict[str, Any]:
    """The scrape config Prometheus Operator generates for a PodMonitor's first endpoint."""
    meta, spec = monitor["metadata"], monitor["spec"]
    endpoint = spec["podMetricsEndpoints"][0]
    job = f"podMonitor/{meta['namespace']}/{meta['name']}/0"
    relabel: list[dict[str, Any]] = [
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"},
        *_selector_keeps("pod", spec["selector"]["matchLabels"]),
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": re.escape(endpoint["port"]),
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
        # This harness only: pods run on this machine's loopback (see the module docstring).
        {
            "source_labels": ["__meta_kubernetes_pod_container_port_number"],
            "regex": "(\\d+)",
            "target_label": "__address__",
            "replacement": "127.0.0.1:$1",
        },
        {
            "source_labels": ["__meta_kubernetes_pod_ip", "__meta_kubernetes_pod_container_port_number"],
            "regex": "(127\\.[0-9.]+);(\\d+)",
            "target_label": "__address__",
            "replacement": "$1:$2",
        },
    ]
    return {**_endpoint_options(endpoint, job, sd_file), "relabel_configs": relabel}


def service_monitor_scrape_config(monitor: dict[str, Any], sd_file: Path) -> dict[str, Any]:
    """The scrape config Prometheus Operator generates for a ServiceMonitor's first endpoint."""
    meta, spec = monitor["metadata"], monitor["spec"]
    endpoint = spec["endpoints"][0]
    job = f"serviceMonitor/{meta['namespace']}/{meta['name']}/0"
    relabel: list[dict[str, Any]] = [
        *_selector_keeps("service", spec["selector"]["matchLabels"]),
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_endpoint_port_name"],
            "regex": re.escape(endpoint["port"]),
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
    ]
    return {**_endpoint_options(endpoint, job, sd_file), "relabel_configs": relabel}


def _monitor_namespaces(monitor: dict[str, Any]) -> list[str] | None:
    """The namespaces a monitor looks in; None: all."""
    sel = monitor["spec"].get("namespaceSelector") or {}
    if sel.get("any"):
        return None
    return list(sel.get("matchNames") or [monitor["metadata"]["namespace"]])


def _labels_meta(kind: str, labels: dict[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in (labels or {}).items():
        out[f"__meta_kubernetes_{kind}_label_{_sanitize(k)}"] = v
        out[f"__meta_kubernetes_{kind}_labelpresent_{_sanitize(k)}"] = "true"
    return out


def pod_targets(core: Any, monitor: dict[str, Any]) -> list[Target]:
    """Kubernetes pod discovery for a PodMonitor: one target per container port of every pod."""
    namespaces = _monitor_namespaces(monitor)
    pods = (
        core.list_pod_for_all_namespaces().items
        if namespaces is None
        else [p for ns in namespaces for p in core.list_namespaced_pod(ns).items]
    )
    groups: list[Target] = []
    for pod in pods:
        base = {
            "__meta_kubernetes_namespace": pod.metadata.namespace,
            "__meta_kubernetes_pod_name": pod.metadata.name,
            "__meta_kubernetes_pod_phase": pod.status.phase or "",
            "__meta_kubernetes_pod_ip": pod.status.pod_ip or "",
            **_labels_meta("pod", pod.metadata.labels),
        }
        if not pod.status.pod_ip:
            continue
        for c in pod.spec.containers:
            for port in c.ports or []:
                labels = {
                    **base,
                    "__meta_kubernetes_pod_container_name": c.name,
                    "__meta_kubernetes_pod_container_port_name": port.name or "",
                    "__meta_kubernetes_pod_container_port_number": str(port.container_port),
                }
                groups.append({"targets": [f"{pod.status.pod_ip}:{port.container_port}"], "labels": labels})
    return groups


def service_targets(core: Any, monitor: dict[str, Any], stand_ins: dict[str, str]) -> list[Target]:
    """Kubernetes endpoints discovery for a ServiceMonitor, with a stand-in address per Service.

    The harness runs the operator as a local process beside a Deployment scaled to zero, so its
    Service has no endpoints: ``stand_ins`` maps a Service name to the address serving in its place.
    """
    groups: list[Target] = []
    for ns in _monitor_namespaces(monitor) or []:
        for svc in core.list_namespaced_service(ns).items:
            address = stand_ins.get(svc.metadata.name)
            if address is None:
                continue
            for port in svc.spec.ports or []:
                labels = {
                    "__meta_kubernetes_namespace": ns,
                    "__meta_kubernetes_service_name": svc.metadata.name,
                    "__meta_kubernetes_endpoint_port_name": port.name or "",
                    **_labels_meta("service", svc.metadata.labels),
                }
                groups.append({"targets": [address], "labels": labels})
    return groups


class PrometheusError(AssertionError):
    pass


@dataclass
class Prometheus:
    """One Prometheus process with its own TSDB under ``root``; ``discover`` keeps file targets fresh."""

    exe: Path
    root: Path
    scrape_configs: list[dict[str, Any]]
    rule_files: Sequence[Path] = ()
    evaluation_interval: str = "2s"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    _discoverers: list[tuple[Path, Callable[[], list[Target]]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    discovery_errors: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.root / "prometheus.log"

    def discover(self, sd_file: Path, targets: Callable[[], list[Target]]) -> None:
        """Rewrite ``sd_file`` from ``targets()`` every second while Prometheus runs."""
        self._discoverers.append((sd_file, targets))
        self._refresh()

    def _refresh(self) -> None:
        for sd_file, targets in self._discoverers:
            try:
                data = json.dumps(targets(), sort_keys=True)
            except Exception as e:  # the API briefly unavailable: keep the last targets
                self.discovery_errors.append(repr(e))
                continue
            tmp = sd_file.with_suffix(".tmp")
            tmp.write_text(data)
            os.replace(tmp, sd_file)

    def _discovery_loop(self) -> None:
        while not self._stop.wait(1.0):
            self._refresh()

    def start(self, timeout: float = 60) -> Prometheus:
        self.root.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"evaluation_interval": self.evaluation_interval},
            "scrape_configs": self.scrape_configs,
            "rule_files": [str(f) for f in self.rule_files],
        }
        cfg = self.root / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                [
                    str(self.exe),
                    f"--config.file={cfg}",
                    f"--storage.tsdb.path={self.root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self._thread = threading.Thread(target=self._discovery_loop, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return self
            time.sleep(0.3)
        raise TimeoutError(f"Prometheus not ready at {self.url}:\n{tail(self.log)}")

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise PrometheusError(f"prometheus exited ({self.proc.returncode}):\n{tail(self.log)}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>: the `data` of a success, else PrometheusError (with Prometheus' message)."""
        self._check_alive()
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None}, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        return dict(self.api("query", query=expr, time=at))

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=start, end=end, step=step)
        return list(data["result"])

    def active_targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self.api("rules")["groups"])
