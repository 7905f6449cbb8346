"""Per-branch rows against packed rows: tokens forwarded and forward-backward seconds per step, with
the reference trainer's model (the embedded SmolLM2 in F32 with its LoRA on the last 10 blocks).

The trees are recorded through the gateway with a scripted engine (their shapes, not what a model
samples), on the template each shape needs, then trained on as the reference trainer does:

  (a) `make train`'s arithmetic groups: 4 groups of 4 sessions, one short answer each;
  (b) n=4 siblings after a 1,000-token prompt;
  (c) a 16-turn episode whose history is compacted twice (after turns 6 and 11);
  (d) a Qwen3 episode whose template strips earlier turns' thinking, under the fork policy (each
      turn forks where the stripped history parts from the tape), 8 and 32 turns: tokens from
      Qwen3's real template; the time on the embedded model with a tree of the same shape (its
      tokens mapped into the embedded vocabulary), for trees under `--time-below` branch tokens.

The trainer packs branches group by group into rows of at most 2,048 packed tokens (a forest of small
groups; a large tree split by whole branches): the attention mask is dense, N x N per head and layer.

    .venv/bin/python benchmarks/packed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from tests.support.models import materialise

from tokentape.core.packed import pack_branches
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.runtime import embedded_model_path, gguf_renderer, hf_renderer
from tokentape.served import ServeSpec, build_served
from tokentape.train.loss import Sample, build_batch, loss_and_metrics, samples_from_export, token_logprobs
from tokentape.train.packed import branch_rows, packed_groups, packed_loss, packed_token_logprobs

WORDS = ["the", "agent", "reads", "a", "long", "history", "of", "tool", "calls", "and", "answers", "then"]
WORDS += ["plans", "its", "next", "step"]


def words(n: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


class Recorder:
    def __init__(self, renderer: Renderer, end_text: str = "<|im_end|>") -> None:
        self.tokenizer = renderer.tokenizer
        self.end = renderer.tokenizer.encode(end_text)[0]
        self.engine = ScriptedEngine([], self.end)
        self.app = build_served(ServeSpec(served_model_name="m"), engine=self.engine, renderer=renderer).app
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t")

    async def chat(self, session: str, messages: list[dict[str, str]], replies: list[str], **extra: Any) -> None:
        for reply in replies:
            self.engine.push([*self.tokenizer.encode(reply), self.end])
        body = {"model": "m", "messages": messages, "max_tokens": 4096, "n": len(replies), **extra}
        response = await self.http.post(f"/sessions/{session}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text

    async def samples(self, sessions: list[str]) -> list[Sample]:
        out: list[Sample] = []
        for session in sessions:
            out += samples_from_export((await self.http.get(f"/sessions/{session}/export")).json())
        return out


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


async def arithmetic(recorder: Recorder) -> list[Sample]:
    sessions = []
    for g in range(4):
        for m in range(4):
            name = f"a{g}-{m}"
            await recorder.http.post("/sessions", json={"session_id": name, "group_id": f"task{g}"})
            prompt = [user(f"Compute {17 + g} * {23 + g}. Answer with the number only.")]
            await recorder.chat(name, prompt, [f"{(17 + g) * (23 + g) + m}"])
            sessions.append(name)
    return await recorder.samples(sessions)


async def siblings(recorder: Recorder) -> list[Sample]:
    prompt = [user(words(1000))]
    await recorder.chat("siblings", prompt, [words(40, seed) for seed in range(4)])
    return await recorder.samples(["siblings"])


async def compacted(recorder: Recorder) -> list[Sample]:
    history: list[dict[str, str]] = [user("Solve the task in steps.")]
    for turn in range(16):
        if turn in (6, 11):  # the agent compacts its history into a summary
            history = [user(f"Summary of the first {turn} steps: {words(40, turn)}"), user("Go on.")]
        await recorder.chat("compacted", history, [f"Step {turn}: {words(30, turn)}"])
        history += [assistant(f"Step {turn}: {words(30, turn)}"), user(f"Result {turn}: {words(20, turn)}")]
    return await recorder.samples(["compacted"])


async def thinking(recorder: Recorder, turns: int, name: str) -> list[Sample]:
    history: list[dict[str, str]] = [user(f"Task: {words(60)}")]
    for turn in range(turns):
        reply = f"<think>\n{words(80, turn)}\n</think>\n\nAction {turn}: {words(12, turn)}"
        await recorder.chat(name, history, [reply], rewrite_policy="fork")
        history += [assistant(reply), user(f"Observation {turn}: {words(25, turn)}")]
    return await recorder.samples([name])


def into_vocabulary(samples: list[Sample], vocabulary: int) -> list[Sample]:
    """The same tree shape in another vocabulary (for timing on the embedded model)."""
    return [
        Sample(
            s.session_id,
            s.group_id,
            [t % vocabulary for t in s.tokens],
            s.mask,
            s.engine_logprobs,
            s.reward,
            s.versions,
            loss_weight=s.loss_weight,
        )
        for s in samples
    ]


def advantages(samples: list[Sample]) -> list[float]:
    return [(-1.0) ** i * 0.5 for i in range(len(samples))]


def step_seconds(model: Any, samples: list[Sample], packed: bool) -> tuple[float, int]:
    start = time.perf_counter()
    model.zero_grad()
    adv = advantages(samples)
    if packed:
        forwarded = 0
        for row, share in packed_groups(samples, adv):
            loss, _ = packed_loss(packed_token_logprobs(model, row, 0.8), row, 2.0)
            (loss * share).backward()
            forwarded += row.input_ids.shape[1]
    else:
        batch = build_batch(samples, advantages_=adv)
        loss, _ = loss_and_metrics(token_logprobs(model, batch, 0.8), batch, 2.0)
        loss.backward()
        forwarded = int(batch.input_ids.numel())  # padded rows, as the trainer forwards them
    return time.perf_counter() - start, forwarded


async def record() -> dict[str, list[Sample]]:
    root = Path(tempfile.mkdtemp())
    embedded = Recorder(gguf_renderer(embedded_model_path()))
    qwen3 = Recorder(hf_renderer(materialise("qwen3", root)))
    return {
        "(a) arithmetic groups, 4 x 4": await arithmetic(embedded),
        "(b) n=4 siblings, 1,000-token prompt": await siblings(embedded),
        "(c) 16 turns compacted twice": await compacted(embedded),
        "(d) Qwen3 thinking-strip, 8 turns": await thinking(qwen3, 8, "t8"),
        "(d) Qwen3 thinking-strip, 32 turns": await thinking(qwen3, 32, "t32"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-below", type=int, default=20_000, help="time shapes of fewer branch tokens only")
    args = parser.parse_args()
    import torch

    from tokentape.train.weights import add_lora, f32_gguf, load_model

    torch.manual_seed(0)
    shapes = asyncio.run(record())
    model = add_lora(load_model(f32_gguf(embedded_model_path())), rank=8, last_layers=10)
    vocabulary = model.get_base_model().config.vocab_size
    header = ("shape", "rows", "branch tok", "tree tok", "forwarded", "saved", "per-branch s", "packed s", "speed-up")
    print("{:40} {:>4} {:>10} {:>8} {:>9} {:>6} {:>12} {:>9} {:>8}".format(*header))
    for name, samples in shapes.items():
        samples = into_vocabulary(samples, vocabulary)
        branch_tokens = sum(len(s.tokens) for s in samples)
        packed_tokens = sum(row.input_ids.shape[1] for row, _ in packed_groups(samples, advantages(samples)))
        tree_tokens = len(pack_branches(branch_rows(samples))["tokens"])  # format=packed: one row
        times: dict[bool, list[float]] = {False: [], True: []}
        if branch_tokens >= args.time_below:  # tokens only: the per-branch step would take minutes here
            saved = 1 - packed_tokens / branch_tokens
            counts = (
                f"{name:40} {len(samples):4d} {branch_tokens:10,d} {tree_tokens:8,d} {packed_tokens:9,d} {saved:6.1%}"
            )
            print(f"{counts} {'-':>12} {'-':>9} {'-':>8}")
            continue
        for _ in range(args.repeats):  # alternating, so the machine's ups and downs fall on both
            for packed in (False, True):
                times[packed].append(step_seconds(model, samples, packed)[0])
        per_branch, packed_s = statistics.median(times[False]), statistics.median(times[True])
        saved = 1 - packed_tokens / branch_tokens
        print(
            f"{name:40} {len(samples):4d} {branch_tokens:10,d} {tree_tokens:8,d} {packed_tokens:9,d} {saved:6.1%} "
            f"{per_branch:12.2f} {packed_s:9.2f} {per_branch / packed_s:7.2f}x"
        )
    print(f"load average: {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()
