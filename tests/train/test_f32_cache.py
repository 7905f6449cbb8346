"""The F32 copy the trainer starts from is cached by the bytes of its source: a new checkpoint under
an old name and size is converted anew, never served from the old one's copy."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tokentape.train.weights import f32_gguf


def _checkpoint(path: Path, values: list[float]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", np.array(values, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _weights(path: Path) -> list[float]:
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    return [float(v) for v in np.asarray(tensor.data, dtype=np.float32).ravel()]


def test_same_name_and_size_other_bytes_is_another_copy(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _checkpoint(tmp_path / "step" / "model.gguf", [1.0, 2.0, 3.0, 4.0])
    old = f32_gguf(first, cache)
    assert _weights(old) == [1.0, 2.0, 3.0, 4.0]
    size = first.stat().st_size
    second = _checkpoint(tmp_path / "step" / "model.gguf", [5.0, 6.0, 7.0, 8.0])  # rewritten in place
    assert second.stat().st_size == size
    new = f32_gguf(second, cache)
    assert new != old and _weights(new) == [5.0, 6.0, 7.0, 8.0]
    assert f32_gguf(second, cache) == new  # and cached
