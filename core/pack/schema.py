"""On-disk format of a pack: the contract between packer and trainer.

Layout of an output folder::

    manifest.json            written last, atomically; its presence means "complete"
    rejects.jsonl            one line per rejected input sample (source, index, id, reason)
    shards/00000.arrow       packed sequences (Arrow IPC file, one row per sequence)
    shards/00000.media.arrow media blobs referenced by that shard, deduplicated by sha256
    work/                    intermediate stage outputs (convert parts, plan)

Arrow IPC (uncompressed) is used because readers memory-map it and slice rows
with no decode step; `tests/bench/bench_shard_format.py` measures this choice
against Parquet.
"""

from __future__ import annotations

import pyarrow as pa

FORMAT_VERSION = 1

MEDIA_REF = pa.struct(
    [
        ("sample", pa.int32()),  # index of the sub-sample within the sequence
        ("kind", pa.string()),  # "image" | "video"
        ("key", pa.string()),  # sha256 of the original file bytes; row key in the media table
        ("height", pa.int32()),  # resized height the token count assumed
        ("width", pa.int32()),  # resized width
        ("grid_t", pa.int32()),  # patch grid (before the 2x2 merge): t, h, w
        ("grid_h", pa.int32()),
        ("grid_w", pa.int32()),
        ("frames", pa.list_(pa.int32())),  # video: decoded frame indices sampled; image: empty
        ("second_per_grid", pa.float32()),  # video: seconds per temporal grid step (Qwen2.5-VL mRoPE)
    ]
)

SEQUENCE_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),  # -100 where not trained
        ("seq_lens", pa.list_(pa.int32())),  # lengths of the sub-samples, in order; sum = len(input_ids)
        ("sample_ids", pa.list_(pa.string())),  # each sub-sample's id (record `id`, else "<file>:<index>")
        ("sources", pa.list_(pa.string())),  # each sub-sample's dataset file name (files sharing a name:
        # their paths relative to their common folder, e.g. "a/train.jsonl", "b/train.jsonl")
        ("indices", pa.list_(pa.int64())),  # each sub-sample's 0-based index in its file
        ("media", pa.list_(MEDIA_REF)),  # in order of appearance in input_ids
    ]
)

MEDIA_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("kind", pa.string()),  # "image" | "video"
        ("encoding", pa.string()),  # "original" | "resized" (PNG already at height x width / sampled frames)
        ("data", pa.binary()),  # original: file bytes; resized image: PNG bytes; resized video: empty
        ("frames", pa.list_(pa.binary())),  # resized video: PNG per sampled frame; otherwise empty
    ]
)

IGNORE_INDEX = -100
