"""The media a dataset names: confinement, caps and measurement (access), and what a shard stores (store)."""
