"""How a family writes an image and a video into the token stream, as a pattern a pack records and
a reader checks against the installed processor.

The packer writes ids by its own counting rules, which follow the family's HF processor. When
transformers changes how a processor writes media (5.25 dropped the outer vision pair around a
Qwen3-VL video that 5.24 kept), a pack and the model served after it disagree by a few tokens per
video, and nothing fails. So: `pack run` compares the packer's ids with the installed processor's on
built-in probes (`packer/processor_check.py`), the manifest records the layout and the transformers
version, and the trainer compares the recorded layout with what its own processor writes.

A layout is the decoded text of one media item with each pad run written `<pad>*` and each frame
timestamp `<t seconds>`; repeated per-frame groups are written once, followed by `+`. The probes are
tiny synthetic media written here, so nothing is downloaded and both sides read the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from packtrain.core.families import Family

# The transformers versions whose processors write what the packer writes, for every family
# (pyproject.toml declares the same floor; the parity tests run against the installed version).
TRANSFORMERS_FLOOR = "5.25"
# A probe prompt marks each media item with these, so its layout can be cut out of the decoded text.
OPEN, CLOSE = "[[", "]]"
_STAMP = re.compile(r"<\d+(?:\.\d+)? seconds>")
_FRAME_NUMBER = re.compile(r"Frame\d+: ")
PROCESSING_SUFFIXES = frozenset({".json", ".jinja", ".txt", ".model"})
_MAX_HASHED_BYTES = 64 << 20


@dataclass(frozen=True)
class Probe:
    """One built-in sample: a user prompt with `<image>` / `<video>` placeholders and its media files."""

    name: str
    prompt: str
    images: tuple[str, ...] = ()
    videos: tuple[str, ...] = ()


# (width, height) of each probe image; a video of 9 frames at 3 fps, 80x60 (an odd frame count).
PROBE_IMAGES = {"wide.png": (96, 40), "tall.png": (36, 90), "square.png": (64, 64)}
PROBE_VIDEO = ("clip.mp4", 9, 3, 80, 60)
PROBES = (
    Probe("image", f"{OPEN}<image>{CLOSE} What is shown?", images=("wide.png",)),
    Probe("multi-image", "<image><image>Compare the two.", images=("tall.png", "square.png")),
    Probe("video", f"{OPEN}<video>{CLOSE} What happens?", videos=(PROBE_VIDEO[0],)),
)
PROBE_ANSWER = "Ok."


def family_probes(family: Family) -> tuple[Probe, ...]:
    """The probes that apply to `family`: a family whose model takes no video (`Family.videos`
    false: the packer rejects a video) is probed on images only."""
    return tuple(p for p in PROBES if family.videos or not p.videos)


def cache_dir() -> Path:
    """Where checks remember an agreement: `$PACKTRAIN_CACHE_DIR`, else `$XDG_CACHE_HOME/packtrain`,
    else `~/.cache/packtrain`."""
    if os.environ.get("PACKTRAIN_CACHE_DIR"):
        return Path(os.environ["PACKTRAIN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packtrain"


def processing_digest(folder: Path, facts: list[str], code: list[bytes]) -> str:
    """A key for what a processor check depends on: the installed transformers, `facts`, `code`, and
    the model folder's processor, template and tokenizer files (its own regular files: no link is
    followed out of it; weights are not read)."""
    digest = hashlib.sha256(json.dumps([version("transformers"), *facts]).encode())
    for blob in code:
        digest.update(hashlib.sha256(blob).digest())
    for path in sorted(folder.iterdir()):
        own = path.is_file() and not path.is_symlink() and path.stat().st_size <= _MAX_HASHED_BYTES
        if own and path.suffix in PROCESSING_SUFFIXES:
            digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def family_layout(family: Family) -> dict[str, str]:
    """The layout the packer writes for `family`, by media kind (an images-only family: no video)."""
    if family.tiling is not None:
        # InternVL: the template's newline after each placeholder; a video is frame-prefixed image runs.
        run = f"{family.vision_start}{family.image_pad}*{family.vision_end}"
        prefix = _FRAME_NUMBER.sub("Frame{n}: ", family.tiling.frame_prefix.format(n=1))
        frames = family.tiling.frame_separator.join([prefix + run] * 3)
        return {"image": run + "\n", "video": _fold_repeats(frames + "\n")}
    image = f"{family.vision_start}{family.image_pad}*{family.vision_end}"
    video = f"{family.vision_start}{family.video_pad}*{family.vision_end}"
    if family.video_timestamps:
        video = f"(<t seconds>{video})+"
    return {"image": image, "video": video} if family.videos else {"image": image}


def layout_of_text(text: str, family: Family) -> dict[str, str]:
    """The layout of each media item marked by OPEN ... CLOSE in a decoded probe text, by kind."""
    for pad in (family.image_pad, family.video_pad):
        text = re.sub(f"(?:{re.escape(pad)})+", pad + "*", text)
    text = _STAMP.sub("<t seconds>", text)
    tiled = family.tiling is not None
    if tiled:
        text = _FRAME_NUMBER.sub("Frame{n}: ", text)
    found: dict[str, str] = {}
    for segment in re.findall(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), text, flags=re.S):
        kind = "video" if family.video_pad in segment or (tiled and "Frame{n}: " in segment) else "image"
        found[kind] = _fold_repeats(segment)
    return found


def _fold_repeats(segment: str) -> str:
    """Each run of a repeated token sequence (per-frame groups) written once as `(X)+`."""
    tokens = re.findall(r"<[^<>]*>\*?|[^<]+", segment)
    out: list[str] = []
    i = 0
    while i < len(tokens):
        for size in range(1, (len(tokens) - i) // 2 + 1):
            unit = tokens[i : i + size]
            times = 1
            while tokens[i + times * size : i + (times + 1) * size] == unit:
                times += 1
            if times > 1:
                out.append(f"({''.join(unit)})+")
                i += times * size
                break
        else:
            out.append(tokens[i])
            i += 1
    return "".join(out)


def layout_difference(recorded: Mapping[str, str], actual: Mapping[str, str]) -> str | None:
    """In words, where two layouts disagree on a kind both name; None when they agree."""
    wrong = [
        f"{kind}: {recorded[kind]!r} vs {actual[kind]!r}"
        for kind in sorted(recorded)
        if kind in actual and recorded[kind] != actual[kind]
    ]
    return "; ".join(wrong) or None


def write_probe_media(folder: Path) -> None:
    """The probes' images (PNG) and video (H.264 mp4, moving gradients) in `folder`."""
    import av
    from PIL import Image

    for name, (w, h) in PROBE_IMAGES.items():
        column = np.linspace(0, 255, w, dtype=np.uint8)[None, :, None]
        Image.fromarray(np.ascontiguousarray(np.broadcast_to(column, (h, w, 3)))).save(folder / name)
    name, frames, fps, w, h = PROBE_VIDEO
    with av.open(str(folder / name), "w") as out:
        stream = out.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        ramp = np.linspace(0, 255, w, dtype=np.int64)[None, :, None]
        for i in range(frames):
            rgb = np.broadcast_to((ramp + 9 * i) % 256, (h, w, 3)).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")))
        out.mux(stream.encode())


def probe_record(probe: Probe) -> dict[str, Any]:
    """The probe as a dataset record (messages with placeholders, media paths beside the data file)."""
    return {
        "messages": [
            {"role": "user", "content": probe.prompt},
            {"role": "assistant", "content": PROBE_ANSWER},
        ],
        "images": list(probe.images),
        "videos": list(probe.videos),
    }


def processor_ids(processor: Any, probe: Probe, folder: Path) -> list[int]:
    """The ids the HF `processor` writes for `probe` with its own settings (its media read from
    `folder`: images by PIL, the video by transformers' own PyAV reader)."""
    from PIL import Image
    from transformers.video_utils import load_video

    content: list[dict[str, Any]] = []
    for piece in re.split("(<image>|<video>)", probe.prompt):
        if piece in ("<image>", "<video>"):
            content.append({"type": piece[1:-1]})
        elif piece:
            content.append({"type": "text", "text": piece})
    conversation = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": PROBE_ANSWER}]},
    ]
    kwargs: dict[str, Any] = {"text": [processor.apply_chat_template(conversation, tokenize=False)]}
    if probe.images:
        kwargs["images"] = [Image.open(folder / n).convert("RGB") for n in probe.images]
    if probe.videos:
        # transformers reads a path given as a string (its annotation names only decoded inputs).
        decoded = [load_video(str(folder / n), backend="pyav") for n in probe.videos]  # type: ignore[arg-type]
        kwargs["videos"] = [frames for frames, _ in decoded]
        kwargs["video_metadata"] = [meta for _, meta in decoded]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(**kwargs)
    return [int(t) for t in out["input_ids"][0]]
