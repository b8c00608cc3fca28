"""The operator's lifecycle: startup (settings, client, defaults, /metrics), the progress loop and
the periodic sweep that bounds the waits, and cleanup."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf
import kubernetes

from packtrain.operator import logs, metrics, progress
from packtrain.operator import status as st
from packtrain.operator.api import GROUP
from packtrain.operator.handlers.common import RECONCILERS, log, now, write_status
from packtrain.operator.settings import OperatorDefaults
from packtrain.operator.view import CachedKube, Kube

RESYNC_INTERVAL = float(os.environ.get("PACKTRAIN_RESYNC_INTERVAL", "60"))
# Seconds between looks at a parent waiting for its predecessor's children to be garbage-collected.
LEFTOVER_RECHECK = 2.0


# Periodic sweep: bounded waits need a clock, not only events.


def sweep(memo: kopf.Memo, only: frozenset[tuple[str, str, str]] | None = None) -> None:
    """Reconcile every unfinished PackJob and SFTJob from the cache, so deadlines pass without an event.

    `only`: just these (plural, namespace, name), the parents waiting for a predecessor's leftovers.
    """
    seen: set[tuple[str, str, str]] = set()
    for plural in ("packjobs", "sftjobs"):
        for body in memo.view.list_all(plural):
            key = (plural, body["metadata"]["namespace"], body["metadata"]["name"])
            seen.add(key)
            if (only is None or key in only) and (body.get("status") or {}).get("phase") not in st.TERMINAL:
                meta = body["metadata"]
                try:
                    write_status(memo, plural, body)
                except Exception:  # one broken object must not stop the sweep of the others
                    kind = RECONCILERS[plural][0]
                    log.exception(
                        "%s %s/%s: reconcile in the sweep failed",
                        kind,
                        meta["namespace"],
                        meta["name"],
                        extra=logs.ref(kind, meta["namespace"], meta["name"]),
                    )
    if "leftovers" in memo:  # parents deleted while they waited
        memo.leftovers.difference_update(set(memo.leftovers) - seen)


async def _sweep_loop(memo: kopf.Memo) -> None:
    """The full sweep every RESYNC_INTERVAL; between them, every LEFTOVER_RECHECK seconds, the parents
    waiting for a predecessor's leftovers (a ConfigMap's deletion brings no event: none is watched)."""
    loop = asyncio.get_running_loop()
    next_sweep = loop.time() + RESYNC_INTERVAL
    while True:
        await asyncio.sleep(min(RESYNC_INTERVAL, LEFTOVER_RECHECK))
        view = memo.get("view")
        context = view.context if view is not None else None
        if context is None:  # no handler has run yet: nothing is cached to sweep
            continue
        if loop.time() >= next_sweep:
            next_sweep = loop.time() + RESYNC_INTERVAL
            await loop.run_in_executor(None, context.run, sweep, memo)
        elif waiting := frozenset(memo.get("leftovers") or ()):
            await loop.run_in_executor(None, context.run, sweep, memo, waiting)


# Operator lifecycle


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Progress in annotations (the status schema is ours alone), client config, defaults, /metrics."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    memo.kube = Kube()
    memo.latest = {}
    memo.running = set()
    memo.leftovers = set()  # (plural, namespace, name) of parents waiting for a predecessor's children to go
    memo.view = CachedKube(memo.kube, memo.latest)
    memo.defaults = OperatorDefaults.from_env()
    metrics.serve(int(memo.get("metrics_port", 0) or 0))


@kopf.on.startup()
async def start_loops(memo: kopf.Memo, **_: Any) -> None:
    """One progress loop for all running SFTJobs and one deadline sweep (per-object kopf timers would put
    a finalizer on each)."""
    memo.progress_task = asyncio.create_task(
        progress.progress_loop(lambda: memo.view, lambda: sorted(memo.get("running") or ()), now)
    )
    memo.sweep_task = asyncio.create_task(_sweep_loop(memo))


@kopf.on.cleanup()
async def stop_loops(memo: kopf.Memo, **_: Any) -> None:
    for task in (memo.get("progress_task"), memo.get("sweep_task")):
        if task is not None:
            task.cancel()
