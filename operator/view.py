"""The operator's view of the cluster: API writes, and reads served from kopf indexes.

`Kube` makes the few API calls the operator needs. `CachedKube` answers the reconcilers'
reads (Jobs, pods, training jobs, PackJobs, SFTJobs) from the indexes kopf keeps from
the watches it runs anyway, so an event costs no API read. The cache lags the API by one
watch event at most; that is safe because every create is "if absent" (on a 409 the object
there is read, and used only if the parent owns it) and every status write is conditional
on the resourceVersion read. Our own status writes are remembered (`latest`) so the next
event does not compute from the status just replaced.
"""

from __future__ import annotations

import builtins
import contextvars
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import Any, cast

import kubernetes
from kubernetes.client.rest import ApiException

from packtrain.operator.api import GROUP, VERSION
from packtrain.operator.children import CHILD_KINDS
from packtrain.operator.names import JOB_NAME_LABEL, SFTJOB_LABEL

PLURALS = {"Job": "jobs", **{c.kind: c.plural for c in CHILD_KINDS}}
# plural -> the kopf index (a handler function's name in `handlers`) holding those objects by (namespace,
# name).
INDEX_OF = {
    "jobs": "job_index",
    **{c.plural: c.index for c in CHILD_KINDS},
    "packjobs": "packjob_index",
    "sftjobs": "sftjob_index",
}
PLURAL_OF_KIND = {**PLURALS, "ConfigMap": "configmaps"}
# How long a child this process created counts as existing while its watch event is on the way.
CREATED_GRACE = 30.0
# pod label -> the index holding the pods by (label, namespace, value).
POD_INDEX_OF = {JOB_NAME_LABEL: "pack_pod_index", SFTJOB_LABEL: "sft_pod_index"}


class Kube:
    """The few API calls the operator makes, returning plain camelCase dicts."""

    def __init__(self, client: kubernetes.client.ApiClient | None = None) -> None:
        self.client = client or kubernetes.client.ApiClient()
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.core = kubernetes.client.CoreV1Api(self.client)

    def get(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return cast(
                dict[str, Any],
                self.custom.get_namespaced_custom_object(group, version, namespace, plural, name),
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, group: str, version: str, plural: str, namespace: str) -> builtins.list[dict[str, Any]]:
        found = cast(
            dict[str, Any], self.custom.list_namespaced_custom_object(group, version, namespace, plural)
        )
        return cast(builtins.list[dict[str, Any]], found.get("items", []))

    def create(self, body: dict[str, Any]) -> bool:
        """Create unless it exists; True when this call created it."""
        group, _, version = body["apiVersion"].rpartition("/")
        namespace = body["metadata"]["namespace"]
        try:
            if body["kind"] == "ConfigMap":
                # The client serializes a plain dict as it is; its stub names only the model class.
                self.core.create_namespaced_config_map(namespace, body)  # type: ignore[arg-type]
            else:
                self.custom.create_namespaced_custom_object(
                    group, version, namespace, PLURALS[body["kind"]], body
                )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def read(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """The object `body` names (its kind, namespace and name) as the API server has it; None if absent."""
        meta = body["metadata"]
        if body["kind"] != "ConfigMap":
            group, _, version = body["apiVersion"].rpartition("/")
            return self.get(group, version, PLURALS[body["kind"]], meta["namespace"], meta["name"])
        try:
            found = self.core.read_namespaced_config_map(meta["name"], meta["namespace"])
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(self.client.sanitize_for_serialization(found))

    def patch(self, group: str, version: str, plural: str, namespace: str, name: str, body: dict) -> None:
        self.custom.patch_namespaced_custom_object(group, version, namespace, plural, name, body)

    def delete(self, group: str, version: str, plural: str, namespace: str, name: str, *, uid: str) -> None:
        """Delete the object of this `uid` with its pods (background garbage collection).

        The uid precondition pins the delete to the object that was checked: one re-created under the
        name since is refused (409), like one already gone (404); both are fine.
        """
        options = kubernetes.client.V1DeleteOptions(
            propagation_policy="Background", preconditions=kubernetes.client.V1Preconditions(uid=uid)
        )
        try:
            self.custom.delete_namespaced_custom_object(group, version, namespace, plural, name, body=options)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def patch_status(
        self, plural: str, namespace: str, name: str, status: dict[str, Any], resource_version: str
    ) -> dict[str, Any]:
        """Merge-patch the status, refused (409) if the object changed since `resource_version` was read."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        patched = self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, plural, name, body
        )
        return cast(dict[str, Any], patched)

    def merge_status(self, plural: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch part of the status unconditionally (fields no reconcile derives, like progress)."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, plural, name, {"status": status}
        )

    def pods(self, namespace: str, selector: str) -> builtins.list[dict[str, Any]]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items
        return [self.client.sanitize_for_serialization(p) for p in pods]


def _version(body: Mapping[str, Any] | None) -> int:
    try:
        return int(((body or {}).get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:  # resourceVersions are opaque; etcd's are integers, anything else is "unknown"
        return 0


def _owners(body: Mapping[str, Any]) -> list[Any]:
    return [ref.get("uid") for ref in (body.get("metadata") or {}).get("ownerReferences") or ()]


class CachedKube:
    """`Kube`'s surface with reads from kopf indexes (and the API for what no index holds)."""

    def __init__(self, kube: Kube, latest: MutableMapping[tuple[str, str, str], dict[str, Any]]) -> None:
        self.kube = kube
        self.latest = latest
        self.indexes: Mapping[str, Any] = {}
        self.context: contextvars.Context | None = None  # a handler's, for work outside handlers (the sweep)
        # Children created (or found existing) by this process, until the watch shows them.
        self._created: dict[tuple[str, str, str], tuple[float, dict[str, Any]]] = {}
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        self._lock = threading.Lock()

    def _recent(self, key: tuple[str, str, str]) -> dict[str, Any] | None:
        with self._lock:
            seen = self._created.get(key)
            if seen is None:
                return None
            if time.monotonic() - seen[0] > CREATED_GRACE:
                del self._created[key]
                return None
            return seen[1]

    def _read(self, index: str | None, key: tuple[str, ...]) -> builtins.list[dict[str, Any]] | None:
        """What kopf index `index` holds under `key`; None where no such index is filled (ask the API)."""
        if index is None or index not in self.indexes:
            return None
        return [dict(body) for body in self.indexes[index].get(key) or ()]

    def get(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        held = self._read(INDEX_OF.get(plural), (namespace, name))
        if held is None:
            return self.kube.get(group, version, plural, namespace, name)
        found = next(iter(held), None)
        if found is None:
            return self._recent((plural, namespace, name))
        with self._lock:
            self._created.pop((plural, namespace, name), None)
        mine = self.latest.get((plural, namespace, name))
        if (
            found is not None
            and mine is not None
            and found["metadata"].get("uid") == mine["metadata"].get("uid")
        ):
            return mine if _version(mine) > _version(found) else found
        return found

    def list(self, group: str, version: str, plural: str, namespace: str) -> builtins.list[dict[str, Any]]:
        return [b for b in self.list_all(plural) if b["metadata"].get("namespace") == namespace]

    def list_all(self, plural: str) -> builtins.list[dict[str, Any]]:
        index = self.indexes.get(INDEX_OF[plural])
        if index is None:
            return []
        bodies = [next(iter(store)) for store in index.values() if store]
        return [
            self.get(GROUP, VERSION, plural, b["metadata"]["namespace"], b["metadata"]["name"]) or b
            for b in bodies
        ]

    def pods(self, namespace: str, selector: str) -> builtins.list[dict[str, Any]]:
        label, _, value = selector.partition("=")
        held = self._read(POD_INDEX_OF.get(label), (label, namespace, value))
        return self.kube.pods(namespace, selector) if held is None else held

    def create(self, body: dict[str, Any]) -> bool:
        """Create unless this process made it for the same owner moments ago and the watch has not shown it
        yet.

        One made for an earlier owner of the same name (a parent deleted and created again) does not
        count: the API decides, and the caller reads what is there (`read`) when it already exists.
        """
        meta = body["metadata"]
        key = (PLURAL_OF_KIND.get(body["kind"], body["kind"]), meta["namespace"], meta["name"])
        with self._lock:  # claimed before the call: a racing reconcile of the same parent skips it
            seen = self._created.get(key)
            fresh = seen is not None and time.monotonic() - seen[0] <= CREATED_GRACE
            if fresh and seen is not None and _owners(seen[1]) == _owners(body):
                return False
            self._created[key] = (time.monotonic(), body)
        created = False
        try:
            created = self.kube.create(body)
            return created
        finally:
            if not created:  # not made by this call: nothing to remember
                with self._lock:
                    self._created.pop(key, None)

    def read(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """What exists under `body`'s name: the one this process just created, else the API's answer
        (not the cache: this is asked when a create met an object the cache does not show)."""
        meta = body["metadata"]
        mine = self._recent((PLURAL_OF_KIND.get(body["kind"], body["kind"]), meta["namespace"], meta["name"]))
        if mine is not None and _owners(mine) == _owners(body):
            return mine
        return self.kube.read(body)

    def lock(self, plural: str, namespace: str, name: str) -> threading.Lock:
        """One writer per parent at a time: events of its children arrive on several threads at once."""
        with self._lock:
            return self._locks.setdefault((plural, namespace, name), threading.Lock())

    def wait_newer(
        self, plural: str, namespace: str, name: str, than: str, timeout: float = 2.0
    ) -> dict | None:
        """The cached object once its resourceVersion differs from `than` (a write we lost to), else None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.get(GROUP, VERSION, plural, namespace, name)
            if found is None or found["metadata"].get("resourceVersion") != than:
                return found
            time.sleep(0.05)
        return None

    def patch(self, group: str, version: str, plural: str, namespace: str, name: str, body: dict) -> None:
        self.kube.patch(group, version, plural, namespace, name, body)

    def delete(self, group: str, version: str, plural: str, namespace: str, name: str, *, uid: str) -> None:
        self.kube.delete(group, version, plural, namespace, name, uid=uid)

    def patch_status(
        self, plural: str, namespace: str, name: str, status: dict[str, Any], resource_version: str
    ) -> dict[str, Any]:
        written = self.kube.patch_status(plural, namespace, name, status, resource_version)
        if isinstance(written, dict) and written.get("metadata"):
            self.latest[(plural, namespace, name)] = written
        return written

    def merge_status(self, plural: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.kube.merge_status(plural, namespace, name, status)
