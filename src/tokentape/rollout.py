"""`tokentape rollout`: run an async agent function N times against the gateway, in groups, with a
live progress bar, and write the recorded episodes as a dataset.

An agent is `async def agent(client: openai.AsyncOpenAI, episode: Episode) -> float | None`: the client
is already bound to the episode's session; the return value is the episode's reward. Episodes of
one group share a task (`episode.group`), as GRPO groups do. Every episode ends with a `status` in its
session's metadata: `done`; `context_full` when its next request no longer fits the context (a request
whose `max_tokens` passes the room left gets that room, finish `length`; the request after it ends the
episode, rewarded `overflow_reward`); `error` when the agent raised anything else (the error kept in the
metadata, no reward). None of them stops the run.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from tokentape.client import GatewayClient
from tokentape.errors import InvalidRequest

__all__ = [
    "Agent",
    "Episode",
    "RolloutStats",
    "context_overflow",
    "last_branch",
    "load_agent",
    "rendered_prompt",
    "run_rollout",
]


@dataclass(frozen=True, slots=True)
class Episode:
    index: int
    group: int  # episodes of one group share a task
    member: int  # position inside the group
    session_id: str
    model: str
    # request fields a trainer's loss depends on, by OpenAI's names (temperature, top_p): an agent sends
    # them on every call (`**episode.sampling`); empty when nothing trains on the episode
    sampling: Mapping[str, float] = field(default_factory=dict)


Agent = Callable[[openai.AsyncOpenAI, Episode], Awaitable[float | None]]


@dataclass(slots=True)
class RolloutStats:
    run_id: str
    episodes: int
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    errors: int = 0
    context_full: int = 0  # episodes ended because their next request no longer fit the context
    turns: int = 0
    sampled_tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    error_messages: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.sampled_tokens / max(time.monotonic() - self.started, 1e-9)

    @property
    def mean_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


OVERFLOW_CODE = "context_length_exceeded"
ERROR_CODE_HEADER = "x-tokentape-error-code"  # every error response names its code here, in any dialect


def _overflow_response(response: object) -> bool:
    """Whether an HTTP response (httpx's or httpx2's: the SDKs differ) is the gateway's context
    overflow: its code header (set in every dialect; the anthropic shape has no code field) or an
    OpenAI-shaped body's `error.code`."""
    if getattr(response, "status_code", None) != 400:
        return False
    headers = getattr(response, "headers", None)
    if headers is not None and headers.get(ERROR_CODE_HEADER) == OVERFLOW_CODE:
        return True
    try:
        body = response.json()  # type: ignore[attr-defined]
    except Exception:  # an unread stream, not JSON: not the gateway's error body
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == OVERFLOW_CODE


def context_overflow(exc: BaseException) -> bool:
    """Whether an exception (or one it was raised from) is the gateway's `context_length_exceeded`:
    the episode's next request no longer fits the context. Recognised in the openai SDK's errors, the
    anthropic SDK's and plain httpx's (`HTTPStatusError`), whichever the agent uses."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, openai.APIStatusError) and getattr(current, "code", None) == OVERFLOW_CODE:
            return True
        if _overflow_response(getattr(current, "response", None)):  # anthropic.APIStatusError, httpx
            return True
        current = current.__cause__ or current.__context__
    return False


async def rendered_prompt(gateway: GatewayClient, prompt: object) -> list[int]:
    """The prompt's tokens as the gateway renders them (`POST /tokenize`): chat messages with the
    generation prompt, or text as it is. For an episode whose first request did not fit."""
    body: dict[str, object] = {"model": gateway.model}
    if isinstance(prompt, list):
        body["messages"] = prompt
    else:
        body["prompt"] = str(prompt)
    response = await gateway.http.post("/tokenize", json=body)
    response.raise_for_status()
    return [int(t) for t in response.json()["tokens"]]


def last_branch(export: dict[str, Any]) -> dict[str, Any]:
    """The branch of a session's export that holds its latest turn (the agent's last answer)."""
    branch: dict[str, Any] = max(export["branches"], key=lambda b: max(b["turn_ids"]))
    return branch


def load_agent(target: str, examples_dir: Path = Path("examples")) -> Agent:
    """`arithmetic` (examples/arithmetic_agent.py:agent), `path/to/file.py:func` or `package.module:func`."""
    module_part, _, func = target.partition(":")
    func = func or "agent"
    example = examples_dir / f"{module_part}_agent.py"
    if ":" not in target and example.is_file():
        path = example
    elif module_part.endswith(".py"):
        path = Path(module_part)
    else:
        path = None
    if path is not None:
        if not path.is_file():
            raise InvalidRequest(f"no agent file {path}", param="agent")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise InvalidRequest(f"cannot load {path}", param="agent")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise InvalidRequest(f"cannot import {module_part}: {exc}", param="agent") from exc
    agent = getattr(module, func, None)
    if not callable(agent):
        raise InvalidRequest(f"{target} names no function {func!r}", param="agent")
    loaded: Agent = agent
    return loaded


async def run_rollout(
    agent: Agent,
    gateway: GatewayClient,
    *,
    episodes: int,
    concurrency: int,
    group_size: int,
    on_progress: Callable[[RolloutStats], None] = lambda _: None,
    run_id: str | None = None,
    overflow_reward: float = 0.0,
    sampling: Mapping[str, float] | None = None,
) -> RolloutStats:
    stats = RolloutStats(run_id or f"run-{uuid.uuid4().hex[:8]}", episodes)
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> None:
        group, member = divmod(index, group_size)
        session_id = f"{stats.run_id}-{index:05d}"
        episode = Episode(index, group, member, session_id, gateway.model, dict(sampling or {}))
        async with gate:
            metadata = {"run": stats.run_id, "episode": index, "max_tokens": "clip"}
            await gateway.create_session(session_id, group_id=f"{stats.run_id}-g{group:04d}", metadata=metadata)
            client = gateway.client(session_id)
            reward: float | None = None
            ending: dict[str, str] = {"status": "done"}
            try:
                reward = await agent(client, episode)
            except Exception as exc:  # a bad rollout is data, not a crash
                if context_overflow(exc):
                    stats.context_full += 1
                    reward, ending = overflow_reward, {"status": "context_full"}
                else:
                    stats.errors += 1
                    stats.error_messages.append(f"episode {index}: {exc!r}")
                    ending = {"status": "error", "error": traceback.format_exc()[-4000:]}
            rewards = {"reward": reward} if reward is not None else {}
            summary = await gateway.finish(session_id, metadata=ending, **rewards)
            stats.done += 1
            stats.turns += int(summary["turns"])
            stats.sampled_tokens += int(summary["sampled_tokens"])
            if reward is not None:
                stats.rewards.append(float(reward))
            on_progress(stats)

    await asyncio.gather(*(one(i) for i in range(episodes)))
    return stats
