"""A turn whose whole reply a fork cut off (Qwen3's template strips earlier thinking, so under the
fork policy every next turn forks at the reply's start) is on its branch without a sampled span: the
trainer reads each span's turn by its index, never by zipping spans with turns."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.models import materialise
from tests.support.served import build
from tokentape.engines.scripted import ScriptedEngine
from tokentape.runtime import hf_renderer
from tokentape.train.loss import check_sampling, samples_from_export


async def test_branches_with_cut_turns_become_samples(tmp_path: Path) -> None:
    renderer = hf_renderer(materialise("qwen3", tmp_path))
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = ScriptedEngine([], end)
    app = build(engine, renderer, model="qwen3").app
    history = [{"role": "user", "content": "Task: count."}]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        for turn in range(3):
            reply = f"<think>\nthinking {turn}\n</think>\n\nAction {turn}."
            engine.push([*renderer.tokenizer.encode(reply), end])
            body = {"model": "qwen3", "messages": history, "rewrite_policy": "fork", "temperature": 0.7}
            assert (await http.post("/sessions/t/v1/chat/completions", json=body)).status_code == 200
            history += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Obs {turn}"}]
        export = (await http.get("/sessions/t/export")).json()
    cut = [b for b in export["branches"] if len(b["action_ranges"]) < len(b["turn_ids"])]
    assert cut, "the case: a branch holds a turn with no sampled span"
    samples = samples_from_export(export, sampling={"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0})
    for branch, sample in zip(export["branches"], samples, strict=True):
        assert sample.mask == [bool(m) for m in branch["loss_mask"]]
        assert [v is not None for v in sample.versions] == sample.mask
    check_sampling(export, cut[0], {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0})
