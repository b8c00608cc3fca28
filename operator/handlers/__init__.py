"""kopf handlers: read the cached view, ask `builders`/`status` what to do, write the result.

One module per kind (`packjob.py`, `sftjob.py`) over what both share (`common.py`: creating owned
children, the conditional status write, the indexes) and the operator's startup and sweep
(`lifecycle.py`). Importing this package registers every handler with kopf.

Event-driven, without kopf timers or daemons, so kopf puts no finalizer on
PackJobs or SFTJobs: deleting one never waits for the operator, and the garbage
collector removes the children it owns. A parent is reconciled when it is created
or the operator starts (`resume`), on every event of a child it owns (Jobs, pods,
PyTorchJobs/TrainJobs; SFTJobs also on their PackJob's events), and by one sweep
every `RESYNC_INTERVAL` seconds that bounds the waits (`status.Deadlines`).

Reads come from kopf indexes (`view.CachedKube`), filled by the watches kopf runs anyway,
so an event costs no API read. Every create is "if absent" under a deterministic name,
so a restart mid-run, a stale cache or two events racing never makes a duplicate; a child
counts only if its ownerReference carries the parent's uid (`ownership`), so a parent
re-created under the same name waits for its predecessor's children to go; every
status write is conditional on the resourceVersion it was computed from, so a stale view
never overwrites a newer one.
"""

from __future__ import annotations

# Importing the modules registers their kopf handlers (indexes, events, startup): `packtrain operator`
# imports this package for that.
from packtrain.operator.handlers import common, lifecycle, packjob, sftjob
from packtrain.operator.handlers.common import write_status
from packtrain.operator.handlers.packjob import reconcile_packjob
from packtrain.operator.handlers.sftjob import reconcile_sftjob
from packtrain.operator.view import Kube

__all__ = [
    "Kube",
    "common",
    "lifecycle",
    "packjob",
    "reconcile_packjob",
    "reconcile_sftjob",
    "sftjob",
    "write_status",
]
