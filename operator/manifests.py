"""The PackJobs and SFTJobs of a YAML file, validated as the operator validates them.

`packtrain run` and `packtrain render` read the same files with this one loader, so a manifest
is read, checked and refused the same way by both (and as the operator would refuse it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packtrain.core.errors import ConfigError
from packtrain.core.spec_file import manifest_spec, read_documents, validate
from packtrain.operator.api import GROUP, PackJob, SFTJob

KINDS: dict[str, type[PackJob] | type[SFTJob]] = {"PackJob": PackJob, "SFTJob": SFTJob}


@dataclass(frozen=True)
class Named:
    """A validated PackJob or SFTJob spec, with its manifest's name and namespace."""

    name: str
    namespace: str
    spec: Any


@dataclass
class Manifests:
    """What a file holds, in file order: PackJobs, SFTJobs, and (for render) every other object."""

    packs: list[Named] = field(default_factory=list)
    sfts: list[Named] = field(default_factory=list)
    others: list[dict[str, Any]] = field(default_factory=list)


def invalid(path: Path, kind: str, name: str) -> str:
    """How a fault of one object of a file is introduced (before the fault's own line)."""
    return f"{path}: {kind} {name} is invalid"


def load_manifests(path: Path, keep_others: bool = False) -> Manifests:
    """Every document of the (multi-document) YAML `path`; ValueError naming the document and the fault.

    With `keep_others` (render), an object that is not a PackJob or SFTJob of packtrain's API group
    goes to `others`, as `helm template` prints objects it does not template. Without it (run),
    every document must be a PackJob or SFTJob, whatever its apiVersion says.
    """
    docs = read_documents(path)
    found = Manifests()
    expected = "a Kubernetes object" if keep_others else "a PackJob or SFTJob manifest"
    for n, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ValueError(f"{path} document {n}: a {type(doc).__name__}; expected {expected}")
        kind, meta = doc.get("kind"), doc.get("metadata") or {}
        ours = kind in KINDS and str(doc.get("apiVersion", "")).startswith(f"{GROUP}/")
        if keep_others and not ours:
            found.others.append(doc)
            continue
        if kind not in KINDS:
            raise ValueError(f"{path} document {n}: kind {kind!r}; expected PackJob or SFTJob")
        name = meta.get("name")
        if not name:
            raise ValueError(f"{path} document {n}: {kind} needs metadata.name")
        where = invalid(path, kind, name)
        try:
            spec_doc = manifest_spec(doc, kind)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        spec = validate(KINDS[kind], {"spec": spec_doc}, where).spec
        (found.packs if kind == "PackJob" else found.sfts).append(
            Named(name, meta.get("namespace", "default"), spec)
        )
    if not found.packs and not found.sfts:
        raise ValueError(f"{path} holds no PackJob or SFTJob")
    return found
