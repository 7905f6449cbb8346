"""Images through verl's loop, as verl's own multimodal loops pass them: each `generate` call gets
`image_data` (PIL images, one per placeholder run, in order) beside prompt IDs whose runs the
processor expanded, and the `AgentLoopOutput` carries `multi_modal_data={"images": [...]}` in the
order of the runs, each run as long as the processor makes it for its image (verl's worker runs the
processor again on those images for the trainer's forward).

The loop runs on Qwen2-VL's real tokenizer and template (offline) with transformers' Qwen2-VL image
processor; the server manager is an instrument shaped like verl's `LLMServerClient` that answers
scripted tokens and records each call. The oracle is `tests.images.conftest.Oracle` (transformers
alone)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from verl.workers.rollout.replica import TokenOutput

from tests.images.conftest import Oracle, data_url, png
from tests.support.models import materialise
from tokentape.integrations import verl as tape_verl

RED, BLUE = png((200, 30, 30)), png((30, 30, 200), (120, 70))
REPLIES = ("A red screen.", "A blue one.")


class Servers:
    """verl's `LLMServerClient.generate`, answering scripted replies; records every call."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.calls: list[tuple[list[int], list[Any] | None]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        self.calls.append((list(prompt_ids), kwargs.get("image_data")))
        tokens = self.oracle.answer(REPLIES[len(self.calls) - 1])
        extra = {"global_steps": 3, "min_global_steps": 3, "max_global_steps": 3}
        logprobs = [-0.5] * len(tokens)
        return TokenOutput(token_ids=tokens, log_probs=logprobs, stop_reason="completed", extra_fields=extra)


async def two_screens(client: Any, prompt: list[dict[str, Any]]) -> float:
    def shown(text: str, image: bytes) -> dict[str, Any]:
        parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        return {"role": "user", "content": parts}

    model = (await client.models.list()).data[0].id
    messages: list[dict[str, Any]] = [shown(prompt[0]["content"], RED)]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=20)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, shown("And now?", BLUE)]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=20)
    return 1.0


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialise("qwen2-vl", tmp_path_factory.mktemp("verl-vl"))


@pytest.fixture(scope="module")
def oracle(vl_dir: Path) -> Oracle:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Oracle(AutoTokenizer.from_pretrained(vl_dir), Qwen2VLImageProcessorPil())


def _loop(servers: Servers, vl_dir: Path) -> tape_verl.TokentapeAgentLoop:
    """The loop with what `run` reads (its base class's __init__ wants verl's whole config)."""
    loop = object.__new__(tape_verl.TokentapeAgentLoop)
    loop.server_manager, loop.tokenizer, loop.tokenizer_dir = servers, None, vl_dir
    loop.agent, loop._takes_row = two_screens, False
    loop.rollout_config = {"name": "vllm", "logprobs_mode": "processed_logprobs"}  # type: ignore[assignment]
    loop.prompt_length, loop.response_length = 1024, 1024
    loop.rewrite_policy, loop.store, loop.all_branches, loop.fail_on_engine_error = "tape", ":memory:", False, False
    loop.overflow_reward = loop.error_reward = 0.0
    return loop


def pixels(image: Any) -> bytes:
    return bytes(image.convert("RGB").tobytes())


def opened(data: bytes) -> bytes:
    return pixels(Image.open(io.BytesIO(data)))


async def test_images_reach_verls_servers_and_the_output_as_verls_loops_pass_them(vl_dir: Path, oracle: Oracle) -> None:
    servers = Servers(oracle)
    loop = _loop(servers, vl_dir)
    output = await loop.run(
        {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
        raw_prompt=[{"role": "user", "content": "What is on screen?"}],
    )
    hf: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "What is on screen?"}, {"type": "image"}]}
    ]
    (first, first_images), (second, second_images) = servers.calls
    assert first == oracle.ids(hf, [RED])
    hf += [
        {"role": "assistant", "content": REPLIES[0]},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}, {"type": "image"}]},
    ]
    assert second == oracle.ids(hf, [RED, BLUE])
    assert first_images is not None and [pixels(i) for i in first_images] == [opened(RED)]
    assert second_images is not None and [pixels(i) for i in second_images] == [opened(RED), opened(BLUE)]
    assert not isinstance(output, list)
    assert output.extra_fields["tokentape_status"] == "done"
    sequence = output.prompt_ids + output.response_ids
    assert sequence == second + oracle.answer(REPLIES[1])
    images = (output.multi_modal_data or {})["images"]
    assert [pixels(i) for i in images] == [opened(RED), opened(BLUE)]
    # what verl's worker relies on: run i is as long as the processor makes it for image i
    pad = oracle.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    runs, count = [], 0
    for token in [*sequence, -1]:
        if token == pad:
            count += 1
        elif count:
            runs, count = [*runs, count], 0
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        encoded.append(oracle.pads(buffer.getvalue()))
    assert runs == encoded


def test_a_response_cut_never_splits_an_image_run() -> None:
    """verl re-expands every run from its image: a cut inside a run moves before it, and the image
    of a run left out is left out of the output."""
    tokens = list(range(20))
    branch = {
        "tokens": tokens,
        "loss_mask": [0] * 4 + [1] * 4 + [0] * 12,
        "logprobs": [None] * 4 + [-0.1] * 4 + [None] * 12,
        "versions": [-1] * 4 + [0] * 4 + [-1] * 12,
        "image_runs": [{"digest": "a", "start": 1, "end": 3}, {"digest": "b", "start": 10, "end": 16}],
        "images": ["data:image/png;base64,QQ==", "data:image/png;base64,Qg=="],
    }
    sample = tape_verl.verl_sample(branch, prompt_length=100, response_length=8)  # the cut at 12 would split b
    assert sample.prompt_ids == tokens[:4] and sample.response_ids == tokens[4:10]
    assert sample.images == ["data:image/png;base64,QQ=="] and sample.truncated
    whole = tape_verl.verl_sample(branch, prompt_length=100, response_length=16)
    assert whole.response_ids == tokens[4:] and len(whole.images) == 2
