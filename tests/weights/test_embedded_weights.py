"""The embedded engine takes new weights under a live gateway: a LoRA adapter swapped onto the loaded
model (no reload) and a whole GGUF, through `POST /admin/weights`. After the update a request's
logprobs equal, bit for bit, those of a cold llama.cpp context loaded with that adapter; before it,
those of the base model. Bad updates are refused before anything is paused."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.support.lora import write_lora
from tests.weights.reference import cold_greedy
from tokentape.core.sampling import SamplingParams
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.engines.weights import WeightSource
from tokentape.gateway.calls import ChatCall, ChoiceDone, Started
from tokentape.gateway.service import Gateway


async def greedy_turn(gateway: Gateway, session: str, max_tokens: int = 8) -> tuple[list[int], list[int], list[float]]:
    """(prompt, sampled tokens, logprobs) of one greedy chat turn."""
    call = ChatCall(
        messages=[{"role": "user", "content": "Name three colours of the rainbow."}],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        session_id=session,
    )
    prompt: list[int] = []
    done = None
    async for event in gateway.run(call, streamed=False):
        if isinstance(event, Started):
            prompt = list(event.prompt_token_ids)
        elif isinstance(event, ChoiceDone):
            done = event
    assert done is not None
    return prompt, [t.token_id for t in done.tokens], [t.logprob for t in done.tokens]


async def test_a_lora_update_gives_the_logprobs_of_a_cold_context_with_that_adapter(
    fresh: Gateway, admin: httpx.AsyncClient, own_engine: LlamaCppEngine, model_path: Path, adapters: list[Path]
) -> None:
    stop = fresh.renderer.tokenizer.end_of_turn_ids
    prompt, tokens, logprobs = await greedy_turn(fresh, "before")
    assert (tokens, logprobs) == cold_greedy(model_path, prompt, len(tokens), stop=stop)

    answer = await admin.post("/admin/weights", json={"version": 1, "lora": str(adapters[0])})
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert (report["version"], report["previous_version"], report["status"]["weights_version"]) == (1, 0, 1)
    assert set(report["phases"]) == {"check", "hold", "pause", "load", "probe", "resume"}
    assert report["status"]["paused"] is False

    prompt2, tokens2, logprobs2 = await greedy_turn(fresh, "after")
    assert prompt2 == prompt
    assert (tokens2, logprobs2) == cold_greedy(model_path, prompt, len(tokens2), lora=adapters[0], stop=stop)
    assert logprobs2 != logprobs  # the adapter changed the model

    # a second adapter replaces the first (not stacked on it)
    assert (await admin.post("/admin/weights", json={"version": 2, "lora": str(adapters[1])})).status_code == 200
    _, tokens3, logprobs3 = await greedy_turn(fresh, "again")
    assert (tokens3, logprobs3) == cold_greedy(model_path, prompt, len(tokens3), lora=adapters[1], stop=stop)
    (turn,) = (await fresh.sessions.get("again")).tree.leaves
    assert (turn.policy_version, [s.as_dict() for s in turn.policy_spans]) == (
        "2",
        [{"version": 2, "start": 0, "end": len(tokens3)}],
    )


async def _engine_greedy(engine: LlamaCppEngine, prompt: list[int], count: int) -> tuple[list[int], list[float]]:
    tokens = [t async for t in engine.generate(prompt, SamplingParams(max_tokens=count, temperature=0.0), seed=0)]
    return [t.token_id for t in tokens], [t.logprob for t in tokens]


@pytest.mark.parametrize("keep", [False, True])
async def test_the_cached_prefix_is_reused_only_under_the_weights_that_computed_it(
    own_engine: LlamaCppEngine, fresh: Gateway, model_path: Path, adapters: list[Path], keep: bool
) -> None:
    """The engine alone (the gateway's probe would evict the cache): a prompt that extends the cached
    one is computed again after a load, unless the update kept the old KV."""
    tokenizer = fresh.renderer.tokenizer
    first = tokenizer.encode("A short story about a lighthouse keeper who")
    longer = [*first, *tokenizer.encode(" finds a bottle")]
    await _engine_greedy(own_engine, first, 2)
    await own_engine.pause_generation("keep" if keep else "continue")
    await own_engine.load_weights(WeightSource("lora", str(adapters[2])), 1)
    await own_engine.resume_generation(fresh_kv=not keep)
    got = await _engine_greedy(own_engine, longer, 4)
    fresh_kv = cold_greedy(model_path, longer, 4, lora=adapters[2])
    if keep:  # the prefix computed by the base model was reused: not what the adapter alone gives
        assert got[1] != fresh_kv[1]
    else:
        assert got == fresh_kv


async def test_a_whole_model_replaces_the_loaded_one(
    fresh: Gateway, admin: httpx.AsyncClient, own_engine: LlamaCppEngine, model_path: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(model_path, copy)
    _, tokens, logprobs = await greedy_turn(fresh, "m0")
    answer = await admin.post("/admin/weights", json={"version": 5, "model": str(copy)})
    assert answer.status_code == 200, answer.text
    assert own_engine.model_path == copy and own_engine.weights_version == 5
    _, tokens2, logprobs2 = await greedy_turn(fresh, "m1")
    assert (tokens2, logprobs2) == (tokens, logprobs)  # the same weights from another file


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"version": 1, "lora": "/nonexistent/adapter.gguf"}, 400, "does not exist"),
        ({"version": 1, "in_flight": "later", "lora": "ADAPTER"}, 400, "in_flight must be one of"),
        ({"version": 0, "lora": "ADAPTER"}, 409, "is not new"),
        ({"version": "1", "lora": "ADAPTER"}, 400, "version must be an integer"),
        ({"version": 1, "lora": "ADAPTER", "model": "MODEL"}, 400, "exactly one of"),
        ({"version": 1, "lora": "MODEL"}, 400, "is not a LoRA adapter"),
        ({"version": 1, "model": "ADAPTER"}, 400, "is not a model"),
        ({"version": 1, "lora": "TEXT"}, 400, "is not a GGUF file"),
        ({"version": 1, "lora": "OTHER_ARCH"}, 400, "architecture 'qwen2'"),
        ({"version": 1, "lora": "OTHER_SHAPE"}, 400, "do not fit its shape"),
        ({"version": 1, "lora": "F64"}, 400, "ggml type 28"),
        ({"version": 1, "engine_managed": True}, 400, "loads its weights itself"),
    ],
)
async def test_bad_updates_are_refused_before_anything_is_paused(
    fresh: Gateway,
    admin: httpx.AsyncClient,
    own_engine: LlamaCppEngine,
    model_path: Path,
    adapters: list[Path],
    tmp_path: Path,
    body: dict[str, object],
    status: int,
    words: str,
) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    files = {
        "ADAPTER": str(adapters[0]),
        "MODEL": str(model_path),
        "TEXT": str(text),
        "OTHER_ARCH": str(write_lora(tmp_path / "qwen.gguf", seed=3, architecture="qwen2", blocks=1)),
        "OTHER_SHAPE": str(write_lora(tmp_path / "wide.gguf", seed=3, shapes={"attn_v": (576, 576)}, blocks=1)),
        "F64": str(_f64_adapter(tmp_path / "f64.gguf")),
    }
    body = {k: files.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    before = own_engine.describe()
    answer = await admin.post("/admin/weights", json=body)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]["message"]
    state = (await admin.get("/admin/status")).json()
    assert (state["paused"], state["weights_version"], state["updating"]) == (False, 0, False)
    assert own_engine.describe() == before  # nothing loaded, nothing paused


def _f64_adapter(path: Path) -> Path:
    """An adapter whose factors are float64: llama.cpp would crash on it, so it is refused."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 16.0)
    writer.add_tensor("blk.0.attn_v.weight.lora_a", np.zeros((8, 576)))
    writer.add_tensor("blk.0.attn_v.weight.lora_b", np.zeros((192, 8)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


async def test_a_second_update_while_one_runs_is_refused(
    fresh: Gateway, admin: httpx.AsyncClient, adapters: list[Path]
) -> None:
    fresh.updates.running = True  # as while another update is between its phases
    try:
        answer = await admin.post("/admin/weights", json={"version": 1, "lora": str(adapters[0])})
    finally:
        fresh.updates.running = False
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "update_in_progress"
