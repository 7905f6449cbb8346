"""New weights on remote engines (the seam of engines/weights.py): the calls each adapter makes for each
in-flight mode and each kind of weights, the engine's refusals passed on in its words, and the check
that refuses what an engine cannot do before anything is paused.

The engines are stand-ins (a test instrument): the generation routes of tests/support/fake_engines.py
plus the weight routes of vLLM and SGLang with the request and answer shapes of their sources, an
OpenAPI schema listing the routes a server so configured has, and a record of every call."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests.support.fake_engines import FakeState, SwappableApp, serving, sglang_app, vllm_app
from tokentape.core.sampling import SamplingParams
from tokentape.engines.remote import SGLangEngine, VLLMEngine, VLLMGenerateEngine
from tokentape.engines.remote.updates import UpdatableRemote
from tokentape.engines.remote.vllm import LORA_NAME
from tokentape.engines.weights import (
    IN_FLIGHT_MODES,
    InFlight,
    UpdatableEngine,
    WeightSource,
    WeightUpdateFailed,
    WeightUpdateRefused,
)

PROMPT = [1, 4093, 198, 19556, 2]
LORA = WeightSource("lora", "/adapters/step-7")
MODEL = WeightSource("model", "/checkpoints/step-7")
MANAGED = WeightSource("engine_managed")

PAUSES = ("/pause", "/pause_generation")
RESUMES = ("/resume", "/continue_generation")
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate", "/generate")

Call = tuple[str, str, Any]  # method, path (with its query), JSON body (None: none)


@dataclass
class Stand:
    """How the stand-in engine is configured, and what it was asked."""

    kind: str  # "vllm" or "sglang"
    version: str = "0.32.0"
    dev_mode: bool = True  # vLLM: VLLM_SERVER_DEV_MODE=1
    runtime_lora: bool = True  # vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
    pause_modes: bool = True  # vLLM's /pause takes `mode`; SGLang's /pause_generation takes a body
    enable_lora: bool = True  # SGLang: --enable-lora
    schema: bool = True  # /openapi.json is served
    refuse: dict[str, tuple[int, Any]] = field(default_factory=dict)  # route -> (status, body) answered instead
    adapters: list[str] = field(default_factory=list)  # vLLM: loaded adapters, listed among its models
    calls: list[Call] = field(default_factory=list)
    generation: FakeState = field(default_factory=FakeState)
    paused: bool = False  # between a pause that succeeded and a resume: generation requests are held

    def routes(self) -> dict[str, dict[str, Any]]:
        """The control routes this server has, each with its OpenAPI operation."""
        mode = {"parameters": [{"name": "mode", "in": "query", "schema": {"type": "string"}}]}
        body = {"requestBody": {"content": {"application/json": {}}}}
        if self.kind == "vllm":
            routes: dict[str, dict[str, Any]] = {}
            if self.dev_mode:
                routes |= {"/pause": mode if self.pause_modes else {}, "/resume": {}}
                routes |= {"/reset_prefix_cache": {}, "/collective_rpc": {}}
            if self.runtime_lora:
                routes["/v1/load_lora_adapter"] = body
            return routes
        return {
            "/pause_generation": body if self.pause_modes else {},
            "/continue_generation": {},
            "/flush_cache": {},
            "/load_lora_adapter": body,
            "/unload_lora_adapter": body,
            "/update_weights_from_disk": body,
        }

    def answer(self, path: str) -> Response:
        """What vLLM's and SGLang's handlers answer on success."""
        answers: dict[str, Response] = {
            "/pause": JSONResponse({"status": "paused"}),
            "/resume": JSONResponse({"status": "resumed"}),
            "/reset_prefix_cache": JSONResponse({"success": True}),
            "/collective_rpc": JSONResponse({"results": [None]}),
            "/v1/load_lora_adapter": PlainTextResponse(f"Success: LoRA adapter '{LORA_NAME}' added successfully."),
            "/pause_generation": JSONResponse({"message": "Generation paused successfully.", "status": "ok"}),
            "/continue_generation": JSONResponse({"message": "Generation continued successfully.", "status": "ok"}),
            "/flush_cache": PlainTextResponse("Cache flushed.\n"),
            "/load_lora_adapter": JSONResponse({"success": True, "error_message": "", "loaded_adapters": {}}),
            "/unload_lora_adapter": JSONResponse({"success": True, "error_message": "", "loaded_adapters": {}}),
            "/update_weights_from_disk": JSONResponse(
                {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
            ),
        }
        return answers[path]

    def app(self) -> Starlette:
        generation = (vllm_app if self.kind == "vllm" else sglang_app)(self.generation)

        async def control(request: Request) -> Response:
            raw = await request.body()
            query = f"?{request.url.query}" if request.url.query else ""
            self.calls.append((request.method, request.url.path + query, json.loads(raw) if raw else None))
            if request.url.path in self.refuse:
                status, answer = self.refuse[request.url.path]
                return JSONResponse(answer, status_code=status)
            if request.url.path in PAUSES:
                self.paused = True
            elif request.url.path in RESUMES:
                self.paused = False
            return self.answer(request.url.path)

        async def held(scope: Any, receive: Any, send: Any) -> None:
            """As vLLM and SGLang do: a generation request waits while the engine is paused."""
            if scope["type"] == "http" and scope["path"] in GENERATION_ROUTES:
                while self.paused:
                    await asyncio.sleep(0.01)
            await served(scope, receive, send)

        async def schema(request: Request) -> Response:
            self.calls.append(("GET", "/openapi.json", None))
            if not self.schema:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"openapi": "3.1.0", "paths": {p: {"post": op} for p, op in self.routes().items()}})

        async def version(request: Request) -> Response:
            self.calls.append(("GET", request.url.path, None))
            if self.kind == "vllm":
                return JSONResponse({"version": self.version})
            return JSONResponse({"version": self.version, "enable_lora": self.enable_lora, "lora_paths": None})

        async def models(request: Request) -> Response:
            listed = [{"id": "fake-model", "object": "model", "max_model_len": 4096}]
            listed += [{"id": name, "object": "model", "parent": "fake-model"} for name in self.adapters]
            return JSONResponse({"object": "list", "data": listed})

        control_routes = [Route(path, control, methods=["POST"]) for path in self.routes()]
        served = Starlette(
            routes=[
                Route("/v1/models", models),
                *generation.routes,
                *control_routes,
                Route("/openapi.json", schema),
                Route("/version" if self.kind == "vllm" else "/get_server_info", version),
            ]
        )
        return held  # type: ignore[return-value]  # an ASGI app, as Starlette is


class Server(SwappableApp):
    """The module's server for one stand: every test serves a fresh stand of its own on it."""

    def __init__(self) -> None:
        super().__init__()
        self.url = ""

    def serving(self, app: Any) -> str:
        self.app = app
        return self.url


def _server() -> Iterator[Server]:
    shared = Server()
    with serving(shared, lifespan="off") as url:
        shared.url = url
        yield shared


server = pytest.fixture(scope="module")(_server)
sglang_server = pytest.fixture(scope="module")(_server)  # the `sglang` stand's, beside a `vllm` one


@pytest.fixture
async def vllm(server: Server) -> AsyncIterator[tuple[VLLMEngine, Stand]]:
    stand = Stand("vllm")
    engine = VLLMEngine(server.serving(stand.app()))
    yield engine, stand
    await engine.close()  # its connections to the shared server go with it


@pytest.fixture
async def sglang(sglang_server: Server) -> AsyncIterator[tuple[SGLangEngine, Stand]]:
    stand = Stand("sglang", version="0.5.9")
    engine = SGLangEngine(sglang_server.serving(stand.app()))
    yield engine, stand
    await engine.close()  # its connections to the shared server go with it


async def _update(engine: UpdatableRemote, source: WeightSource, in_flight: InFlight, version: int = 7) -> None:
    """The four steps in the gateway's order."""
    await engine.check_weights(source, in_flight)
    await engine.pause_generation(in_flight)
    await engine.load_weights(source, version)
    await engine.resume_generation(fresh_kv=in_flight != "keep")


def _posts(stand: Stand) -> list[Call]:
    return [call for call in stand.calls if call[0] == "POST"]


def test_the_remote_adapters_offer_the_seam() -> None:
    for engine in (VLLMEngine("http://x"), VLLMGenerateEngine("http://x"), SGLangEngine("http://x")):
        assert isinstance(engine, UpdatableEngine)


@pytest.mark.parametrize("in_flight", IN_FLIGHT_MODES)
@pytest.mark.parametrize("source", [LORA, MODEL, MANAGED], ids=["lora", "model", "engine_managed"])
async def test_vllm_calls_in_order(vllm: tuple[VLLMEngine, Stand], source: WeightSource, in_flight: InFlight) -> None:
    engine, stand = vllm
    if source.kind == "lora" and in_flight == "keep":
        # requests paused in place run on under the adapter they were sent with: none, before the first
        with pytest.raises(WeightUpdateRefused, match="the first adapter cannot be swapped in under requests paused"):
            await engine.check_weights(source, in_flight)
        assert stand.calls == []
        await _update(engine, source, "continue", version=6)
        stand.calls.clear()  # then the same adapter is replaced in place under them
    await _update(engine, source, in_flight)
    assert stand.calls[:2] == [("GET", "/openapi.json", None), ("GET", "/version", None)]  # the check reads only
    load: list[Call] = {
        "lora": [
            ("POST", "/v1/load_lora_adapter", {"lora_name": LORA_NAME, "lora_path": LORA.path, "load_inplace": True})
        ],
        "model": [
            ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": MODEL.path}}),
        ],
        "engine_managed": [],
    }[source.kind]
    fresh: list[Call] = [] if in_flight == "keep" else [("POST", "/reset_prefix_cache", None)]
    mode = "keep" if in_flight == "keep" else "abort"
    assert _posts(stand) == [("POST", f"/pause?mode={mode}", None), *load, *fresh, ("POST", "/resume", None)]
    assert engine.describe()["weight_version"] == 7


@pytest.mark.parametrize("in_flight", IN_FLIGHT_MODES)
@pytest.mark.parametrize("source", [LORA, MODEL, MANAGED], ids=["lora", "model", "engine_managed"])
async def test_sglang_calls_in_order(
    sglang: tuple[SGLangEngine, Stand], source: WeightSource, in_flight: InFlight
) -> None:
    engine, stand = sglang
    if source.kind == "lora" and in_flight == "keep":
        # each version's adapter is a new one, never swapped in place under the requests paused in place
        with pytest.raises(WeightUpdateRefused, match="an adapter cannot be swapped in under requests paused"):
            await engine.check_weights(source, in_flight)
        assert stand.calls == []
        return
    await _update(engine, source, in_flight)
    assert stand.calls[:2] == [("GET", "/openapi.json", None), ("GET", "/get_server_info", None)]
    load: list[Call] = {
        "lora": [("POST", "/load_lora_adapter", {"lora_name": "tokentape-v7", "lora_path": LORA.path})],
        "model": [
            (
                "POST",
                "/update_weights_from_disk",
                # it stays paused until told; flushing under requests paused in place would fail
                {
                    "model_path": MODEL.path,
                    "weight_version": "7",
                    "keep_pause": True,
                    "flush_cache": in_flight != "keep",
                },
            )
        ],
        "engine_managed": [],
    }[source.kind]
    fresh: list[Call] = [] if in_flight == "keep" else [("POST", "/flush_cache", None)]
    mode = "in_place" if in_flight == "keep" else "abort"
    expected = [("POST", "/pause_generation", {"mode": mode}), *load, *fresh, ("POST", "/continue_generation", None)]
    assert _posts(stand) == expected


async def _generate(engine: UpdatableRemote) -> None:
    async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=3), seed=1):
        pass


@pytest.mark.parametrize("cls", [VLLMEngine, VLLMGenerateEngine])
async def test_vllm_generations_name_the_loaded_adapter_as_their_model(cls: type[VLLMEngine], server: Server) -> None:
    stand = Stand("vllm")
    url = server.serving(stand.app())
    engine = cls(url)
    await engine.discover()
    await _generate(engine)
    assert stand.generation.requests[-1]["model"] == "fake-model"
    await _update(engine, LORA, "continue")
    await _generate(engine)
    assert stand.generation.requests[-1]["model"] == LORA_NAME
    await _update(engine, MODEL, "continue", version=8)  # new base weights: no adapter on them
    await _generate(engine)
    assert stand.generation.requests[-1]["model"] == "fake-model"
    await engine.close()


async def test_sglang_generations_name_the_loaded_adapter_and_the_one_before_is_unloaded(
    sglang: tuple[SGLangEngine, Stand],
) -> None:
    engine, stand = sglang
    await _generate(engine)
    assert "lora_path" not in stand.generation.requests[-1]
    await _update(engine, LORA, "continue", version=7)
    await _generate(engine)
    assert stand.generation.requests[-1]["lora_path"] == "tokentape-v7"
    stand.calls.clear()
    await _update(engine, LORA, "abort", version=8)
    await _generate(engine)
    assert stand.generation.requests[-1]["lora_path"] == "tokentape-v8"
    assert ("POST", "/unload_lora_adapter", {"lora_name": "tokentape-v7"}) in stand.calls
    assert _posts(stand).index(("POST", "/unload_lora_adapter", {"lora_name": "tokentape-v7"})) > _posts(stand).index(
        ("POST", "/load_lora_adapter", {"lora_name": "tokentape-v8", "lora_path": LORA.path})
    )


async def test_a_refused_load_is_a_failure_in_the_engines_words(
    vllm: tuple[VLLMEngine, Stand], sglang: tuple[SGLangEngine, Stand]
) -> None:
    engine, stand = vllm
    # vLLM's ErrorResponse for an adapter it cannot load
    refusal = {"object": "error", "message": "Loading lora step-7 failed: No adapter found", "type": "BadRequestError"}
    stand.refuse["/v1/load_lora_adapter"] = (400, {**refusal, "param": None, "code": 400})
    await engine.check_weights(LORA, "continue")
    await engine.pause_generation("continue")
    with pytest.raises(WeightUpdateFailed, match=r"could not load the LoRA adapter .*No adapter found"):
        await engine.load_weights(LORA, 7)
    assert engine.adapter is None and engine.weight_version is None  # generations still name the base model
    # a reset that vLLM could not do (blocks still held) is said in a 200
    stand.refuse["/reset_prefix_cache"] = (200, {"success": False})
    with pytest.raises(WeightUpdateFailed, match="could not drop its prefix cache"):
        await engine.resume_generation(fresh_kv=True)
    assert _posts(stand)[-1] == ("POST", "/reset_prefix_cache", None)  # and it did not resume

    engine, stand = sglang
    stand.refuse["/update_weights_from_disk"] = (
        400,
        {"success": False, "message": "Failed to get weights iterator: shapes differ", "num_paused_requests": 0},
    )
    with pytest.raises(WeightUpdateFailed, match=r"could not load the weights at .*shapes differ"):
        await engine.load_weights(MODEL, 7)
    stand.refuse["/load_lora_adapter"] = (400, {"success": False, "error_message": "rank 64 exceeds max_lora_rank 8"})
    with pytest.raises(WeightUpdateFailed, match="rank 64 exceeds max_lora_rank 8"):
        await engine.load_weights(LORA, 7)


@pytest.mark.parametrize(
    ("stand", "source", "in_flight", "words"),
    [
        (Stand("vllm", dev_mode=False), MODEL, "continue", r"POST /collective_rpc \(vLLM served with VLLM_SERVER_DEV"),
        (Stand("vllm", dev_mode=False), LORA, "abort", "pausing needs POST /pause"),
        (Stand("vllm", runtime_lora=False), LORA, "continue", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        (Stand("vllm", version="0.14.0", pause_modes=False), MODEL, "keep", r"/pause\?mode=.*it runs 0.14.0"),
        (Stand("vllm", schema=False), MANAGED, "continue", "cannot be read from /openapi.json"),
        (Stand("vllm"), WeightSource("lora"), "continue", "names the path to load"),
        (Stand("sglang", version="0.5.5", pause_modes=False), MODEL, "keep", "newer than 0.5.5.*it runs 0.5.5"),
        (Stand("sglang", enable_lora=False), LORA, "continue", "started without --enable-lora"),
    ],
)
async def test_what_an_engine_cannot_do_is_refused_before_anything_changes(
    server: Server, stand: Stand, source: WeightSource, in_flight: InFlight, words: str
) -> None:
    url = server.serving(stand.app())
    engine = (VLLMEngine if stand.kind == "vllm" else SGLangEngine)(url)
    with pytest.raises(WeightUpdateRefused, match=words):
        await engine.check_weights(source, in_flight)
    assert _posts(stand) == []  # nothing paused, loaded or flushed
    await engine.close()


async def test_a_vllm_engine_that_holds_the_adapter_already_is_named_so_and_keeps_it_under_a_kept_pause(
    server: Server,
) -> None:
    stand = Stand("vllm", adapters=[LORA_NAME])  # loaded by an earlier gateway process
    url = server.serving(stand.app())
    engine = VLLMEngine(url)
    await engine.discover()
    assert (engine.model_id, engine.adapter) == ("fake-model", LORA_NAME)
    await _generate(engine)
    assert stand.generation.requests[-1]["model"] == LORA_NAME
    await _update(engine, LORA, "keep")  # replaced in place under the requests it pauses
    # new base weights would drop the adapter those requests run under
    with pytest.raises(WeightUpdateRefused, match="drop the adapter that requests paused in place run under"):
        await engine.check_weights(MODEL, "keep")
    await engine.close()
