"""Multi-turn sessions with images through the real SDKs: at every turn the prompt the engine got and
the tape recorded equal the processor's full render of the conversation (computed with transformers
alone, `conftest.Oracle`); each image's run appears once per occurrence; the export carries the
images, their grids and runs, with the loss mask 0 on every placeholder."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.images.conftest import App, Oracle, data_url, png
from tests.support.fake_vision import IMAGE_PAD, VISION_END, VISION_START
from tokentape.render.renderer import Renderer, RenderOptions

RED, BLUE, GREEN = (200, 30, 30), (30, 30, 200), (30, 160, 30)


def openai_image(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def runs_of(tokens: list[int]) -> list[tuple[int, int]]:
    """Every placeholder run in `tokens` as (start, end), markers included, found by scanning."""
    runs, start = [], None
    for i, token in enumerate(tokens):
        if token == VISION_START:
            start = i
        elif token == VISION_END and start is not None:
            runs.append((start, i + 1))
            start = None
    return runs


def check_export(branch: dict[str, Any], oracle: Oracle, images: list[bytes]) -> None:
    """The branch's images: one run per occurrence, in order, each the processor's length, masked."""
    tokens, mask = branch["tokens"], branch["loss_mask"]
    assert [(r["start"], r["end"]) for r in branch["image_runs"]] == runs_of(tokens)
    assert len(branch["image_runs"]) == len(images) == len(branch["images"])
    assert branch["images"] == [data_url(d) for d in images]
    assert branch["image_grid_thw"] == [oracle.grid(d) for d in images]
    for run, data in zip(branch["image_runs"], images, strict=True):
        assert tokens[run["start"] : run["end"]] == [VISION_START, *[IMAGE_PAD] * oracle.pads(data), VISION_END]
        assert set(mask[run["start"] : run["end"]]) == {0}
    assert tokens.count(IMAGE_PAD) == sum(oracle.pads(d) for d in images)  # expanded once, never twice


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_user_images_each_turn_equal_the_processors_render(app: App, oracle: Oracle, stream: bool) -> None:
    session = f"screens-{stream}"
    red, blue = png(RED), png(BLUE, (120, 70))
    sent: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "What is on screen?"}, openai_image(red)]}
    ]
    hf: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "What is on screen?"}, {"type": "image"}]}
    ]
    images = [red]
    steps = [("A red screen.", "And now?", blue), ("A blue one.", "And the first again?", red), ("Red.", "", b"")]
    for turn, (reply, follow_up, image) in enumerate(steps):
        app.queue(oracle.answer(reply))
        headers = {"X-Session-ID": session}
        if stream:
            chunks = await app.openai.chat.completions.create(
                model="m", messages=sent, stream=True, max_tokens=40, extra_headers=headers
            )
            content = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        else:
            response = await app.openai.chat.completions.create(
                model="m", messages=sent, max_tokens=40, extra_headers=headers
            )
            content = response.choices[0].message.content or ""
        assert content == reply
        expected = oracle.ids(hf, images)
        assert app.engine.state.requests[-1]["token_ids"] == expected, f"turn {turn}: the engine's prompt"
        (branch,) = (await app.export(session))["branches"]
        starts = [start for start, _ in branch["action_ranges"]]
        assert branch["tokens"][: starts[-1]] == expected, f"turn {turn}: the tape's prompt"
        check_export(branch, oracle, images)
        if not follow_up:
            break
        sent += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": [{"type": "text", "text": follow_up}, openai_image(image)]},
        ]
        hf += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": [{"type": "text", "text": follow_up}, {"type": "image"}]},
        ]
        images.append(image)
    # the same red screenshot twice: two runs on the tape, one image in the store
    store = app.gateway.sessions.store
    assert store is not None
    assert (await store.image_stats())["images"] == 2


async def test_n_choices_share_the_prompt_and_each_branch_holds_the_image_once(app: App, oracle: Oracle) -> None:
    green = png(GREEN, (90, 90))
    app.queue(oracle.answer("Green."), oracle.answer("A green square."))
    message = {"role": "user", "content": [openai_image(green), {"type": "text", "text": "Color?"}]}
    response = await app.openai.chat.completions.create(
        model="m", messages=[message], n=2, max_tokens=20, extra_headers={"X-Session-ID": "twice"}
    )
    assert sorted(c.message.content or "" for c in response.choices) == ["A green square.", "Green."]
    expected = oracle.ids(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}], [green]
    )
    assert [r["token_ids"] for r in app.engine.state.requests[-2:]] == [expected, expected]
    branches = (await app.export("twice"))["branches"]
    assert len(branches) == 2
    for branch in branches:
        check_export(branch, oracle, [green])


async def test_anthropic_tool_result_screenshot_is_bridged_exactly(
    app: App, oracle: Oracle, vl_renderer: Renderer
) -> None:
    """A tool returns a screenshot: the bridge appends the tool result with its image's run, after the
    sampled tool call, and the whole equals the processor's render."""
    tool = {"name": "screenshot", "description": "Take a screenshot", "input_schema": {"type": "object"}}
    chat_tool = {
        "type": "function",
        "function": {"name": "screenshot", "parameters": {"type": "object"}, "description": "Take a screenshot"},
    }
    call_text = '<tool_call>\n{"name": "screenshot", "arguments": {}}\n</tool_call>'
    shot = png(BLUE, (150, 100))
    app.queue(oracle.answer(call_text), oracle.answer("The screen is blue."))
    user = {"role": "user", "content": "Look at the screen."}
    first = await app.anthropic.messages.create(
        model="m", max_tokens=60, messages=[user], tools=[tool], extra_headers={"X-Session-ID": "tool-shot"}
    )
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "screenshot"
    result = {
        "type": "tool_result",
        "tool_use_id": use.id,
        "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data_url(shot)[22:]}},
            {"type": "text", "text": "taken"},
        ],
    }
    second = await app.anthropic.messages.create(
        model="m",
        max_tokens=60,
        messages=[user, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}],
        tools=[tool],
        extra_headers={"X-Session-ID": "tool-shot"},
    )
    assert second.content[0].type == "text" and second.content[0].text == "The screen is blue."
    # the tool listing is the renderer's documented text for templates without tools; the rest is transformers'
    prepared, _ = vl_renderer.prepare([{"role": "user", "content": "x"}], RenderOptions(tools=[chat_tool]))
    system = prepared[0]
    tool_parts = [{"type": "text", "text": "<tool_response>\n"}, {"type": "image"}, {"type": "text", "text": "taken"}]
    hf = [
        system,
        user,
        {"role": "assistant", "content": call_text},
        {"role": "tool", "content": [*tool_parts, {"type": "text", "text": "\n</tool_response>"}]},
    ]
    expected = oracle.ids(hf, [shot])
    assert app.engine.state.requests[-1]["token_ids"] == expected
    (branch,) = (await app.export("tool-shot"))["branches"]
    assert branch["tokens"][: branch["action_ranges"][-1][0]] == expected
    assert branch["origins"][branch["image_runs"][0]["start"]] == "bridge"  # the image came in the bridge
    check_export(branch, oracle, [shot])
    # the generation that showed the image gave vLLM its features at the tape's run
    body = app.engine.vision.generations[-1]
    place = body["features"]["mm_placeholders"]["image"][0]
    assert place == {"offset": branch["image_runs"][0]["start"] + 1, "length": oracle.pads(shot)}


async def test_responses_input_image(app: App, oracle: Oracle) -> None:
    red = png(RED, (70, 70))
    app.queue(oracle.answer("Red."))
    response = await app.openai.responses.create(
        model="m",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Color?"},
                    {"type": "input_image", "image_url": data_url(red)},
                ],
            }
        ],
        max_output_tokens=20,
        extra_headers={"X-Session-ID": "responses"},
    )
    assert response.output_text == "Red."
    expected = oracle.ids([{"role": "user", "content": [{"type": "text", "text": "Color?"}, {"type": "image"}]}], [red])
    assert app.engine.state.requests[-1]["token_ids"] == expected
    (branch,) = (await app.export("responses"))["branches"]
    check_export(branch, oracle, [red])


async def test_engine_is_told_to_never_sample_a_placeholder_and_a_sampled_one_is_not_fed_back(
    app: App, oracle: Oracle
) -> None:
    red = png(RED)
    message = {"role": "user", "content": [openai_image(red), {"type": "text", "text": "Describe."}]}
    app.queue([*oracle.answer("Look")[:-1], IMAGE_PAD, 151645])  # an engine that ignores the ban
    headers = {"X-Session-ID": "stray-pad"}
    first = await app.openai.chat.completions.create(
        model="m", messages=[message], max_tokens=20, extra_headers=headers
    )
    bias = app.engine.state.requests[-1]["sampling_params"]["logit_bias"]
    assert {int(t) for t, v in bias.items() if v == -100} >= {VISION_START, IMAGE_PAD, VISION_END}
    echoed = {"role": "assistant", "content": first.choices[0].message.content}
    follow = [message, echoed, {"role": "user", "content": "Go on."}]
    before = len(app.engine.state.requests)
    response = await app.http.post("/v1/chat/completions", json={"model": "m", "messages": follow}, headers=headers)
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "placeholder_sampled"
    assert len(app.engine.state.requests) == before
    assert len((await app.export("stray-pad"))["branches"][0]["action_ranges"]) == 1


async def test_the_store_keeps_images_across_a_restart(app: App, oracle: Oracle, tmp_path: Any) -> None:
    from tests.images.conftest import open_app

    red = png(RED, (80, 50))
    message = {"role": "user", "content": [openai_image(red), {"type": "text", "text": "Color?"}]}
    app.queue(oracle.answer("Red."))
    headers = {"X-Session-ID": "kept"}
    await app.openai.chat.completions.create(model="m", messages=[message], max_tokens=20, extra_headers=headers)
    before = await app.export("kept")
    # a second gateway over the same store: it knows the session only from what the store kept
    url = app.engine.url
    gateway, http = await open_app(app.gateway.renderer, url, app.engine, tmp_path / "tape.db")
    async with http:
        after = await App(gateway, http, app.engine).export("kept")
        assert after["branches"] == before["branches"]
        app.queue(oracle.answer("Still red."))
        follow = [message, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Sure?"}]
        response = await http.post("/v1/chat/completions", json={"model": "m", "messages": follow}, headers=headers)
        assert response.status_code == 200, response.text
        hf = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Sure?"},
        ]
        assert app.engine.state.requests[-1]["token_ids"] == oracle.ids(hf, [red])
        assert app.engine.vision.generations[-1]["features"]["mm_placeholders"]["image"][0]["length"] == oracle.pads(
            red
        )
    await gateway.aclose()
    json.dumps(after)  # the export is plain JSON


async def test_a_completion_continuing_a_turn_with_an_image_carries_that_image(app: App, oracle: Oracle) -> None:
    """After a chat turn with a screenshot, `/v1/completions` with that turn's tokens plus more sends
    the engine the screenshot's features for its run (the fake vLLM refuses pads without them); a
    token prompt with a placeholder outside every recorded run is refused and changes nothing."""
    red = png(RED)
    app.queue(oracle.answer("Red."), oracle.answer("More."))
    sent = [{"role": "user", "content": [{"type": "text", "text": "Color?"}, openai_image(red)]}]
    headers = {"X-Session-ID": "complete-image"}
    chat = await app.http.post(
        "/v1/chat/completions", json={"model": "m", "messages": sent, "max_tokens": 20}, headers=headers
    )
    assert chat.status_code == 200, chat.text
    turn = chat.json()
    prompt = [*turn["prompt_token_ids"], *turn["choices"][0]["token_ids"], *oracle.tokenizer("\nMore:")["input_ids"]]
    completion = await app.http.post(
        "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 5}, headers=headers
    )
    assert completion.status_code == 200, completion.text
    request = app.engine.state.requests[-1]
    assert request["token_ids"] == prompt
    assert len(request["features"]["mm_hashes"]["image"]) == 1  # the recorded run's image, once
    before = (await app.export("complete-image"))["branches"]
    stray = [*prompt[:5], IMAGE_PAD, *prompt[5:8]]
    refused = await app.http.post(
        "/v1/completions", json={"model": "m", "prompt": stray, "max_tokens": 5}, headers=headers
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "placeholder_without_image"
    assert (await app.export("complete-image"))["branches"] == before
