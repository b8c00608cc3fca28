"""The data side of the trainer: shards to micro-batches (`packed`), the epoch plan (`sampler`), media
decoding (`media`), mRoPE positions (`rope`), the batch the model reads (`batch`) and the pack-layout
check (`layout_check`). Nothing is imported here: each module loads what it needs."""
