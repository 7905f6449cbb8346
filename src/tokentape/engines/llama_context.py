"""The llama.cpp model and the one context the embedded engine decodes in: a KV cache whose cells
every sequence shares (`kv_unified`), rows of many sequences evaluated in one `llama_decode`, and a
sequence's KV cut, shared with another, saved to host memory and put back (`engines.batching` drives it).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Native", "NativeSettings"]


@dataclass(frozen=True, slots=True)
class NativeSettings:
    threads: int
    batch_size: int
    cache_tokens: int  # KV cells shared by all sequences
    sequences: int  # sequence ids (KV slots)
    flash_attention: bool
    kv_cache_f32: bool


class Native:
    """A llama.cpp model and one context over it whose KV cache holds many sequences."""

    def __init__(self, lib: Any, path: Path, settings: NativeSettings) -> None:
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's own chatter
        lib.llama_backend_init()
        self._lib = lib
        params = lib.llama_model_default_params()
        # No repacked weights (llama.cpp's extra buffer types: AMX tiles, interleaved Q4_0): another
        # kernel, so another rounding than a reference context computes; on a CPU with AMX, llama.cpp
        # 0.3.36's AMX matmul of the shipped Q4_1 weights crashed. F32 and Q4_1 run as before elsewhere.
        params.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        self.ctx = None
        try:
            self.ctx = lib.llama_init_from_model(self.model, self._context_params(settings))
            if not self.ctx:
                raise ValueError(f"llama.cpp could not create a context for {path}")
        except BaseException:
            self.close()
            raise
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab: int = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch_size = settings.batch_size
        self._batch = lib.llama_batch_init(settings.batch_size, 0, 1)

    def _context_params(self, settings: NativeSettings) -> Any:
        lib = self._lib
        params = lib.llama_context_default_params()
        params.n_ctx = settings.cache_tokens
        params.n_batch = params.n_ubatch = settings.batch_size
        params.n_seq_max = settings.sequences
        params.kv_unified = True  # one pool of cells: a sequence may grow to the whole context
        params.n_threads = params.n_threads_batch = settings.threads
        params.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attention else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        if settings.kv_cache_f32:
            params.type_k = params.type_v = 0  # GGML_TYPE_F32; else llama.cpp's F16
        return params

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> int:
        """Evaluate (token, position, sequence id, wants logits) rows; llama_decode's status."""
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, (token, position, seq_id, logits) in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = logits
        return int(self._lib.llama_decode(self.ctx, batch))

    def logits(self, row: int) -> np.ndarray:
        """The row's logits, a copy of its own (for a grammar thread that runs past the next decode)."""
        return self.logits_view(row).copy()

    def logits_view(self, row: int) -> np.ndarray:
        """The row's logits in llama.cpp's buffer, valid until the next decode: what the worker samples
        from at once (a copy of a 49k row page-faults, the buffer being past the mmap threshold)."""
        pointer = self._lib.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def cut(self, seq_id: int, start: int) -> None:
        """Drop the sequence's KV from position `start` on."""
        self._lib.llama_memory_seq_rm(self.memory, seq_id, start, -1)

    def copy(self, source: int, target: int, length: int) -> None:
        """Give `target` the first `length` positions of `source` (the cells are shared, not copied)."""
        self._lib.llama_memory_seq_cp(self.memory, source, target, 0, length)

    def save(self, seq_id: int) -> ctypes.Array[ctypes.c_uint8]:
        """The sequence's KV cells as llama.cpp writes them (its sequence state), in host memory."""
        lib = self._lib
        size = int(lib.llama_state_seq_get_size_ext(self.ctx, seq_id, 0))
        data = (ctypes.c_uint8 * size)()
        if int(lib.llama_state_seq_get_data_ext(self.ctx, data, size, seq_id, 0)) != size:
            raise RuntimeError(f"llama.cpp could not save sequence {seq_id}'s KV")
        return data

    def restore(self, seq_id: int, data: ctypes.Array[ctypes.c_uint8]) -> bool:
        """Put saved KV back into the sequence (replacing what it holds); False when the cache has no room."""
        return int(self._lib.llama_state_seq_set_data_ext(self.ctx, data, len(data), seq_id, 0)) == len(data)

    def set_threads(self, threads: int) -> None:
        self._lib.llama_set_n_threads(self.ctx, threads, threads)

    def close(self) -> None:
        lib = self._lib
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lib.llama_model_free(self.model)
            self.model = None
