"""What a run leaves behind: sharded DCP checkpoints (`checkpoint`) and the Hugging Face export (`export`).
Nothing is imported here: each module loads what it needs."""
