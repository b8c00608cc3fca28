"""Before any step: the pack's media layout against what this trainer's processor writes.

A pack records how it wrote each image and video into the ids and under which transformers
(`core/layout.py`). The model is served with the processor installed where it is served; when that
processor writes media differently (transformers 5.25 changed the Qwen3-VL video layout), training
on the pack teaches a layout inference never shows. So the trainer runs the built-in image and
video probes through its own processor and refuses (exit 2) a pack whose layout differs, naming both.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

from packtrain.core import layout
from packtrain.core.errors import ConfigError
from packtrain.core.families import Family
from packtrain.core.layout import (
    PROBES,
    cache_dir,
    family_layout,
    layout_difference,
    layout_of_text,
    processing_digest,
    processor_ids,
    write_probe_media,
)
from packtrain.core.model_spec import ModelSpec

_REPACK = "re-pack the data with this installation (`packtrain pack run`)"


def check_pack_layout(manifest: Mapping[str, Any], model_path: str, spec: ModelSpec) -> None:
    """ConfigError when the pack records no layout, or one this installation would not write."""
    recorded = manifest.get("layout")
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise ConfigError(
            "the pack records no media token layout (made by an older packtrain): its video tokens may "
            f"not match what the model is served with; {_REPACK}"
        )
    made_with = manifest.get("transformers", "an unknown version")
    ours = family_layout(spec.family)
    wrong = layout_difference(recorded, ours)
    if wrong is None:
        actual = processor_layout(model_path, spec)
        if actual is None:
            return
        ours, wrong = actual, layout_difference(recorded, actual)
        source = f"this trainer's processor (transformers {version('transformers')})"
    else:
        source = f"this packtrain's {spec.family.name} family"
    if wrong:
        raise ConfigError(
            f"the pack's media token layout differs from what {source} writes — {wrong} (pack first, then "
            f"here; the pack was made with transformers {made_with}): {_REPACK}, or train with the "
            f"transformers the pack was made with"
        )


def processor_layout(model_path: str, spec: ModelSpec) -> dict[str, str] | None:
    """The layout the model folder's processor writes for the built-in probes; None when the folder
    has no processor to build (then the family's own layout stands). Remembered under the cache
    folder, keyed on the transformers version, the folder's processing files and this code."""
    code = [Path(m.__file__ or "").read_bytes() for m in (layout, sys.modules[__name__])]
    key = processing_digest(Path(model_path), [spec.family.name], code)
    remembered = cache_dir() / "processor-layouts" / f"{key}.json"
    with contextlib.suppress(OSError, ValueError):
        found = json.loads(remembered.read_text())
        if isinstance(found, dict) and all(isinstance(v, str) for v in found.values()):
            return found
    found = _processor_layout(model_path, spec.family, spec.vision)
    if found is not None:
        with contextlib.suppress(OSError):
            remembered.parent.mkdir(parents=True, exist_ok=True)
            remembered.write_text(json.dumps(found))
    return found


def _processor_layout(model_path: str, family: Family, vision: Any) -> dict[str, str] | None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    try:
        processor = transformers.AutoProcessor.from_pretrained(model_path, trust_remote_code=False)
    except (OSError, ValueError, ImportError):
        return None
    found: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="packtrain-probe-") as tmp:
        folder = Path(tmp)
        write_probe_media(folder)
        for probe in PROBES:
            if probe.name in ("image", "video"):
                ids = processor_ids(processor, probe, folder)
                found |= layout_of_text(processor.tokenizer.decode(ids), family)
    return found
