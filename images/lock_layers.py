"""Split an image's hash lock into the layers its Dockerfile installs, one RUN each.

Committing a layer holds its files about three times over for a moment (the container's files,
a tar of them, the new layer). The trainer's wheels install to ~6.5 GB, mostly CUDA libraries:
in one layer its build needs ~20 GB free at the peak; in layers of about a gigabyte each, the
image plus ~3 GB. Every lock entry lands in exactly one layer: the first whose patterns match
its name, the last layer taking whatever no pattern names.

Stdlib only, as it runs inside the build on the bare base:
    python3 lock_layers.py LOCK IMAGE K      the lock's entries for layer K (1-based), to stdout
    python3 lock_layers.py LOCK IMAGE        one line per layer: K, its packages
"""

from __future__ import annotations

import fnmatch
import re
import sys

# Patterns (canonical names, fnmatch) of every layer but the last; sizes as installed, 2026-12.
LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "trainer": (
        ("torch",),  # 1.1 GB
        ("triton",),  # 1.0 GB
        ("nvidia-cudnn-*",),  # 0.9 GB
        ("nvidia-cublas", "nvidia-cufft", "nvidia-cusolver"),  # 1.1 GB
        ("nvidia-*", "cuda-*"),  # the other CUDA libraries, 1.1 GB
    ),
}


def entries(lock_text: str) -> list[tuple[str, str]]:
    """(canonical name, entry text with its hash lines) for each requirement of a pip lock."""
    out: list[tuple[str, str]] = []
    for line in lock_text.splitlines(keepends=True):
        if not line.strip() or line.startswith("#"):
            continue
        if line[0].isspace():
            if not out:
                raise ValueError(f"continuation line before any requirement: {line.strip()}")
            name, text = out[-1]
            out[-1] = (name, text + line)
            continue
        name = re.split(r"[\s\[<>=!~;@]", line, maxsplit=1)[0]
        out.append((re.sub(r"[-_.]+", "-", name).lower(), line))
    return out


def layer_of(name: str, patterns: tuple[tuple[str, ...], ...]) -> int:
    """The 1-based layer an entry goes to: the first that names it, else the last."""
    for k, layer in enumerate(patterns, start=1):
        if any(fnmatch.fnmatchcase(name, p) for p in layer):
            return k
    return len(patterns) + 1


def split(lock_text: str, image: str) -> list[list[tuple[str, str]]]:
    """The lock's entries per layer; an image without a split is one layer."""
    patterns = LAYERS.get(image, ())
    layers: list[list[tuple[str, str]]] = [[] for _ in range(len(patterns) + 1)]
    for name, text in entries(lock_text):
        layers[layer_of(name, patterns) - 1].append((name, text))
    return layers


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        layers = split(f.read(), argv[1])
    if len(argv) == 2:
        for k, layer in enumerate(layers, start=1):
            print(k, " ".join(sorted({name for name, _ in layer})))
        return 0
    k = int(argv[2])
    if not 1 <= k <= len(layers):
        print(f"{argv[1]} has layers 1 to {len(layers)}, not {k}", file=sys.stderr)
        return 2
    if not layers[k - 1]:
        print(f"layer {k} of {argv[1]} matches no entry of {argv[0]}: fix LAYERS", file=sys.stderr)
        return 2
    sys.stdout.write("".join(text for _, text in layers[k - 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
