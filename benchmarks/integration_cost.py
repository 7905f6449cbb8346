"""Per-call cost of the trainer integrations at 1k and 32k tokens of history, on a scripted instant
engine (so the figures are tokentape's own work, not inference).

- OpenRLHF: an agent's call through `agent_executor` (the gateway on OpenRLHF's vLLM-shaped engine),
  and the one export `execute` does when the episode ends.
- Atropos: a `ManagedSession.chat_completion`, beside the same call on a plain client (the gateway's
  own cost): the difference is the integration's. Also what the session used to do after every call
  (export and detokenize the whole session), for comparison.

    python benchmarks/integration_cost.py [--lengths 1000 32000] [--calls 9]

Wall time, median of `--calls` calls at each length, on whatever else the machine is running.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.integrations.vllm_shape import CompletionOutput, Logprob, RequestOutput, SamplingParams
from tests.support.models import gguf_tokenizer_dir

from tokentape.client import InProcessGateway
from tokentape.engines.scripted import ScriptedEngine
from tokentape.integrations.atropos import TokentapeServerManager
from tokentape.integrations.openrlhf import agent_executor
from tokentape.runtime import embedded_model_path, gguf_renderer
from tokentape.served import ServeSpec

REPLY = [504, 37576, 42, 29902, 593, 376, 731, 330]  # a short answer, then the turn's close


def filler(tokens: int) -> str:
    return "the model reads a long history of tool calls and answers " * (tokens // 11 + 1)


class InstantLLM:
    """OpenRLHF's `llm_engine`: answers every prompt at once with REPLY and its close."""

    def __init__(self, close: int) -> None:
        self.close = close

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        tokens = [*REPLY, self.close]
        ranked = [{t: Logprob(-1.0, 1)} for t in tokens]
        output = CompletionOutput(0, "x", tokens, None, ranked, "stop")
        return RequestOutput("r", list(prompt_token_ids), [output])


async def openrlhf(length: int, calls: int, tokenizer_dir: Path, close: int) -> dict[str, float]:
    times: list[float] = []

    async def agent(client: openai.AsyncOpenAI, prompt: str, label: str) -> float:
        messages: list[Any] = [{"role": "user", "content": prompt}]
        model = (await client.models.list()).data[0].id
        for turn in range(calls + 1):
            start = time.perf_counter()
            reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=32)
            if turn:  # the first call renders the whole history once
                times.append(time.perf_counter() - start)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "go on"},
            ]
        return 1.0

    executor = agent_executor(agent)()
    start = time.perf_counter()
    result = await executor.execute(
        filler(length),
        "",
        SamplingParams(logprobs=0),
        length * 2,
        SimpleNamespace(name_or_path=str(tokenizer_dir)),
        InstantLLM(close),
    )
    episode = time.perf_counter() - start
    assert len(result["observation_tokens"]) >= length
    # the rest of the episode: the gateway built on the executor's first call, the first (whole) render, one export
    return {"call_ms": statistics.median(times) * 1e3, "rest_of_episode_ms": (episode - sum(times)) * 1e3}


async def atropos(length: int, calls: int, close: int, tokenizer: Any) -> dict[str, float]:
    spec = ServeSpec(served_model_name="m")
    local = InProcessGateway(spec, engine=ScriptedEngine(REPLY, close), renderer=gguf_renderer(embedded_model_path()))
    managed_times, plain_times, old_times = [], [], []
    async with TokentapeServerManager(local).managed_server(tokenizer=tokenizer) as managed:
        plain = "plain"
        await local.create_session(plain)
        client = local.client(plain)
        history: list[Any] = [{"role": "user", "content": filler(length)}]
        plain_history = list(history)
        for turn in range(calls + 1):
            start = time.perf_counter()
            reply = await managed.chat_completion(messages=history, max_tokens=32)
            managed_time = time.perf_counter() - start
            start = time.perf_counter()
            other = await client.chat.completions.create(model="m", messages=plain_history, max_tokens=32)
            plain_time = time.perf_counter() - start
            start = time.perf_counter()  # what the session did after every call before
            export = await local.export(managed.session_id)
            for branch in export["branches"]:
                await local.detokenize(branch["tokens"])
            old_time = time.perf_counter() - start
            if turn:
                managed_times.append(managed_time)
                plain_times.append(plain_time)
                old_times.append(old_time)
            history += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "go on"},
            ]
            plain_history += [
                {"role": "assistant", "content": other.choices[0].message.content},
                {"role": "user", "content": "go on"},
            ]
    await local.aclose()
    return {
        "call_ms": statistics.median(managed_times) * 1e3,
        "gateway_alone_ms": statistics.median(plain_times) * 1e3,
        "integration_ms": (statistics.median(managed_times) - statistics.median(plain_times)) * 1e3,
        "old_refresh_ms": statistics.median(old_times) * 1e3,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 32000])
    parser.add_argument("--calls", type=int, default=9)
    args = parser.parse_args()
    renderer = gguf_renderer(embedded_model_path())
    (close,) = renderer.tokenizer.encode("<|im_end|>")
    with tempfile.TemporaryDirectory() as root:
        tokenizer_dir = gguf_tokenizer_dir(embedded_model_path(), Path(root))
        hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
        for length in args.lengths:
            ours = await openrlhf(length, args.calls, tokenizer_dir, close)
            print(f"OpenRLHF  {length:>6} tokens: " + ", ".join(f"{k} {v:.2f}" for k, v in ours.items()))
            for name, tokenizer in (("tokenizer", hf), ("no tokenizer", None)):
                theirs = await atropos(length, args.calls, close, tokenizer)
                print(f"Atropos   {length:>6} tokens ({name}): " + ", ".join(f"{k} {v:.2f}" for k, v in theirs.items()))


if __name__ == "__main__":
    asyncio.run(main())
