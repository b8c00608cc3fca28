"""Dataset readers: JSON, JSONL and Parquet records, weighted mixtures, records to conversations."""
