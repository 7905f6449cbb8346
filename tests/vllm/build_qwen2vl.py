"""A tiny Qwen2-VL with random weights, built here (no model hub): `python build_qwen2vl.py
TOKENIZER_DIR OUT_DIR`. TOKENIZER_DIR holds the Qwen2-VL tokenizer and chat template the tests
already use (tests/support/models.py, `qwen2-vl`); they are copied as they are. transformers makes
the model from a small config with a fixed seed and saves it with its image and video processors'
default configs (Qwen2-VL's own: 14-pixel patches merged 2x2).

About 20M parameters, nearly all the embedding of Qwen2-VL's vocabulary: hidden size 128, 2 layers,
a vision tower of depth 2. It samples nonsense; it serves to check what goes into vLLM (the prompt
tokens, the image placeholders, the image features), not what comes out. Runs under the vLLM
virtualenv's Python (torch, transformers, and torchvision through `cpu_torchvision.py`'s hook),
not tokentape's.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

SEED = 0
TEXT = {
    "vocab_size": 151936,  # Qwen2-VL's (the tokenizer's 151,657 IDs, padded)
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32768,
    # head size 64: mrope's three sections (time, height, width) add up to half of it
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12], "rope_theta": 1000000.0},
}
VISION = {"depth": 2, "embed_dim": 128, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build(tokenizer_dir: Path, out: Path) -> None:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    torch.manual_seed(SEED)
    config = Qwen2VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=True)
    config.dtype = torch.float32
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    Qwen2VLImageProcessor().save_pretrained(partial)
    Qwen2VLVideoProcessor().save_pretrained(partial)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, partial / name)
    partial.rename(out)  # whole or absent: a half-written directory is never taken for a model


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
