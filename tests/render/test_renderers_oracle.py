"""An outside oracle: the `renderers` package (the per-family renderers verifiers and prime-rl train
with), run on the same local tokenizers. For every family both support, tokentape's first prompts
and bridges equal its output, or the disagreement is listed below with which of the two matches the
template's own full rendering, and why. A listed disagreement that no longer happens fails too.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from renderers import configs as rc
from renderers import create_renderer
from transformers import PreTrainedTokenizerFast

from tests.render.corpus import WEATHER, Episode
from tokentape.render.renderer import Renderer, RenderOptions

# family -> renderers' config for it
ORACLE: dict[str, type[rc.BaseRendererConfig]] = {
    "qwen3": rc.Qwen3RendererConfig,
    "qwen3.5": rc.Qwen35RendererConfig,
    "qwen3.6": rc.Qwen36RendererConfig,
    "deepseek-r1": rc.DeepSeekR1RendererConfig,
    "deepseek-v3": rc.DeepSeekV3RendererConfig,
    "glm-4.5": rc.GLM45RendererConfig,
    "glm-4.7": rc.GLM5RendererConfig,  # GLM-4.7 reuses GLM-5's template
    "glm-5": rc.GLM5RendererConfig,
    "minimax-m2": rc.MiniMaxM2RendererConfig,
    "llama3.2": rc.Llama3RendererConfig,
}
# Where the two disagree, the winner's tokens equal the template's own full rendering and the other's
# do not. tokentape's `tools` on templates that ignore them are a deliberate difference.
PROMPT_DISAGREEMENTS: dict[tuple[str, str], tuple[str, str]] = {
    ("deepseek-r1", "tools"): ("renderers", "the template ignores `tools`; tokentape lists them in the system prompt"),
    ("deepseek-v3", "tools"): ("renderers", "the template ignores `tools`; tokentape lists them in the system prompt"),
    **{
        ("glm-4.5", shape): (
            "tokentape",
            "the GLM-4.5V template shipped offline ends the prompt with `<|assistant|>\\n`",
        )
        for shape in ("plain", "system", "tools")
    },
    ("minimax-m2", "plain"): ("tokentape", "the shipped template's default system prompt names MiniMax-M2.7, not M2.5"),
    ("minimax-m2", "tools"): ("tokentape", "the shipped template's default system prompt names MiniMax-M2.7, not M2.5"),
    **{
        ("llama3.2", shape): (
            "tokentape",
            "the template writes today's date (strftime_now); renderers pins 26 Jul 2024",
        )
        for shape in ("plain", "system", "tools")
    },
}
# (family, turn) -> why renderers' bridge differs from the full rendering that tokentape's equals
BRIDGE_DISAGREEMENTS: dict[tuple[str, int], str] = {
    ("deepseek-r1", 1): "it adds `<think>\\n` after tool outputs, where the template writes no generation prompt",
    (
        "deepseek-r1",
        3,
    ): "it opens `<｜tool▁outputs▁begin｜>` again at the second tool round; the template opens it once",
    (
        "deepseek-v3",
        3,
    ): "it opens `<｜tool▁outputs▁begin｜>` again at the second tool round; the template opens it once",
    ("glm-4.5", 1): "it ends the generation prompt without the newline the GLM-4.5V template writes",
    ("glm-4.5", 3): "it ends the generation prompt without the newline the GLM-4.5V template writes",
    ("glm-4.5", 5): "after a truncated turn it bridges `</think><|endoftext|>`, which the template never writes",
    ("glm-4.7", 5): "after a truncated turn it bridges `<|endoftext|>`; the template goes straight to `<|user|>`",
    ("glm-5", 5): "after a truncated turn it bridges `<|endoftext|>`; the template goes straight to `<|user|>`",
}
SHAPES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": ([{"role": "user", "content": "Capital of France?"}], None),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}], None),
    "tools": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER]),
}


@functools.cache
def oracle(family: str, directory: Path) -> Any:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    try:  # bridge across new user messages too, as tokentape does (its `tape` policy)
        return create_renderer(tokenizer, ORACLE[family](thinking_retention="all"))
    except ValueError:
        return create_renderer(tokenizer, ORACLE[family]())


@pytest.mark.parametrize("family", list(ORACLE))
def test_first_prompts_agree_or_the_template_decides(
    renderers: dict[str, Renderer], model_dirs: dict[str, Path], family: str
) -> None:
    ours_renderer = renderers[family]
    theirs_renderer = oracle(family, model_dirs[family])
    tokenizer = ours_renderer.tokenizer
    for shape, (messages, tools) in SHAPES.items():
        ours = ours_renderer.prompt(messages, RenderOptions(tools=tools)).tokens
        theirs = list(theirs_renderer.render_ids(messages, tools=tools, add_generation_prompt=True))
        truth = tokenizer.encode(ours_renderer.template.render(messages, add_generation_prompt=True, tools=tools))
        known = PROMPT_DISAGREEMENTS.get((family, shape))
        if ours == theirs:
            assert known is None, f"{family} {shape}: listed as a disagreement, but both agree"
            assert ours == truth
            continue
        assert known is not None, (
            f"{family} {shape}: {tokenizer.decode_all(ours)!r} vs {tokenizer.decode_all(theirs)!r}"
        )
        winner, loser = (ours, theirs) if known[0] == "tokentape" else (theirs, ours)
        assert winner == truth and loser != truth, f"{family} {shape}: {known[1]}"


@pytest.mark.parametrize("family", list(ORACLE))
async def test_bridges_agree_or_the_template_decides(
    renderers: dict[str, Renderer], model_dirs: dict[str, Path], family: str
) -> None:
    """Two tool rounds (DeepSeek's state shows at the second), a new user message, a truncated turn.
    `Episode.check` proves each of tokentape's bridges equals the full rendering there."""
    ep = Episode.of(renderers[family], family, tools=True)
    await ep.turn(
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}],
        ep.calling([("get_weather", {"city": "Paris"})], reasoning="I need the weather."),
    )
    first = ep.replies[-1]["tool_calls"][0]["id"]
    await ep.turn([{"role": "tool", "tool_call_id": first, "content": "sunny"}], ep.sample("Sunny."))
    await ep.turn([{"role": "user", "content": "And Oslo?"}], ep.calling([("get_weather", {"city": "Oslo"})]))
    second = ep.replies[-1]["tool_calls"][0]["id"]
    await ep.turn([{"role": "tool", "tool_call_id": second, "content": "rain"}], ep.sample("Rain."))
    done = await ep.turn([{"role": "user", "content": "Tell me a long story."}], ep.sample("Once " * 40), max_tokens=6)
    assert done.finish_reason == "length"
    await ep.turn([{"role": "user", "content": "Thanks."}], ep.sample("Bye."))
    ep.check()
    theirs_renderer = oracle(family, model_dirs[family])
    compared = 0
    for k, (bridge, new) in enumerate(ep.bridges(), start=1):
        prompt, ids = ep.calls[k - 1]
        rendered = theirs_renderer.bridge_to_next_turn(prompt, ids, new, tools=[WEATHER])
        if rendered is None:  # renderers declines where it cannot prove the bridge (some GLM-4.5 turns)
            continue
        theirs = list(rendered.token_ids)
        assert theirs[: len(prompt) + len(ids)] == prompt + ids  # both keep the sampled tokens
        compared += 1
        why = BRIDGE_DISAGREEMENTS.get((family, k))
        if why is None:
            assert theirs[len(prompt) + len(ids) :] == bridge, f"{family} turn {k}"
        else:
            assert theirs[len(prompt) + len(ids) :] != bridge, f"{family} turn {k}: listed, yet both agree"
    assert compared >= 3
