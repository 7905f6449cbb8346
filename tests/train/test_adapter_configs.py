"""The LoRA settings a TRL user passes, written as a llama.cpp adapter: for each accepted peft config
(peft's default for llama, which targets q and v; every linear layer; rslora; rank and alpha
patterns) the engine's logprobs under the written adapter equal the trainer's (the peft model's,
recomputed with torch) to the F32 bound of tests/train/test_weights.py; each config a llama.cpp
adapter cannot hold is refused with a message naming the module or setting, and nothing is written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("gguf")

from tests.train.test_weights import TOKENS, trainer_logprobs  # noqa: E402
from tokentape.runtime import embedded_model_path  # noqa: E402
from tokentape.train.weights import UnwritableLora, f32_gguf, load_model, write_lora_gguf  # noqa: E402

pytestmark = pytest.mark.heavy

MEAN_BOUND, MAX_BOUND = 1e-4, 1e-3  # measured without an adapter: 4.8e-6 mean, 3.1e-5 max
LAYERS = [0, 13, 29]  # a few blocks, first and last among them: the test stays quick


def engine_logprobs(model: Path, adapter: Path) -> np.ndarray[Any, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(model), lora_path=str(adapter), n_ctx=128, logits_all=True,
        type_k=0, type_v=0, verbose=False, n_threads=1,
    )  # fmt: skip
    llm.eval(TOKENS)
    logits = np.array(llm.scores[: len(TOKENS) - 1], dtype=np.float64)
    llm.close()
    top = logits.max(axis=1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    return logprobs[np.arange(len(TOKENS) - 1), TOKENS[1:]]


@pytest.fixture(scope="module")
def f32() -> Path:
    return f32_gguf(embedded_model_path())


@pytest.fixture(scope="module")
def base(f32: Path) -> Any:
    return load_model(f32)


@pytest.fixture(scope="module")
def base_logprobs(base: Any) -> np.ndarray[Any, Any]:
    return trainer_logprobs(base)


@pytest.fixture
def lora(base: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The base model under the config's LoRA, its B factors random (B starts at zero), then unloaded."""
    model = peft.get_peft_model(base, request.param)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    yield model
    model.unload()


ACCEPTED = {
    "peft default (q, v)": peft.LoraConfig(r=4, lora_alpha=8, layers_to_transform=LAYERS),
    "every linear layer": peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        layers_to_transform=LAYERS,
    ),
    "rslora": peft.LoraConfig(
        r=8, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj"], layers_to_transform=LAYERS
    ),
    "patterns": peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
        rank_pattern={"k_proj": 2, "down_proj": 6},
        alpha_pattern={"q_proj": 3.0, "down_proj": 24.0},
        layers_to_transform=LAYERS,
    ),
}


@pytest.mark.parametrize("lora", list(ACCEPTED.values()), ids=list(ACCEPTED), indirect=True)
def test_the_engine_samples_the_written_adapter_as_the_trainer_computes_it(
    lora: Any, f32: Path, tmp_path: Path, base_logprobs: np.ndarray[Any, Any]
) -> None:
    adapter = write_lora_gguf(lora, tmp_path / "adapter.gguf")
    engine = engine_logprobs(f32, adapter)
    difference = np.abs(engine - trainer_logprobs(lora))
    assert difference.mean() < MEAN_BOUND and difference.max() < MAX_BOUND, (difference.mean(), difference.max())
    # and the adapter moves them far past that bound: a module dropped or mis-scaled would show
    assert np.abs(engine - base_logprobs).mean() > 100 * max(difference.mean(), MEAN_BOUND / 10)


REFUSED = {
    "DoRA": (peft.LoraConfig(r=4, target_modules=["v_proj"], use_dora=True, layers_to_transform=[0]), "use_dora"),
    "modules_to_save": (
        peft.LoraConfig(r=4, target_modules=["v_proj"], modules_to_save=["lm_head"], layers_to_transform=[0]),
        "modules_to_save",
    ),
    "LoRA bias": (
        peft.LoraConfig(r=4, target_modules=["v_proj"], lora_bias=True, layers_to_transform=[0]),
        "lora_bias",
    ),
    "the head": (peft.LoraConfig(r=4, target_modules=["lm_head"]), "lm_head"),
    "the embedding": (peft.LoraConfig(r=4, target_modules=["embed_tokens"]), "embed_tokens"),
}


@pytest.mark.parametrize("lora", [c for c, _ in REFUSED.values()], ids=list(REFUSED), indirect=True)
def test_what_an_adapter_cannot_hold_is_refused_naming_it(
    lora: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    words = REFUSED[request.node.callspec.id][1]
    with pytest.raises(UnwritableLora, match=words):
        write_lora_gguf(lora, tmp_path / "adapter.gguf")
    assert list(tmp_path.iterdir()) == []  # nothing written
