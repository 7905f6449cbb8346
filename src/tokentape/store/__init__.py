"""Where recorded data goes: what the gateway asks of a trajectory store (`base.TrajectoryStore`,
given to the session registry, which closes it), the store itself (SQLite in WAL mode, one file per
gateway process: `sqlite.py`, its tables declared column by column in `schema.py`, its writer
thread's group commit in `writer.py`), image bytes read back by digest through a cache bounded in
bytes (`images.py`), scans of stored sessions across one store or several shards (`scan.py`),
exports streamed a page of sessions at a time (`export.py`), and dataset files, JSONL or Parquet
(`datasets.py`)."""
