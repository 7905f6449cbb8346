"""A packed row (a tree's branches as one row, every shared token once) gives every token the logprob
the per-branch forward gives it, and the packed loss has the per-branch loss's value and gradient,
for trees of each shape a session takes: n=4 siblings, a fork on a rewritten history, a compacted
history, a group of 8 sessions sharing a prompt. The trees are recorded through the gateway (a
scripted engine answers, so their shapes do not depend on sampling); the per-branch side is the
trainer's own per-branch path (`build_batch`, `token_logprobs`, `loss_and_metrics`), computed
independently of the packing. In float64 throughout, so that a difference is the packing's and not
rounding's: transformers' RMSNorm computes in float32 whatever the model's dtype, and a difference
below float32's resolution then either vanishes or grows to one float32 step (measured on these
trees: the gradient's relative difference 1e-8 with the norms in float32, 1e-14 in float64), so the
test model's norms run in float64. Attention is SDPA's, whose softmax keeps the model's dtype (eager
attention's is float32); the rotary angles are float32 in both paths, the same for one position.
The model is the embedded model's first BLOCKS blocks under its own final norm and head: the packing
(mask, positions, the head on the parents) acts the same in every block, and a float64 forward of all
30 blocks would cost this file most of its time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import MethodType
from typing import Any

import httpx
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.runtime import embedded_model_path
from tokentape.train.loss import Sample, build_batch, loss_and_metrics, samples_from_export, token_logprobs
from tokentape.train.packed import PackedBatch, build_packed, packed_groups, packed_loss, packed_token_logprobs
from tokentape.train.weights import f32_gguf, load_model

pytestmark = pytest.mark.heavy

TEMPERATURE, CLIP = 0.8, 2.0
BLOCKS = 4  # more than the two whose gradient is compared: a leak in an earlier block reaches them


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    loaded = load_model(f32_gguf(embedded_model_path()))
    loaded.model.layers = loaded.model.layers[:BLOCKS]
    loaded.config.num_hidden_layers = BLOCKS
    loaded = loaded.double()
    assert loaded.config._attn_implementation == "sdpa"  # eager attention's softmax would run in float32
    norms = [module for module in loaded.modules() if isinstance(module, LlamaRMSNorm)]
    assert len(norms) == 2 * BLOCKS + 1  # two per block and the final one
    for norm in norms:
        norm.forward = MethodType(_norm_in_float64, norm)
    for parameter in loaded.parameters():  # the gradient is compared on the last two blocks: the backward stops there
        parameter.requires_grad_(False)
    for block in loaded.model.layers[-2:]:
        for parameter in block.parameters():
            parameter.requires_grad_(True)
    yield loaded


def _norm_in_float64(self: LlamaRMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm.forward` in the model's dtype (transformers' own goes through float32)."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


class Recorder:
    def __init__(self, renderer: Renderer) -> None:
        self.tokenizer = renderer.tokenizer
        self.end = renderer.tokenizer.encode("<|im_end|>")[0]
        self.engine = ScriptedEngine([], self.end)
        self.app = build(self.engine, renderer).app

    def answers(self, *texts: str) -> None:
        for text in texts:
            self.engine.push([*self.tokenizer.encode(text), self.end])

    async def chat(self, http: httpx.AsyncClient, session: str, messages: list[dict[str, str]], **extra: Any) -> Any:
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 32, **extra}
        response = await http.post(f"/sessions/{session}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


async def _samples(recorder: Recorder, http: httpx.AsyncClient, sessions: list[str]) -> list[Sample]:
    samples = []
    for session in sessions:
        samples += samples_from_export((await http.get(f"/sessions/{session}/export")).json())
    return samples


@pytest.fixture
async def shapes(renderer: Renderer) -> AsyncIterator[dict[str, list[Sample]]]:
    recorder = Recorder(renderer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=recorder.app), base_url="http://t") as http:
        out: dict[str, list[Sample]] = {}
        recorder.answers("Red.", "Blue like the sky.", "Green, as grass grows.", "Yellow!")
        await recorder.chat(http, "siblings", [user("Name a colour.")], n=4)
        out["n=4 siblings"] = await _samples(recorder, http, ["siblings"])

        recorder.answers("Hello! How can I help?", "Why did the chicken cross?", "Knock knock.")
        history = [user("Hi"), assistant("Hello! How can I help?"), user("Tell me a joke")]
        await recorder.chat(http, "fork", [user("Hi")], rewrite_policy="fork")
        await recorder.chat(http, "fork", history)
        edited = [user("Hi"), assistant("Hello! What do you need?"), user("Tell me a joke")]
        await recorder.chat(http, "fork", edited)
        out["fork on a rewrite"] = await _samples(recorder, http, ["fork"])

        recorder.answers("Step one done.", "Step two done.", "Resumed from the summary.")
        first = [user("Do the task.")]
        await recorder.chat(http, "compacted", first)
        second = [*first, assistant("Step one done."), user("Next.")]
        await recorder.chat(http, "compacted", second)
        summary = [user("Summary: steps one and two are done."), user("Next.")]
        await recorder.chat(http, "compacted", summary)
        out["compacted history"] = await _samples(recorder, http, ["compacted"])

        group = []
        for n in range(8):
            recorder.answers(f"The answer is {n + 1}.")
            created = await http.post("/sessions", json={"session_id": f"g{n}", "group_id": "g"})
            assert created.status_code == 201, created.text
            await recorder.chat(http, f"g{n}", [user("What is 2 + 2?")])
            group.append(f"g{n}")
        out["group of 8"] = await _samples(recorder, http, group)
        yield out


def _paths(batch: PackedBatch, samples: list[Sample]) -> list[list[int]]:
    """Each branch's packed indices, read back from the parents (root first)."""
    parents = batch.parents.tolist()
    ends = []
    tokens = batch.input_ids[0].tolist()
    # the packed row lists each branch's new tokens in order: a branch ends where its path is as long as it
    for sample in samples:
        candidates = [i for i in range(len(parents)) if _depth(parents, i) == len(sample.tokens) - 1]
        path = next(p for p in (_path(parents, c) for c in candidates) if [tokens[i] for i in p] == sample.tokens)
        ends.append(path)
    return ends


def _depth(parents: list[int], i: int) -> int:
    depth = 0
    while parents[i] >= 0:
        i, depth = parents[i], depth + 1
    return depth


def _path(parents: list[int], end: int) -> list[int]:
    path = []
    while end >= 0:
        path.append(end)
        end = parents[end]
    return path[::-1]


def _advantages(samples: list[Sample]) -> list[float]:
    return [(-1.0) ** i * (0.5 + 0.25 * i) for i in range(len(samples))]  # distinct, both signs


def _compare(model: Any, samples: list[Sample], packed: PackedBatch) -> tuple[float, float, float]:
    """Largest logprob difference over every trained token of every branch, the loss difference,
    and the gradient's relative difference (over every parameter)."""
    advantages = _advantages(samples)
    batch = build_batch(samples, advantages_=advantages)
    batch.engine_logprobs = batch.engine_logprobs.double()
    batch.mask, batch.advantages = batch.mask.double(), batch.advantages.double()
    batch.weights = batch.weights.double()

    model.zero_grad()
    per_branch = token_logprobs(model, batch, TEMPERATURE)
    branch_loss, _ = loss_and_metrics(per_branch, batch, CLIP)
    branch_loss.backward()
    branch_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]

    model.zero_grad()
    packed_logprobs = packed_token_logprobs(model, packed, TEMPERATURE)
    loss, metrics = packed_loss(packed_logprobs, packed, CLIP)
    loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]

    largest = 0.0
    for row, path in enumerate(_paths(packed, samples)):
        for position, index in enumerate(path):
            if batch.mask[row, position]:
                assert packed.mask[index], "a token the branch trains on is not trained in the packed row"
                gap = float((per_branch[row, position] - packed_logprobs[index]).detach())
                largest = max(largest, abs(gap))
    difference = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(branch_grads, packed_grads, strict=True)))
    norm = torch.sqrt(sum((a**2).sum() for a in branch_grads))
    assert metrics["tokens_forwarded"] < metrics["branch_tokens"]  # something was shared
    return largest, abs(float(branch_loss - loss)), float(difference / norm)


SHAPES = ["n=4 siblings", "fork on a rewrite", "compacted history", "group of 8"]


@pytest.mark.parametrize("shape", SHAPES)
async def test_packed_rows_give_the_per_branch_logprobs_loss_and_gradient(
    model: Any, shapes: dict[str, list[Sample]], shape: str
) -> None:
    samples = shapes[shape]
    assert len(samples) >= 2
    packed = build_packed(samples, _advantages(samples), dtype=torch.float64)
    logprobs, loss, gradient = _compare(model, samples, packed)
    assert logprobs <= 1e-12, (shape, logprobs)  # ~5e-14 measured
    # ~1e-14 measured (1e-8 with transformers' float32 norms); 1e-4 is the bar asked
    assert loss <= 1e-12 and gradient <= 1e-10, (shape, loss, gradient)


async def test_a_token_that_sees_a_sibling_is_caught(model: Any, shapes: dict[str, list[Sample]]) -> None:
    samples = shapes["n=4 siblings"]
    packed = build_packed(samples, _advantages(samples), dtype=torch.float64)
    paths = _paths(packed, samples)
    # the token that predicts the second branch's last token is let see the first branch's reply
    sibling = [i for i in paths[0] if i not in paths[1]]
    packed.attention[0, 0, paths[1][-2], sibling] = 0.0
    logprobs, _, _ = _compare(model, samples, packed)
    assert logprobs > 1e-6


async def test_a_batch_of_groups_packs_to_the_batch_loss(model: Any, shapes: dict[str, list[Sample]]) -> None:
    """`train --packed`: branches taken group by group into rows of a token budget (a forest of
    small groups, a large tree split by whole branches, a lone branch causal), each row scaled by its
    share of the batch."""
    samples = shapes["n=4 siblings"] + shapes["group of 8"]
    advantages = _advantages(samples)
    batch = build_batch(samples, advantages_=advantages)
    batch.engine_logprobs, batch.mask = batch.engine_logprobs.double(), batch.mask.double()
    batch.advantages, batch.weights = batch.advantages.double(), batch.weights.double()
    with torch.no_grad():
        expected, _ = loss_and_metrics(token_logprobs(model, batch, TEMPERATURE), batch, CLIP)
        for budget, count in ((1, len(samples)), (300, None), (4096, 1)):
            rows = packed_groups(samples, advantages, dtype=torch.float64, max_tokens=budget)
            got = sum(
                share * packed_loss(packed_token_logprobs(model, row, TEMPERATURE), row, CLIP)[0] for row, share in rows
            )
            assert count is None or len(rows) == count, (budget, len(rows))
            assert abs(float(expected - got)) <= 1e-12, (budget, float(expected - got))
            if budget == 1:  # every branch its own row: a plain causal sequence, no N x N mask
                assert all(row.attention is None for row, _ in rows)
