"""SkyRL's generator on tokentape: any agent trains through SkyRL, every token from SkyRL's servers.

    python -m skyrl.train.entrypoints.main_base \\
        trainer.override_entrypoint=tokentape.integrations.skyrl_main \\
        tokentape.agent=my_pkg.agents:solve  ...the usual SkyRL keys

`async def solve(client: openai.AsyncOpenAI, prompt) -> float | None` is an ordinary agent (the
verl / TRL / `tokentape rollout` contract): `prompt` is the row's chat messages, the return value its
reward (None: 0.0, SkyRL takes its rewards from the generator). An agent that takes a third
parameter gets the row there: `env_class`, `env_extras`, `trajectory_id`.

`TokentapeGenerator.generate` runs one episode per entry of the `GeneratorInput` (each repetition of
a prompt its own `TrajectoryID`, all of one prompt in one tokentape group), concurrently, against a
gateway in this process whose engine samples through SkyRL's `inference_engine_client`
(`tokentape.integrations.skyrl_engine`). It returns a `GeneratorOutput` as SkyRL's own generator
fills it, in the input's order:
- merged (SkyRL's default): one row per trajectory, the branch holding the agent's last turn:
  `prompt_token_ids` up to the first sampled token, `response_ids` the rest, `loss_masks` the tape's
  (1 on sampled tokens; tool results, user turns and turn closes 0), `rollout_logprobs` (the
  servers', 0.0 off the mask; given when the sampling asks for logprobs, as SkyRL's generator does);
- step-wise (`generator.step_wise_trajectories=true`): one row per assistant turn of the session
  (every branch's turns, each once, in the order they were sampled): the prompt the model saw and what
  it sampled; `is_last_step` on the last row of each trajectory, every row carrying its
  `TrajectoryID`, so SkyRL computes one advantage per rollout from the last step and broadcasts it;
- `rewards` (one scalar per row), `stop_reasons` (`stop`, `length`, or the failure's status),
  `trajectory_ids`, `trajectory_generation_times`, `rollout_metrics` (SkyRL's own plus
  `tokentape/*`), `env_metrics` (empty dicts), and beside them `tokentape_versions` (per response
  token, the weights version that sampled it, -1 off the mask), `tokentape_status` and
  `tokentape_session_ids` per row (SkyRL carries extra list keys along);
- images (merged mode): `pixel_values` and `image_grid_thw`, one tensor per row as SkyRL's VLM
  generator fills them (the processor's outputs for the row's runs, in order; empty tensors for a row
  without images in a batch with some; both keys left out of a batch without images). The engine
  sends each prompt's images to SkyRL's servers as `mm_features`. Step-wise rows carry none in SkyRL
  0.3.0 (its merge asserts so): there a request with an image is refused (`images_not_supported`).

Failures follow `tokentape.integrations.inprocess`: an agent that raises, a refused request, an
engine error end their rollout with a status, the rollout stays in its group as rows with loss mask
0 (logprobs 0.0, versions -1) and `error_reward`; a full context (a prompt past `max_input_length`)
keeps the branch so far, trained, with `overflow_reward`. The step never fails on an episode, unless
`fail_on_engine_error` is set: then SkyRL's inference failing raises out of `generate`, as SkyRL's
own generator would. `generator.zero_reward_on_non_stop` and `generator.apply_overlong_filtering` act
as in SkyRL's generator.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import io
import sys
import time
import typing
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import typing_extensions

from tokentape.client import InProcessGateway
from tokentape.errors import TokentapeError
from tokentape.integrations.inprocess import Episode, in_process_gateway, plain, run_episode
from tokentape.integrations.skyrl_engine import SkyRLEngine
from tokentape.integrations.trainer_engine import asks_logprobs
from tokentape.rollout import load_agent, rendered_prompt
from tokentape.runtime import hf_renderer


def _import_skyrl() -> None:
    """skyrl 0.3 declares Python 3.11 but its Tinker types (which its generator package imports) are
    pydantic models over `typing.TypedDict`, which pydantic refuses before 3.12: on 3.11 that one
    module is imported with `typing_extensions.TypedDict` in its place, and nothing else changes."""
    if sys.version_info >= (3, 12) or "skyrl.tinker.types" in sys.modules:
        return
    original = typing.TypedDict
    setattr(typing, "TypedDict", typing_extensions.TypedDict)  # noqa: B010 (mypy: a module attribute)
    try:
        import skyrl.tinker.types  # noqa: F401
    finally:
        setattr(typing, "TypedDict", original)  # noqa: B010


_import_skyrl()

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput  # noqa: E402
from skyrl.train.generators.utils import apply_overlong_filtering, get_rollout_metrics  # noqa: E402

__all__ = ["SkyRLRow", "TokentapeGenerator", "merged_row", "step_rows"]

Agent = Callable[..., Awaitable[float | None]]  # (client, prompt) or (client, prompt, row)
STEP_WISE_IMAGES = (
    "SkyRL 0.3.0's step-wise trajectories carry no images (its step-wise merge asserts pixel_values and "
    "image_grid_thw are None, and its SkyRLVLMGymGenerator refuses step_wise_trajectories): train a vision "
    "agent with generator.step_wise_trajectories=false"
)


@dataclass(frozen=True, slots=True)
class SkyRLRow:
    """One row of a `GeneratorOutput` (a trajectory, or one step of one)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # 0.0 off the mask
    versions: list[int]  # per response token; -1 off the mask
    stop_reason: str
    images: tuple[str, ...] = ()  # data: URLs, one per placeholder run of the row, in order


def _untrain(row: SkyRLRow, stop_reason: str) -> SkyRLRow:
    n = len(row.response_ids)
    return replace(row, loss_mask=[0] * n, logprobs=[0.0] * n, versions=[-1] * n, stop_reason=stop_reason)


def _row(
    tokens: Sequence[int], mask: Sequence[int], logprobs: Sequence[Any], versions: Sequence[Any], split: int, stop: str
) -> SkyRLRow:
    bits = [int(bool(m)) for m in mask]
    return SkyRLRow(
        prompt_ids=list(tokens[:split]),
        response_ids=list(tokens[split:]),
        loss_mask=bits[split:],
        logprobs=[
            float(lp) if m and lp is not None else 0.0 for lp, m in zip(logprobs[split:], bits[split:], strict=True)
        ],
        versions=[int(v) if m and v is not None else -1 for v, m in zip(versions[split:], bits[split:], strict=True)],
        stop_reason=stop,
    )


def _stop(finish_reason: Any) -> str:
    return "length" if finish_reason == "length" else "stop"


def merged_row(branch: Mapping[str, Any]) -> SkyRLRow:
    """A branch as one SkyRL row: the prompt up to its first sampled token, the rest the response;
    its images (one per placeholder run, in order) for the row's `pixel_values`."""
    mask = list(branch["loss_mask"])
    first = next((i for i, m in enumerate(mask) if m), len(mask))
    stop = _stop(branch["finish_reasons"][-1] if branch["finish_reasons"] else None)
    row = _row(branch["tokens"], mask, branch["logprobs"], branch["versions"], first, stop)
    runs = sorted(
        zip(branch.get("image_runs") or (), branch.get("images") or (), strict=True), key=lambda r: r[0]["start"]
    )
    return replace(row, images=tuple(url for _, url in runs))


def step_rows(export: Mapping[str, Any]) -> list[SkyRLRow]:
    """Every assistant turn of a session once, in the order sampled: what the model saw, what it sampled."""
    turns: dict[Any, SkyRLRow] = {}
    for branch in export.get("branches", ()):
        tokens, turn_index = branch["tokens"], branch["turn_index"]
        for start, end in branch["action_ranges"]:
            turn = turn_index[start]
            node = branch["turn_ids"][turn]
            if node in turns:
                continue
            stop = _stop(branch["finish_reasons"][turn])
            cut = slice(0, end)
            turns[node] = _row(
                tokens[cut], branch["loss_mask"][cut], branch["logprobs"][cut], branch["versions"][cut], start, stop
            )
    return [turns[node] for node in sorted(turns)]


@dataclass(slots=True)
class _Trajectory:
    rows: list[SkyRLRow]
    reward: float
    status: str
    session_id: str
    seconds: float
    error: str | None
    vision: list[tuple[Any, Any] | None]  # per row: (pixel_values, image_grid_thw), None where no image
    resumed: int = 0  # its calls' aborted answers resumed
    straddled: int = 0  # its calls that straddled a weight sync


def _config(cfg: Any, name: str, default: Any) -> Any:
    value = cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)
    return default if value is None else value


class TokentapeGenerator(GeneratorInterface):  # type: ignore[misc]
    """SkyRL's `GeneratorInterface` running a tokentape agent (see the module's docstring).

    `generator_cfg` is SkyRL's `GeneratorConfig` (`step_wise_trajectories`, `max_input_length`,
    `sampling_params`, ...), `inference_engine_client` the client SkyRL's entrypoint builds,
    `policy_model_name` the `model` SkyRL's generator passes it (its policy or LoRA adapter name)."""

    def __init__(
        self,
        generator_cfg: Any,
        tokenizer: Any,
        inference_engine_client: Any,
        *,
        agent: str | Agent,
        policy_model_name: str | None = None,
        tokenizer_dir: str | None = None,
        rewrite_policy: str = "tape",
        overflow_reward: float = 0.0,
        error_reward: float = 0.0,
        fail_on_engine_error: bool = False,
        logprobs_mode: str = "raw_logprobs",
        store: str = ":memory:",
    ) -> None:
        self.generator_cfg = generator_cfg
        self.tokenizer = tokenizer
        self.client = inference_engine_client
        self.agent = load_agent(agent) if isinstance(agent, str) else agent
        self._takes_row = len(inspect.signature(self.agent).parameters) >= 3
        self.policy_model_name = policy_model_name
        self.tokenizer_dir = Path(str(tokenizer_dir or getattr(tokenizer, "name_or_path", "")))
        self.rewrite_policy = rewrite_policy
        self.overflow_reward, self.error_reward = float(overflow_reward), float(error_reward)
        self.fail_on_engine_error = bool(fail_on_engine_error)
        self.logprobs_mode = logprobs_mode
        self.store = store
        self.step_wise = bool(_config(generator_cfg, "step_wise_trajectories", False))
        sampling = _config(generator_cfg, "sampling_params", {})
        self.max_generate_length = int(_config(sampling, "max_generate_length", 1024))
        self.max_input_length = int(_config(generator_cfg, "max_input_length", 4096))
        self._gateway: asyncio.Task[InProcessGateway] | None = None
        self.engine: SkyRLEngine | None = None

    def _default_sampling(self) -> dict[str, Any]:
        """SkyRL's own fallback where the input carries no sampling: the config's, in vLLM's names."""
        sampling = _config(self.generator_cfg, "sampling_params", {})
        with contextlib.suppress(Exception):
            from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params

            return dict(get_vllm_sampling_params(sampling))
        return dict(asdict(sampling)) if is_dataclass(sampling) and not isinstance(sampling, type) else dict(sampling)

    async def gateway(self) -> InProcessGateway:
        """The gateway this generator samples through, built once (concurrent episodes share it)."""
        if self._gateway is None:

            async def build() -> InProcessGateway:
                renderer = await asyncio.to_thread(hf_renderer, self.tokenizer_dir)
                self.engine = SkyRLEngine(
                    self.client,
                    model_id=self.policy_model_name or self.tokenizer_dir.name,
                    model=self.policy_model_name,
                    max_input_length=self.max_input_length,
                    max_generate_length=self.max_generate_length,
                    end_of_turn_ids=renderer.tokenizer.end_of_turn_ids,
                    logprobs_mode=self.logprobs_mode,
                    images_refused=STEP_WISE_IMAGES if self.step_wise else None,
                )
                return in_process_gateway(self.engine, renderer, rewrite_policy=self.rewrite_policy, store=self.store)

            self._gateway = asyncio.ensure_future(build())
        try:
            return await asyncio.shield(self._gateway)
        except Exception:
            self._gateway = None  # a failed build is not kept: the next batch tries again
            raise

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        gateway = await self.gateway()
        prompts = input_batch["prompts"]
        n = len(prompts)
        ids = input_batch.get("trajectory_ids") or [None] * n
        classes = input_batch.get("env_classes") or [None] * n
        extras = input_batch.get("env_extras") or [{}] * n
        sampling = input_batch.get("sampling_params") or self._default_sampling()
        metadata = input_batch.get("batch_metadata")
        step = None if metadata is None else int(metadata.global_step)
        trajectories = await asyncio.gather(
            *(self._trajectory(gateway, prompts[i], classes[i], extras[i], ids[i], sampling, step) for i in range(n))
        )
        if self.fail_on_engine_error:
            failed = [t for t in trajectories if t.status == "engine_error"]
            if failed:
                raise RuntimeError(
                    f"SkyRL's inference failed under {len(failed)} of {n} trajectories: {failed[0].error}"
                )
        return self._output(trajectories, ids, sampling)

    async def _trajectory(
        self,
        gateway: InProcessGateway,
        prompt: Any,
        env_class: Any,
        env_extras: Any,
        trajectory_id: Any,
        sampling: Mapping[str, Any],
        step: int | None,
    ) -> _Trajectory:
        assert self.engine is not None
        started = time.monotonic()
        session_id = f"skyrl-{uuid.uuid4().hex}"
        group = str(trajectory_id.instance_id) if trajectory_id is not None else session_id
        row = {
            "env_class": env_class,
            "env_extras": plain(env_extras),
            "trajectory_id": None if trajectory_id is None else trajectory_id.to_string(),
        }
        messages = plain(prompt)
        self.engine.open_episode(session_id, sampling, step)
        try:
            episode = await run_episode(
                gateway,
                session_id,
                self.agent,
                (messages, row) if self._takes_row else (messages,),
                group=group,
                overflow_reward=self.overflow_reward,
                error_reward=self.error_reward,
            )
        finally:
            resumed, straddled = self.engine.episode_calls(session_id)
            self.engine.close_episode(session_id)
            finish = getattr(self.client, "finish_session", None)
            if finish is not None:  # SkyRL's router frees the session's replica (its generator does this too)
                with contextlib.suppress(Exception):
                    await finish(session_id)
        rows = await self._rows(gateway, episode, messages)
        if self.store == ":memory:":  # exported: nothing needs it any more (a store file keeps it)
            with contextlib.suppress(TokentapeError):
                await gateway.gateway.sessions.delete(session_id)
        reward = 0.0 if episode.reward is None else episode.reward
        vision = [await self._vision(gateway, row.images) if row.images else None for row in rows]
        seconds = time.monotonic() - started
        return _Trajectory(rows, reward, episode.status, session_id, seconds, episode.error, vision, resumed, straddled)

    async def _vision(self, gateway: InProcessGateway, urls: Sequence[str]) -> tuple[Any, Any]:
        """A row's `pixel_values` ([patches, dim]) and `image_grid_thw` ([images, 3]) as SkyRL's VLM
        generator hands them to its trainer: its images' processor outputs, concatenated in run order,
        from the processor that expanded the runs (the gateway's)."""
        vision = gateway.gateway.renderer.vision
        if vision is None:  # images on the tape need a renderer with vision: not reached
            raise RuntimeError("the gateway's renderer has no image processor for the images it recorded")
        return await asyncio.to_thread(_processed, vision, urls)

    async def _rows(self, gateway: InProcessGateway, episode: Episode, messages: Any) -> list[SkyRLRow]:
        branches = episode.export.get("branches") or []
        if not branches:
            rows = [await self._untrained(gateway, messages)]
        elif self.step_wise:
            rows = step_rows(episode.export)
        else:
            rows = [merged_row(max(branches, key=lambda b: max(b["turn_ids"])))]
        if episode.status == "context_full":
            rows[-1] = replace(rows[-1], stop_reason="length")  # as SkyRL's loop ends at max_input_length
        if not episode.trained:
            rows = [_untrain(r, episode.status) for r in rows]
        return rows

    async def _untrained(self, gateway: InProcessGateway, messages: Any) -> SkyRLRow:
        """No turn was recorded: the rendered prompt and one end-of-sequence token, trained on nowhere."""
        try:
            prompt_ids = (await rendered_prompt(gateway, messages))[-self.max_input_length :]
        except Exception:  # a prompt the gateway cannot render: an empty one
            prompt_ids = []
        vision = gateway.gateway.renderer.vision
        if vision is not None and not vision.vision_token_ids.isdisjoint(prompt_ids):
            prompt_ids = []  # an image's placeholders without its pixels: the model's forward would refuse them
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return SkyRLRow(prompt_ids, [0 if eos is None else int(eos)], [0], [0.0], [-1], "length")

    def _output(
        self, trajectories: list[_Trajectory], ids: Sequence[Any], sampling: Mapping[str, Any]
    ) -> GeneratorOutput:
        rows = [(t, i, r, j == len(t.rows) - 1) for i, t in enumerate(trajectories) for j, r in enumerate(t.rows)]
        stops = [r.stop_reason for _, _, r, _ in rows]
        rewards: list[float] = [t.reward for t, _, _, _ in rows]
        if _config(self.generator_cfg, "zero_reward_on_non_stop", False):
            rewards = [w if s == "stop" else 0.0 for w, s in zip(rewards, stops, strict=True)]
        masks = [r.loss_mask for _, _, r, _ in rows]
        if _config(self.generator_cfg, "apply_overlong_filtering", False):
            masks = apply_overlong_filtering(masks, stops)
        responses = [r.response_ids for _, _, r, _ in rows]
        times = [t.seconds for t in trajectories]
        metrics = get_rollout_metrics(responses, rewards, loss_masks=masks, trajectory_completion_times=times)
        metrics.update(self._metrics(trajectories, rows))
        logprobs = asks_logprobs(sampling.get("logprobs"))  # as SkyRL's generator: given where asked for
        output: dict[str, Any] = {
            "prompt_token_ids": [r.prompt_ids for _, _, r, _ in rows],
            "response_ids": responses,
            "rewards": rewards,
            "loss_masks": masks,
            "stop_reasons": stops,
            "rollout_metrics": metrics,
            "rollout_logprobs": [r.logprobs for _, _, r, _ in rows] if logprobs else None,
            "trajectory_ids": [ids[i] for _, i, _, _ in rows] if self.step_wise else None,
            "trajectory_generation_times": [t.seconds for t, _, _, _ in rows],
            "rollout_expert_indices": None,
            "is_last_step": [last for _, _, _, last in rows] if self.step_wise else None,
            "env_metrics": [{} for _ in rows],
            "tokentape_versions": [r.versions for _, _, r, _ in rows],
            "tokentape_status": [t.status for t, _, _, _ in rows],
            "tokentape_session_ids": [t.session_id for t, _, _, _ in rows],
        }
        vision = [t.vision[j] for t in trajectories for j in range(len(t.rows))]
        if any(v is not None for v in vision):  # as SkyRL's VLM generator: only in a batch with images
            output["pixel_values"], output["image_grid_thw"] = _vision_columns(vision)
        return typing.cast(GeneratorOutput, output)

    def _metrics(self, trajectories: list[_Trajectory], rows: list[Any]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for t in trajectories:
            metrics[f"tokentape/status_{t.status}"] = metrics.get(f"tokentape/status_{t.status}", 0.0) + 1.0
        versions = [v for _, _, r, _ in rows for v in r.versions if v >= 0]
        if versions:
            metrics["tokentape/min_version"], metrics["tokentape/max_version"] = min(versions), max(versions)
        if self.engine is not None:  # this batch's own calls, not every call since the start
            metrics["tokentape/straddled_calls"] = float(sum(t.straddled for t in trajectories))
            metrics["tokentape/resumed_calls"] = float(sum(t.resumed for t in trajectories))
        return metrics


def _processed(vision: Any, urls: Sequence[str]) -> tuple[Any, Any]:
    """The processor's `pixel_values` and `image_grid_thw` for images given as data: URLs, as tensors."""
    import torch
    from PIL import Image

    opened = [Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB") for url in urls]
    result = vision.processor(images=opened, return_tensors="np")
    pixels = torch.from_numpy(np.ascontiguousarray(result["pixel_values"]))
    grids = torch.from_numpy(np.ascontiguousarray(result["image_grid_thw"], dtype=np.int64)).reshape(-1, 3)
    return pixels, grids


def _vision_columns(vision: Sequence[tuple[Any, Any] | None]) -> tuple[list[Any], list[Any]]:
    """One tensor per row, as SkyRL's `TensorList` needs (a None entry breaks it): a row without images
    gets no patches ([0, dim]) and no grids ([0, 3])."""
    import torch

    pixels, _ = next(v for v in vision if v is not None)
    none = torch.zeros((0, *pixels.shape[1:]), dtype=pixels.dtype)
    no_grid = torch.zeros((0, 3), dtype=torch.int64)
    return [none if v is None else v[0] for v in vision], [no_grid if v is None else v[1] for v in vision]
