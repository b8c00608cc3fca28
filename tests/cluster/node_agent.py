"""Node agent: the kubelet stand-in for the test cluster's fake nodes.

The test cluster has no container runtime, so this agent registers the nodes the chart targets
(``cpu-0`` and ``gpu-0``), keeps their leases fresh so the node-lifecycle controller sees them
Ready, and drives the pods the scheduler binds to them through their phases:

* simulate (the default): the pod goes Running, then every container "exits" after
  ``packtrain.dev/node-agent-duration`` seconds (default 0.2) with the code in
  ``packtrain.dev/node-agent-exit-code`` (default 0); nothing is executed.
* run (annotation ``packtrain.dev/node-agent: run``, or ``--run-all``): every container's
  ``command`` + ``args`` really runs as a local process, in this agent's Python environment
  instead of the image. Volumes become local folders (emptyDir and configMap/secret under the
  pod's work dir, PVCs under ``--pvc-root``, hostPath as is) and mount paths in the command, args,
  env values and working dir are rewritten to them; env comes from the pod spec (fieldRef,
  configMap/secret refs and envFrom resolved, so the Job controller's ``JOB_COMPLETION_INDEX``
  works), and a value naming a Service of the pod's namespace (a PyTorchJob's master address)
  resolves to 127.0.0.1. The termination message file is mapped too.
* run in images (``--images``, with run): each container runs inside the root filesystem of its
  pod's ``image``, resolved from the local tags ``images/build.sh`` builds (``rootfs.py``): the
  image's own Python, packages and entrypoint. Volumes are bind-mounted at their mount paths
  (nothing is rewritten), ``command``/``args`` default to the image's ENTRYPOINT/CMD, the
  environment is the image's ENV plus the container's, the working dir is ``workingDir`` or the
  image's WORKDIR (``--workdir`` overrides the latter), the user ``runAsUser``/``runAsGroup``
  (container, then pod, then the image's USER) with the pod's ``fsGroup`` and
  ``supplementalGroups``, which own the pod's emptyDir and claim folders as a kubelet makes them.
  ``--mount HOST:PATH`` adds a read-only folder to every container, as a node's local data.

Either way the agent reports what a kubelet would: phase, container states with exit codes,
reasons and termination messages, restarts under ``restartPolicy: OnFailure``/``Always``, and
it finishes graceful deletions (stopping processes first) so garbage collection completes.

Usage: python tests/cluster/node_agent.py --kubeconfig FILE --work-dir DIR [--run-all] [--pvc-root DIR]
       [--workdir DIR] [--images [--mount HOST:PATH ...]]
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rootfs  # noqa: E402  (beside this file, which runs as a script)

log = logging.getLogger("node-agent")

MODE_ANNOTATION = "packtrain.dev/node-agent"
EXIT_CODE_ANNOTATION = "packtrain.dev/node-agent-exit-code"
DURATION_ANNOTATION = "packtrain.dev/node-agent-duration"
LEASE_SECONDS = 40
# Pods run as local processes sharing this machine's network, and Linux routes all of 127.0.0.0/8
# to loopback: a pod IP from this range reaches whatever the pod serves on 0.0.0.0 (its trainer's
# /metrics), as a real pod IP does on a cluster, so the operator's live progress scrape is exercised.
# The price: the API refuses loopback EndpointSlice addresses, so Services get no endpoints (the
# controller-manager logs FailedToUpdateEndpointSlices); nothing here reads them, as the agent
# resolves a Service name itself.
POD_CIDR = ipaddress.ip_network("127.244.0.0/16")


@dataclass(frozen=True)
class NodeSpec:
    """A fake node; labels and taints follow the chart's default pools."""

    name: str
    labels: dict[str, str]
    capacity: dict[str, str]
    taints: tuple[dict[str, str], ...] = ()


DEFAULT_NODES = (
    NodeSpec(
        "cpu-0",
        {"packtrain.dev/pool": "cpu"},
        {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "500Gi"},
    ),
    NodeSpec(
        "gpu-0",
        {"packtrain.dev/pool": "gpu", "nvidia.com/gpu.present": "true"},
        {"cpu": "96", "memory": "1024Gi", "pods": "110", "ephemeral-storage": "2Ti", "nvidia.com/gpu": "8"},
        ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},),
    ),
)


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_body(spec: NodeSpec) -> dict[str, Any]:
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "packtrain-node-agent",
        **spec.labels,
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels},
        "spec": {"taints": list(spec.taints)},
        "status": node_status(spec),
    }


def node_status(spec: NodeSpec) -> dict[str, Any]:
    t = now()
    return {
        "capacity": spec.capacity,
        "allocatable": spec.capacity,
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": spec.name},
        ],
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "NodeAgentReady",
                "message": "packtrain node agent",
                "lastHeartbeatTime": t,
                "lastTransitionTime": t,
            },
        ],
        "nodeInfo": {
            "architecture": "amd64",
            "operatingSystem": "linux",
            "osImage": "packtrain node agent",
            "kernelVersion": os.uname().release,
            "containerRuntimeVersion": "packtrain-node-agent://1",
            "kubeletVersion": "packtrain-node-agent",
            "kubeProxyVersion": "",
            "bootID": "",
            "machineID": "",
            "systemUUID": "",
        },
    }


# --- pod execution -----------------------------------------------------------------------------


@dataclass
class ContainerResult:
    exit_code: int
    started: str
    finished: str
    message: str = ""

    @property
    def reason(self) -> str:
        return "Completed" if self.exit_code == 0 else "Error"


@dataclass
class PodRun:
    """One bound pod's life on a node: start, run or simulate containers, report, stop on delete."""

    agent: NodeAgent
    pod: Any
    pod_ip: str
    stopping: threading.Event = field(default_factory=threading.Event)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: str = ""
    restarts: dict[str, int] = field(default_factory=dict)
    inits: dict[str, ContainerResult] = field(default_factory=dict)
    running: dict[str, str] = field(default_factory=dict)
    results: dict[str, ContainerResult] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.pod.metadata.namespace}/{self.pod.metadata.name}"

    @property
    def run_mode(self) -> bool:
        ann = self.pod.metadata.annotations or {}
        return self.agent.run_all or ann.get(MODE_ANNOTATION) == "run"

    def start(self) -> None:
        threading.Thread(target=self._main, name=f"pod-{self.key}", daemon=True).start()

    def stop(self, grace: float) -> None:
        """Stop running containers like a kubelet: SIGTERM, then SIGKILL after the grace period."""
        self.stopping.set()
        with self.lock:
            procs = list(self.procs.values())
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def _main(self) -> None:
        try:
            self._lifecycle()
        except Exception as e:  # the agent must survive any one pod's failure
            log.exception("pod %s: agent error", self.key)
            if not self.stopping.is_set():
                self._report_failed_to_start(f"node agent error: {e}")

    def _lifecycle(self) -> None:
        spec = self.pod.spec
        self.started = now()
        self.restarts = {c.name: 0 for c in spec.containers}
        env_cache = self._prepare() if self.run_mode else None

        for c in spec.init_containers or []:
            self._report("Pending")
            res = self._run_container(c, env_cache)
            self.inits[c.name] = res
            if res.exit_code != 0 or self.stopping.is_set():
                self._report("Failed", reason="InitContainerFailed")
                return

        threads = [
            threading.Thread(target=self._container_loop, args=(c, env_cache)) for c in spec.containers
        ]
        for c in spec.containers:
            self.running[c.name] = now()
        self._report("Running")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.stopping.is_set():
            return
        ok = all(r.exit_code == 0 for r in self.results.values())
        self._report("Succeeded" if ok else "Failed")

    def _container_loop(self, c: Any, env_cache: dict[str, Any] | None) -> None:
        policy = self.pod.spec.restart_policy or "Always"
        while True:
            res = self._run_container(c, env_cache)
            restart = policy == "Always" or (policy == "OnFailure" and res.exit_code != 0)
            if not restart or self.stopping.is_set():
                self.results[c.name] = res
                self.running.pop(c.name, None)
                return
            # A kubelet backs off restarts; a short, capped backoff keeps tests quick.
            self.restarts[c.name] += 1
            self.results[c.name] = res
            self.running[c.name] = now()
            self._report("Running")
            if self.stopping.wait(min(10.0, 0.5 * 2 ** (self.restarts[c.name] - 1))):
                return

    # -- simulate or really run one container --------------------------------------------------

    def _run_container(self, c: Any, env_cache: dict[str, Any] | None) -> ContainerResult:
        started = now()
        if env_cache is None:
            ann = self.pod.metadata.annotations or {}
            code = int(ann.get(EXIT_CODE_ANNOTATION, "0"))
            self.stopping.wait(float(ann.get(DURATION_ANNOTATION, "0.2")))
            msg = f"simulated exit code {code}" if code else ""
            return ContainerResult(137 if self.stopping.is_set() else code, started, now(), msg)
        return self._exec(c, env_cache, started)

    def _prepare(self) -> dict[str, Any]:
        """Lay out the pod's volumes as local folders and learn which names resolve to loopback."""
        pod = self.pod
        pod_dir = self.agent.work_dir / "pods" / pod.metadata.namespace / pod.metadata.name
        if pod_dir.exists():
            # A pod re-created under the same name (a PyTorchJob restart): keep the old one's logs.
            n = 1
            while pod_dir.with_name(f"{pod_dir.name}~{n}").exists():
                n += 1
            pod_dir.rename(pod_dir.with_name(f"{pod_dir.name}~{n}"))
        pod_dir.mkdir(parents=True)
        core = client.CoreV1Api(self.agent.api)
        ns = pod.metadata.namespace
        volumes: dict[str, Path] = {}
        for v in pod.spec.volumes or []:
            local = pod_dir / "volumes" / v.name
            if v.host_path is not None:
                local = Path(v.host_path.path)
            elif v.persistent_volume_claim is not None:
                local = self.agent.pvc_root / ns / v.persistent_volume_claim.claim_name
                local.mkdir(parents=True, exist_ok=True)
            elif v.config_map is not None:
                cm = core.read_namespaced_config_map(v.config_map.name, ns)
                _materialize(local, cm.data or {}, v.config_map.items)
            elif v.secret is not None:
                sec = core.read_namespaced_secret(v.secret.secret_name, ns)
                _materialize(local, _decode(sec.data or {}), v.secret.items)
            else:
                local.mkdir(parents=True, exist_ok=True)
            if self.agent.images and (v.persistent_volume_claim is not None or v.empty_dir is not None):
                _own_by_fs_group(local, pod.spec.security_context)
            volumes[v.name] = local
        services = {s.metadata.name for s in core.list_namespaced_service(ns).items}
        hostnames = {pod.spec.hostname} if pod.spec.hostname else set()
        return {"dir": pod_dir, "volumes": volumes, "services": services | hostnames}

    def _exec(self, c: Any, env_cache: dict[str, Any], started: str) -> ContainerResult:
        pod_dir: Path = env_cache["dir"]
        if self.agent.images:
            try:
                image = rootfs.inspect(c.image or "")
                command, cwd, env = self._in_image(c, image, env_cache, pod_dir)
            except (rootfs.ImageNotFound, ValueError) as e:
                return ContainerResult(128, started, now(), f"cannot run container {c.name}: {e}")
            return self._spawn(
                c, command, cwd, env, pod_dir, str(pod_dir / f"{c.name}.termination-log"), started
            )
        command = [*(c.command or []), *(c.args or [])]
        if not c.command:
            return ContainerResult(
                128,
                started,
                now(),
                f"container {c.name} has no command: the node agent cannot run an image's entrypoint; "
                "set command in the pod spec",
            )
        mounts = self._mounts(c, env_cache, pod_dir)
        env = self._env(c, env_cache)
        command = [_rewrite(a, mounts) for a in command]
        # Only what the pod set names paths inside it: the agent's own environment (PATH to this venv,
        # which may itself lie under a path the pod mounts over, such as /tmp) is left as it is.
        host = _agent_env()
        env = {k: v if host.get(k) == v else _rewrite(v, mounts) for k, v in env.items()}
        # Without a workingDir a container starts in its image's WORKDIR: --workdir stands in for it.
        default_cwd = self.agent.workdir or pod_dir / "cwd"
        cwd = Path(_rewrite(c.working_dir, mounts)) if c.working_dir else default_cwd
        cwd.mkdir(parents=True, exist_ok=True)
        term_path = mounts.get(c.termination_message_path or "/dev/termination-log")
        return self._spawn(c, command, cwd, env, pod_dir, term_path, started)

    def _in_image(
        self, c: Any, image: rootfs.Image, env_cache: dict[str, Any], pod_dir: Path
    ) -> tuple[list[str], Path, dict[str, str]]:
        """The command, host cwd and environment that run container `c` inside `image`'s files."""
        if c.command:
            argv = [*c.command, *(c.args or [])]
        else:
            argv = [*image.entrypoint, *(c.args if c.args is not None else image.cmd)]
        if not argv:
            raise ValueError(f"image {image.ref} has no ENTRYPOINT or CMD and the container sets no command")
        mounts = [
            rootfs.Mount(local, target) for target, local in self._mounts(c, env_cache, pod_dir).items()
        ]
        mounts += [rootfs.Mount(src, dst, read_only=True) for src, dst in self.agent.extra_mounts]
        pod_sc, sc = self.pod.spec.security_context, c.security_context
        image_uid, image_gid = rootfs.numeric_user(image.user)
        uid = _first(sc and sc.run_as_user, pod_sc and pod_sc.run_as_user, image_uid)
        gid = _first(sc and sc.run_as_group, pod_sc and pod_sc.run_as_group, image_gid)
        groups = [
            *((pod_sc and pod_sc.supplemental_groups) or []),
            *([pod_sc.fs_group] if pod_sc and pod_sc.fs_group else []),
        ]
        env = {**image.env, **self._env(c, env_cache, base={})}
        workdir = c.working_dir or (str(self.agent.workdir) if self.agent.workdir else image.workdir)
        n = sum(1 for _ in pod_dir.glob(f"{c.name}.rootfs*"))
        command = rootfs.container_argv(
            image,
            argv,
            scratch=pod_dir / f"{c.name}.rootfs{n}",
            env=env,
            mounts=mounts,
            workdir=workdir,
            uid=uid,
            gid=gid,
            groups=groups,
        )
        return command, pod_dir, {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}

    def _spawn(
        self,
        c: Any,
        command: list[str],
        cwd: Path,
        env: dict[str, str],
        pod_dir: Path,
        term_path: str | None,
        started: str,
    ) -> ContainerResult:
        if term_path:
            Path(term_path).unlink(missing_ok=True)
            if self.agent.images:  # bind-mounted into the container: it must exist, writable by its user
                Path(term_path).touch()
                Path(term_path).chmod(0o666)
        log_path = pod_dir / f"{c.name}.log"
        log.info("pod %s container %s: running %s", self.key, c.name, command)
        with log_path.open("ab") as out:
            try:
                proc = subprocess.Popen(
                    command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as e:
                return ContainerResult(127, started, now(), f"cannot start {command[0]}: {e}")
            with self.lock:
                self.procs[c.name] = proc
            code = proc.wait()
        if code < 0:
            code = 128 - code  # killed by a signal, reported as a shell would
        message = ""
        if term_path and Path(term_path).is_file() and Path(term_path).stat().st_size:
            message = Path(term_path).read_text(errors="replace")[-4096:]
        elif code != 0 and (c.termination_message_policy or "File") == "FallbackToLogsOnError":
            lines = log_path.read_text(errors="replace").splitlines()[-80:]
            message = "\n".join(lines)[-2048:]
        return ContainerResult(code, started, now(), message)

    def _mounts(self, c: Any, env_cache: dict[str, Any], pod_dir: Path) -> dict[str, str]:
        mounts: dict[str, str] = {}
        for m in c.volume_mounts or []:
            local = env_cache["volumes"].get(m.name)
            if local is None:
                continue
            if m.sub_path:
                local = local / m.sub_path
            mounts[m.mount_path.rstrip("/") or "/"] = str(local)
        term = c.termination_message_path or "/dev/termination-log"
        mounts[term] = str(pod_dir / f"{c.name}.termination-log")
        return mounts

    def _env(self, c: Any, env_cache: dict[str, Any], base: dict[str, str] | None = None) -> dict[str, str]:
        pod = self.pod
        core = client.CoreV1Api(self.agent.api)
        ns = pod.metadata.namespace
        env = _agent_env() if base is None else dict(base)
        env["HOSTNAME"] = pod.spec.hostname or pod.metadata.name
        for src in c.env_from or []:
            prefix = src.prefix or ""
            if src.config_map_ref is not None:
                data = _optional(
                    lambda r=src.config_map_ref: core.read_namespaced_config_map(r.name, ns).data,
                    src.config_map_ref.optional,
                )
            elif src.secret_ref is not None:
                data = _decode(
                    _optional(
                        lambda r=src.secret_ref: core.read_namespaced_secret(r.name, ns).data,
                        src.secret_ref.optional,
                    )
                    or {}
                )
            else:
                data = {}
            env.update({prefix + k: v for k, v in (data or {}).items()})
        for e in c.env or []:
            if e.value_from is None:
                env[e.name] = _expand(e.value or "", env)
                continue
            vf = e.value_from
            if vf.field_ref is not None:
                env[e.name] = self._field(vf.field_ref.field_path)
            elif vf.config_map_key_ref is not None:
                r = vf.config_map_key_ref
                data = (
                    _optional(lambda r=r: core.read_namespaced_config_map(r.name, ns).data, r.optional) or {}
                )
                if r.key in data:
                    env[e.name] = data[r.key]
            elif vf.secret_key_ref is not None:
                r = vf.secret_key_ref
                data = _decode(
                    _optional(lambda r=r: core.read_namespaced_secret(r.name, ns).data, r.optional) or {}
                )
                if r.key in data:
                    env[e.name] = data[r.key]
            elif vf.resource_field_ref is not None:
                res = c.resources
                kind, _, name = vf.resource_field_ref.resource.partition(".")
                values = (getattr(res, kind, None) or {}) if res else {}
                env[e.name] = str(values.get(name, "0"))
        services: set[str] = env_cache["services"]
        for k, v in env.items():
            if _names_service(v, services, ns):
                env[k] = "127.0.0.1"
        return env

    def _field(self, path: str) -> str:
        pod = self.pod
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return str((getattr(pod.metadata, m.group(1)) or {}).get(m.group(2), ""))
        values = {
            "metadata.name": pod.metadata.name,
            "metadata.namespace": pod.metadata.namespace,
            "metadata.uid": pod.metadata.uid,
            "spec.nodeName": pod.spec.node_name,
            "spec.serviceAccountName": pod.spec.service_account_name or "default",
            "status.podIP": self.pod_ip,
            "status.podIPs": self.pod_ip,
            "status.hostIP": "127.0.0.1",
            "status.hostIPs": "127.0.0.1",
        }
        return str(values.get(path, ""))

    # -- status reporting ---------------------------------------------------------------------

    def _container_status(self, c: Any, phase: str) -> dict[str, Any]:
        name = c.name
        res = self.results.get(name) or self.inits.get(name)
        restarts = self.restarts.get(name, 0)
        base = {
            "name": name,
            "image": c.image or "",
            "imageID": "",
            "restartCount": restarts,
            "containerID": f"packtrain://{self.pod.metadata.uid}/{name}",
        }
        terminated = (
            {
                "exitCode": res.exit_code,
                "reason": res.reason,
                "message": res.message,
                "startedAt": res.started,
                "finishedAt": res.finished,
            }
            if res
            else None
        )
        if name in self.running and phase == "Running":
            st: dict[str, Any] = {
                **base,
                "ready": True,
                "started": True,
                "state": {"running": {"startedAt": self.running[name]}},
            }
            if terminated:
                st["lastState"] = {"terminated": terminated}
            return st
        if terminated:
            return {**base, "ready": False, "started": False, "state": {"terminated": terminated}}
        return {
            **base,
            "ready": False,
            "started": False,
            "state": {
                "waiting": {"reason": "PodInitializing" if phase == "Pending" else "ContainerCreating"}
            },
        }

    def _report(self, phase: str, reason: str | None = None) -> None:
        spec = self.pod.spec
        t = now()
        running = phase == "Running"
        initialized = phase != "Pending"
        conds = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": self.started},
            {"type": "Initialized", "status": str(initialized), "lastTransitionTime": t},
            {"type": "ContainersReady", "status": str(running), "lastTransitionTime": t},
            {"type": "Ready", "status": str(running), "lastTransitionTime": t},
        ]
        if phase in ("Succeeded", "Failed"):
            for cond in conds[2:]:
                cond["reason"] = "PodCompleted"
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": conds,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.started,
            "containerStatuses": [self._container_status(c, phase) for c in spec.containers],
        }
        if spec.init_containers:
            status["initContainerStatuses"] = [self._container_status(c, phase) for c in spec.init_containers]
        if reason:
            status["reason"] = reason
        self.agent.patch_status(self.pod, status)

    def _report_failed_to_start(self, message: str) -> None:
        status = {
            "phase": "Failed",
            "reason": "NodeAgentError",
            "message": message[-1024:],
            "hostIP": "127.0.0.1",
            "podIP": self.pod_ip,
            "startTime": self.started or now(),
        }
        self.agent.patch_status(self.pod, status)


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)


def _own_by_fs_group(folder: Path, pod_sc: Any) -> None:
    """What a kubelet does for fsGroup: the group owns the volume, can write it, and new files inherit it."""
    group = pod_sc.fs_group if pod_sc is not None else None
    if group is None:
        return
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chown(path, -1, group)
        mode = path.stat().st_mode
        path.chmod(mode | 0o060 | (0o2010 if path.is_dir() else 0))


def _materialize(target: Path, data: dict[str, str], items: Any) -> None:
    target.mkdir(parents=True, exist_ok=True)
    pairs = [(i.key, i.path) for i in items] if items else [(k, k) for k in data]
    for key, rel in pairs:
        if key in data:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            (target / rel).write_text(data[key])


def _decode(data: dict[str, str]) -> dict[str, str]:
    import base64

    return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}


def _optional(read: Any, optional: bool | None) -> Any:
    try:
        return read()
    except ApiException as e:
        if e.status == 404 and optional:
            return None
        raise


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; $$(VAR) escapes it."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def _agent_env() -> dict[str, str]:
    """The environment a container starts from: the pod runs in this agent's Python environment
    instead of its image."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _rewrite(value: str, mounts: dict[str, str]) -> str:
    """Replace mount paths at path boundaries with their local folders, longest first, in one pass.

    One pass, so a local folder that itself lies under a mount path (the agent's work dir under
    /tmp, and a pod that mounts an emptyDir at /tmp) is not rewritten a second time.
    """
    names = [m for m in sorted(mounts, key=len, reverse=True) if m != "/"]
    if not names:
        return value
    alternatives = "|".join(map(re.escape, names))
    return re.sub(rf"(?<![\w.-])(?:{alternatives})(?=/|$|[^\w.-])", lambda m: mounts[m.group(0)], value)


def _names_service(value: str, services: set[str], ns: str) -> bool:
    if not value or not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?", value):
        return False
    parts = value.split(".")
    if parts[0] not in services:
        return False
    rest = parts[1:]
    return rest in ([], [ns], [ns, "svc"], [ns, "svc", "cluster", "local"])


# --- the agent ---------------------------------------------------------------------------------


class NodeAgent:
    """Registers the nodes, renews their leases and runs the pods bound to them."""

    def __init__(
        self,
        api: client.ApiClient,
        work_dir: Path,
        nodes: tuple[NodeSpec, ...] = DEFAULT_NODES,
        run_all: bool = False,
        pvc_root: Path | None = None,
        workdir: Path | None = None,
        images: bool = False,
        extra_mounts: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.work_dir = work_dir
        self.nodes = {n.name: n for n in nodes}
        self.run_all = run_all
        self.pvc_root = pvc_root or work_dir / "pvc"
        self.workdir = workdir
        self.images = images
        self.extra_mounts = extra_mounts
        self.runs: dict[str, PodRun] = {}
        self.deleting: set[str] = set()
        self._ips = (str(ip) for ip in itertools.islice(POD_CIDR.hosts(), 1, None))
        self._stop = threading.Event()

    def register_nodes(self) -> None:
        for spec in self.nodes.values():
            body = node_body(spec)
            try:
                self.core.create_node(body)
            except ApiException as e:
                if e.status != 409:
                    raise
                self.core.patch_node(
                    spec.name, {"metadata": {"labels": body["metadata"]["labels"]}, "spec": body["spec"]}
                )
            self.core.patch_node_status(spec.name, {"status": node_status(spec)})
            log.info("node %s registered", spec.name)

    def renew_leases(self) -> None:
        coord = client.CoordinationV1Api(self.api)
        while not self._stop.is_set():
            for name in self.nodes:
                body = {
                    "metadata": {"name": name, "namespace": "kube-node-lease"},
                    "spec": {
                        "holderIdentity": name,
                        "leaseDurationSeconds": LEASE_SECONDS,
                        "renewTime": micro_now(),
                    },
                }
                try:
                    try:
                        coord.patch_namespaced_lease(name, "kube-node-lease", {"spec": body["spec"]})
                    except ApiException as e:
                        if e.status != 404:
                            raise
                        coord.create_namespaced_lease("kube-node-lease", body)
                except Exception:
                    log.exception("renewing lease of node %s", name)
            self._stop.wait(10)

    def patch_status(self, pod: Any, status: dict[str, Any]) -> None:
        try:
            self.core.patch_namespaced_pod_status(
                pod.metadata.name, pod.metadata.namespace, {"status": status}
            )
        except ApiException as e:
            if e.status != 404:  # deleted meanwhile
                raise

    def handle(self, pod: Any) -> None:
        if pod.spec.node_name not in self.nodes:
            return
        uid = pod.metadata.uid
        run = self.runs.get(uid)
        if pod.metadata.deletion_timestamp is not None:
            if uid in self.deleting:
                return
            self.deleting.add(uid)
            threading.Thread(target=self._finish_deletion, args=(pod, run), daemon=True).start()
            return
        if run is not None or pod.status.phase in ("Succeeded", "Failed"):
            return
        run = PodRun(self, pod, next(self._ips))
        self.runs[uid] = run
        log.info(
            "pod %s/%s bound to %s: %s",
            pod.metadata.namespace,
            pod.metadata.name,
            pod.spec.node_name,
            "run" if run.run_mode else "simulate",
        )
        run.start()

    def _finish_deletion(self, pod: Any, run: PodRun | None) -> None:
        """What a kubelet does for a graceful delete: stop the containers, then remove the pod."""
        if run is not None and not run.stopping.is_set():
            run.stop(min(float(pod.metadata.deletion_grace_period_seconds or 30), 30.0))
        try:
            self.core.delete_namespaced_pod(
                pod.metadata.name,
                pod.metadata.namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=pod.metadata.uid)
                ),
            )
        except ApiException as e:
            if e.status not in (404, 409):
                raise
        self.runs.pop(pod.metadata.uid, None)
        self.deleting.discard(pod.metadata.uid)

    def serve(self) -> None:
        self.register_nodes()
        threading.Thread(target=self.renew_leases, name="leases", daemon=True).start()
        w = watch.Watch()
        while not self._stop.is_set():
            try:
                self._list_and_watch(w)
            except ApiException as e:
                if e.status != 410:  # a stale resourceVersion just means: list again
                    log.exception("pod watch failed; listing again")
                    time.sleep(1)
            except Exception:
                # A dropped connection or a slow API server must not take the node down.
                log.exception("pod watch failed; listing again")
                time.sleep(1)

    def _list_and_watch(self, w: watch.Watch) -> None:
        pods = self.core.list_pod_for_all_namespaces()
        for pod in pods.items:
            self.handle(pod)
        for event in w.stream(
            self.core.list_pod_for_all_namespaces,
            resource_version=pods.metadata.resource_version,
            timeout_seconds=300,
            allow_watch_bookmarks=True,
        ):
            if event["type"] in ("ADDED", "MODIFIED"):
                self.handle(event["object"])
            elif event["type"] == "DELETED":
                run = self.runs.pop(event["object"].metadata.uid, None)
                if run is not None:
                    run.stop(0)

    def shutdown(self, *_: Any) -> None:
        self._stop.set()
        for run in list(self.runs.values()):
            run.stop(2)
        sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--work-dir", required=True, type=Path, help="pod folders, logs and emptyDir volumes")
    p.add_argument("--pvc-root", type=Path, help="where PersistentVolumeClaims live (default: WORK_DIR/pvc)")
    p.add_argument("--run-all", action="store_true", help="run every pod's commands, not only annotated pods")
    p.add_argument(
        "--workdir",
        type=Path,
        help="working dir of containers that set none, as an image's WORKDIR (default: the pod's folder)",
    )
    p.add_argument(
        "--images",
        action="store_true",
        help="run containers inside their image's root filesystem (local tags; needs root)",
    )
    p.add_argument(
        "--mount",
        action="append",
        default=[],
        metavar="HOST:PATH",
        help="with --images: a read-only folder in every container (repeatable)",
    )
    args = p.parse_args(argv)
    mounts = tuple(tuple(m.split(":", 1)) for m in args.mount)
    if any(len(m) != 2 or not m[1].startswith("/") for m in mounts):
        p.error("--mount takes HOST:PATH with an absolute PATH")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    agent = NodeAgent(
        config.new_client_from_config(config_file=args.kubeconfig),
        args.work_dir,
        run_all=args.run_all,
        pvc_root=args.pvc_root,
        workdir=args.workdir,
        images=args.images,
        extra_mounts=mounts,  # type: ignore[arg-type]
    )
    signal.signal(signal.SIGTERM, agent.shutdown)
    signal.signal(signal.SIGINT, agent.shutdown)
    agent.serve()


if __name__ == "__main__":
    main()
