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
import json
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

from packtrain.core import families, layout, model_spec, vision
from packtrain.core.config import PackConfig, SourceConfig
from packtrain.core.errors import ConfigError
from packtrain.core.layout import (
    PROCESSING_SUFFIXES,
    TRANSFORMERS_FLOOR,
    Probe,
    cache_dir,
    family_layout,
    family_probes,
    layout_difference,
    layout_of_text,
    probe_record,
    processing_digest,
    processor_ids,
    write_probe_media,
)
from packtrain.core.model_spec import served_processor_configs
from packtrain.packer import tokenize
from packtrain.packer.sources.raw import RawRecord
from packtrain.packer.tokenize import Reject, SampleTokenizer, TokenizedSample

_CONTEXT = 6  # tokens shown on each side of the first difference
_COUNTING_CODE = (tokenize, layout, vision, families, model_spec)


def load_processor(cfg: PackConfig, folder: Path) -> Any:
    """The processor the model is served with after training on this pack: the model folder's
    processing files with the pack's vision settings written over them (`served_processor_configs`,
    what the trainer exports), built in `folder` (never remote code). ImportError/OSError/ValueError
    when it cannot be built here."""
    import transformers

    model = Path(cfg.model.path)
    for path in model.iterdir():
        if path.suffix in PROCESSING_SUFFIXES and path.is_file() and not path.is_symlink():
            shutil.copyfile(path, folder / path.name)
    for name, config in served_processor_configs(model, cfg.model).items():
        (folder / name).write_text(json.dumps(config))
    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoProcessor.from_pretrained(str(folder), trust_remote_code=False)


def check_processor(cfg: PackConfig, tokenizer: SampleTokenizer) -> str | None:
    """ConfigError when the packer's ids differ from the installed processor's on any probe; a
    warning (the check could not run here) or None when they agree.

    An agreement is remembered under the cache folder, keyed on everything the ids depend on (the
    model folder's processor and tokenizer files, the vision settings, the chat template, the
    transformers version and packtrain's own counting code), so a re-run skips the ~5 s it costs.
    """
    marker = cache_dir() / "processor-checks" / f"{_agreement_key(cfg, tokenizer)}.ok"
    if marker.is_file():
        return None
    warning = _check(cfg, tokenizer)
    if warning is None:
        with contextlib.suppress(OSError):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return warning


def _agreement_key(cfg: PackConfig, tokenizer: SampleTokenizer) -> str:
    model = tokenizer.model
    facts = [repr(model.vision), model.family.name, model.chat_template]
    code = [Path(m.__file__ or "").read_bytes() for m in _COUNTING_CODE]
    return processing_digest(Path(cfg.model.path), facts, code)


def _check(cfg: PackConfig, tokenizer: SampleTokenizer) -> str | None:
    with tempfile.TemporaryDirectory(prefix="packtrain-probe-") as tmp:
        media, served = Path(tmp) / "media", Path(tmp) / "processor"
        media.mkdir()
        served.mkdir()
        try:
            processor = load_processor(cfg, served)
        except (ImportError, OSError, ValueError) as exc:
            return (
                f"the token layout was not checked against transformers {version('transformers')}: "
                f"its processor for {cfg.model.path} cannot be built here "
                f"({str(exc).strip().splitlines()[0]}); the trainer checks it before training"
            )
        write_probe_media(media)
        source = SourceConfig(paths=[str(media / "probe.json")], media_root=str(media))
        ours = SampleTokenizer(source, cfg.model, _probe_packing(cfg), loaded=tokenizer.model)
        for i, probe in enumerate(family_probes(tokenizer.model.family)):
            _compare(
                probe,
                ours(RawRecord(media / "probe.json", i, probe_record(probe), None)),
                ours,
                processor,
                media,
            )
    return None


def _compare(
    probe: Probe, sample: TokenizedSample | Reject, ours: SampleTokenizer, processor: Any, media: Path
) -> None:
    """ConfigError when the packer's ids for `probe` are not the processor's, or its layout not the
    family's."""
    if not isinstance(sample, TokenizedSample):
        raise ConfigError(
            f"the built-in {probe.name!r} probe is rejected with these settings ({sample.detail}); "
            "the counting rules cannot be checked against the processor"
        )
    theirs = processor_ids(processor, probe, media)
    if sample.input_ids != theirs:
        raise ConfigError(_difference(probe.name, sample.input_ids, theirs, ours, processor))
    if any(m.kind == "video" and m.grid_t < 2 for m in sample.media):
        return  # one frame group shows no repeat to name (maxFrames below 4)
    found = layout_of_text(ours.model.tokenizer.decode(sample.input_ids), ours.model.family)
    wrong = layout_difference(family_layout(ours.model.family), found)
    if wrong:
        raise ConfigError(f"the packer writes a layout its family does not declare: {wrong}")


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
