"""Before a pack is made: the packer's counting rules against the installed HF processor.

The packer counts vision tokens and writes media by its own rules (fast, no pixels decoded); the
model is served with the processor of whatever transformers is installed. Each built-in probe of
`core/layout.py` (an image, two images, a video) is tokenized both ways with the pack's vision
settings; any difference stops `pack run` with exit 2 before any work, naming where the ids part.
Where the processor cannot be built here (the packer image has no torchvision, which transformers'
video processors need) the check is skipped with a warning: the trainer makes its own layout check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

from packtrain.packer import tokenize
from packtrain.packer.core import families, layout, model_spec, vision
from packtrain.packer.core.config import PackConfig, SourceConfig
from packtrain.packer.core.errors import ConfigError
from packtrain.packer.core.layout import (
    PROBES,
    TRANSFORMERS_FLOOR,
    family_layout,
    layout_difference,
    layout_of_text,
    probe_record,
    processor_ids,
    write_probe_media,
)
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.tokenize import SampleTokenizer, TokenizedSample

_CONTEXT = 6  # tokens shown on each side of the first difference
_COUNTING_CODE = (tokenize, layout, vision, families, model_spec)
_PROCESSING_SUFFIXES = frozenset({".json", ".jinja", ".txt", ".model"})
_MAX_HASHED_BYTES = 64 << 20


def load_processor(model_path: str) -> Any:
    """The model folder's HF processor (never remote code); ImportError/OSError/ValueError when it
    cannot be built here."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoProcessor.from_pretrained(model_path, trust_remote_code=False)


def check_processor(cfg: PackConfig, tokenizer: SampleTokenizer) -> str | None:
    """ConfigError when the packer's ids differ from the installed processor's on any probe; a
    warning (the check could not run here) or None when they agree.

    An agreement is remembered under the cache folder, keyed on everything the ids depend on (the
    model folder's processor and tokenizer files, the vision settings, the chat template, the
    transformers version and packtrain's own counting code), so a re-run skips the ~5 s it costs.
    """
    key = _agreement_key(cfg, tokenizer)
    marker = cache_dir() / "processor-checks" / f"{key}.ok"
    if marker.is_file():
        return None
    warning = _check(cfg, tokenizer)
    if warning is None:
        with contextlib.suppress(OSError):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return warning


def cache_dir() -> Path:
    """`$PACKTRAIN_CACHE_DIR`, else `$XDG_CACHE_HOME/packtrain`, else `~/.cache/packtrain`."""
    if os.environ.get("PACKTRAIN_CACHE_DIR"):
        return Path(os.environ["PACKTRAIN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packtrain"


def _agreement_key(cfg: PackConfig, tokenizer: SampleTokenizer) -> str:
    digest = hashlib.sha256()
    model = tokenizer.model
    facts = [version("transformers"), repr(model.vision), model.family.name, model.chat_template]
    digest.update(json.dumps(facts).encode())
    for module in _COUNTING_CODE:
        digest.update(Path(module.__file__ or "").read_bytes())
    folder = Path(cfg.model.path)
    for path in sorted(folder.iterdir()):
        # Regular files of the folder's own (no link leads outside it), weights left out.
        own = path.is_file() and not path.is_symlink() and path.stat().st_size <= _MAX_HASHED_BYTES
        if own and path.suffix in _PROCESSING_SUFFIXES:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _check(cfg: PackConfig, tokenizer: SampleTokenizer) -> str | None:
    try:
        processor = load_processor(cfg.model.path)
    except (ImportError, OSError, ValueError) as exc:
        return (
            f"the token layout was not checked against transformers {version('transformers')}: its "
            f"processor for {cfg.model.path} cannot be built here ({str(exc).strip().splitlines()[0]}); "
            "the trainer checks it before training"
        )
    with tempfile.TemporaryDirectory(prefix="packtrain-probe-") as tmp:
        folder = Path(tmp)
        write_probe_media(folder)
        source = SourceConfig(paths=[str(folder / "probe.json")], media_root=str(folder))
        ours = SampleTokenizer(source, cfg.model, _probe_packing(cfg), loaded=tokenizer.model)
        for i, probe in enumerate(PROBES):
            sample = ours(RawRecord(folder / "probe.json", i, probe_record(probe), None))
            if not isinstance(sample, TokenizedSample):
                raise ConfigError(
                    f"the built-in {probe.name!r} probe is rejected with these settings ({sample.detail}); "
                    "the counting rules cannot be checked against the processor"
                )
            theirs = processor_ids(processor, probe, folder, ours.model.vision, ours.model.family)
            if sample.input_ids != theirs:
                raise ConfigError(_difference(probe.name, sample.input_ids, theirs, ours, processor))
            if probe.videos or probe.name == "image":
                found = layout_of_text(ours.model.tokenizer.decode(sample.input_ids), ours.model.family)
                wrong = layout_difference(family_layout(ours.model.family), found)
                if wrong:
                    raise ConfigError(f"the packer writes a layout its family does not declare: {wrong}")
    return None


def _probe_packing(cfg: PackConfig) -> Any:
    """The pack's label settings with room for any probe (the probes are short; ids do not depend on it)."""
    return cfg.packing.model_copy(
        update={"max_length": max(cfg.packing.max_length, 4096), "overlong": "error"}
    )


def _difference(
    name: str, ours: list[int], theirs: list[int], tokenizer: SampleTokenizer, processor: Any
) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
    )
    lo = max(0, at - _CONTEXT)

    def show(ids: list[int]) -> str:
        return repr(tokenizer.model.tokenizer.decode(ids[lo : at + _CONTEXT]))

    return (
        f"packtrain's {tokenizer.model.family.name} counting rules disagree with the installed "
        f"transformers {version('transformers')} ({type(processor).__name__}) on the built-in {name!r} "
        f"probe: at token {at} the processor writes {show(theirs)} ({len(theirs)} tokens) where "
        f"packtrain writes {show(ours)} ({len(ours)} tokens). A pack made now would not match the model "
        "served with this transformers: "
        f"install transformers>={TRANSFORMERS_FLOOR} (the range packtrain is tested on), or report the "
        "new layout"
    )
