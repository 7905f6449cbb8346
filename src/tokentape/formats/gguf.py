"""What a GGUF file says about itself, read from its header alone: selected metadata and every
tensor's name, shape and type. Enough to refuse a file before any engine is paused (not a GGUF, an
adapter for another architecture or of other shapes, a model with another vocabulary)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FLOAT_TYPES",
    "GGUF_MAGIC",
    "GGUFHeader",
    "TensorInfo",
    "read_header",
    "read_metadata_values",
    "read_string",
    "read_value",
]

GGUF_MAGIC = b"GGUF"
# GGUF value types: fixed-size scalars by struct format; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml tensor types llama.cpp's CPU backend multiplies in a LoRA: F32, F16, BF16 (F64, 28, it cannot)
FLOAT_TYPES = frozenset({0, 1, 30})


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] first (the input dimension of a weight matrix)
    type: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    metadata: dict[str, Any]  # the keys asked for that the file has
    tensors: dict[str, TensorInfo]


def read_header(path: Path, keys: frozenset[str]) -> GGUFHeader:
    """The values of `keys` and every tensor's description; ValueError if `path` is no GGUF file."""
    with path.open("rb") as file:
        if file.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _parse(data, keys)
            except (struct.error, UnicodeDecodeError, IndexError) as exc:
                raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_metadata_values(data: mmap.mmap, keys: frozenset[str], *, whole: bool) -> tuple[dict[str, Any], int, int]:
    """The values of `keys` in a GGUF header's metadata (versions 2 and 3), skipping every other value;
    with the offset after the metadata and the tensor count. `whole=False` stops once every key is found
    (the offset is then not the metadata's end)."""
    version, n_tensors, count = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    offset = 24
    found: dict[str, Any] = {}
    for _ in range(count):
        key, offset = read_string(data, offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        value, offset = read_value(data, offset + 4, kind, keep=key in keys)
        if key in keys:
            found[key] = value
            if not whole and len(found) == len(keys):
                break
    return found, offset, n_tensors


def _parse(data: mmap.mmap, keys: frozenset[str]) -> GGUFHeader:
    found, offset, n_tensors = read_metadata_values(data, keys, whole=True)
    tensors: dict[str, TensorInfo] = {}
    for _ in range(n_tensors):
        name, offset = read_string(data, offset)
        (dims,) = struct.unpack_from("<I", data, offset)
        shape = struct.unpack_from(f"<{dims}Q", data, offset + 4)
        offset += 4 + 8 * dims
        kind, _start = struct.unpack_from("<IQ", data, offset)
        offset += 12
        tensors[name] = TensorInfo(name, tuple(shape), kind)
    return GGUFHeader(found, tensors)


def read_string(data: mmap.mmap, offset: int) -> tuple[str, int]:
    """The string at `offset` and the offset after it."""
    (size,) = struct.unpack_from("<Q", data, offset)
    start = offset + 8
    return data[start : start + size].decode("utf-8"), start + size


def read_value(data: mmap.mmap, offset: int, kind: int, *, keep: bool) -> tuple[Any, int]:
    """The value of type `kind` at `offset` (None unless `keep`: skipped as cheaply as it can be)
    and the offset after it."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)
    if kind == _STRING:
        return read_string(data, offset)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, size = struct.unpack_from("<IQ", data, offset)
    offset += 12
    if item in _SCALARS:
        width = struct.calcsize(_SCALARS[item])
        values = list(struct.unpack_from(f"<{size}{_SCALARS[item][1]}", data, offset)) if keep else None
        return values, offset + size * width
    if item == _STRING:  # a vocabulary is 49k strings: one loop, skipped without decoding
        strings: list[str] = []
        length_at = struct.Struct("<Q").unpack_from
        for _ in range(size):
            (length,) = length_at(data, offset)
            offset += 8
            if keep:
                strings.append(data[offset : offset + length].decode("utf-8"))
            offset += length
        return (strings if keep else None), offset
    out = []
    for _ in range(size):
        value, offset = read_value(data, offset, item, keep=keep)
        out.append(value)
    return (out if keep else None), offset
