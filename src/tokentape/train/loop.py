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
from tokentape.train.loss import Sample, build_batch, loss_and_metrics, samples_from_export, token_logprobs

__all__ = ["StepRecord", "TrainConfig", "Trainer", "push_adapter"]


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


@dataclass(slots=True)
class StepRecord:
    step: int
    version: int  # the policy version that sampled this step's rollouts
    reward_mean: float
    episodes: int
    metrics: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)  # rollout, forward_backward, push
    sampled_versions: list[int | None] = field(default_factory=list)  # every version seen on the tape


async def push_adapter(gateway: GatewayClient, version: int, path: Path) -> dict[str, Any]:
    """Hand the engine a new LoRA: `POST /admin/weights`; turns still running finish on the old one."""
    response = await gateway.http.post(
        "/admin/weights", json={"version": version, "lora": str(path), "in_flight": "continue"}
    )
    if response.status_code >= 400:
        raise RuntimeError(f"the gateway refused the weights (HTTP {response.status_code}): {response.text}")
    result: dict[str, Any] = response.json()
    return result


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
        self.version = 0
        config.out.mkdir(parents=True, exist_ok=True)
        (config.out / "adapters").mkdir(exist_ok=True)

    def _embedded_gateway(self) -> InProcessGateway:
        from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
        from tokentape.runtime import RuntimeSettings, build_gateway

        settings = LlamaCppSettings(
            model_path=self.engine_path, context_length=self.config.context_length, kv_cache_f32=True
        )
        runtime = RuntimeSettings(model_path=self.engine_path, context_length=self.config.context_length)
        gateway, name = build_gateway(runtime, engine=LlamaCppEngine(settings))
        return InProcessGateway(gateway=gateway, model=name or "policy")

    async def rollouts(self, step: int) -> tuple[list[dict[str, Any]], float]:
        run_id = f"train-s{self.config.seed}-{step:04d}"
        episodes = self.config.groups * self.config.group_size
        stats = await run_rollout(
            self.agent,
            self.gateway,
            episodes=episodes,
            concurrency=self.config.concurrency,
            group_size=self.config.group_size,
            run_id=run_id,
        )
        exports = [await self.gateway.export(f"{run_id}-{i:05d}") for i in range(episodes)]
        return exports, stats.mean_reward or 0.0

    def samples(self, exports: list[dict[str, Any]]) -> list[Sample]:
        samples = []
        for export in exports:
            samples += samples_from_export(
                export,
                version=self.version,
                max_staleness=self.config.max_staleness,
                logprob_mode="temperature_scaled_untruncated",
            )
        return [s for s in samples if any(s.mask)]

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step; the mismatch figures are those of the policy that sampled (before it)."""
        import torch

        batch = build_batch(samples)
        self.model.train()
        logprobs = token_logprobs(self.model, batch, self.config.temperature)
        loss, metrics = loss_and_metrics(logprobs, batch, self.config.clip)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if self.config.measure_base:
            with torch.no_grad(), self.model.disable_adapter():
                base = token_logprobs(self.model, batch, self.config.temperature)
            on = batch.mask.bool()
            metrics["base_diff_mean"] = float((base - batch.engine_logprobs).abs()[on].mean())
        return metrics

    async def push(self) -> Path:
        from tokentape.train.weights import write_lora_gguf

        self.version += 1
        path = self.config.out / "adapters" / f"lora-v{self.version}.gguf"
        await asyncio.to_thread(write_lora_gguf, self.model, path)
        await push_adapter(self.gateway, self.version, path)
        return path

    async def step(self, step: int) -> StepRecord:
        start = time.perf_counter()
        sampled_by = self.version
        exports, reward = await self.rollouts(step)
        rolled = time.perf_counter()
        samples = self.samples(exports)
        metrics = await asyncio.to_thread(self.update, samples)
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
        )


async def train(
    config: TrainConfig, agent: Agent, on_step: Callable[[StepRecord], None] = lambda _: None
) -> list[StepRecord]:
    """The whole loop; each step's record is appended to `out/steps.jsonl` as it ends."""
    trainer = await asyncio.to_thread(Trainer, config, agent)
    log = config.out / "steps.jsonl"
    log.write_text("")
    records = []
    try:
        for step in range(config.steps):
            record = await trainer.step(step)
            records.append(record)
            with log.open("a") as file:
                file.write(json.dumps(asdict(record)) + "\n")
            on_step(record)
    finally:
        await trainer.gateway.aclose()
    return records
