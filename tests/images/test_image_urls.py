"""Image URLs, where the operator allows fetching: closed to the operator's network by construction.
Servers bound on loopback stand for the inside of that network; each refusal is checked to have made
no request there, and the caller learns nothing of what answered."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.images.conftest import App, Engine, Oracle, data_url, open_app, png
from tests.support.fake_engines import SwappableApp, serving
from tokentape.render.renderer import Renderer
from tokentape.server import image_urls
from tokentape.server.dialects.images import ImageLimits
from tokentape.server.image_urls import address_refusal

SHOT = png((200, 30, 30), (50, 50))
LOOPBACK = ImageLimits(allow_fetch=True, fetch_networks=("127.0.0.1/32",))

REFUSED = [
    "127.0.0.1",
    "127.9.9.9",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "100.64.0.1",  # shared address space (carrier NAT)
    "0.0.0.0",
    "224.0.0.1",
    "239.255.255.250",
    "255.255.255.255",
    "192.0.2.1",  # documentation
    "::1",
    "::",
    "fe80::1",
    "fc00::1",
    "fd12:3456::1",
    "ff02::1",
    "::ffff:127.0.0.1",
    "::ffff:169.254.169.254",
    "2002:7f00:1::1",  # 6to4 around 127.0.0.1
    "64:ff9b:1::1",  # local-use NAT64
]


@pytest.mark.parametrize("address", REFUSED)
def test_every_address_inside_a_network_is_refused(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_are_fetched(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is None


def test_a_network_the_operator_names_is_opened_and_no_other() -> None:
    trusted = [ipaddress.ip_network("10.0.0.0/8")]
    assert address_refusal(ipaddress.ip_address("10.1.2.3"), trusted) is None
    assert address_refusal(ipaddress.ip_address("::ffff:10.1.2.3"), trusted) is None
    assert address_refusal(ipaddress.ip_address("192.168.1.1"), trusted) is not None
    assert address_refusal(ipaddress.ip_address("127.0.0.1"), trusted) is not None


class Site:
    """An image server standing for the operator's network: it counts what reaches it."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.elsewhere = ""  # a second server's address, for redirects

    def app(self) -> Starlette:
        async def screen(request: Request) -> Response:
            self.hits.append(request.url.path)
            return Response(SHOT, media_type="image/png")

        async def gone(request: Request) -> Response:
            self.hits.append(request.url.path)
            return Response(b"secret internal page", status_code=404)

        async def away(request: Request) -> Response:
            self.hits.append(request.url.path)
            return RedirectResponse(f"{self.elsewhere}/screen.png", status_code=302)

        async def loop(request: Request) -> Response:
            self.hits.append(request.url.path)
            return RedirectResponse("/loop", status_code=307)

        async def huge(request: Request) -> Response:
            self.hits.append(request.url.path)

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(64):
                    yield b"\0" * (1 << 20)

            return StreamingResponse(chunks(), media_type="image/png")  # no length declared

        async def slow(request: Request) -> Response:
            self.hits.append(request.url.path)
            for _ in range(600):  # 30 s, unless the fetcher gave up first (then the server need not wait)
                if await request.is_disconnected():
                    break
                await asyncio.sleep(0.05)
            return Response(SHOT, media_type="image/png")

        routes = [("/screen.png", screen), ("/gone.png", gone), ("/away", away), ("/loop", loop)]
        routes += [("/huge", huge), ("/slow", slow)]
        return Starlette(routes=[Route(path, handler) for path, handler in routes])


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[SwappableApp, str, SwappableApp, str]]:
    inside, other = SwappableApp(), SwappableApp()
    # a request still on /slow when the module ends is cut after 1 s, not waited for (its 30 s)
    with (
        serving(inside, timeout_graceful_shutdown=1, lifespan="off") as url,
        serving(other, host="127.0.0.2", timeout_graceful_shutdown=1, lifespan="off") as other_url,
    ):
        yield inside, url, other, other_url


@pytest.fixture
def sites(servers: tuple[SwappableApp, str, SwappableApp, str]) -> tuple[Site, str, Site, str]:
    """One site on 127.0.0.1 and one on 127.0.0.2 (the operator opens at most the first)."""
    inside_server, url, other_server, other_url = servers
    inside, other = Site(), Site()
    inside_server.app, other_server.app = inside.app(), other.app()
    inside.elsewhere = other_url
    return inside, url, other, other_url


async def _ask(app: App, session: str, url: str) -> httpx.Response:
    part = {"type": "image_url", "image_url": {"url": url}}
    body = {"model": "m", "messages": [{"role": "user", "content": [part]}], "max_tokens": 4}
    return await app.http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": session})


@pytest.fixture
async def opened(
    vl_renderer: Renderer, fake: tuple[Engine, str], tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[App]:
    engine, url = fake
    engine.state.queued.clear()
    limits: ImageLimits = getattr(request, "param", LOOPBACK)
    gateway, http = await open_app(vl_renderer, url, engine, tmp_path / "u.db", limits)
    async with http:
        yield App(gateway, http, engine)
    await gateway.aclose()


def _refused(response: httpx.Response, where: str = "messages[0].content[0]") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "image_url_not_fetched" and error["message"].startswith(where)
    assert "404" not in error["message"] and "secret" not in error["message"]  # nothing of what answered


@pytest.mark.parametrize("opened", [ImageLimits(allow_fetch=True)], indirect=True)
async def test_loopback_is_refused_before_any_connection(opened: App, sites: tuple[Site, str, Site, str]) -> None:
    inside, url, _, _ = sites
    port = url.rsplit(":", 1)[1]
    for target in (f"{url}/screen.png", f"http://localhost:{port}/screen.png", f"http://[::1]:{port}/screen.png"):
        _refused(await _ask(opened, "private", target))
    _refused(await _ask(opened, "private", "http://169.254.169.254/latest/meta-data/"))
    assert inside.hits == []
    assert (await opened.http.get("/sessions/private/export")).status_code == 404  # nothing recorded


async def test_a_redirect_out_of_the_opened_network_is_refused(
    opened: App, oracle: Oracle, sites: tuple[Site, str, Site, str]
) -> None:
    inside, url, other, _ = sites
    opened.queue(oracle.answer("Red."))
    fine = await _ask(opened, "open", f"{url}/screen.png")
    assert fine.status_code == 200, fine.text
    (branch,) = (await opened.export("open"))["branches"]
    assert branch["images"] == [data_url(SHOT)]
    _refused(await _ask(opened, "redirected", f"{url}/away"))
    assert inside.hits == ["/screen.png", "/away"] and other.hits == []  # the redirect's target never reached


async def test_upstream_answers_never_reach_the_caller(opened: App, sites: tuple[Site, str, Site, str]) -> None:
    inside, url, _, _ = sites
    _refused(await _ask(opened, "gone", f"{url}/gone.png"))
    _refused(await _ask(opened, "loop", f"{url}/loop"))
    assert inside.hits.count("/loop") == LOOPBACK.max_redirects + 1
    started = time.monotonic()
    _refused(await _ask(opened, "huge", f"{url}/huge"))  # stops at the byte cap, not at 64 MiB
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("opened", [replace(LOOPBACK, fetch_seconds=0.5)], indirect=True)
async def test_one_time_budget_for_all_of_a_requests_fetches(opened: App, sites: tuple[Site, str, Site, str]) -> None:
    _, url, _, _ = sites
    parts = [{"type": "image_url", "image_url": {"url": f"{url}/slow?{i}"}} for i in range(3)]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 4}
    started = time.monotonic()
    response = await opened.http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "slow"})
    assert time.monotonic() - started < 5  # three slow URLs, one half-second budget
    assert response.status_code == 400 and response.json()["error"]["code"] == "image_url_not_fetched"


async def test_fetching_holds_an_admission_slot(opened: App, sites: tuple[Site, str, Site, str]) -> None:
    inside, url, _, _ = sites
    opened.gateway.admission.max_active = opened.gateway.admission.active  # full
    response = await _ask(opened, "full", f"{url}/screen.png")
    assert response.status_code == 429 and "retry-after" in response.headers
    assert inside.hits == []  # refused before fetching
    opened.gateway.admission.max_active = 64
    body: Any = (await _ask(opened, "full", f"{url}/gone.png")).json()
    assert body["error"]["code"] == "image_url_not_fetched"
    assert opened.gateway.admission.active == 0  # the slot is given back after a failed fetch


HOSTILE_URLS = [
    "http://[::1/x",  # not a URL
    "http://example.com:99999/x",  # no such port
    "http://" + "a" * 70 + ".example/x",  # a label past 63 characters
    "https://x\x00y/",
    "http://" + "a" * 1_000_000 + "/x",  # a megabyte of host
    "http://0x7f000001/x",  # loopback spelled in hex
    "http://2130706433/x",  # and as one number
]


@pytest.mark.parametrize("opened", [ImageLimits(allow_fetch=True)], indirect=True)
@pytest.mark.parametrize("url", HOSTILE_URLS, ids=range(len(HOSTILE_URLS)))
async def test_a_hostile_url_is_a_400_never_a_500(opened: App, url: str) -> None:
    _refused(await _ask(opened, "hostile", url))


async def test_requests_with_image_urls_share_one_tls_context(
    opened: App, oracle: Oracle, sites: tuple[Site, str, Site, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TLS context loads its CA bundle when it is built (about 50 ms of CPU on the event loop): one is
    built for the process, not one for each request that carries an image URL."""
    _, url, _, _ = sites
    loads: list[object] = []
    load = ssl.SSLContext.load_verify_locations

    def counted(context: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(args or kwargs)
        load(context, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    image_urls._tls.cache_clear()  # as in a process that has fetched nothing yet
    for i in range(3):
        opened.queue(oracle.answer("Red."))
        response = await _ask(opened, f"tls-{i}", f"{url}/screen.png?{i}")
        assert response.status_code == 200, response.text
    assert len(loads) == 1
