"""Where recorded data goes: dataset files (JSONL, Parquet)."""
