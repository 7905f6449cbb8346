"""The same weights on both sides: the engine's GGUF, the trainer's torch model, the LoRA between them.

- `f32_gguf(path)`: a copy of a GGUF with every tensor dequantized to F32 (written once, cached): the
  engine serves it so that its logprobs and the trainer's agree to rounding.
- `load_model(path)`: the torch model from a GGUF (transformers' GGUF loader dequantizes; it also
  undoes the q/k permutation that llama conversion applies).
- `write_lora_gguf(model, path)`: the peft LoRA as a llama.cpp adapter GGUF, named as llama.cpp's
  convert_lora_to_gguf.py names its tensors. The LoRA targets v, o and the feed-forward projections
  only: llama conversion permutes q and k rows (rotary halves), so a q/k LoRA would need the same
  permutation of its B matrix.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LORA_TARGETS", "add_lora", "f32_gguf", "load_model", "write_lora_gguf"]

# peft module name -> the GGUF tensor it adapts (llama layout); no q_proj/k_proj (see above)
LORA_TARGETS = {
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def cache_dir() -> Path:
    root = Path(os.environ.get("TOKENTAPE_CACHE", Path.home() / ".cache" / "tokentape"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def f32_gguf(source: Path, target_dir: Path | None = None) -> Path:
    """`source` with every tensor in F32, metadata unchanged but the file type. Cached by the source's
    name and size; written to a temporary name first, so a half-written file is never used."""
    import gguf

    stat = source.stat()
    key = hashlib.blake2b(f"{source.name}:{stat.st_size}".encode(), digest_size=6).hexdigest()
    target = (target_dir or cache_dir()) / f"{source.stem}.f32-{key}.gguf"
    if target.is_file():
        return target
    reader = gguf.GGUFReader(str(source))
    architecture = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    partial = target.with_suffix(f".{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), architecture)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, weights.reshape([int(d) for d in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target


def load_model(path: Path) -> Any:
    """The causal LM in a GGUF, dequantized to float32, in eval mode (no dropout in this model)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()  # type: ignore[no-untyped-call]
    # the weights are dequantized float32 tensors: nothing of the file's quantization remains, but the
    # loader marks the model as GGUF-quantized, which trainers (transformers' Trainer) refuse to train
    model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def add_lora(model: Any, *, rank: int = 8, alpha: float = 16.0, seed: int = 0, last_layers: int | None = None) -> Any:
    """A peft LoRA on `model` (v, o and feed-forward projections), its B zero: the policy starts as
    the base model. `last_layers`: adapt only the last N blocks, so the backward pass stops there
    (on a CPU it is most of a step's cost)."""
    import peft
    import torch

    torch.manual_seed(seed)
    blocks = int(model.config.num_hidden_layers)
    layers = None if last_layers is None else list(range(max(0, blocks - last_layers), blocks))
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int; a float is used as is
        lora_dropout=0.0,
        target_modules=sorted(LORA_TARGETS),
        layers_to_transform=layers,
    )
    return peft.get_peft_model(model, config)


def lora_tensors(model: Any) -> dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """GGUF tensor base name ("blk.3.attn_v") -> (A [rank, in], B [out, rank]) of a peft LoRA model."""
    tensors: dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in LORA_TARGETS or not hasattr(module, "lora_A"):
            continue
        layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
        a = module.lora_A["default"].weight.detach().to("cpu").float().numpy()
        b = module.lora_B["default"].weight.detach().to("cpu").float().numpy()
        tensors[f"blk.{layer}.{LORA_TARGETS[leaf]}"] = (a, b)
    if not tensors:
        raise ValueError("the model has no LoRA on the modules a llama adapter GGUF can hold")
    return tensors


def write_lora_gguf(model: Any, path: Path, *, architecture: str = "llama") -> Path:
    """The model's LoRA as a llama.cpp adapter GGUF: `general.type=adapter`, `adapter.type=lora`,
    `adapter.lora.alpha`, tensors `blk.N.<name>.weight.lora_a` (ggml [in, rank]: numpy [rank, in])
    and `.lora_b` (ggml [rank, out]), F32. llama.cpp scales B·A by alpha / rank, as peft does."""
    import gguf

    config = model.peft_config["default"]
    partial = path.with_suffix(f".{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), architecture)
    writer.add_string(gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config.lora_alpha))
    for base, (a, b) in lora_tensors(model).items():
        writer.add_tensor(f"{base}.weight.lora_a", np.ascontiguousarray(a, dtype=np.float32))
        writer.add_tensor(f"{base}.weight.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path
