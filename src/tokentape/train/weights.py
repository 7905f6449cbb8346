"""The same weights on both sides: the engine's GGUF, the trainer's torch model, the LoRA between them.

- `f32_gguf(path)`: a copy of a GGUF with every tensor dequantized to F32 (written once, cached): the
  engine serves it so that its logprobs and the trainer's agree to rounding.
- `load_model(path)`: the torch model from a GGUF (transformers' GGUF loader dequantizes; it also
  undoes the q/k permutation that llama conversion applies), kept as a safetensors copy for the next load.
- `write_lora_gguf(model, path)`: the peft LoRA as a llama.cpp adapter GGUF, named as llama.cpp's
  convert_lora_to_gguf.py names its tensors. Every projection peft can adapt on llama (q, k, v, o,
  gate, up, down); llama conversion permutes the rows of q and k (rotary halves, per head; k per
  key-value head), so their B factor gets the same permutation, as convert_lora_to_gguf.py applies
  it. Each module's scaling is peft's own (`scaling`: alpha / r, alpha / sqrt(r) with rslora, the
  rank and alpha patterns): llama.cpp scales every tensor by the file's one alpha over that tensor's
  rank, so B carries the rest. What llama.cpp adapters cannot hold is refused, naming the module and
  the setting (DoRA, modules_to_save, LoRA bias, embedding or head LoRAs, ...): never dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "LLAMA_LORA_TENSORS",
    "LORA_TARGETS",
    "UnwritableLora",
    "add_lora",
    "f32_gguf",
    "load_model",
    "write_lora_gguf",
]

# peft module name -> the GGUF tensor it adapts (llama layout)
LLAMA_LORA_TENSORS = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
# what `tokentape train` adapts (the loop's own choice; any of LLAMA_LORA_TENSORS can be written)
LORA_TARGETS = {name: LLAMA_LORA_TENSORS[name] for name in ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}

# LoraConfig settings a llama.cpp adapter cannot express: refused when set (a value other than these)
_UNWRITABLE_SETTINGS = {
    "use_dora": False,  # DoRA's magnitude vector
    "modules_to_save": None,  # whole modules trained beside the LoRA
    "lora_bias": False,
    "target_parameters": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "fan_in_fan_out": False,
    "use_qalora": False,
    "alora_invocation_tokens": None,
}


class UnwritableLora(ValueError):
    """The peft model holds something a llama.cpp adapter GGUF cannot: the message names the module
    and the setting; nothing is written."""


def cache_dir() -> Path:
    root = Path(os.environ.get("TOKENTAPE_CACHE", Path.home() / ".cache" / "tokentape"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def f32_gguf(source: Path, target_dir: Path | None = None) -> Path:
    """`source` with every tensor in F32, metadata unchanged but the file type. Cached by the digest of
    the source's bytes (a new checkpoint under an old name and size is converted anew; hashing costs
    well under a second per 100 MB); written to a temporary name first, so a half-written file is
    never used."""
    import gguf

    with source.open("rb") as file:
        key = hashlib.file_digest(file, lambda: hashlib.blake2b(digest_size=8)).hexdigest()
    folder = target_dir or cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{source.stem}.f32-{key}.gguf"
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
    """The causal LM in a GGUF, dequantized to float32, in eval mode (no dropout in this model).

    transformers' GGUF loader parses the file's metadata twice and rebuilds gguf's tensor-name map
    for every tensor (the dequantizing itself is 2 s); `_gguf_parsed_once` shares both within the
    load. The dequantized model is then kept as a safetensors copy (`hf_copy`), keyed by the file's
    bytes and the transformers version, which loads in under a second: float32 tensors written and
    read back are the same bits."""
    import torch
    import transformers

    copy = hf_copy(path)
    if (copy / "config.json").is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(copy), dtype=torch.float32)
    else:
        with _gguf_parsed_once():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
        # the weights are dequantized float32 tensors: nothing of the file's quantization remains, but the
        # loader marks the model as GGUF-quantized, which trainers (transformers' Trainer) refuse to train
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _keep(model, copy)
    model.eval()
    return model


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within one transformers GGUF load: one `GGUFReader` per file (the reader is read-only over a
    memory map) and one tensor-name map per (architecture, blocks), where transformers builds them
    again for the config, the weights and each tensor. Both are pure functions of their arguments;
    the loaded model is the same (tests/train/test_weights.py compares it tensor for tensor)."""
    import functools
    from unittest import mock

    import gguf

    readers: dict[str, Any] = {}
    make_reader = gguf.GGUFReader

    def shared_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return make_reader(path, *args, **kwargs)
        key = os.fspath(path)
        if key not in readers:
            readers[key] = make_reader(path)
        return readers[key]

    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "GGUFReader", shared_reader), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        yield


def hf_copy(path: Path) -> Path:
    """Where the dequantized model of the GGUF at `path` is kept (a folder, once written)."""
    import transformers

    with path.open("rb") as file:
        key = hashlib.file_digest(file, lambda: hashlib.blake2b(digest_size=8)).hexdigest()
    return cache_dir() / "hf" / f"{path.stem}-{key}-transformers-{transformers.__version__}"


def _keep(model: Any, copy: Path) -> None:
    """Write the model to `copy` through a temporary folder renamed into place, so a reader never
    meets half of one; a copy that cannot be written (a read-only cache) is only not kept."""
    import shutil

    partial = copy.with_name(f"{copy.name}.{os.getpid()}.partial")
    try:
        model.save_pretrained(str(partial), safe_serialization=True)
        partial.replace(copy)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)


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


def permute_rows(weights: np.ndarray[Any, Any], n_head: int, n_head_kv: int | None) -> np.ndarray[Any, Any]:
    """llama.cpp's conversion of q/k rows (convert_hf_to_gguf.py `LlamaModel.permute`): per head, the
    rotary halves interleaved. Applied to a LoRA's B [out, rank] it permutes B·A's rows the same way."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _check_settings(config: Any) -> None:
    for setting, default in _UNWRITABLE_SETTINGS.items():
        value = getattr(config, setting, default)
        if value not in (default, None, False, [], {}):
            raise UnwritableLora(
                f"the LoRA sets {setting}={value!r}, which a llama.cpp adapter GGUF cannot hold; train without it"
            )


def lora_tensors(model: Any, alpha: float) -> dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """GGUF tensor base name ("blk.3.attn_q") -> (A [rank, in], B [out, rank]) of a peft LoRA model, B
    scaled so that llama.cpp's alpha / rank gives peft's scaling, q and k permuted as the GGUF's rows."""
    _check_settings(model.peft_config["default"])
    text = model.get_base_model().config
    n_head, n_head_kv = (
        int(text.num_attention_heads),
        int(getattr(text, "num_key_value_heads", text.num_attention_heads)),
    )
    tensors: dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
    for name, module in model.named_modules():
        if len(getattr(module, "lora_embedding_A", None) or {}):
            raise UnwritableLora(f"{name}: an embedding LoRA (target_modules) cannot go in a llama.cpp adapter")
        if "default" not in (getattr(module, "lora_A", None) or {}):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in LLAMA_LORA_TENSORS or ".layers." not in name:
            raise UnwritableLora(
                f"{name}: a LoRA on this module (target_modules) cannot go in a llama.cpp adapter; it holds "
                f"{', '.join(LLAMA_LORA_TENSORS)} of the transformer blocks"
            )
        if getattr(module, "use_dora", {}).get("default"):
            raise UnwritableLora(f"{name}: DoRA (use_dora) cannot go in a llama.cpp adapter")
        layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
        a = module.lora_A["default"].weight.detach().to("cpu").double().numpy()
        b = module.lora_B["default"].weight.detach().to("cpu").double().numpy()
        # llama.cpp: delta = (alpha / rank) * B·A with the file's one alpha; peft: scaling * B·A
        b = b * (float(module.scaling["default"]) * a.shape[0] / alpha)
        if leaf == "q_proj":
            b = permute_rows(b, n_head, n_head)
        elif leaf == "k_proj":
            b = permute_rows(b, n_head, n_head_kv)
        tensors[f"blk.{layer}.{LLAMA_LORA_TENSORS[leaf]}"] = (a.astype(np.float32), b.astype(np.float32))
    if not tensors:
        raise UnwritableLora("the model has no LoRA on the modules a llama adapter GGUF can hold")
    return tensors


def write_lora_gguf(model: Any, path: Path, *, architecture: str = "llama") -> Path:
    """The model's LoRA as a llama.cpp adapter GGUF: `general.type=adapter`, `adapter.type=lora`,
    `adapter.lora.alpha`, tensors `blk.N.<name>.weight.lora_a` (ggml [in, rank]: numpy [rank, in])
    and `.lora_b` (ggml [rank, out]), F32. llama.cpp scales B·A by alpha / rank; B carries what else
    peft's scaling of that module holds. UnwritableLora (nothing written) for what it cannot hold."""
    import gguf

    configured = float(model.peft_config["default"].lora_alpha)
    alpha = configured if configured > 0 else 1.0  # 0 would make llama.cpp skip the alpha / rank scale
    tensors = lora_tensors(model, alpha)  # refused before any file is opened
    partial = path.with_suffix(f".{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), architecture)
    writer.add_string(gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for base, (a, b) in tensors.items():
        writer.add_tensor(f"{base}.weight.lora_a", np.ascontiguousarray(a, dtype=np.float32))
        writer.add_tensor(f"{base}.weight.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path
