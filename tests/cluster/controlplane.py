"""A throwaway Kubernetes control plane made of real binaries, for tests.

Like controller-runtime's envtest, but with the controllers and scheduler too: etcd,
kube-apiserver, kube-controller-manager and kube-scheduler run as local processes on free
loopback ports, and our node agent (``node_agent.py``) plays the kubelet for fake CPU and GPU
nodes. The binaries come from ``tests/cluster/build.sh``.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
REQUIRED_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
SERVICE_CIDR = "10.0.0.0/24"
# The API server's in-cluster address is the first IP of the service range.
KUBERNETES_SERVICE_IP = "10.0.0.1"
NODE_AGENT = HERE / "node_agent.py"


class ClusterUnavailable(RuntimeError):
    """The control-plane binaries are missing; ``impossible`` says whether they cannot be built here."""

    def __init__(self, message: str, impossible: bool) -> None:
        super().__init__(message)
        self.impossible = impossible


def locate_binaries() -> tuple[Path, Path]:
    """Return (bin dir, CRD dir) of the build cache, or raise ClusterUnavailable saying what to do."""
    override = os.environ.get("PACKTRAIN_CLUSTER_BIN")
    if override:
        bin_dir = Path(override)
        crd_dir = Path(os.environ.get("PACKTRAIN_CLUSTER_CRDS", str(bin_dir.parent / "crds")))
    else:
        out = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--print-bin-dir"],
            check=True,
            capture_output=True,
            text=True,
        )
        bin_dir = Path(out.stdout.strip())
        crd_dir = bin_dir.parent / "crds"
    missing = [b for b in REQUIRED_BINARIES if not (bin_dir / b).is_file()]
    if missing:
        marker = bin_dir.parent / "UNAVAILABLE"
        if marker.is_file():
            raise ClusterUnavailable(
                f"the local control plane cannot be built on this machine: {marker.read_text().strip()}",
                impossible=True,
            )
        raise ClusterUnavailable(
            f"control-plane binaries missing from {bin_dir} ({', '.join(missing)}): "
            "run `bash tests/cluster/build.sh` (about 20 min cold on 2 cores, seconds when warm)",
            impossible=False,
        )
    return bin_dir, crd_dir


_ADDONS_BUILT = False


def ensure_addons() -> None:
    """Build the add-ons (Kueue, Trainer v2, JobSet, Prometheus) unless they are up to date, once per
    session: `.ci/run` starts the first cluster tests while build.sh still builds them under its lock,
    so a test that needs one waits here for that build (warm: a second). Exit 3 (impossible here) is
    left to the checks that follow, which say why; binaries given by PACKTRAIN_CLUSTER_BIN are used
    as they are."""
    global _ADDONS_BUILT
    if _ADDONS_BUILT or os.environ.get("PACKTRAIN_CLUSTER_BIN"):
        return
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    if done.returncode not in (0, 3):
        raise RuntimeError(f"tests/cluster/build.sh failed ({done.returncode}):\n{done.stderr[-4000:]}")
    _ADDONS_BUILT = True


def free_port() -> int:
    """A loopback port free a moment ago (a component, rendezvous or /metrics binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- PKI -------------------------------------------------------------------------------------


@dataclass
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    # P-256 keys generate in microseconds; RSA would cost seconds for the five keys we need.
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(cn: str, orgs: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class Pki:
    """A throwaway CA that signs the serving certificate and the client certificates."""

    def __init__(self) -> None:
        self._ca_key = _key()
        now = dt.datetime.now(dt.UTC)
        self._not_before = now - dt.timedelta(minutes=5)
        self._not_after = now + dt.timedelta(days=2)
        name = _name("packtrain-test-ca")
        self._ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        self.ca_pem = self._ca_cert.public_bytes(serialization.Encoding.PEM)

    def _issue(
        self, subject: x509.Name, usage: x509.ObjectIdentifier, sans: Sequence[x509.GeneralName] = ()
    ) -> KeyPair:
        key = _key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def serving(self) -> KeyPair:
        names = [
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ]
        ips = ["127.0.0.1", KUBERNETES_SERVICE_IP]
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        return self._issue(_name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans)

    def client(self, user: str, groups: Sequence[str] = ()) -> KeyPair:
        return self._issue(_name(user, groups), ExtendedKeyUsageOID.CLIENT_AUTH)


def _write(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write_kubeconfig(path: Path, server: str, ca_pem: bytes, pair: KeyPair, user: str) -> Path:
    """A kubeconfig with the certificates inlined, so it stays valid wherever it is copied."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "packtrain-test",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(pair.cert_pem),
                    "client-key-data": _b64(pair.key_pem),
                },
            }
        ],
        "contexts": [{"name": "packtrain-test", "context": {"cluster": "packtrain-test", "user": user}}],
        "current-context": "packtrain-test",
    }
    return _write(path, yaml.safe_dump(cfg).encode())


# --- processes --------------------------------------------------------------------------------


@dataclass
class Component:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(
                f"{self.name} exited with code {code}; last lines of {self.log}:\n{tail(self.log)}"
            )


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _get(url: str, context: ssl.SSLContext, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, context=context, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode(errors="replace")


def _die_with_parent() -> None:
    """Linux: kill the component when the test process dies, even by SIGKILL or a CI timeout."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class ControlPlane:
    """Starts, describes and stops one local control plane.

    ``start()`` leaves a working cluster: API server ready, controllers and scheduler healthy,
    CRDs established, nodes ``cpu-0`` and ``gpu-0`` registered and Ready under the node agent.
    """

    bin: Path
    crd_dir: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="packtrain-cluster-")))
    node_agent_args: Sequence[str] = ()
    components: list[Component] = field(default_factory=list)
    server_version: str = ""

    def __post_init__(self) -> None:
        self.logs_dir = self.root / "logs"
        self.pki_dir = self.root / "pki"
        self.kubeconfig = self.root / "kubeconfig"
        for d in (self.logs_dir, self.pki_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._pki = Pki()
        self.api_port = free_port()
        self.server = f"https://127.0.0.1:{self.api_port}"

    # -- public API ---------------------------------------------------------------------------

    def api_client(self) -> ApiClient:
        """A new kubernetes ApiClient authenticated as cluster admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def env(self) -> dict[str, str]:
        """Environment for tools run against this cluster: KUBECONFIG set, our binaries first on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return env

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; on failure the error carries kubectl's stderr."""
        return self._tool("kubectl", args, input, check, timeout)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run helm (built by build.sh) against this cluster."""
        if not (self.bin / "helm").is_file():
            raise RuntimeError(f"no helm in {self.bin}: run `bash tests/cluster/build.sh`")
        return self._tool("helm", args, input, check, timeout)

    def _tool(
        self, tool: str, args: Sequence[str], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin / tool), "--kubeconfig", str(self.kubeconfig), *args]
        res = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, env=self.env()
        )
        if check and res.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({res.returncode}):\n{res.stderr.strip()}")
        return res

    def start(self, timeout: float = 180) -> ControlPlane:
        deadline = time.monotonic() + timeout
        pki = self._pki
        ca = _write(self.pki_dir / "ca.crt", pki.ca_pem, 0o644)
        serving = pki.serving()
        apiserver_crt = _write(self.pki_dir / "apiserver.crt", serving.cert_pem, 0o644)
        apiserver_key = _write(self.pki_dir / "apiserver.key", serving.key_pem)
        sa_key = _key()
        sa_priv = _write(self.pki_dir / "sa.key", _key_pem(sa_key))
        sa_pub = _write(
            self.pki_dir / "sa.pub",
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )
        write_kubeconfig(
            self.kubeconfig, self.server, pki.ca_pem, pki.client("admin", ["system:masters"]), "admin"
        )
        kcm_kubeconfig = write_kubeconfig(
            self.pki_dir / "controller-manager.kubeconfig",
            self.server,
            pki.ca_pem,
            pki.client("system:kube-controller-manager"),
            "system:kube-controller-manager",
        )
        sched_kubeconfig = write_kubeconfig(
            self.pki_dir / "scheduler.kubeconfig",
            self.server,
            pki.ca_pem,
            pki.client("system:kube-scheduler"),
            "system:kube-scheduler",
        )

        etcd_port, etcd_peer = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                "--data-dir",
                str(self.root / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
            ],
        )
        self._spawn(
            "kube-apiserver",
            [
                "--advertise-address=127.0.0.1",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--cert-dir={self.pki_dir}",
                f"--tls-cert-file={apiserver_crt}",
                f"--tls-private-key-file={apiserver_key}",
                f"--client-ca-file={ca}",
                "--authorization-mode=RBAC",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--service-account-issuer={self.server}",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_priv}",
                # Nothing mounts service-account tokens into pods here (envtest does the same).
                "--disable-admission-plugins=ServiceAccount",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
            ],
        )
        self._wait_ready(f"{self.server}/readyz", ca_file=ca, deadline=deadline, what="kube-apiserver")

        kcm_port, sched_port = free_port(), free_port()
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={kcm_kubeconfig}",
                f"--authentication-kubeconfig={kcm_kubeconfig}",
                f"--authorization-kubeconfig={kcm_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--cert-dir={self.root / 'kcm-certs'}",
                "--leader-elect=false",
                # Each controller gets its own service account and RBAC role, as on a real cluster.
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa_priv}",
                f"--root-ca-file={ca}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--controllers=*",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={sched_kubeconfig}",
                f"--authentication-kubeconfig={sched_kubeconfig}",
                f"--authorization-kubeconfig={sched_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                f"--cert-dir={self.root / 'scheduler-certs'}",
                "--leader-elect=false",
            ],
        )
        self._wait_ready(f"https://127.0.0.1:{kcm_port}/healthz", None, deadline, "kube-controller-manager")
        self._wait_ready(f"https://127.0.0.1:{sched_port}/healthz", None, deadline, "kube-scheduler")

        version = json.loads(_get(f"{self.server}/version", self._ssl(ca))[1])
        self.server_version = str(version["gitVersion"])
        self._install_crds()
        self._spawn(
            "node-agent",
            [
                "--kubeconfig",
                str(self.kubeconfig),
                "--work-dir",
                str(self.root / "node-agent"),
                *self.node_agent_args,
            ],
            exe=[sys.executable, str(NODE_AGENT)],
        )
        self._wait_nodes_ready(deadline)
        return self

    def start_training_operator(
        self, namespace: str = "kubeflow", schemes: Sequence[str] = ("pytorchjob",), timeout: float = 120
    ) -> Component:
        """Run the real Kubeflow training-operator (v1, built by build.sh) against this cluster.

        Its admission webhooks stay unregistered (an empty ValidatingWebhookConfiguration), but its
        certificate rotator must still see certificates "mounted": ours go to a private TMPDIR, where
        the webhook server reads them, and the rotator's hard-coded
        /tmp/k8s-webhook-server/serving-certs/tls.crt is created when absent (it only checks that
        the file exists). Stop it with ``stop_component`` when a test is done with it.
        """
        exe = self.bin / "training-operator"
        if not exe.is_file():
            raise RuntimeError(f"no training-operator in {self.bin}: run `bash tests/cluster/build.sh`")
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "List",
                    "items": [
                        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
                        {
                            "apiVersion": "v1",
                            "kind": "Secret",
                            "type": "Opaque",
                            "metadata": {"name": "training-operator-webhook-cert", "namespace": namespace},
                        },
                        {
                            "apiVersion": "admissionregistration.k8s.io/v1",
                            "kind": "ValidatingWebhookConfiguration",
                            "metadata": {"name": "validator.training-operator.kubeflow.org"},
                            "webhooks": [],
                        },
                    ],
                }
            ),
        )
        serving = self._pki.serving()
        tmp = self.root / "training-operator-tmp"
        for certs in (
            tmp / "k8s-webhook-server" / "serving-certs",
            Path("/tmp/k8s-webhook-server/serving-certs"),
        ):
            certs.mkdir(parents=True, exist_ok=True)
            if not (certs / "tls.crt").exists():
                _write(certs / "tls.crt", serving.cert_pem, 0o644)
                _write(certs / "tls.key", serving.key_pem)
        probe = free_port()
        env = {**self.env(), "MY_POD_NAMESPACE": namespace, "TMPDIR": str(tmp)}
        comp = self._spawn(
            "training-operator",
            [
                f"--kubeconfig={self.kubeconfig}",
                *(f"--enable-scheme={s}" for s in schemes),
                f"--webhook-server-port={free_port()}",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                f"--health-probe-bind-address=127.0.0.1:{probe}",
            ],
            exe=[str(exe)],
            env=env,
        )
        # /readyz turns green once the certificates are in place and the controllers start.
        self._wait_ready(
            f"http://127.0.0.1:{probe}/readyz", None, time.monotonic() + timeout, "training-operator"
        )
        return comp

    # -- add-ons: Kueue, JobSet, Kubeflow Trainer v2 (built by build.sh) ------------------------
    # Like the training-operator, Kueue and Trainer run with their admission webhooks unregistered
    # (JobSet's are registered, see start_jobset). Their controllers are unchanged; what goes
    # untested is the webhooks' own work: Kueue's defaulting (suspending a queued Job on create: the
    # operator creates queued children suspended instead) and validation, and Trainer's
    # defaulting/validation of TrainJobs and runtimes (the CRD schemas still apply).

    @property
    def addon_dir(self) -> Path:
        """Where build.sh copies the add-ons' CRDs and runtimes (installed only by tests that use them)."""
        ensure_addons()
        return self.bin.parent / "addons"

    def install_addon_manifests(self, *subdirs: str) -> None:
        """Server-side apply each manifest in the add-on dir's ``subdirs`` (CRDs wait until Established)."""
        files = [f for d in subdirs for f in sorted((self.addon_dir / d).rglob("*.yaml"))]
        if not files:
            raise RuntimeError(
                f"nothing under {self.addon_dir}/{{{','.join(subdirs)}}}: run `bash tests/cluster/build.sh`"
            )
        args: list[str] = ["apply", "--server-side", "--force-conflicts"]
        for f in files:
            args += ["-f", str(f)]
        self.kubectl(*args)
        docs = [yaml.safe_load(f.read_text()) for f in files]
        crds = [d["metadata"]["name"] for d in docs if d.get("kind") == "CustomResourceDefinition"]
        if crds:
            self._wait_established(*crds)

    def _addon_exe(self, name: str) -> Path:
        ensure_addons()
        exe = self.bin / name
        if not exe.is_file():
            raise RuntimeError(
                f"no {name} in {self.bin}: run `bash tests/cluster/build.sh` (without --no-addons)"
            )
        return exe

    def _addon_certs(self, name: str) -> Path:
        """A serving certificate for an add-on's webhook and metrics servers (nothing calls them)."""
        certs = self.root / name / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        serving = self._pki.serving()
        _write(certs / "tls.crt", serving.cert_pem, 0o644)
        _write(certs / "tls.key", serving.key_pem)
        return certs

    def _start_addon(
        self,
        name: str,
        namespace: str,
        config: dict[str, Any],
        args: Sequence[str],
        probe: int,
        timeout: float,
    ) -> Component:
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}),
        )
        cfg = self.root / name / "config.yaml"
        cfg.write_text(yaml.safe_dump(config))
        env = {**self.env(), "POD_NAMESPACE": namespace, "TMPDIR": str(self.root / name)}
        comp = self._spawn(
            name,
            [f"--kubeconfig={self.kubeconfig}", f"--config={cfg}", *args],
            exe=[str(self._addon_exe(name))],
            env=env,
        )
        self._wait_ready(f"http://127.0.0.1:{probe}/readyz", None, time.monotonic() + timeout, name)
        return comp

    def start_kueue(
        self,
        frameworks: Sequence[str] = ("batch/job", "kubeflow.org/pytorchjob"),
        namespace: str = "kueue-system",
        timeout: float = 120,
    ) -> Component:
        """Run Kueue's controller manager (sigs.k8s.io/kueue, built by build.sh) with its CRDs.

        Webhooks unregistered (see above). Kueue reads its
        metrics certificate from a fixed /etc/kueue/metrics/certs when its own certificate
        management is off, so ours is written there when that folder holds none.
        """
        self.install_addon_manifests("kueue")
        certs = self._addon_certs("kueue")
        metrics_certs = Path("/etc/kueue/metrics/certs")
        try:
            metrics_certs.mkdir(parents=True, exist_ok=True)
            for f in ("tls.crt", "tls.key"):
                if not (metrics_certs / f).exists():
                    shutil.copy(certs / f, metrics_certs / f)
        except OSError as e:
            raise RuntimeError(
                f"Kueue needs its metrics certificate in {metrics_certs} and it cannot be written: {e}"
            ) from e
        probe = free_port()
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": namespace,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{probe}"},
            "metrics": {"bindAddress": f"127.0.0.1:{free_port()}"},
            "webhook": {"port": free_port(), "host": "127.0.0.1", "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            # Its on-demand visibility API server binds a fixed port; nothing here queries it.
            "featureGates": {"VisibilityOnDemand": False},
            "integrations": {"frameworks": list(frameworks)},
        }
        return self._start_addon("kueue", namespace, config, [], probe, timeout)

    def start_jobset(self, namespace: str = "jobset-system", timeout: float = 120) -> Component:
        """Run the JobSet controller (sigs.k8s.io/jobset, the version Trainer v2 requires) with its CRDs.

        Unlike the others, JobSet's own webhooks for JobSet objects are registered and called: its
        controller relies on their defaults (a JobSet without ``spec.network`` panics it). The API
        server reaches them by URL on loopback (its own host), with our CA as the bundle; the
        module's webhook configurations are applied with only the client config changed. Its pod
        webhooks (exclusive placement) stay unregistered: they would see every pod of the cluster.
        """
        self.install_addon_manifests("jobset")
        certs = self._addon_certs("jobset")
        probe, webhook_port = free_port(), free_port()
        config = {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{probe}"},
            "metrics": {"bindAddress": f"127.0.0.1:{free_port()}", "certDir": str(certs)},
            "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
        }
        comp = self._start_addon("jobset", namespace, config, [], probe, timeout)
        configs = []
        for doc in yaml.safe_load_all((self.addon_dir / "jobset-webhooks" / "manifests.yaml").read_text()):
            if not doc:
                continue
            doc["metadata"]["name"] = f"jobset-{doc['metadata']['name']}"
            doc["webhooks"] = [w for w in doc["webhooks"] if "jobset" in w["name"]]
            for w in doc["webhooks"]:
                path = w["clientConfig"]["service"]["path"]
                w["clientConfig"] = {
                    "url": f"https://127.0.0.1:{webhook_port}{path}",
                    "caBundle": _b64(self._pki.ca_pem),
                }
            configs.append(doc)
        self.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": configs})
        )
        return comp

    def start_trainer(self, namespace: str = "kubeflow-system", timeout: float = 120) -> Component:
        """Run the Kubeflow Trainer v2 controller manager and install the torch-distributed runtime.

        Its TrainJob/TrainingRuntime CRDs are among every cluster's CRDs; the JobSet controller it
        creates JobSets for must run too (``start_jobset``). Webhooks unregistered (see above).
        """
        certs = self._addon_certs("trainer-controller-manager")
        # controller-runtime's webhook server reads {TMPDIR}/k8s-webhook-server/serving-certs.
        serving = self.root / "trainer-controller-manager" / "k8s-webhook-server" / "serving-certs"
        serving.mkdir(parents=True, exist_ok=True)
        for f in ("tls.crt", "tls.key"):
            shutil.copy(certs / f, serving / f)
        probe = free_port()
        config = {
            "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
            "kind": "Configuration",
            "health": {
                "healthProbeBindAddress": f"127.0.0.1:{probe}",
                "readinessEndpointName": "readyz",
                "livenessEndpointName": "healthz",
            },
            "metrics": {"bindAddress": f"127.0.0.1:{free_port()}", "secureServing": True},
            "webhook": {"port": free_port(), "host": "127.0.0.1"},
            "leaderElection": {"leaderElect": False},
            "certManagement": {"enable": False},
        }
        comp = self._start_addon("trainer-controller-manager", namespace, config, [], probe, timeout)
        self.install_addon_manifests("trainer/runtimes")
        return comp

    def stop_component(self, comp: Component) -> None:
        """Stop one component started on top of the control plane (e.g. the training-operator)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(comp.proc.pid, signal.SIGTERM)
        try:
            comp.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(comp.proc.pid, signal.SIGKILL)
            comp.proc.wait()
        self.components.remove(comp)

    def stop(self, keep_logs: bool) -> None:
        """Stop the components newest first, each before the next (etcd last), and delete the state.

        The logs survive when ``keep_logs`` is set, for a failed run.
        """
        for comp in reversed(list(self.components)):
            self.stop_component(comp)
        if keep_logs:
            for child in self.root.iterdir():
                if child != self.logs_dir:
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- internals ----------------------------------------------------------------------------

    def _spawn(
        self,
        name: str,
        args: Sequence[str],
        exe: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Component:
        log = self.logs_dir / f"{name}.log"
        cmd = [*(exe or [str(self.bin / name)]), *args]
        with log.open("ab") as fh:
            fh.write(f"$ {' '.join(cmd)}\n".encode())
            fh.flush()
            # A session of its own, so stop() can signal the component without touching pytest.
            proc = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env=env,
            )
        comp = Component(name, proc, log)
        self.components.append(comp)
        return comp

    def _check_components(self) -> None:
        for comp in self.components:
            comp.check_alive()

    @staticmethod
    def _ssl(ca_file: Path | None) -> ssl.SSLContext:
        if ca_file is None:
            # Controller-manager and scheduler serve self-signed certificates on loopback.
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            return ctx
        return ssl.create_default_context(cafile=str(ca_file))

    def _wait_ready(self, url: str, ca_file: Path | None, deadline: float, what: str) -> None:
        ctx = self._ssl(ca_file)
        if ca_file is not None:
            # /readyz is open to anonymous users, but the admin certificate keeps the check honest.
            cfg = yaml.safe_load(self.kubeconfig.read_text())["users"][0]["user"]
            cert = _write(self.pki_dir / "admin.crt", base64.b64decode(cfg["client-certificate-data"]))
            key = _write(self.pki_dir / "admin.key", base64.b64decode(cfg["client-key-data"]))
            ctx.load_cert_chain(str(cert), str(key))
        last = ""
        while time.monotonic() < deadline:
            self._check_components()
            try:
                code, body = _get(url, ctx)
                if code == 200:
                    return
                last = f"HTTP {code}: {body.strip()[-500:]}"
            except (OSError, ssl.SSLError) as e:
                last = str(e)
            time.sleep(0.3)
        raise TimeoutError(f"{what} not ready at {url}: {last}; logs in {self.logs_dir}")

    def _install_crds(self) -> None:
        files = sorted(self.crd_dir.rglob("*.yaml"))
        if not files:
            raise RuntimeError(f"no CRDs under {self.crd_dir}: run `bash tests/cluster/build.sh`")
        args: list[str] = ["apply", "--server-side"]
        for f in files:
            args += ["-f", str(f)]
        self.kubectl(*args)
        self._wait_established("--all")

    def _wait_established(self, *crds: str, timeout: float = 60) -> None:
        """`kubectl wait` for CRDs to be Established, again while one has no status yet.

        kubectl fails at once (`.status.conditions accessor error`) on a CRD the API server has
        not yet given a status, instead of waiting for it.
        """
        deadline = time.monotonic() + timeout
        while True:
            res = self.kubectl(
                "wait", "--for=condition=Established", f"--timeout={timeout:.0f}s", "crd", *crds, check=False
            )
            if res.returncode == 0:
                return
            if "accessor error" not in res.stderr or time.monotonic() > deadline:
                raise RuntimeError(f"kubectl wait for CRDs {' '.join(crds)} failed:\n{res.stderr.strip()}")
            time.sleep(0.5)

    def _wait_nodes_ready(self, deadline: float) -> None:
        last: Any = None
        while time.monotonic() < deadline:
            self._check_components()
            res = self.kubectl("get", "nodes", "-o", "json", check=False)
            if res.returncode == 0:
                items = json.loads(res.stdout)["items"]
                ready = {
                    n["metadata"]["name"]
                    for n in items
                    for c in n.get("status", {}).get("conditions", [])
                    if c["type"] == "Ready" and c["status"] == "True"
                }
                last = sorted(ready)
                if {"cpu-0", "gpu-0"} <= ready:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"nodes not Ready (ready: {last}); see {self.logs_dir / 'node-agent.log'}")
