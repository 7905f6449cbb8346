"""A LoRA adapter in GGUF form, written here with `gguf.GGUFWriter` for the embedded model: rank-r
factors on attn_v and ffn_down of every block (q and k are left out: GGUF stores them permuted for
llama.cpp's rope, so factors written straight from a PEFT checkpoint would not match them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# SmolLM2-135M: the (input, output) sizes of the adapted projections
_SHAPES = {"attn_v": (576, 192), "ffn_down": (1536, 576)}
BLOCKS = 30


def write_lora(
    path: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    scale_b: float = 0.02,
    architecture: str = "llama",
    shapes: dict[str, tuple[int, int]] | None = None,
    blocks: int = BLOCKS,
) -> Path:
    """Write an adapter with random A and small random B (B = 0 would leave the model unchanged)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    # float32 throughout: a float64 factor is written as F64, which llama.cpp's CPU matmul cannot take
    for block in range(blocks):
        for name, (n_in, n_out) in (shapes or _SHAPES).items():
            # numpy shapes are GGUF's reversed: lora_a is ne [n_in, r], lora_b is ne [r, n_out]
            a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * scale_b).astype(np.float32)
            writer.add_tensor(f"blk.{block}.{name}.weight.lora_a", a)
            writer.add_tensor(f"blk.{block}.{name}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
