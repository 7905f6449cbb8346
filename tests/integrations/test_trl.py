"""TRL's GRPOTrainer, one real optimizer step on this CPU, its rollouts through tokentape: what
`rollout_func` hands TRL is the tape's branch, cut TRL's way; after the step the LoRA reaches the
engine (POST /admin/weights) and the next episode records the new version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import peft  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402

from tokentape.client import InProcessGateway  # noqa: E402
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings  # noqa: E402
from tokentape.integrations.trl import PushLora, _loop, rollout_func, tape_reward  # noqa: E402
from tokentape.runtime import RuntimeSettings, build_gateway, embedded_model_path  # noqa: E402
from tokentape.train.weights import LORA_TARGETS, f32_gguf, load_model  # noqa: E402


async def two_turns(client: openai.AsyncOpenAI, prompt: list[dict[str, str]]) -> float:
    """Ask, then ask again: the completion spans two sampled turns with the follow-up between them."""
    model = (await client.models.list()).data[0].id
    first = await client.chat.completions.create(model=model, messages=prompt, max_tokens=6, temperature=1.0)  # type: ignore[arg-type]
    follow = [*prompt, {"role": "assistant", "content": first.choices[0].message.content or ""}]
    follow.append({"role": "user", "content": "Once more."})
    second = await client.chat.completions.create(model=model, messages=follow, max_tokens=6, temperature=1.0)  # type: ignore[arg-type]
    return float(len(second.choices[0].message.content or "") % 3)  # varied, so advantages are not all 0


def test_one_grpo_trainer_step_learns_from_the_tape(tmp_path: Path, hf_dir: Path) -> None:
    f32 = f32_gguf(embedded_model_path())
    engine = LlamaCppEngine(LlamaCppSettings(model_path=f32, context_length=512, kv_cache_f32=True))
    core, name = build_gateway(RuntimeSettings(model_path=f32, context_length=512), engine=engine)
    gateway = InProcessGateway(gateway=core, model=name)
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
        learning_rate=1e-3,
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
    assert trainer.state.log_history and "loss" in trainer.state.log_history[0]
    # the engine now samples the pushed LoRA, and the tape says so
    after = rollout_func(two_turns, gateway)(prompts[:1], trainer)
    (branch,) = _loop().run(gateway.export(after["tokentape_session_id"][0]))["branches"]
    assert branch["policy_versions"] == ["1", "1"]
    _loop().run(gateway.aclose())
