"""Parquet files in the layouts public VLM datasets use, written with pyarrow from the shared demo data.

- LLaVA-OneVision-Data: `id`, `image` (a `{bytes, path}` struct, null for text-only rows),
  `conversations` (list of `{from, value}`), `data_source`.
- A Hugging Face `datasets`-saved image dataset: `messages` (list of `{role, content}`) and
  `images` (list of `{bytes, path}` structs, the `Sequence(Image())` feature), with the
  `huggingface` schema metadata `datasets` writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from support.paths import DATASETS, DEMO, MODELS

LLAVA = DATASETS / "text-sft" / "llava-instruct-100" / "llava_instruct_100.json"
QWEN2 = MODELS / "qwen2-vl"
DEMO_IMAGES = [DEMO / "mllm_demo_data" / f"{i}.jpg" for i in (1, 2, 3)]

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
LLAVA_OV_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("image", IMAGE),
        ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
        ("data_source", pa.string()),
    ]
)
HF_FEATURES = {
    "messages": [
        {"content": {"dtype": "string", "_type": "Value"}, "role": {"dtype": "string", "_type": "Value"}}
    ],
    "images": {"feature": {"_type": "Image"}, "_type": "Sequence"},
}
HF_SCHEMA = pa.schema(
    [
        ("messages", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("images", pa.list_(IMAGE)),
    ],
    metadata={b"huggingface": json.dumps({"info": {"features": HF_FEATURES}}).encode()},
)


def llava_ov_rows(n: int = 24, text_every: int = 6) -> list[dict[str, Any]]:
    """LLaVA-OneVision-Data rows from the LLaVA-Instruct demo conversations, each image one of the
    demo JPEGs (embedded bytes); every `text_every`-th row is text-only (null image)."""
    records = json.loads(LLAVA.read_text())[:n]
    rows = []
    for i, rec in enumerate(records):
        text_only = text_every and i % text_every == text_every - 1
        image = DEMO_IMAGES[i % 3]
        conv = [dict(t) for t in rec["conversations"]]
        if text_only:
            conv = [{**t, "value": t["value"].replace("<image>", "").strip()} for t in conv]
        rows.append(
            {
                "id": rec["id"],
                "image": None if text_only else {"bytes": image.read_bytes(), "path": f"{rec['id']}.jpg"},
                "conversations": conv,
                "data_source": "llava_instruct_demo",
            }
        )
    return rows


def json_twin(rows: list[dict[str, Any]], image_dir: Path) -> list[dict[str, Any]]:
    """The same samples as JSON records naming files: each embedded image written to `image_dir`."""
    image_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for row in rows:
        rec = {k: v for k, v in row.items() if k not in ("image", "images")}
        images = row.get("images") or ([row["image"]] if row.get("image") else [])
        names = []
        for j, img in enumerate(images):
            name = f"{len(out)}-{j}.jpg"
            (image_dir / name).write_bytes(img["bytes"])
            names.append(f"{image_dir.name}/{name}")
        if names:
            rec["images"] = names
        out.append(rec)
    return out


def hf_rows() -> list[dict[str, Any]]:
    """The LLaMA-Factory multimodal demo (`mllm_demo.json`) as a `datasets` image dataset: every
    image's bytes embedded, its original path kept in the struct."""
    rows = []
    for rec in json.loads((DEMO / "mllm_demo.json").read_text()):
        images = [{"bytes": (DEMO / p).read_bytes(), "path": Path(p).name} for p in rec["images"]]
        rows.append({"messages": rec["messages"], "images": images})
    return rows


def write(
    path: Path, rows: list[dict[str, Any]], schema: pa.Schema, row_group_size: int = 4, **kw: Any
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size, **kw)
    return path


def config(paths: list[Path | str], **source: Any) -> dict[str, Any]:
    return {
        "source": {"paths": [str(p) for p in paths], **source},
        "model": {"path": str(QWEN2), "maxPixels": 200_000},
        "packing": {"maxLength": 2048, "sequencesPerShard": 4, "maxRejectedFraction": 1.0},
    }
