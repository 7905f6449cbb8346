"""Two steps of the reference loop on the embedded model, with a tiny batch: the F32 engine and the
trainer agree on every sampled token's logprob before any update; after the first update (pushed as
a llama.cpp adapter GGUF through POST /admin/weights) the engine samples the updated policy: its
logprobs equal the updated trainer's within the same bound and differ from the old policy's by far
more; the exported policy versions say which weights sampled each token. The gateway is one a user
runs (`--url`): served on a port, with a trainer key and session keys required, so every call of the
loop, the weight push included, has to carry the key it is given."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from tests.support.fake_engines import serving
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
from tokentape.rollout import Episode
from tokentape.runtime import embedded_model_path
from tokentape.served import ServeSpec, build_served
from tokentape.train.loop import TrainConfig, Trainer, connect
from tokentape.train.weights import f32_gguf

pytestmark = pytest.mark.heavy

TRAINER_KEY = "trainer-key-of-the-test"

# Measured on this model (F32 weights, F32 KV cache, 2 threads): mean 3.5e-6, max 3.6e-5 nats over
# a 20-step run; the Q4_1 file against the same trainer: mean 0.08, max 0.42.
MEAN_BOUND, MAX_BOUND = 1e-4, 1e-3


async def agent(client: openai.AsyncOpenAI, episode: Episode) -> float:
    """One short turn; the first member of a group is rewarded: every group has a signal to learn.
    It samples with the settings the loop hands it (the trainer's, or greedy on held-out tasks)."""
    await client.chat.completions.create(
        model=episode.model,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        seed=episode.index,
        **{"temperature": 2.0, **episode.sampling},  # type: ignore[arg-type]
    )
    return 1.0 if episode.member == 0 else 0.0


@pytest.mark.parametrize("packed", [False, True], ids=["per-branch", "packed"])
async def test_two_steps_engine_and_trainer_agree_before_and_after_an_update(tmp_path: Path, packed: bool) -> None:
    f32 = f32_gguf(embedded_model_path())
    engine = LlamaCppEngine(LlamaCppSettings(model_path=f32, context_length=1024, kv_cache_f32=True))
    spec = ServeSpec(model=f32, context_length=1024, api_keys=(TRAINER_KEY,), session_keys="required")
    with serving(build_served(spec, engine=engine, owns_gateway=True).app) as url:
        config = TrainConfig(
            steps=2,
            groups=1,
            group_size=2,
            learning_rate=2e-2,
            temperature=1.0,
            out=tmp_path,
            measure_base=True,
            eval_tasks=2,
            url=url,
            api_key=TRAINER_KEY,
            packed=packed,
        )
        trainer = Trainer(config, agent, await connect(config))
        try:
            first = await trainer.step(0)
            second = await trainer.step(1)
            held_out = await trainer.evaluate(2)
            (branch,) = (await trainer.gateway.export("heldout-s0-u0002-00000"))["branches"]
        finally:
            await trainer.gateway.aclose()
    assert first.version == 0 and first.sampled_versions == [0]  # the base weights sampled step 0
    assert second.version == 1 and second.sampled_versions == [1]  # the pushed adapter sampled step 1
    for record in (first, second):
        assert record.metrics["tokens"] >= 2
        assert record.metrics["logprob_diff_mean"] < MEAN_BOUND, record.metrics
        assert record.metrics["logprob_diff_max"] < MAX_BOUND, record.metrics
        assert record.metrics["clipped_share"] == 0.0
    assert first.metrics["base_diff_mean"] < MEAN_BOUND  # before any update the policy is the base model
    # after it, the engine follows the updated trainer, not the old policy
    assert second.metrics["base_diff_mean"] > 100 * max(second.metrics["logprob_diff_mean"], MEAN_BOUND / 10)
    assert (tmp_path / "adapters" / "lora-v1.gguf").is_file()
    # the held-out evaluation: the pushed policy, greedy, one episode per task, the agent's rewards
    assert (held_out.updates, held_out.version, held_out.rewards) == (2, 2, [1.0] * config.eval_tasks)
    assert branch["sampling"] == [{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}]
    assert branch["policy_versions"] == ["2"]
