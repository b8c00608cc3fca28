"""The pack format: schemas, the manifest, atomic writes, the shard reader and the row invariants."""
