"""The end-to-end harness: a local cluster whose pods really run, Kubeflow's training-operator, the chart.

Everything is a real component. The control plane comes from ``tests/cluster``; its node agent
runs every pod's command as a local process (``--run-all``) in the checkout (``--workdir``, the
stand-in for the images' WORKDIR, so the quickstart's ``../shared`` paths resolve as they do for
``packtrain run``). The training-operator is the binary ``build.sh`` builds from Kubeflow's Go
module. The packtrain chart is installed with Helm, and the operator runs as a local process
with the chart Deployment's arguments and environment and a token of the chart's ServiceAccount,
so the chart's RBAC authorizes every call it makes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self, TypeVar

import pytest
import yaml
from cluster.controlplane import (
    ControlPlane,
    _die_with_parent,
    free_port,
    locate_binaries,
    tail,
)
from cluster.fixture import built_or_skip
from cluster.fixture import in_ci as in_ci  # re-exported: the e2e tests import it from here
from cluster.waiting import wait_for
from kubernetes import client, watch

from packtrain.operator.api import GROUP, VERSION, SFTJobSpec

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
RELEASE, RELEASE_NS = "packtrain", "packtrain-system"
CLAIMS = ("packtrain-data", "packtrain-checkpoints")
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


def stamp() -> str:
    return datetime.now(UTC).strftime("%H:%M:%S")


def quickstart_docs() -> list[dict[str, Any]]:
    """The objects of examples/quickstart.yaml, as a test edits them before applying."""
    return [d for d in yaml.safe_load_all(QUICKSTART.read_text()) if d]


def of_kind(docs: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The first object of `kind` among `docs`."""
    return next(d for d in docs if d["kind"] == kind)


def table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: how the tests print what they measured."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("|" + "|".join(f" {c} " if str(c) else " " for c in line) + "|" for line in lines)


def stop_process(proc: subprocess.Popen[bytes], grace: float = 20) -> None:
    """SIGTERM the process group, then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class Harness:
    """One started e2e environment; ``diagnostics(ns)`` is what a failing test prints."""

    cp: ControlPlane
    work: Path
    api: client.ApiClient = field(init=False)
    operator: subprocess.Popen[bytes] | None = None
    operator_starts: int = 0
    deployment: dict[str, Any] = field(default_factory=dict)
    operator_kubeconfig: Path | None = None
    # Extra chart values (e.g. the images a run in image mode deploys), merged over the ports.
    chart_values: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.api = self.cp.api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.batch = client.BatchV1Api(self.api)

    # -- components --------------------------------------------------------------------------

    def start_training_operator(self) -> None:
        """Kubeflow's training-operator v1 (PyTorchJob only), from ``ControlPlane.start_training_operator``.

        Its validating webhook cannot be served here: the API server would reach it only through
        a Service with loopback endpoints, which the API refuses. So it runs as a user can run it
        without webhooks: no webhook is registered and its certificate rotator is satisfied, the
        API server never calls it, and PyTorchJobs are validated by the CRD schema alone. The
        controllers, which turn the PyTorchJob into pods and Services, are unchanged.
        """
        self.cp.start_training_operator()

    def install_chart(self) -> None:
        """`helm install` the chart; the Deployment is scaled to zero and its command run here instead.

        The node agent cannot run an image's entrypoint (the Deployment sets only args) nor mount
        a ServiceAccount token, so the operator runs beside the agent, exactly as the
        Deployment would run it, with a token of the chart's ServiceAccount.
        """
        from chart.helm import helm_install

        values = {
            **self.chart_values,
            "operator": {
                **self.chart_values.get("operator", {}),
                "metricsPort": free_port(),
                "livenessPort": free_port(),
            },
        }
        release = helm_install(self.cp.kubeconfig, RELEASE, RELEASE_NS, values)
        objects = [d for d in yaml.safe_load_all(release["manifest"]) if d]
        self.deployment = next(o for o in objects if o["kind"] == "Deployment")
        name = self.deployment["metadata"]["name"]
        self.cp.kubectl("scale", "deployment", name, "-n", RELEASE_NS, "--replicas=0")
        account = self.deployment["spec"]["template"]["spec"]["serviceAccountName"]
        token = self.cp.kubectl("create", "token", account, "-n", RELEASE_NS, "--duration=2h").stdout.strip()
        admin = yaml.safe_load(self.cp.kubeconfig.read_text())
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "sa",
            "clusters": [{"name": "local", "cluster": admin["clusters"][0]["cluster"]}],
            "users": [{"name": account, "user": {"token": token}}],
            "contexts": [
                {"name": "sa", "context": {"cluster": "local", "user": account, "namespace": RELEASE_NS}}
            ],
        }
        self.operator_kubeconfig = self.work / "operator.kubeconfig"
        self.operator_kubeconfig.write_text(yaml.safe_dump(cfg))
        self.operator_kubeconfig.chmod(0o600)

    @property
    def operator_log(self) -> Path:
        return self.cp.logs_dir / "packtrain-operator.log"

    def start_operator(self) -> None:
        """`packtrain operator` with the Deployment's args and env, as the chart's ServiceAccount."""
        assert self.operator_kubeconfig is not None, "install_chart() first"
        container = self.deployment["spec"]["template"]["spec"]["containers"][0]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
        env.update(KUBECONFIG=str(self.operator_kubeconfig), POD_NAMESPACE=RELEASE_NS, HOME=str(self.work))
        packtrain = Path(sys.executable).with_name("packtrain")
        self.operator_starts += 1
        with self.operator_log.open("ab") as log:
            log.write(f"--- operator start #{self.operator_starts} at {stamp()}\n".encode())
            log.flush()
            self.operator = subprocess.Popen(
                [str(packtrain), "operator", *container["args"]],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # no orphaned operator when pytest is killed
            )

    def stop_operator(self) -> None:
        if self.operator is not None:
            stop_process(self.operator)
            self.operator = None

    def check_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is not None:
            raise AssertionError(
                f"the operator exited ({self.operator.returncode}):\n{tail(self.operator_log, 60)}"
            )

    def close(self) -> None:
        self.stop_operator()
        self.api.close()

    # -- cluster helpers ---------------------------------------------------------------------

    def namespace_with_claims(self, ns: str) -> None:
        """A namespace with the quickstart's claims, bound to hostPath volumes (the agent maps them).

        It enforces the `restricted` Pod Security Standard, as a shared cluster's team namespaces
        do: the API server's PodSecurity admission refuses any pod of ours that breaks it.
        """
        self.core.create_namespace({"metadata": {"name": ns, "labels": RESTRICTED}})
        for claim in CLAIMS:
            pv = f"{ns}-{claim}"
            self.core.create_persistent_volume(
                {
                    "metadata": {"name": pv},
                    "spec": {
                        "capacity": {"storage": "10Gi"},
                        "accessModes": ["ReadWriteMany"],
                        "storageClassName": "e2e",
                        "hostPath": {"path": str(self.pvc_dir(ns, claim))},
                        "claimRef": {"namespace": ns, "name": claim},
                    },
                }
            )
            self.core.create_namespaced_persistent_volume_claim(
                ns,
                {
                    "metadata": {"name": claim},
                    "spec": {
                        "accessModes": ["ReadWriteMany"],
                        "storageClassName": "e2e",
                        "volumeName": pv,
                        "resources": {"requests": {"storage": "10Gi"}},
                    },
                },
            )
        for claim in CLAIMS:
            wait_for(
                f"claim {ns}/{claim} to bind",
                lambda c=claim: (
                    self.core.read_namespaced_persistent_volume_claim(c, ns).status.phase == "Bound"
                ),
                timeout=60,
            )

    def pvc_dir(self, ns: str, claim: str) -> Path:
        """The local folder the node agent mounts for a claim (its default ``--pvc-root``)."""
        return self.cp.root / "node-agent" / "pvc" / ns / claim

    def pod_dir(self, ns: str, pod: str) -> Path:
        return self.cp.root / "node-agent" / "pods" / ns / pod

    def get(self, plural: str, ns: str, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, plural, name))

    def phase(self, plural: str, ns: str, name: str) -> str | None:
        return (self.get(plural, ns, name).get("status") or {}).get("phase")

    def wait_phase(self, plural: str, ns: str, name: str, phases: tuple[str, ...], timeout: float) -> str:
        def probe() -> str | None:
            self.check_operator()
            p = self.phase(plural, ns, name)
            return p if p in phases else None

        return str(
            wait_for(
                f"{plural} {ns}/{name} to reach {'/'.join(phases)}",
                probe,
                timeout=timeout,
                every=1,
                diagnostics=lambda: self.diagnostics(ns),
            )
        )

    def diagnostics(self, ns: str) -> str:
        """Everything needed to see why a run went wrong: objects, events, and every component's log."""
        parts = []
        for args in (
            ("get", "packjobs,sftjobs,jobs,pytorchjobs,pods,services,pvc", "-o", "wide"),
            ("get", "events", "--sort-by=.lastTimestamp"),
        ):
            res = self.cp.kubectl(*args, "-n", ns, check=False)
            parts.append(f"$ kubectl {' '.join(args)} -n {ns}\n{res.stdout}{res.stderr}")
        for plural in ("packjobs", "sftjobs"):
            res = self.cp.kubectl("get", plural, "-n", ns, "-o", "yaml", check=False)
            parts.append(f"$ kubectl get {plural} -n {ns} -o yaml\n{res.stdout[-6000:]}")
        pods = self.cp.root / "node-agent" / "pods" / ns
        for log in sorted(pods.glob("*/*.log")):
            parts.append(f"--- pod log {log.parent.name}/{log.name}\n{tail(log, 40)}")
        parts.append(f"--- operator log\n{tail(self.operator_log, 60)}")
        for comp in self.cp.components:
            if comp.name in ("training-operator", "node-agent"):
                parts.append(f"--- {comp.name} log\n{tail(comp.log, 40)}")
        return "\n".join(parts)


H = TypeVar("H", bound=Harness)


def control_plane_binaries() -> tuple[Path, Path]:
    """(bin dir, CRD dir) of the built control plane; a skip outside CI where it cannot be built here."""
    return built_or_skip(locate_binaries, "CLUSTER TESTS")


def running(
    request: pytest.FixtureRequest, work: Path, cp: ControlPlane, harness: type[H], **fields: Any
) -> Iterator[H]:
    """Start `cp` and the e2e components on it (training-operator, chart, operator), yield the
    `harness` built with `fields`, then stop everything: the body of a module-scoped e2e fixture.

    The components' logs are kept when a test of the session failed (or with
    PACKTRAIN_KEEP_CLUSTER_LOGS=1); a start that fails keeps them and names where they are.
    """
    started: H | None = None
    try:
        cp.start()
        started = harness(cp, work, **fields)
        started.start_training_operator()
        started.install_chart()
        started.start_operator()
    except Exception as e:
        if started is not None:
            started.close()
        cp.stop(keep_logs=True)
        pytest.fail(f"the end-to-end environment did not start: {e}\ncomponent logs: {cp.logs_dir}")
    yield started
    started.close()
    keep = request.session.testsfailed > 0 or os.environ.get("PACKTRAIN_KEEP_CLUSTER_LOGS") == "1"
    cp.stop(keep_logs=keep)
    if keep:
        print(f"\ne2e component logs kept in {cp.logs_dir}")


class Background:
    """Runs `_loops()` (by default `_run`) on daemon threads for the length of a `with` block.

    A loop polls or watches until `_stop` is set. Leaving the block sets it and gives each thread
    10 s to end; a thread stuck in an API call is left behind (a daemon, it dies with the tests).
    """

    _stop: threading.Event
    _threads: list[threading.Thread]

    def _loops(self) -> list[Callable[[], None]]:
        return [self._run]

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=loop, daemon=True) for loop in self._loops()]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)


@dataclass
class Recorder(Background):
    """Watches a namespace's PackJobs and SFTJobs while a run goes on.

    Records every phase each object passes through (from watch events, so short phases are not
    missed) and, on each change, the output of ``kubectl get packjobs,sftjobs``: the transcript a
    user watching the run would see.
    """

    h: Harness
    ns: str
    phases: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    transcript: list[str] = field(default_factory=list)
    _changed: threading.Event = field(default_factory=threading.Event)
    _last: list[str] = field(default_factory=list)

    def _loops(self) -> list[Callable[[], None]]:
        return [lambda: self._watch("packjobs"), lambda: self._watch("sftjobs"), self._snapshots]

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._changed.set()  # the snapshot loop sees the stop now, not after its 5 s wait
        super().__exit__()
        self._snapshot()

    def sequence(self, plural: str, name: str) -> list[str]:
        return list(self.phases.get((plural, name), []))

    def _record(self, plural: str, obj: dict[str, Any]) -> None:
        phase = (obj.get("status") or {}).get("phase")
        seen = self.phases.setdefault((plural, obj["metadata"]["name"]), [])
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)
            self._changed.set()

    def _watch(self, plural: str) -> None:
        rv = None
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                kwargs: dict[str, Any] = {"timeout_seconds": 2}
                if rv:
                    kwargs["resource_version"] = rv
                for ev in w.stream(
                    self.h.custom.list_namespaced_custom_object, GROUP, VERSION, self.ns, plural, **kwargs
                ):
                    obj = ev["object"]
                    rv = obj["metadata"].get("resourceVersion", rv)
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._record(plural, obj)
                    if self._stop.is_set():
                        break
            except Exception:  # a dropped or expired watch: list again from now
                rv = None
                time.sleep(0.2)

    def _snapshots(self) -> None:
        while not self._stop.is_set():
            if self._changed.wait(timeout=5):
                self._changed.clear()
            self._snapshot()

    def _snapshot(self) -> None:
        res = self.h.cp.kubectl("get", "packjobs,sftjobs", "-n", self.ns, check=False)
        text = (res.stdout or res.stderr).rstrip()
        # A new entry only when something besides the AGE column changed.
        key = [line.rsplit(None, 1)[0] for line in text.splitlines() if line.strip()]
        if text and key != self._last:
            self._last = key
            self.transcript.append(f"[{stamp()}] $ kubectl get packjobs,sftjobs -n {self.ns}\n{text}")


@dataclass
class MetricsScraper(Background):
    """Scrapes the trainer's Prometheus endpoint while it runs (the node agent runs pods on loopback)."""

    port: int
    samples: list[str] = field(default_factory=list)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                    body = r.read().decode()
            except OSError:
                continue
            if "packtrain_train_" in body:
                self.samples.append(body)


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def free_trainer_port(sftjob: dict[str, Any]) -> int:
    """The SFTJob's trainer /metrics port, once it is free: pods share this machine's network here,
    so another run's trainer on the same port would crash ours."""
    port = SFTJobSpec.model_validate(sftjob["spec"]).metrics_port
    wait_for(
        f"port {port} (the trainer's /metrics) to be free", lambda: port_is_free(port), timeout=300, every=2
    )
    return port


def metric(text: str, name: str) -> float | None:
    """The value of an unlabelled-or-rank-labelled gauge in Prometheus text format."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def convert_processes(pvc_root: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(pid, environment) of running `packtrain pack convert` processes writing under `pvc_root`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"convert" not in argv or not any(a.startswith(str(pvc_root).encode()) for a in argv):
                continue
            raw = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(e.decode(errors="replace").partition("=")[::2] for e in raw if b"=" in e)
        yield int(proc.name), env
