"""examples/internvl.yaml end to end, as a user runs it: `packtrain run` packs the demo data with
InternVL's tiles and frames, trains the tiny random-init InternVL, and exports a folder that plain
transformers loads as the model it was trained as (its own LM head, untied)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from test_first_hour import packtrain

REPO = Path(__file__).resolve().parents[2]


def test_the_internvl_example_packs_trains_and_exports(shared_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = packtrain(
        "run", "examples/internvl.yaml", "--output", str(out), "--max-steps", "4", cwd=REPO, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "pack" / "internvl-quickstart" / "manifest.json").read_text())
    counts = manifest["counts"]
    assert counts["rejected"] == 0 and counts["packed"] == counts["input"] > 500, counts
    kinds = {ref["kind"] for ref in _media_refs(out / "pack" / "internvl-quickstart")}
    assert kinds == {"image", "video"}

    final = out / "train" / "internvl-quickstart" / "final"
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(final)
    assert type(model).__name__ == "InternVLForConditionalGeneration"
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()
    summary = json.loads((out / "logs" / "internvl-quickstart-train.termination.json").read_text())
    assert summary["steps"] == 4 and math.isfinite(summary["final_loss"]), summary


def _media_refs(pack: Path) -> list[dict[str, object]]:
    from packtrain.core.pack.shards import ShardReader

    return [ref for row in ShardReader(pack) for ref in row["media"]]
