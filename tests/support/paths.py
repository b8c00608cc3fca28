"""Where the checkout and the real fixture data are, for tests and benchmarks alike.

Real tokenizers, configs and datasets live in `../shared`, beside the checkout, read-only.
Import from here rather than deriving the folder again (`from support.paths import SHARED`).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = (REPO.parent / "shared").resolve()
MODELS = SHARED / "models"
DATASETS = SHARED / "datasets"
DEMO = DATASETS / "llamafactory-mllm-demo"
