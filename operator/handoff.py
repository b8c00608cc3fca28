"""What `packtrain render` checks before a spec reaches a cluster, beyond what the API server refuses.

A spec can be valid and still not work in its pods: a local path (`/tmp/data.json`, a relative
`train.json`) renders fine and fails minutes later in a pod where nothing is mounted there, and a
training job too big for its GPUs fails only when the operator plans it. Both are said here,
at the hand-off, with what to change: the paths against the claims the rendered pods mount, the
memory with the operator's own plan (`status/memory.py`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from packtrain.core.errors import ConfigError
from packtrain.core.model_size import planning_config, read_config
from packtrain.operator import policy
from packtrain.operator.api import SFT_MODEL_MOUNT, ClaimMount, PackJobSpec, SFTJobSpec
from packtrain.operator.status.memory import START_UP_NOTE, context_parallel_refusal, memory_verdict

ALLOW_UNMOUNTED = "--allow-unmounted"
EXAMPLE_MOUNT = "/datasets"
EXAMPLE_CLAIM = "my-claim"


def pack_paths(spec: PackJobSpec) -> list[tuple[str, str]]:
    """Every path a PackJob's pods read, with the field that names it (its output is its own claim)."""
    found = [(f"source.paths[{i}]", p) for i, p in enumerate(spec.source.paths)]
    if spec.source.media_root:
        found.append(("source.mediaRoot", spec.source.media_root))
    # A relative target resolves against mediaRoot or the dataset file's folder, checked above.
    found += [
        (f"source.mediaPathMap[{key!r}]", target)
        for key, target in spec.source.media_path_map.items()
        if target.startswith("/")
    ]
    found.append(("model.path", spec.model.path))
    if spec.model.chat_template:
        found.append(("model.chatTemplate", spec.model.chat_template))
    return found


def sft_paths(spec: SFTJobSpec) -> list[tuple[str, str]]:
    """Every path an SFTJob's pods read (its output goes to its checkpoints claim, set by the operator)."""
    found = [("model.path", spec.model.path)]
    if spec.data.path:
        found.append(("data.path", spec.data.path))
    if spec.data.eval_path:
        found.append(("data.evalPath", spec.data.eval_path))
    return found


def claim_mounts(objects: Iterable[Any]) -> set[str]:
    """Where the pod specs in `objects` mount a PersistentVolumeClaim. Their emptyDir `/tmp` and the
    config folder are mounts too, but hold nothing the spec's author put there."""
    found: set[str] = set()
    stack = list(objects)
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
        elif isinstance(node, Mapping):
            if isinstance(node.get("volumes"), list) and isinstance(node.get("containers"), list):
                claims = {v["name"] for v in node["volumes"] if "persistentVolumeClaim" in v}
                found.update(
                    m["mountPath"]
                    for c in node["containers"]
                    for m in c.get("volumeMounts", [])
                    if m["name"] in claims
                )
            stack += list(node.values())
    return found


def mounted(path: str, mounts: Iterable[str]) -> bool:
    """Whether the absolute `path` lies on one of `mounts` (a relative one resolves against the
    image's working directory, `~` against the pod's HOME, the emptyDir /tmp: never)."""
    if not path.startswith("/"):
        return False
    norm = posixpath.normpath(path)
    return any(norm == m or norm.startswith(m.rstrip("/") + "/") for m in mounts)


def _pack_fix(paths: Sequence[str], mounts: set[str]) -> str:
    """The `spec.volumes` entry to add: at the paths' own top folder when a claim may go there (the
    paths then stay as written), else at /datasets."""
    tops = {"/" + p.split("/")[1] if p.startswith("/") else "" for p in paths}
    where, then = EXAMPLE_MOUNT, f"then write them under {EXAMPLE_MOUNT}"
    if len(tops) == 1 and (top := tops.pop()) not in mounts:
        try:
            ClaimMount(name="datasets", claim_name=EXAMPLE_CLAIM, mount_path=top)
            where, then = top, "the paths stay as written"
        except ValidationError:
            pass  # relative, or an image folder (/tmp, /home, ...) no claim may cover
    snippet = f"volumes: [{{name: datasets, claimName: {EXAMPLE_CLAIM}, mountPath: {where}}}]"
    return f"put them on a PersistentVolumeClaim and add it to the PackJob's spec: `{snippet}` ({then})"


def _sft_fix(fields: Sequence[str], spec: SFTJobSpec, data_mount: str) -> str:
    fixes = []
    if "model.path" in fields:
        if spec.volumes.model is None:
            snippet = f"volumes: {{model: {{claimName: {EXAMPLE_CLAIM}}}}}"
            fixes.append(
                f"put the model on a PersistentVolumeClaim, add `{snippet}` to the SFTJob's spec (mounted "
                f"at {SFT_MODEL_MOUNT}) and write model.path under {SFT_MODEL_MOUNT}, or put it on the data "
                f"claim and write it under {data_mount}"
            )
        else:
            fixes.append(f"write model.path under {SFT_MODEL_MOUNT}, where spec.volumes.model is mounted")
    if any(f.startswith("data.") for f in fields):
        fixes.append(f"write the data paths under {data_mount}, where the data claim is mounted")
    return "; ".join(fixes)


def unmounted(kind: str, name: str, paths: Sequence[tuple[str, str]], mounts: set[str], fix: str) -> str:
    """One line naming the paths no claim covers and what to change, or '' when all are covered."""
    bad = [(f, p) for f, p in paths if not mounted(p, mounts)]
    if not bad:
        return ""
    named = ", ".join(f"{f} {p!r}" for f, p in bad)
    return (
        f"{kind} {name}: {named} {'is' if len(bad) == 1 else 'are'} on no volume its pods mount (claims at "
        f"{', '.join(sorted(mounts))}; a relative path resolves against the image's working directory): "
        f"{fix}; or pass {ALLOW_UNMOUNTED} if the image or the nodes provide them"
    )


def pack_unmounted(name: str, spec: PackJobSpec, children: Sequence[Any]) -> str:
    mounts = claim_mounts(children)
    paths = pack_paths(spec)
    fix = _pack_fix([p for _, p in paths if not mounted(p, mounts)], mounts)
    return unmounted("PackJob", name, paths, mounts, fix)


def sft_unmounted(name: str, spec: SFTJobSpec, child: Any, data_mount: str) -> str:
    mounts = claim_mounts([child])
    paths = sft_paths(spec)
    bad = [f for f, p in paths if not mounted(p, mounts)]
    return unmounted("SFTJob", name, paths, mounts, _sft_fix(bad, spec, data_mount))


def local_sizes(folder: str) -> dict[str, Any] | None:
    """What the PackJob's convert stage would report as `status.modelSizes`, read on this machine."""
    try:
        return planning_config(read_config(folder))
    except ConfigError:
        return None


def memory_plan(
    name: str, spec: SFTJobSpec, pack: PackJobSpec | None, rules: policy.Policy
) -> tuple[str | None, str | None]:
    """The operator's memory plan of an SFTJob: (why it cannot fit, None) or (None, a note when it
    could not be planned here). The model's sizes come from model.path's config.json when this
    machine has it, as the PackJob's convert stage reports them in the cluster. Context parallelism
    is checked against the world first, and against the attention heads with the sizes."""
    if (split := context_parallel_refusal(spec)) is not None:
        return f"SFTJob {name}: {split}", None
    if spec.resources.gpus_per_node == 0:
        return None, None
    sizes = local_sizes(pack.model.path) if pack is not None else None
    if pack is not None and sizes is None:
        return None, (
            f"SFTJob {name}: GPU memory not planned here: model.path {pack.model.path!r} has no readable "
            f"config.json on this machine; the operator plans it from what PackJob "
            f"{spec.data.pack_job_ref} reports, and {START_UP_NOTE}"
        )
    verdict = memory_verdict(spec, rules, pack, {"modelSizes": sizes} if sizes else None)
    if verdict.invalid is not None:
        return f"SFTJob {name}: {verdict.invalid}", None
    if verdict.refusal is not None:
        return f"SFTJob {name}: {verdict.refusal}", None
    if not verdict.planned:
        return None, f"SFTJob {name}: GPU memory {verdict.status['message']}"
    return None, None
