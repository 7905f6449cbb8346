"""Images through SkyRL's generator seam, as SkyRL 0.3.0's own VLM path carries them:
- to its servers, each `generate` call's `mm_features` (`MultiModalFeatures`: `mm_hashes`,
  `mm_placeholders`, `kwargs_data`) from the client's `render_chat_completion` of the images alone,
  each placeholder range where the image's pad run sits in the prompt (SkyRL's Tinker sample path,
  `RemoteInferenceClient._render_for_sample`);
- to its trainer, per row `pixel_values` ([patches, dim]) and `image_grid_thw` ([images, 3]), the
  images of the row's runs in order (`SkyRLVLMGymGenerator`); in a batch with images, a text row gets
  empty tensors (SkyRL's `TensorList` takes no None); SkyRL's own `validate_generator_output` and its
  trainer's `convert_to_training_input` take the batch;
- step-wise rows carry no images in SkyRL 0.3.0: an image is refused there, by name.

Qwen2-VL's real tokenizer and template (offline) with transformers' Qwen2-VL image processor; the
client is an instrument shaped like SkyRL's `RemoteInferenceClient` that answers scripted tokens and
renders images as vLLM's render route does (token IDs from transformers alone, `tests.images.conftest.
Oracle`; `kwargs_data` opaque strings, vLLM's serialized tensors in a real one) and records each call."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import openai
import pytest
import torch
from PIL import Image

# isort: off
from tokentape.integrations.skyrl import TokentapeGenerator  # first: it makes skyrl importable on Python 3.11

from skyrl.backends.skyrl_train.training_batch import TensorList
from skyrl.train.trainer import RayPPOTrainer
from skyrl.train.utils.trainer_utils import validate_generator_output
from skyrl.utils.tok import get_tokenizer
# isort: on

from tests.images.conftest import Oracle, data_url, png
from tests.integrations.test_skyrl import _config, _input
from tests.support.models import materialise

RED, BLUE = png((200, 30, 30)), png((30, 30, 200), (120, 70))
REPLIES = ("A red screen.", "A blue one.", "Plain text.")
PAD = "<|image_pad|>"


def _runs(ids: list[int], pad: int) -> list[dict[str, int]]:
    """The pad runs of `ids` as vLLM's placeholder ranges (offset, length)."""
    runs: list[dict[str, int]] = []
    for i, token in enumerate(ids):
        if token == pad and (i == 0 or ids[i - 1] != pad):
            runs.append({"offset": i, "length": 0})
        if token == pad:
            runs[-1]["length"] += 1
    return runs


def _opaque(data: bytes) -> str:
    return "kwargs-" + hashlib.sha256(data).hexdigest()[:16]


class VisionClient:
    """SkyRL's `RemoteInferenceClient`: `generate` answers REPLIES in turn (each episode's own), and
    `render_chat_completion` renders a message of images as vLLM's render route does."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.pad = oracle.tokenizer.convert_tokens_to_ids(PAD)
        self.model_name = "base-model"
        self.calls: list[dict[str, Any]] = []
        self.renders: list[dict[str, Any]] = []

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        body = request_payload["json"]
        self.renders.append(body)
        (message,) = body["messages"]
        images = [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for p in message["content"]]
        ids = self.oracle.ids([{"role": "user", "content": [{"type": "image"} for _ in images]}], images)
        features = {
            "mm_hashes": {"image": [hashlib.sha256(d).hexdigest() for d in images]},
            "mm_placeholders": {"image": _runs(ids, self.pad)},
            "kwargs_data": {"image": [_opaque(d) for d in images]},
        }
        return {"token_ids": ids, "features": features}

    async def generate(self, input_batch: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        (prompt,) = input_batch["prompt_token_ids"]
        (session,) = input_batch["session_ids"]
        features = (input_batch.get("mm_features") or [None])[0]
        turn = sum(c["session"] == session for c in self.calls)
        text = REPLIES[2] if features is None and turn == 0 and self.pad not in prompt else REPLIES[turn]
        tokens = self.oracle.answer(text)
        self.calls.append({"session": session, "prompt": list(prompt), "features": features, "tokens": tokens})
        return {
            "responses": [text],
            "response_ids": [tokens],
            "stop_reasons": ["stop"],
            "response_logprobs": [[-0.5] * len(tokens)],
        }

    async def finish_session(self, session_id: str) -> None:
        return None


def _shown(text: str, image: bytes) -> dict[str, Any]:
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    return {"role": "user", "content": parts}


REFUSALS: list[str] = []  # what the gateway told the agent when it refused a request


async def screens_or_text(client: Any, prompt: list[dict[str, Any]], row: dict[str, Any]) -> float:
    """Two turns, a screen each (RED, then BLUE with RED still in the history); or one text turn."""
    model = (await client.models.list()).data[0].id
    if row["env_extras"]["agent"] in ("text", "given"):  # the row's prompt as it is (given: with an image)
        await client.chat.completions.create(model=model, messages=prompt, max_tokens=20)
        return 0.5
    messages: list[dict[str, Any]] = [_shown(prompt[0]["content"], RED)]
    try:
        first = await client.chat.completions.create(model=model, messages=messages, max_tokens=20)
    except openai.APIStatusError as exc:
        REFUSALS.append(f"{exc.code}: {exc.message}")
        raise
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, _shown("And now?", BLUE)]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=20)
    return 1.0


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialise("qwen2-vl", tmp_path_factory.mktemp("skyrl-vl"))


@pytest.fixture(scope="module")
def oracle(vl_dir: Path) -> Oracle:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Oracle(AutoTokenizer.from_pretrained(vl_dir), Qwen2VLImageProcessorPil())


def _generator(cfg: Any, client: VisionClient, vl_dir: Path) -> TokentapeGenerator:
    tokenizer = get_tokenizer(str(vl_dir), padding_side="left")
    return TokentapeGenerator(cfg.generator, tokenizer, client, agent=screens_or_text)


def _processed(images: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' processor alone, on the images as sent."""
    opened = [Image.open(io.BytesIO(d)).convert("RGB") for d in images]
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    result = Qwen2VLImageProcessorPil()(images=opened, return_tensors="np")
    return torch.from_numpy(np.asarray(result["pixel_values"])), torch.tensor(np.asarray(result["image_grid_thw"]))


async def test_images_reach_skyrls_servers_and_its_trainer_as_its_vlm_path_carries_them(
    vl_dir: Path, oracle: Oracle
) -> None:
    cfg = _config(n_samples_per_prompt=1, max_input_length=2048)
    client = VisionClient(oracle)
    generator = _generator(cfg, client, vl_dir)
    batch, uids = _input(cfg, ("What is on screen?", "Say yes."), agents=["images", "text"])
    out = await generator.generate(batch)
    validate_generator_output(len(batch["prompts"]), out)
    assert list(out["tokentape_status"]) == ["done", "done"]  # type: ignore[typeddict-item]

    # the servers: the prompts with each image's run expanded, and mm_features placing each image there
    hf: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "What is on screen?"}, {"type": "image"}]}
    ]
    session = out["tokentape_session_ids"][0]  # type: ignore[typeddict-item]
    first, second = [c for c in client.calls if c["session"] == session]
    assert first["prompt"] == oracle.ids(hf, [RED])
    hf += [
        {"role": "assistant", "content": REPLIES[0]},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}, {"type": "image"}]},
    ]
    assert second["prompt"] == oracle.ids(hf, [RED, BLUE])
    for call, images in ((first, [RED]), (second, [RED, BLUE])):
        features = call["features"]
        assert features["mm_placeholders"] == {"image": _runs(call["prompt"], client.pad)}
        assert features["kwargs_data"] == {"image": [_opaque(d) for d in images]}
        assert features["mm_hashes"] == {"image": [hashlib.sha256(d).hexdigest() for d in images]}
    (text_call,) = [c for c in client.calls if c["session"] != session]
    assert text_call["features"] is None
    assert all(r.get("session_id") for r in client.renders)  # routed with the session, as SkyRL's render is

    # the trainer: the images row's tensors are the processor's for its runs, in order
    sequence = out["prompt_token_ids"][0] + out["response_ids"][0]
    assert sequence == second["prompt"] + second["tokens"]
    pixels, grids = _processed([RED, BLUE])
    assert torch.equal(out["pixel_values"][0], pixels) and torch.equal(out["image_grid_thw"][0], grids)
    assert [r["length"] for r in _runs(sequence, client.pad)] == [int(g.prod()) // 4 for g in grids]
    assert out["pixel_values"][1].shape == (0, pixels.shape[1]) and out["image_grid_thw"][1].shape == (0, 3)

    # SkyRL's trainer builds its batch from them
    trainer: Any = object.__new__(RayPPOTrainer)
    trainer.cfg, trainer.tokenizer, trainer.all_metrics = cfg, generator.tokenizer, {}
    trainer.dispatch = SimpleNamespace(get_lcm_dp_size=lambda: 1)
    post, uids = trainer.postprocess_generator_output(out, uids)
    data = trainer.convert_to_training_input(post, uids)
    assert isinstance(data["pixel_values"], TensorList) and isinstance(data["image_grid_thw"], TensorList)
    assert torch.equal(torch.cat(data["pixel_values"].tensors), pixels)  # what its model wrapper concatenates
    assert torch.equal(torch.cat(data["image_grid_thw"].tensors), grids)


async def test_a_text_only_batch_carries_no_image_fields(vl_dir: Path, oracle: Oracle) -> None:
    cfg = _config(n_samples_per_prompt=1, max_input_length=2048)
    generator = _generator(cfg, VisionClient(oracle), vl_dir)
    batch, _ = _input(cfg, ("Say yes.",), agents=["text"])
    out = await generator.generate(batch)
    assert "pixel_values" not in out and "image_grid_thw" not in out  # as SkyRL's generators leave them


async def test_step_wise_rows_refuse_images_by_name(vl_dir: Path, oracle: Oracle) -> None:
    """SkyRL 0.3.0's step-wise merge asserts no pixel_values, and its VLM generator refuses step-wise
    mode: the image request is refused, its rollout untrained in its group; the text one trains."""
    cfg = _config(n_samples_per_prompt=1, max_input_length=2048, step_wise_trajectories=True)
    client = VisionClient(oracle)
    generator = _generator(cfg, client, vl_dir)
    batch, _ = _input(cfg, ("What is on screen?", "Say yes.", "unused"), agents=["images", "text", "given"])
    batch["prompts"][2] = [_shown("What is on screen?", RED)]  # a dataset row that brings its own image
    REFUSALS.clear()
    out = await generator.generate(batch)
    validate_generator_output(len(batch["prompts"]), out, step_wise=True)
    (refusal,) = REFUSALS
    assert refusal.startswith("images_not_supported: ") and "step-wise" in refusal and "pixel_values" in refusal
    statuses = list(out["tokentape_status"])  # type: ignore[typeddict-item]
    assert statuses == ["refused", "done", "refused"]
    for i in (0, 2):
        assert out["loss_masks"][i] == [0] * len(out["response_ids"][i])  # untrained, in its place
    assert all(c["features"] is None for c in client.calls) and not client.renders  # nothing reached the servers
    assert len(client.calls) == 1 and "pixel_values" not in out
    text_prompt = oracle.ids([{"role": "user", "content": "What is on screen?"}], [])
    assert out["prompt_token_ids"][0] == text_prompt  # no turn: the row's own (text) prompt, rendered
    # the image row's rendered prompt holds a placeholder run with no pixels to go with it: dropped
    assert out["prompt_token_ids"][2] == []
    for i in range(3):
        assert client.pad not in out["prompt_token_ids"][i] + out["response_ids"][i]
