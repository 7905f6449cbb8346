"""Turn a GGUF file into a Hugging Face model directory (config, safetensors weights, tokenizer)
that vLLM can serve: `python convert_gguf.py MODEL.gguf OUT_DIR`.

transformers dequantises the GGUF's weights while loading; the quantiser it records in the config
is cleared before saving, so the saved weights are plain tensors. Runs under the vLLM virtualenv's
Python (it has torch, transformers and gguf), not tokentape's.
"""

from __future__ import annotations

import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantised already: save them as they are
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.rename(out)  # whole or absent: a half-written directory is never taken for a model


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
