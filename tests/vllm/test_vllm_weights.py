"""New weights on a real vLLM (CPU build) through the remote adapter's four steps: LoRA adapters written
by the test (PEFT layout, random B) loaded in place one after another, whole weights reloaded from a
directory, a generation paused in place (keep) that goes on after the update, and the logprobs of each
version against vLLM's own answer to the same request made straight to it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from tests.vllm.conftest import FIGURES, VLLM_PYTHON, VLLMServer
from tokentape.core.sampling import SamplingParams
from tokentape.engines.remote import VLLMEngine
from tokentape.engines.remote.vllm import LORA_NAME
from tokentape.engines.weights import InFlight, WeightSource

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="a real vLLM runs under `make e2e-vllm` only (minutes of CPU; not part of make test)"
    ),
    pytest.mark.timeout(900),
]

RANK = 8
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


def _adapter(directory: Path, model_dir: Path, seed: int) -> Path:
    """A PEFT LoRA adapter for the served model on `v_proj` and `down_proj`, B drawn at random (a
    trained adapter starts at B = 0, which would change nothing)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * (hidden // config["num_attention_heads"])
    shapes = {"self_attn.v_proj": (hidden, kv), "mlp.down_proj": (config["intermediate_size"], hidden)}
    rng = numpy.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.05, (RANK, fan_in)).astype(numpy.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.05, (fan_out, RANK)).astype(numpy.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["v_proj", "down_proj"],
        "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False,
    }
    (directory / "adapter_config.json").write_text(json.dumps(peft))
    return directory


async def _update(engine: VLLMEngine, source: WeightSource, in_flight: InFlight, version: int) -> dict[str, float]:
    """The four steps in the gateway's order; seconds each took."""
    took: dict[str, float] = {}
    for name, step in (
        ("check", lambda: engine.check_weights(source, in_flight)),
        ("pause", lambda: engine.pause_generation(in_flight)),
        ("load", lambda: engine.load_weights(source, version)),
        ("resume", lambda: engine.resume_generation(fresh_kv=in_flight != "keep")),
    ):
        started = time.perf_counter()
        await step()
        took[name] = round(time.perf_counter() - started, 3)
    return took


def _uncached(server: VLLMServer) -> None:
    """Drop vLLM's prefix cache: a prompt computed afresh and one read partly from cached blocks differ
    by up to ~1e-2 in logprob on the CPU build (seen: -0.0166 against -0.0262), so every answer these
    tests compare is computed afresh."""
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()


async def _greedy(engine: VLLMEngine, prompt: list[int], server: VLLMServer) -> list[tuple[int, float]]:
    _uncached(server)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    return [(t.token_id, t.logprob) async for t in engine.generate(prompt, params, seed=1)]


def _straight(server: VLLMServer, model: str, prompt: list[int]) -> list[tuple[int, float]]:
    """The same request made to vLLM directly, naming `model`: vLLM's own answer."""
    _uncached(server)
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 0}
    choice = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=120).json()
    (choice,) = choice["choices"]
    return list(zip(choice["token_ids"], choice["logprobs"]["token_logprobs"], strict=True))


def _same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """The same tokens with the same logprobs, to vLLM's rounding between two runs."""
    return [t for t, _ in a] == [t for t, _ in b] and all(
        abs(x - y) < 1e-3 for (_, x), (_, y) in zip(a, b, strict=True)
    )


def _apart(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> float:
    """How far the first logprob of two answers to one prompt lies apart (same first position)."""
    return abs(a[0][1] - b[0][1])


async def test_lora_model_and_kept_generations_across_updates(vllm_lora_server: VLLMServer, tmp_path: Path) -> None:
    server = vllm_lora_server
    prompt = Tokenizer.from_file(str(server.model_dir / "tokenizer.json")).encode(COUNTING).ids
    engine = VLLMEngine(server.url)
    await engine.discover()
    base = await _greedy(engine, prompt, server)
    assert _same(base, _straight(server, engine.model_id, prompt))

    first = WeightSource("lora", str(_adapter(tmp_path / "a1", server.model_dir, seed=1)))
    FIGURES["vLLM LoRA update, continue (s per step)"] = await _update(engine, first, "continue", version=1)
    one = await _greedy(engine, prompt, server)
    assert _same(one, _straight(server, LORA_NAME, prompt))  # vLLM's answer under the adapter
    assert _apart(one, base) > 1e-3

    # replaced in place under the same name: the next generation samples under the new one
    second = WeightSource("lora", str(_adapter(tmp_path / "a2", server.model_dir, seed=2)))
    FIGURES["vLLM LoRA update in place, abort (s per step)"] = await _update(engine, second, "abort", version=2)
    two = await _greedy(engine, prompt, server)
    assert _same(two, _straight(server, LORA_NAME, prompt))
    assert _apart(two, one) > 1e-3

    # a generation paused in place goes on after the update, on the KV it had
    params = SamplingParams(max_tokens=40, temperature=0.0)  # it counts on: no end of turn before 40
    stream = engine.generate(prompt, params, seed=1)
    before = [await anext(stream) for _ in range(3)]
    third = WeightSource("lora", str(_adapter(tmp_path / "a3", server.model_dir, seed=3)))
    FIGURES["vLLM LoRA update, keep (s per step)"] = await _update(engine, third, "keep", version=3)
    after = [token async for token in stream]
    assert len(before) == 3 and after, "the kept generation went on after the update"

    # whole weights: the served model's own directory, reloaded in place; the adapter is dropped
    model = WeightSource("model", str(server.model_dir))
    FIGURES["vLLM whole-weight reload, continue (s per step)"] = await _update(engine, model, "continue", version=4)
    assert engine.adapter is None
    assert _same(await _greedy(engine, prompt, server), base)
    await engine.close()
