"""One reader of PackJob / SFTJob manifests and bare specs, and one message for a key that is not known.

`packtrain run`, `render`, `pack … -c`, `train -c` and the operator all read specs through here, so a
misspelt key is refused the same way everywhere (exit 2, naming the closest valid key) instead of
being ignored by one entry point and silently taking a default.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from packtrain.core.errors import ConfigError

# The top-level keys of a Kubernetes object; any other key of a manifest is a slip.
MANIFEST_KEYS = ("apiVersion", "kind", "metadata", "spec", "status")

M = TypeVar("M", bound=BaseModel)


def unknown_key(where: str, valid: Iterable[str], note: str = "", hint: str | None = None) -> str:
    """The one message for an unknown key at `where` (a dotted path), naming the closest of `valid`."""
    known = sorted(set(valid))
    key = where.rpartition(".")[2]
    if hint is None:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"the keys there are {', '.join(known)}"
    return f"unknown key {where}{note} ({hint})"


def model_keys(model: type[BaseModel]) -> list[str]:
    """The keys a model reads, as YAML writes them (camelCase aliases)."""
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_in(annotation: Any) -> Any:
    """`annotation` without Optional/Annotated; the BaseModel of a union when it has one."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        args = [_model_in(a) for a in get_args(annotation) if a is not type(None)]
        return next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), args[0])
    return annotation


def keys_at(model: type[BaseModel], loc: Sequence[str | int]) -> list[str]:
    """The keys of the model found at a pydantic error location (list indices and map keys skipped)."""
    node: Any = model
    for part in loc:
        node = _model_in(node)
        if isinstance(node, type) and issubclass(node, BaseModel):
            field = next((f for n, f in node.model_fields.items() if part in (n, f.alias)), None)
            if field is None:
                return []
            node = field.annotation
        elif get_args(node):  # list[X] or dict[str, X]: this part is an index or a map key
            node = get_args(node)[-1]
        else:
            return []
    node = _model_in(node)
    return model_keys(node) if isinstance(node, type) and issubclass(node, BaseModel) else []


def describe(
    exc: ValidationError, model: type[BaseModel], prefix: str = "", root_keys: Collection[str] = ()
) -> str:
    """Every fault of `exc` on one line; an unknown key names the closest valid one. `prefix` is where
    `model` sits in the file (e.g. "spec"); `root_keys` are more keys valid beside the model's own."""
    parts = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        where = ".".join(str(p) for p in (*([prefix] if prefix else []), *loc)) or "the spec"
        if error["type"] == "extra_forbidden":
            beside = root_keys if len(loc) == 1 else ()
            parts.append(unknown_key(where, [*keys_at(model, loc[:-1]), *beside]))
        else:
            parts.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def validate(model: type[M], data: Any, context: str, prefix: str = "", root_keys: Collection[str] = ()) -> M:
    """`model` validated from `data`; ConfigError with `context` (where it was read) and `describe`'s line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{context}: {describe(exc, model, prefix, root_keys)}") from exc


def read_documents(path: str | Path) -> list[Any]:
    """The documents of a (multi-document) YAML file; ConfigError saying what to pass instead."""
    try:
        return [d for d in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")) if d is not None]
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file (not valid UTF-8: {exc}); pass a YAML manifest") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration ({exc.strerror or exc})") from exc


def is_manifest(doc: dict[str, Any]) -> bool:
    """A whole Kubernetes object (it says its kind or apiVersion), not a bare spec."""
    return "kind" in doc or "apiVersion" in doc


def manifest_spec(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    """The spec of a `kind` manifest, its top-level keys checked; a bare spec as it is."""
    if not is_manifest(doc):
        return dict(doc)
    if doc.get("kind") not in (None, kind):
        raise ConfigError(f"expected a {kind} manifest, got kind {doc.get('kind')!r}")
    for key in doc:
        if key not in MANIFEST_KEYS:
            raise ConfigError(unknown_key(str(key), MANIFEST_KEYS))
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        got = "none" if spec is None else type(spec).__name__
        raise ConfigError(f"the {kind}'s `spec` must be a mapping, got {got}")
    return dict(spec)


def load_spec_section(path: str | Path, kind: str, model: type[M], cluster_keys: Collection[str]) -> M:
    """The part of a `kind` manifest or bare spec that `model` describes.

    Takes the first document of that kind in a multi-document YAML (else the first document). The
    spec keys only a cluster reads (`cluster_keys`) are set aside, so the YAML applied to a cluster
    also runs locally; any other key `model` does not know is an error naming the closest valid one.
    """
    docs = read_documents(path)
    if not docs:
        raise ConfigError(f"{path}: empty YAML; expected a {kind} manifest or spec")
    if not all(isinstance(d, dict) for d in docs):
        raise ConfigError(f"{path}: every YAML document must be a mapping (a {kind} manifest or spec)")
    chosen = next((d for d in docs if d.get("kind") == kind), docs[0])
    try:
        spec = manifest_spec(chosen, kind)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    prefix = "spec" if is_manifest(chosen) else ""
    local = {k: v for k, v in spec.items() if k not in cluster_keys}
    return validate(model, local, str(path), prefix, cluster_keys)
