"""`tokentape train`: the reference RL loop, on tokentape's public API only.

Each step: run the agent in GRPO groups through a gateway (`tokentape.rollout`), export the finished
sessions, compute the loss from the tape's tokens, loss mask and logprobs (`tokentape.train.loss`),
take one optimizer step on a LoRA of the same model, write the LoRA as a llama.cpp adapter GGUF and
push it with `POST /admin/weights`, so the next step's rollouts sample the new policy and record its
version. No tokenizer runs here: the trainer reads token IDs.

Both sides hold the same weights: the trainer dequantizes the embedded GGUF; the engine serves an F32
copy of it (with an F32 KV cache), so their logprobs agree to rounding. `weights="q4_1"` serves the
shipped quantized file instead, and the mismatch shows in the per-step figures.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from tokentape.client import GatewayClient, InProcessGateway
from tokentape.rollout import Agent, run_rollout
from tokentape.train.loss import (
    Sample,
    build_batch,
    episode_reward,
    loss_and_metrics,
    samples_from_export,
    token_logprobs,
    trainable,
)

__all__ = ["EvalRecord", "StepRecord", "TrainConfig", "Trainer", "connect"]


@dataclass(slots=True)
class TrainConfig:
    steps: int = 20
    groups: int = 4  # tasks per step
    group_size: int = 4  # episodes per task (GRPO group)
    learning_rate: float = 1e-3
    rank: int = 8
    lora_layers: int | None = 10  # the last N blocks carry the LoRA (None: all): the backward stops there
    alpha: float = 16.0
    clip: float = 2.0  # truncated importance weight: min(p_trainer / p_engine, clip)
    temperature: float = 0.8  # the agent's sampling temperature: the trainer's logprobs use the same
    max_staleness: int = 1  # turns sampled more versions ago than this are left out of the loss
    weights: Literal["f32", "q4_1"] = "f32"
    context_length: int = 1024
    concurrency: int = 16  # episodes in flight: the engine decodes them together, one batch a step
    seed: int = 0
    out: Path = Path("runs/train")
    measure_base: bool = False  # also |engine - base policy| each step (one more forward)
    error_reward: float = 0.0  # an episode whose agent raised: its reward, in the loss and the plot alike
    eval_every: int = 5  # held-out evaluation after every this many updates (and before the first, after the last)
    eval_tasks: int = 16  # the held-out set: episodes of runs named `heldout-...` (the agent's fixed tasks), greedy
    url: str | None = None  # a gateway the user runs (`tokentape serve`, over vLLM, on Ray); None: one in-process
    api_key: str | None = None  # a trainer key of the gateway at `url`
    packed: bool = False  # each group one packed row (`train.packed`): the same loss, shared tokens once


@dataclass(slots=True)
class StepRecord:
    step: int
    version: int  # the policy version that sampled this step's rollouts
    reward_mean: float  # over every episode, errored ones at error_reward (the loss's rule)
    episodes: int
    metrics: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)  # rollout, forward_backward, push
    sampled_versions: list[int | None] = field(default_factory=list)  # every version seen on the tape
    errors: int = 0  # episodes whose agent raised (rewarded error_reward)


@dataclass(slots=True)
class EvalRecord:
    """The policy after `updates` optimizer steps, greedy on the held-out tasks (nothing trains on them)."""

    updates: int
    version: int
    reward_mean: float  # over every held-out episode, errored ones at error_reward
    rewards: list[float]
    errors: int = 0


async def connect(config: TrainConfig) -> GatewayClient | None:
    """The gateway at `config.url` with its trainer key (None: the loop builds one in-process)."""
    return await GatewayClient.connect(config.url, api_key=config.api_key) if config.url else None


class Trainer:
    """The policy (a LoRA on the dequantized model), its optimizer and the gateway it samples through."""

    def __init__(self, config: TrainConfig, agent: Agent, gateway: GatewayClient | None = None) -> None:
        import torch

        from tokentape.runtime import embedded_model_path
        from tokentape.train.weights import add_lora, f32_gguf, load_model

        self.config = config
        self.agent = agent
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        source = embedded_model_path()
        self.f32_path = f32_gguf(source)
        self.engine_path = self.f32_path if config.weights == "f32" else source
        self.model = add_lora(
            load_model(self.f32_path),
            rank=config.rank,
            alpha=config.alpha,
            seed=config.seed,
            last_layers=config.lora_layers,
        )
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=0.0)
        self.gateway = gateway or self._embedded_gateway()
        # what the agent sends on every call (OpenAI's fields), and what every turn must have been sampled
        # with (the gateway's defaults for the rest): the trainer's logprobs are the untruncated
        # distribution at this temperature
        self.sampling = {"temperature": config.temperature, "top_p": 1.0}
        self.expected = {**self.sampling, "top_k": 0, "min_p": 0.0}
        self.version = 0
        config.out.mkdir(parents=True, exist_ok=True)
        (config.out / "adapters").mkdir(exist_ok=True)

    def _embedded_gateway(self) -> InProcessGateway:
        from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
        from tokentape.served import ServeSpec

        settings = LlamaCppSettings(
            model_path=self.engine_path, context_length=self.config.context_length, kv_cache_f32=True
        )
        spec = ServeSpec(model=self.engine_path, context_length=self.config.context_length)
        return InProcessGateway(spec, engine=LlamaCppEngine(settings))

    async def rollouts(self, step: int) -> tuple[list[dict[str, Any]], int]:
        run_id = f"train-s{self.config.seed}-{step:04d}"
        episodes = self.config.groups * self.config.group_size
        stats = await run_rollout(
            self.agent,
            self.gateway,
            episodes=episodes,
            concurrency=self.config.concurrency,
            group_size=self.config.group_size,
            run_id=run_id,
            sampling=self.sampling,
        )
        exports = [await self.gateway.export(f"{run_id}-{i:05d}") for i in range(episodes)]
        return exports, stats.errors

    async def evaluate(self, updates: int) -> EvalRecord:
        """The current policy on the held-out tasks, greedy (temperature 0), one episode per task. A
        run named `heldout-...` is the agent's cue to draw its fixed held-out tasks."""
        run_id = f"heldout-s{self.config.seed}-u{updates:04d}"
        stats = await run_rollout(
            self.agent,
            self.gateway,
            episodes=self.config.eval_tasks,
            concurrency=self.config.concurrency,
            group_size=1,
            run_id=run_id,
            sampling={"temperature": 0.0, "top_p": 1.0},
        )
        rewards = [
            episode_reward(await self.gateway.export(f"{run_id}-{i:05d}"), self.config.error_reward)
            for i in range(self.config.eval_tasks)
        ]
        return EvalRecord(updates, self.version, sum(rewards) / len(rewards), rewards, stats.errors)

    def samples(self, exports: list[dict[str, Any]]) -> tuple[list[Sample], list[float]]:
        """The samples to train on and their advantages, over each group as sampled."""
        samples = []
        for export in exports:
            samples += samples_from_export(
                export,
                version=self.version,
                max_staleness=self.config.max_staleness,
                logprob_mode="temperature_scaled_untruncated",
                sampling=self.expected,
                missing_reward=self.config.error_reward,
            )
        return trainable(samples)

    def update(self, samples: list[Sample], advantages: list[float]) -> dict[str, float]:
        """One optimizer step; the mismatch figures are those of the policy that sampled (before it)."""
        import torch

        if self.config.packed:
            return self._update_packed(samples, advantages)
        batch = build_batch(samples, advantages_=advantages)
        self.model.train()
        logprobs = token_logprobs(self.model, batch, self.config.temperature)
        loss, metrics = loss_and_metrics(logprobs, batch, self.config.clip)
        metrics["tokens_forwarded"] = float(batch.input_ids.numel())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if self.config.measure_base:
            with torch.no_grad(), self.model.disable_adapter():
                base = token_logprobs(self.model, batch, self.config.temperature)
            on = batch.mask.bool()
            metrics["base_diff_mean"] = float((base - batch.engine_logprobs).abs()[on].mean())
        return metrics

    def _update_packed(self, samples: list[Sample], advantages: list[float]) -> dict[str, float]:
        """One optimizer step over packed rows, one per group: each group's loss is scaled by its share
        of the batch's weighted trained tokens, so the sum is the per-branch batch's loss. The mismatch
        figures count each trained token once (a token shared by branches is one token here)."""
        import torch

        from tokentape.train.loss import mismatch
        from tokentape.train.packed import packed_groups, packed_loss, packed_token_logprobs

        def log_ratio(logprobs: Any, row: Any) -> Any:  # log(p_trainer / p_engine) on the trained tokens
            return (logprobs - row.engine_logprobs)[row.mask.bool()]

        rows = packed_groups(samples, advantages)
        self.model.train()
        self.optimizer.zero_grad()
        loss_sum = forwarded = 0.0
        log_ratios = []
        for row, share in rows:  # one row at a time: the gradients add up, the activations do not
            logprobs = packed_token_logprobs(self.model, row, self.config.temperature)
            loss, figures = packed_loss(logprobs, row, self.config.clip)
            (loss * share).backward()
            loss_sum += figures["loss"] * share
            forwarded += figures["tokens_forwarded"]
            log_ratios.append(log_ratio(logprobs.detach(), row))
        self.optimizer.step()
        metrics = {
            "tokens": float(sum(float(row.mask.sum()) for row, _ in rows)),
            **mismatch(torch.cat(log_ratios), self.config.clip),
            "loss": loss_sum,
            "tokens_forwarded": forwarded,
            "branch_tokens": float(sum(row.branch_tokens for row, _ in rows)),
        }
        if self.config.measure_base:
            with torch.no_grad(), self.model.disable_adapter():
                temperature = self.config.temperature
                base = [log_ratio(packed_token_logprobs(self.model, row, temperature), row) for row, _ in rows]
            metrics["base_diff_mean"] = float(torch.cat(base).abs().mean())
        return metrics

    async def push(self) -> Path:
        from tokentape.train.weights import write_lora_gguf

        self.version += 1
        path = self.config.out / "adapters" / f"lora-v{self.version}.gguf"
        await asyncio.to_thread(write_lora_gguf, self.model, path)
        # the client's update path: it carries the trainer key, as every other trainer call does
        await self.gateway.update_weights(self.version, lora=str(path), in_flight="continue")
        return path

    async def step(self, step: int) -> StepRecord:
        start = time.perf_counter()
        sampled_by = self.version
        exports, errors = await self.rollouts(step)
        reward = sum(episode_reward(e, self.config.error_reward) for e in exports) / len(exports)
        rolled = time.perf_counter()
        samples, advantages = self.samples(exports)
        metrics = await asyncio.to_thread(self.update, samples, advantages)
        updated = time.perf_counter()
        await self.push()
        pushed = time.perf_counter()
        versions = sorted({v for s in samples for v in s.versions if v is not None})
        return StepRecord(
            step=step,
            version=sampled_by,
            reward_mean=reward,
            episodes=len(exports),
            metrics=metrics,
            seconds={
                "rollout": rolled - start,
                "forward_backward": updated - rolled,
                "push": pushed - updated,
            },
            sampled_versions=list(versions),
            errors=errors,
        )


async def train(
    config: TrainConfig,
    agent: Agent,
    on_step: Callable[[StepRecord], None] = lambda _: None,
    on_eval: Callable[[EvalRecord], None] = lambda _: None,
) -> list[StepRecord]:
    """The whole loop; each step's record is appended to `out/steps.jsonl` as it ends, each held-out
    evaluation's to `out/heldout.jsonl` (before the first update, every `eval_every`, after the last)."""
    gateway = await connect(config)
    trainer = await asyncio.to_thread(Trainer, config, agent, gateway)
    log, held = config.out / "steps.jsonl", config.out / "heldout.jsonl"
    log.write_text("")
    held.write_text("")
    records = []

    async def evaluate(updates: int) -> None:
        evaluation = await trainer.evaluate(updates)
        with held.open("a") as file:
            file.write(json.dumps(asdict(evaluation)) + "\n")
        on_eval(evaluation)

    try:
        if config.eval_every > 0:
            await evaluate(0)
        for step in range(config.steps):
            record = await trainer.step(step)
            records.append(record)
            with log.open("a") as file:
                file.write(json.dumps(asdict(record)) + "\n")
            on_step(record)
            updates = step + 1
            if config.eval_every > 0 and (updates % config.eval_every == 0 or updates == config.steps):
                await evaluate(updates)
    finally:
        await trainer.gateway.aclose()
    return records
