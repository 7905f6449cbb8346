"""The same weights on both sides: the F32 copy of the embedded GGUF and the trainer's torch model give
the same logprobs to rounding (llama.cpp with an F32 KV cache); the shipped Q4_1 does not; a peft LoRA
is written as a llama.cpp adapter GGUF that llama.cpp loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")

from tokentape.runtime import embedded_model_path  # noqa: E402
from tokentape.train.weights import add_lora, f32_gguf, load_model, write_lora_gguf  # noqa: E402

pytestmark = pytest.mark.heavy

# a rendered chat: system, user, assistant (token IDs of the embedded model's vocabulary)
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2]
TOKENS += [198, 1, 4093, 198, 5820, 253, 7302, 30, 2, 198, 1, 520, 9531, 198, 504, 37576, 42, 29902, 593, 376, 731]


def trainer_logprobs(model: Any) -> np.ndarray[Any, Any]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()


def engine_logprobs(path: Path) -> np.ndarray[Any, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=128, logits_all=True,
        type_k=0, type_v=0, verbose=False, n_threads=1,
    )  # fmt: skip
    llm.eval(TOKENS)
    logits = np.array(llm.scores[: len(TOKENS) - 1], dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    llm.close()
    return logprobs[np.arange(len(TOKENS) - 1), TOKENS[1:]]


@pytest.fixture(scope="module")
def f32() -> Path:
    return f32_gguf(embedded_model_path())


def test_the_f32_copy_and_the_trainer_agree_the_q4_1_file_does_not(f32: Path, tmp_path: Path) -> None:
    reader = gguf.GGUFReader(str(f32))
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    source = gguf.GGUFReader(str(embedded_model_path()))
    assert reader.fields["tokenizer.chat_template"].contents() == source.fields["tokenizer.chat_template"].contents()
    assert f32_gguf(embedded_model_path()) == f32  # cached

    model = load_model(f32)
    ours = trainer_logprobs(model)
    exact = np.abs(engine_logprobs(f32) - ours)
    assert exact.mean() < 1e-4 and exact.max() < 1e-3  # measured: 4.8e-6 and 3.1e-5
    quantized = np.abs(engine_logprobs(embedded_model_path()) - ours)
    assert quantized.mean() > 100 * exact.mean()  # measured: 0.08 mean, 0.42 max

    lora = add_lora(model, rank=4, alpha=8.0, seed=1)
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:  # B starts at zero; give the adapter something to do
            parameter.data.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    adapter = write_lora_gguf(lora, tmp_path / "adapter.gguf")
    meta = gguf.GGUFReader(str(adapter))
    assert meta.fields["general.type"].contents() == "adapter"
    assert meta.fields["adapter.type"].contents() == "lora"
    assert meta.fields["adapter.lora.alpha"].contents() == pytest.approx(8.0)
    names = {t.name for t in meta.tensors}
    assert "blk.0.attn_v.weight.lora_a" in names and "blk.29.ffn_down.weight.lora_b" in names
    assert not any("attn_q" in n or "attn_k" in n for n in names)  # GGUF permutes q/k rows: left out

    # llama.cpp reads the adapter: its shapes and names match the model's tensors (a mismatch fails
    # the load); tests/train/test_loop.py checks what it does to the engine's logprobs
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(embedded_model_path()), lora_path=str(adapter), n_ctx=64, verbose=False)
    llm.close()


def test_the_kept_copy_loads_the_very_model_the_gguf_loader_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`load_model` keeps the dequantized model as safetensors and loads that next time: the same
    parameters bit for bit and the same forward, without the minute transformers' GGUF loader takes."""
    monkeypatch.setenv("TOKENTAPE_CACHE", str(tmp_path))  # an empty cache: the first load reads the GGUF
    path = embedded_model_path()
    from_gguf = load_model(path)
    copy = next((tmp_path / "hf").iterdir())
    assert (copy / "config.json").is_file() and not list((tmp_path / "hf").glob("*.partial"))
    written = (copy / "config.json").stat().st_mtime_ns
    again = load_model(path)
    assert (copy / "config.json").stat().st_mtime_ns == written  # read, not written again
    first, second = from_gguf.state_dict(), again.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not getattr(again, "is_quantized", False) and not hasattr(again.config, "quantization_config")
    assert not again.training
    np.testing.assert_array_equal(trainer_logprobs(from_gguf), trainer_logprobs(again))


def test_a_gguf_load_parses_the_file_once_and_gets_what_fresh_parses_give(tmp_path: Path) -> None:
    """`load_model`'s first load shares one reader per file and one tensor-name map per architecture
    (transformers would build them again for every tensor), within that load only."""
    from tokentape.train.weights import _gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    arch = gguf.MODEL_ARCH.LLAMA
    with _gguf_parsed_once():
        shared = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is shared  # parsed once, whichever way the path is given
        name_map = gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30) is name_map
        assert gguf.get_tensor_name_map(arch, 2) is not name_map
    fresh = gguf.GGUFReader(str(path))
    assert fresh is not shared and gguf.get_tensor_name_map(arch, 30) is not name_map  # only within the load
    assert [(t.name, t.data.tobytes()) for t in shared.tensors] == [(t.name, t.data.tobytes()) for t in fresh.tensors]
    assert name_map.mapping == gguf.get_tensor_name_map(arch, 30).mapping
