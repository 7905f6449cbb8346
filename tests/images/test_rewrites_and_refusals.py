"""An earlier image that changed is a rewrite under the session's policy; bad images get a 400 in
each dialect's shape, naming the part, and change nothing; a model or engine without vision says so."""

from __future__ import annotations

import base64
import io
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.images.conftest import App, Engine, Oracle, data_url, open_app, png
from tests.support.served import build
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer
from tokentape.server.dialects.images import ImageLimits

RED, ORANGE = (200, 30, 30), (220, 120, 20)


def user(text: str, image: bytes) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}],
    }


async def post(http: httpx.AsyncClient, session: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": messages, "max_tokens": 20, **extra}
    return await http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": session})


async def changed_image_request(app: App, oracle: Oracle, session: str, policy: str) -> httpx.Response:
    """Turn 1 shows a red screen; turn 2 sends the history back with an orange screen of the same
    size in its place (the same placeholder tokens, other pixels)."""
    red, orange = png(RED), png(ORANGE)
    app.queue(oracle.answer("Red."), oracle.answer("Fine."))
    first = await post(app.http, session, [user("Color?", red)], rewrite_policy=policy)
    assert first.status_code == 200, first.text
    history = [user("Color?", orange), {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Sure?"}]
    return await post(app.http, session, history)


async def test_changed_earlier_image_under_tape_keeps_the_recorded_image(app: App, oracle: Oracle) -> None:
    response = await changed_image_request(app, oracle, "changed-tape", "tape")
    assert response.status_code == 200, response.text
    export = await app.export("changed-tape")
    (branch,) = export["branches"]
    assert [r["kind"] for r in branch["rewrites"]] == ["image_changed"]
    assert branch["images"] == [data_url(png(RED))]  # the tape, and the engine, keep the red screen
    first, second = app.engine.vision.generations[-2:]
    assert second["features"]["mm_hashes"] == first["features"]["mm_hashes"]


async def test_changed_earlier_image_under_fork_starts_a_branch_before_its_run(app: App, oracle: Oracle) -> None:
    response = await changed_image_request(app, oracle, "changed-fork", "fork")
    assert response.status_code == 200, response.text
    old, new = (await app.export("changed-fork"))["branches"]
    assert old["images"] == [data_url(png(RED))] and new["images"] == [data_url(png(ORANGE))]
    (rewrite,) = new["rewrites"]
    run_start = new["image_runs"][0]["start"]
    assert rewrite["kind"] == "image_changed" and rewrite["at_token"] == run_start
    assert new["tokens"][:run_start] == old["tokens"][:run_start]
    hf = [
        {"role": "user", "content": [{"type": "text", "text": "Color?"}, {"type": "image"}]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Sure?"},
    ]
    assert app.engine.state.requests[-1]["token_ids"] == oracle.ids(hf, [png(ORANGE)])
    first, second = app.engine.vision.generations[-2:]
    assert second["features"]["mm_hashes"] != first["features"]["mm_hashes"]


async def test_changed_earlier_image_under_strict_is_refused_and_changes_nothing(app: App, oracle: Oracle) -> None:
    before = len(app.engine.state.requests)
    response = await changed_image_request(app, oracle, "changed-strict", "strict")
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "rewrite_rejected"
    assert len(app.engine.state.requests) == before + 1  # the first turn only
    assert len((await app.export("changed-strict"))["branches"][0]["action_ranges"]) == 1


# -- bad images ----------------------------------------------------------------------------------------
def noise(side: int) -> bytes:
    """A PNG that does not compress: random pixels."""
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), random.Random(side).randbytes(side * side * 3)).save(out, "PNG")
    return out.getvalue()


def bmp() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(out, "BMP")
    return out.getvalue()


FAULTS: dict[str, tuple[str, str]] = {
    # name: (data URL, the error code)
    "not decodable": (
        "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode(),
        "invalid_image",
    ),
    "not base64": ("data:image/png;base64,%%%", "invalid_request_error"),
    "unsupported type": ("data:image/bmp;base64," + base64.b64encode(bmp()).decode(), "unsupported_image_type"),
    "disguised type": ("data:image/png;base64," + base64.b64encode(bmp()).decode(), "unsupported_image_type"),
    "too large": (data_url(noise(40)), "image_too_large"),
    "http url": ("https://example.com/screen.png", "image_url_not_allowed"),
}


@pytest.fixture
async def strict_limits(vl_renderer: Renderer, fake: tuple[Engine, str], tmp_path: Path) -> AsyncIterator[App]:
    engine, url = fake
    gateway, http = await open_app(
        vl_renderer, url, engine, tmp_path / "t.db", ImageLimits(max_bytes=1500, max_images=2)
    )
    async with http:
        yield App(gateway, http, engine)
    await gateway.aclose()


def wire(dialect: str, *urls: str) -> tuple[str, dict[str, Any], str]:
    """(route, body, the first image part's name) of a request with a text part and then `urls`."""
    if dialect == "chat":
        parts = [{"type": "text", "text": "See:"}, *[{"type": "image_url", "image_url": {"url": u}} for u in urls]]
        body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
        return "/v1/chat/completions", body, "messages[0].content[1]"
    if dialect == "responses":
        parts = [{"type": "input_text", "text": "See:"}, *[{"type": "input_image", "image_url": u} for u in urls]]
        return "/v1/responses", {"model": "m", "input": [{"role": "user", "content": parts}]}, "input[0].content[1]"
    blocks: list[dict[str, Any]] = [{"type": "text", "text": "See:"}]
    for url in urls:
        if url.startswith("data:"):
            media, data = url[5:].split(";base64,")
            blocks.append({"type": "image", "source": {"type": "base64", "media_type": media, "data": data}})
        else:
            blocks.append({"type": "image", "source": {"type": "url", "url": url}})
    body = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": blocks}]}
    return "/v1/messages", body, "messages[0].content[1]"


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
@pytest.mark.parametrize("fault", [*FAULTS, "too many"])
async def test_bad_images_get_a_400_in_the_dialects_shape_and_change_nothing(
    strict_limits: App, dialect: str, fault: str
) -> None:
    app = strict_limits
    if fault == "too many":
        same = data_url(png(RED, (20, 20)))  # sent twice: one image, within the limit of two
        others = [data_url(png((i, 80, 80), (20, 20))) for i in (1, 2)]
        route, body, part = wire(dialect, same, same, *others)
        part = part[:-3] + "[4]"  # the third distinct image is the fourth part after the text
        code = "too_many_images"
    else:
        url, code = FAULTS[fault]
        route, body, part = wire(dialect, url)
    before = len(app.engine.state.requests)
    response = await app.http.post(route, json=body, headers={"X-Session-ID": f"bad-{dialect}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert part in error["message"]
    if dialect == "messages":
        assert response.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["code"] == code if code != "invalid_request_error" else error["type"] == code
    assert len(app.engine.state.requests) == before
    assert (await app.http.get(f"/sessions/bad-{dialect}/export")).status_code == 404


async def test_images_in_assistant_messages_are_refused(app: App) -> None:
    message = user("x", png(RED))
    response = await post(app.http, "assistant-image", [{**message, "role": "assistant"}])
    assert response.status_code == 400 and "messages[0].content" in response.json()["error"]["message"]


# -- models and engines without vision ---------------------------------------------------------------------
async def test_a_text_only_model_says_it_has_no_vision(http: httpx.AsyncClient) -> None:
    response = await http.post(
        "/v1/chat/completions", json={"model": "smollm2-135m-instruct", "messages": [user("x", png(RED))]}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "images_not_supported" and "has no vision" in error["message"]


async def test_the_embedded_engine_refuses_images_before_anything_is_recorded(
    engine: LlamaCppEngine, vl_renderer: Renderer
) -> None:
    app = build(engine, vl_renderer, model="m").app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        response = await post(http, "embedded", [user("x", png(RED))])
        assert response.status_code == 400, response.text
        assert "the embedded model has no vision" in response.json()["error"]["message"]
        export = await http.get("/sessions/embedded/export")
        assert export.status_code == 404 or export.json()["branches"] == [], export.text


# -- image URLs, where the operator allows fetching --------------------------------------------------------
async def test_allowed_image_urls_are_fetched_and_recorded_as_their_bytes(
    vl_renderer: Renderer, fake: tuple[Engine, str], oracle: Oracle, tmp_path: Path
) -> None:
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from tests.support.fake_engines import serving

    shot = png(RED, (50, 50))

    async def screen(_: Any) -> Response:
        return Response(shot, media_type="image/png")

    engine, url = fake
    limits = ImageLimits(allow_fetch=True, fetch_networks=("127.0.0.1/32",))  # the test site is on loopback
    gateway, http = await open_app(vl_renderer, url, engine, tmp_path / "f.db", limits)
    with serving(Starlette(routes=[Route("/screen.png", screen)])) as site:
        async with http:
            app = App(gateway, http, engine)
            app.queue(oracle.answer("Red."))
            blocks = [
                {"type": "image", "source": {"type": "url", "url": f"{site}/screen.png"}},
                {"type": "text", "text": "?"},
            ]
            await app.anthropic.messages.create(
                model="m",
                max_tokens=20,
                messages=[{"role": "user", "content": blocks}],
                extra_headers={"X-Session-ID": "fetched"},
            )
            (branch,) = (await app.export("fetched"))["branches"]
            assert branch["images"] == [data_url(shot)]
            gone = {"type": "image_url", "image_url": {"url": f"{site}/gone.png"}}
            missing = await post(http, "fetch-missing", [{"role": "user", "content": [gone]}])
            assert missing.status_code == 400 and "messages[0].content[0]" in missing.json()["error"]["message"]
    await gateway.aclose()


async def test_a_fork_never_records_an_image_it_cut_off(app: App, oracle: Oracle) -> None:
    """[A, C] answered "One."; that history resent as [B, C] under `fork` (a branch from A's run),
    answered "Two."; then the [B, C] branch's history resent as [A, D]. The images are the same size,
    so only the recorded images tell the paths apart: the last turn's branch records A and D, the
    images the engine was given, never the fork's B."""
    a, b, c, d = png(RED), png(ORANGE), png((30, 160, 30)), png((30, 30, 200))

    def two(first: bytes, second: bytes) -> dict[str, Any]:
        images = [{"type": "image_url", "image_url": {"url": data_url(x)}} for x in (first, second)]
        return {"role": "user", "content": [{"type": "text", "text": "Compare."}, *images]}

    hf_opening = {
        "role": "user",
        "content": [{"type": "text", "text": "Compare."}, {"type": "image"}, {"type": "image"}],
    }
    app.queue(oracle.answer("One."), oracle.answer("Two."), oracle.answer("Three."))
    session = "fork-cut-image"
    assert (await post(app.http, session, [two(a, c)], rewrite_policy="fork")).status_code == 200
    one, two_ = {"role": "assistant", "content": "One."}, {"role": "assistant", "content": "Two."}
    forked = await post(app.http, session, [two(b, c), one, {"role": "user", "content": "Again?"}])
    assert forked.status_code == 200, forked.text
    history = [two(b, c), one, {"role": "user", "content": "Again?"}, two_, {"role": "user", "content": "Now?"}]
    history[0] = two(a, d)
    last = await post(app.http, session, history)
    assert last.status_code == 200, last.text
    sent = app.engine.state.requests[-1]["token_ids"]
    hf = [hf_opening, one, {"role": "user", "content": "Again?"}, two_, {"role": "user", "content": "Now?"}]
    assert sent == oracle.ids(hf, [a, d])
    branches = (await app.export(session))["branches"]
    (branch,) = [br for br in branches if br["tokens"] == sent + oracle.answer("Three.")]
    assert branch["images"] == [data_url(a), data_url(d)]


@pytest.mark.parametrize(
    ("declared", "kind", "media"),
    [
        ("image/jpg", "JPEG", "image/jpeg"),
        ("application/octet-stream", "PNG", "image/png"),
        ("image/x-png", "PNG", "image/png"),
    ],
)
async def test_the_bytes_decide_whatever_type_is_declared(
    app: App, oracle: Oracle, declared: str, kind: str, media: str
) -> None:
    """`data:image/jpg` (a common misspelling) and bytes of no stated kind (what a server that does not
    say sends) are taken as what they decode to; a declared type that is no image is refused."""
    data = png(RED, kind=kind)
    app.queue(oracle.answer("Red."))
    url = f"data:{declared};base64,{base64.b64encode(data).decode()}"
    session = f"declared-{kind}-{declared.replace('/', '-')}"
    response = await post(
        app.http, session, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    )
    assert response.status_code == 200, response.text
    (branch,) = (await app.export(session))["branches"]
    assert branch["images"] == [data_url(data, media)]
    html = f"data:text/html;base64,{base64.b64encode(data).decode()}"
    refused = await post(
        app.http, "declared-html", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": html}}]}]
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_image_type"


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
async def test_an_image_the_processor_refuses_is_named_by_its_part(app: App, dialect: str) -> None:
    """A 300x1 strip decodes, but Qwen2-VL's processor takes no aspect ratio over 200: the 400 says
    which part, before anything reaches the engine."""
    route, body, part = wire(dialect, data_url(png(RED, (300, 1))))
    before = len(app.engine.state.requests)
    response = await app.http.post(route, json=body, headers={"X-Session-ID": f"strip-{dialect}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert part in error["message"] and "aspect ratio" in error["message"]
    if dialect != "messages":  # Anthropic's error shape has no param
        assert error["param"] == part and error["code"] == "invalid_image"
    assert len(app.engine.state.requests) == before
