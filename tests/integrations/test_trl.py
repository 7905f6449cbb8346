"""TRL's GRPOTrainer, one real optimizer step on this CPU, its rollouts through tokentape: what
`rollout_func` hands TRL is the tape's branch, cut TRL's way; after the step the LoRA reaches the
engine (POST /admin/weights, on a gateway with a trainer key and session keys required) and the
engine samples it: its logprobs equal the trained model's (recomputed with torch) to the F32 bound
and differ from the base model's, and the next episode records the new version."""

from __future__ import annotations

import itertools
import logging
import types
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import peft  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402

from tests.conftest import MODEL_NAME  # noqa: E402
from tokentape.client import InProcessGateway  # noqa: E402
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings  # noqa: E402
from tokentape.integrations.trl import PushLora, _loop, rollout_func, tape_reward  # noqa: E402
from tokentape.runtime import embedded_model_path  # noqa: E402
from tokentape.served import Served, ServeSpec  # noqa: E402
from tokentape.train.loss import build_batch, samples_from_export, token_logprobs  # noqa: E402
from tokentape.train.weights import LORA_TARGETS, f32_gguf, load_model  # noqa: E402

pytestmark = pytest.mark.heavy


# the F32 bound of tests/train/test_loop.py: the engine serves an F32 copy with an F32 KV cache
MEAN_BOUND, MAX_BOUND = 1e-4, 1e-3
REWARDS = itertools.count()  # one group's two episodes get 0 and 1, whatever the model samples


async def two_turns(client: openai.AsyncOpenAI, prompt: list[dict[str, str]]) -> float:
    """Ask, then ask again: the completion spans two sampled turns with the follow-up between them."""
    model = (await client.models.list()).data[0].id
    first = await client.chat.completions.create(model=model, messages=prompt, max_tokens=6, temperature=1.0)  # type: ignore[arg-type]
    follow = [*prompt, {"role": "assistant", "content": first.choices[0].message.content or ""}]
    follow.append({"role": "user", "content": "Once more."})
    await client.chat.completions.create(model=model, messages=follow, max_tokens=6, temperature=1.0)  # type: ignore[arg-type]
    return float(next(REWARDS) % 2)  # consecutive within a group: advantages are never all 0


def test_one_grpo_trainer_step_learns_from_the_tape(tmp_path: Path, hf_dir: Path) -> None:
    f32 = f32_gguf(embedded_model_path())
    engine = LlamaCppEngine(LlamaCppSettings(model_path=f32, context_length=512, kv_cache_f32=True))
    spec = ServeSpec(model=f32, context_length=512, api_keys=("trl-trainer-key",), session_keys="required")
    gateway = InProcessGateway(spec, engine=engine)
    seen: dict[str, Any] = {}
    rollout = rollout_func(two_turns, gateway)

    def recording(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        seen.update(rollout(prompts, trainer))
        return seen

    prompts = [[{"role": "user", "content": "Name a colour."}]]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=32,
        max_steps=1,
        learning_rate=2e-2,  # one step that moves the policy well past the F32 bound
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    callback = PushLora(gateway, tmp_path / "adapters")
    trainer = trl.GRPOTrainer(
        model=load_model(f32),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts * 2}),  # one group of two
        processing_class=transformers.AutoTokenizer.from_pretrained(str(hf_dir)),
        reward_funcs=[tape_reward],
        rollout_func=recording,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=sorted(LORA_TARGETS)),
        callbacks=[callback],
    )
    trainer.train()

    assert len(seen["prompt_ids"]) == 2 and callback.pushed == [1]
    for i, session_id in enumerate(seen["tokentape_session_id"]):
        (branch,) = _loop().run(gateway.export(session_id))["branches"]
        tokens, mask = branch["tokens"], branch["loss_mask"]
        first = mask.index(True)
        last = len(mask) - mask[::-1].index(True)
        assert seen["prompt_ids"][i] == tokens[:first]
        assert seen["completion_ids"][i] == tokens[first:last]
        assert seen["env_mask"][i] == [int(m) for m in mask[first:last]]
        assert 0 in seen["env_mask"][i]  # the follow-up between the two turns is not trained on
        assert seen["logprobs"][i] == [0.0 if lp is None else lp for lp in branch["logprobs"][first:last]]
        assert seen["tokentape_reward"][i] == branch["reward"]
    # the engine now samples the pushed LoRA, and the tape says so
    after = rollout_func(two_turns, gateway)(prompts[:1], trainer)
    export = _loop().run(gateway.export(after["tokentape_session_id"][0]))
    (branch,) = export["branches"]
    assert branch["policy_versions"] == ["1", "1"]
    _loop().run(gateway.aclose())
    # ... and samples what the trainer trained: its logprobs are the trained model's, not the base's
    import torch

    batch = build_batch(samples_from_export(export))
    on = batch.mask.bool()
    model = trainer.model.eval()
    with torch.no_grad():
        trained = token_logprobs(model, batch, 1.0)
        with model.disable_adapter():
            base = token_logprobs(model, batch, 1.0)
    difference = (trained - batch.engine_logprobs).abs()[on]
    assert on.sum() >= 2 and difference.mean() < MEAN_BOUND and difference.max() < MAX_BOUND, difference
    assert (base - batch.engine_logprobs).abs()[on].mean() > 100 * max(float(difference.mean()), MEAN_BOUND / 10)


LONG = "one two three four five six seven eight nine ten " * 200  # past a 1024-token context alone


def anthropic_agent(local: InProcessGateway) -> Any:
    """An agent on the anthropic SDK (the in-process HTTP client into the same app), one short answer."""

    async def solve(client: openai.AsyncOpenAI, prompt: list[dict[str, str]]) -> float:
        base = str(client.base_url).rstrip("/").removesuffix("/v1")  # .../sessions/<id>
        sdk = anthropic.AsyncAnthropic(base_url=base, api_key=client.api_key, http_client=local.http, max_retries=0)
        await sdk.messages.create(model=MODEL_NAME, max_tokens=6, messages=prompt)  # type: ignore[arg-type]
        return 1.0

    return solve


def test_an_episode_whose_first_request_does_not_fit_is_a_row_that_trains_nothing(built: Served, hf_dir: Path) -> None:
    """The anthropic SDK's overflow is recognised; the row is the prompt as rendered and a one-token
    completion under env_mask 0, beside an ordinary row, and its status says why."""
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    local = InProcessGateway(served=built)
    trainer = types.SimpleNamespace(eos_token_ids=[hf.eos_token_id])
    prompts = [[{"role": "user", "content": "Name a colour."}], [{"role": "user", "content": LONG}]]
    try:
        out = rollout_func(anthropic_agent(local), local)(prompts, trainer)
        assert out["tokentape_status"] == ["done", "context_full"]
        assert out["tokentape_reward"] == [1.0, 0.0]
        rendered = hf.apply_chat_template(prompts[1], add_generation_prompt=True, tokenize=True)
        assert out["prompt_ids"][1] == list(getattr(rendered, "input_ids", rendered))
        assert len(out["prompt_ids"][1]) > built.gateway.engine.context_length
        assert (out["completion_ids"][1], out["env_mask"][1], out["logprobs"][1]) == ([hf.eos_token_id], [0], [0.0])
        assert 1 in out["env_mask"][0]  # the ordinary row trains on its sampled tokens
        assert set(out) == {"prompt_ids", "completion_ids", "env_mask", "logprobs"} | {
            "tokentape_reward",
            "tokentape_session_id",
            "tokentape_status",
        }
        summary = _loop().run(local.http.get(f"/sessions/{out['tokentape_session_id'][1]}")).json()
        assert summary["metadata"]["status"] == "context_full" and summary["turns"] == 0
    finally:
        _loop().run(local.aclose())


def test_a_refused_weight_push_warns_and_training_goes_on_until_it_keeps_failing(
    built: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import tokentape.train.weights as weights

    local = InProcessGateway(served=built)
    monkeypatch.setattr(weights, "write_lora_gguf", lambda model, path: tmp_path / "never-written.gguf")
    callback = PushLora(local, tmp_path / "adapters", max_failures=2)
    try:
        with caplog.at_level(logging.WARNING, logger="tokentape.integrations.trl"):
            callback.on_step_end(None, types.SimpleNamespace(global_step=1), None, model=None)
        assert callback.pushed == [] and [v for v, _ in callback.failures] == [1]
        (record,) = caplog.records
        assert "weights version 1 not pushed" in record.getMessage()
        assert "never-written.gguf" in record.getMessage()  # the gateway's own words
        with pytest.raises(RuntimeError, match="2 weight pushes failed in a row"):
            callback.on_step_end(None, types.SimpleNamespace(global_step=2), None, model=None)
    finally:
        _loop().run(local.aclose())


def test_grpo_trainer_takes_a_step_whose_rows_did_not_fit(tmp_path: Path, hf_dir: Path) -> None:
    """A real optimizer step on rows whose first request overflowed: taken without error, nothing
    trained (no model token counted), the step's push made."""
    f32 = f32_gguf(embedded_model_path())
    gateway = InProcessGateway(ServeSpec(model=f32, context_length=256))
    long = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 40}]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    seen: dict[str, Any] = {}
    rollout = rollout_func(two_turns, gateway)

    def recording(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        seen.update(rollout(prompts, trainer))
        return seen

    callback = PushLora(gateway, tmp_path / "adapters")
    trainer = trl.GRPOTrainer(
        model=load_model(f32),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": [long, long]}),
        processing_class=transformers.AutoTokenizer.from_pretrained(str(hf_dir)),
        reward_funcs=[tape_reward],
        rollout_func=recording,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=sorted(LORA_TARGETS)),
        callbacks=[callback],
    )
    trainer.train()
    assert seen["tokentape_status"] == ["context_full", "context_full"]
    assert seen["env_mask"] == [[0], [0]] and callback.pushed == [1]
    (logged, *_) = trainer.state.log_history
    assert logged["loss"] == 0.0 and logged["completions/mean_length"] == 0.0
    _loop().run(gateway.aclose())
