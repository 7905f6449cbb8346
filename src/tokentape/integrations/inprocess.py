"""What every trainer integration does the same way: a gateway in the trainer's own process over the
trainer's engine, and an episode run in one of its sessions with one failure contract.

An episode never raises; it ends with a status:
- `done`: the agent returned (its return value is the reward; None leaves scoring to the trainer);
- `context_full`: a request no longer fit the room the trainer gives (`overflow_reward`);
- `refused`: the gateway refused a request (its error code in `error`; `error_reward`);
- `engine_error`: the trainer's own inference failed under the gateway (a dead server or actor:
  `error_reward`); an integration may fail the step on it instead, as the trainer's own loops would;
- `error`: the agent raised (its traceback in `error`; `error_reward`).
An integration whose trainer cuts a sample shorter than the episode may end it `truncated`: the cut
dropped the turn the agent ended on, so the reward the agent gave is not the sample's
(`overflow_reward`, as for `context_full`; verl's `response_length`).
Only `done`, `context_full` and `truncated` are trained on: the others stay in their group with loss
mask 0.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import openai

from tokentape.client import InProcessGateway
from tokentape.engines.base import Engine
from tokentape.gateway.sessions import MemoryLimits
from tokentape.render.renderer import Renderer
from tokentape.rollout import context_overflow
from tokentape.served import ServeSpec

__all__ = ["ENGINE_CODES", "Episode", "Status", "TRAINED", "in_process_gateway", "plain", "refusal", "run_episode"]

Status = Literal["done", "context_full", "truncated", "refused", "engine_error", "error"]
TRAINED: frozenset[str] = frozenset({"done", "context_full", "truncated"})  # the statuses whose tokens go to the loss
ENGINE_CODES = frozenset({"engine_error", "engine_protocol_error"})  # the trainer's inference failed
MAX_ACTIVE = 1 << 20  # the trainer paces its own servers; the gateway adds no queue of its own
IDLE_SECONDS = 600.0  # every session is finished and exported by its episode: none need outlive it


def in_process_gateway(
    engine: Engine,
    renderer: Renderer,
    *,
    rewrite_policy: str = "tape",
    store: str = ":memory:",
    memory: MemoryLimits | None = None,
    max_active: int = MAX_ACTIVE,
    model: str | None = None,
) -> InProcessGateway:
    """A gateway over a trainer's engine, called in process (no port), served as `model` (default:
    the engine's model id); built as every gateway is (`tokentape.served.build_served`).
    `max_tokens` is clipped to the room left, as the trainers' own servers clip it. `memory`: the
    sessions' memory limits (default: idle sessions leave memory after `IDLE_SECONDS`)."""
    spec = ServeSpec(
        rewrite_policy=rewrite_policy,
        store=store,
        memory=memory or MemoryLimits(idle_seconds=IDLE_SECONDS),
        max_active=max_active,
        clip_max_tokens=True,
        served_model_name=model or engine.model_id,
    )
    return InProcessGateway(spec, engine=engine, renderer=renderer)


@dataclass(slots=True)
class Episode:
    """How an episode ended, and its session's export (empty where the gateway itself failed)."""

    status: Status
    reward: float | None
    error: str | None = None
    export: dict[str, Any] = field(default_factory=dict)

    @property
    def trained(self) -> bool:
        return self.status in TRAINED


def plain(value: Any) -> Any:
    """A dataset value without numpy containers (trainers' batches hold rows as numpy object arrays)."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def refusal(exc: BaseException) -> str | None:
    """The gateway's error code when an exception (or one it came from) is a refused request."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, openai.APIStatusError):
            return str(getattr(current, "code", None) or current.status_code)
        current = current.__cause__ or current.__context__
    return None


async def run_episode(
    gateway: InProcessGateway,
    session_id: str,
    agent: Callable[..., Awaitable[float | None] | float | None],
    args: Sequence[Any],
    *,
    group: str,
    overflow_reward: float,
    error_reward: float,
) -> Episode:
    """Run `agent(client, *args)` in a new session, finish it with its status and reward, export it."""
    try:
        await gateway.create_session(session_id, group_id=group, metadata={"max_tokens": "clip"})
        status: Status = "done"
        error: str | None = None
        reward: float | None = None
        try:
            result = agent(gateway.client(session_id), *args)
            value = await result if inspect.isawaitable(result) else result
            reward = None if value is None else float(value)
        except Exception as exc:
            code = refusal(exc)
            if context_overflow(exc):
                status, reward = "context_full", overflow_reward
            elif code in ENGINE_CODES:
                status, reward, error = "engine_error", error_reward, code
            elif code is not None:
                status, reward, error = "refused", error_reward, code
            else:
                status, reward, error = "error", error_reward, traceback.format_exc()[-4000:]
        rewards = {} if reward is None else {"reward": reward}
        await gateway.finish(session_id, metadata={"status": status}, **rewards)
        export: dict[str, Any] = await gateway.export(session_id)
        return Episode(status, reward, error, export)
    except Exception:  # the gateway itself failed around the episode: still an episode the trainer can pad
        return Episode("error", error_reward, traceback.format_exc()[-4000:])
