"""`ServeSpec`, the one settings object of a served gateway, and `build_served`, the one place a gateway
and its app are made from it: the spec pickles as it is (it crosses to Ray's gateway actors), every bad
value is refused when the spec is made, naming the command-line option, and what the spec says is what
the built gateway does, with nothing set on it afterwards."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tokentape.cli import app as cli
from tokentape.core.staleness import Staleness
from tokentape.engines.scripted import ScriptedEngine
from tokentape.gateway.sessions import MemoryLimits
from tokentape.gateway.updates import WeightUpdater
from tokentape.render.renderer import Renderer
from tokentape.served import RayOptions, ServeSpec, SpecError, build_served
from tokentape.server.connections import ConnectionLimits
from tokentape.server.dialects.images import ImageLimits

EVERY_FIELD_SET = ServeSpec(
    model=Path("/models/m.gguf"),
    tokenizer=Path("/models/hf"),
    engines=("vllm=http://engine:8000",),
    served_model_name="policy",
    context_length=4096,
    threads=3,
    parallel=4,
    flash_attention="off",
    rewrite_policy="fork",
    store="/data/t.sqlite3",
    memory=MemoryLimits(max_sessions=7, idle_seconds=9.0, max_bytes=1 << 20),
    max_active=5,
    match_prefix=True,
    clip_max_tokens=True,
    staleness=Staleness(2, 8, 1.5),
    host="0.0.0.0",
    port=9000,
    api_keys=("trainer-key", "second"),
    insecure_open=True,
    session_keys="required",
    max_in_flight_per_key=2,
    max_body_bytes=1000,
    connections=ConnectionLimits(4000, 30, 1.0, 2.0, 3.0),
    weights_dirs=(Path("/weights"),),
    images=ImageLimits(allow_fetch=True, fetch_networks=("10.0.0.0/8",)),
    prompt_token_ids="asked",
    drain_seconds=5,
    keep_alive_seconds=20,
    log_level="warning",
    ray=RayOptions("auto", 3, "/shards", "train", 16, 2),
)


def test_every_field_differs_from_its_default() -> None:
    """So the round trip below compares every field, not defaults with defaults."""
    default = ServeSpec()
    same = [
        f.name for f in dataclasses.fields(ServeSpec) if getattr(EVERY_FIELD_SET, f.name) == getattr(default, f.name)
    ]
    assert same == []


def test_the_spec_round_trips_through_pickle() -> None:
    again = pickle.loads(pickle.dumps(EVERY_FIELD_SET))
    assert again == EVERY_FIELD_SET
    for field in dataclasses.fields(ServeSpec):  # field by field, so a field left out of eq would show
        assert getattr(again, field.name) == getattr(EVERY_FIELD_SET, field.name), field.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.port = 1  # type: ignore[misc]


def test_keys_stay_out_of_the_specs_repr() -> None:
    assert "trainer-key" not in repr(EVERY_FIELD_SET)


@pytest.mark.parametrize(
    ("given", "option"),
    [
        ({"rewrite_policy": "keep"}, "--rewrite-policy"),
        ({"flash_attention": "yes"}, "--flash-attention"),
        ({"prompt_token_ids": "never"}, "--prompt-token-ids"),
        ({"session_keys": "sometimes"}, "--session-keys"),
        ({"session_keys": "required"}, "--session-keys"),  # no trainer key
        ({"context_length": 0}, "--context-length"),
        ({"threads": -1}, "--threads"),
        ({"parallel": -1}, "--parallel"),
        ({"max_active": 0}, "--max-active"),
        ({"max_body_bytes": 0}, "--max-body-bytes"),
        ({"max_in_flight_per_key": 0}, "--max-in-flight-per-key"),
        ({"connections": ConnectionLimits(max_header_bytes=0)}, "--max-header-bytes"),
        ({"connections": ConnectionLimits(max_headers=0)}, "--max-headers"),
        ({"connections": ConnectionLimits(header_seconds=0)}, "--header-timeout"),
        ({"connections": ConnectionLimits(body_seconds=-1)}, "--body-timeout"),
        ({"connections": ConnectionLimits(send_seconds=0)}, "--send-timeout"),
        ({"drain_seconds": -1}, "--drain-seconds"),
        ({"keep_alive_seconds": 0}, "--keep-alive-seconds"),
        ({"staleness": Staleness(max_staleness=-1)}, "--max-staleness"),
        ({"staleness": Staleness(admit_per_version=0)}, "--admit-per-version"),
        ({"staleness": Staleness(admission_wait=-0.5)}, "--admission-wait"),
        ({"images": ImageLimits(fetch_networks=("10.0.0.0/8",))}, "--image-url-network"),  # fetching off
        ({"images": ImageLimits(allow_fetch=True, fetch_networks=("not-a-net",))}, "--image-url-network"),
        ({"host": "0.0.0.0"}, "--host"),  # reachable from other machines, no key, no --insecure-open
        ({"ray": RayOptions(gateways=0)}, "--gateways"),
    ],
)
def test_each_bad_value_is_refused_naming_its_option(given: dict[str, Any], option: str) -> None:
    with pytest.raises(SpecError) as refused:
        ServeSpec(**given)
    assert refused.value.option == option
    assert str(refused.value).startswith(f"{option}: ")


def test_the_open_mode_override_and_a_key_each_pass_the_exposure_check() -> None:
    assert ServeSpec(host="0.0.0.0", insecure_open=True).exposure_warning is not None
    assert ServeSpec(host="0.0.0.0", api_keys=("k",)).exposure_warning is None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--session-keys", "required"], "--session-keys"),
        (["--image-url-network", "10.0.0.0/8"], "--image-url-network"),
        (["--host", "0.0.0.0"], "--host"),
        (["--rewrite-policy", "keep"], "--rewrite-policy"),
    ],
)
def test_the_cli_turns_a_refusal_into_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, options: list[str], named: str
) -> None:
    import tokentape.cli.serve as serve

    monkeypatch.delenv("TOKENTAPE_API_KEYS", raising=False)
    monkeypatch.setattr(serve, "_serve_here", lambda spec: pytest.fail("served despite a bad option"))
    result = CliRunner().invoke(cli, ["serve", "--store", ":memory:", *options])
    assert result.exit_code == 2, result.output
    assert named in result.output


def test_the_cli_builds_the_spec_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokentape.cli.serve as serve

    seen: list[ServeSpec] = []
    monkeypatch.setenv("TOKENTAPE_API_KEYS", "env-key")
    monkeypatch.setattr(serve, "_serve_here", seen.append)
    options = ["--api-key", "flag-key", "--max-headers", "12", "--send-timeout", "4", "--admission-wait", "2"]
    options += ["--allow-image-urls", "--image-url-network", "10.0.0.0/8", "--rewrite-policy", "fork"]
    options += ["--keep-alive-seconds", "30"]
    result = CliRunner().invoke(cli, ["serve", "--store", ":memory:", *options])
    assert result.exit_code == 0, result.output
    (spec,) = seen
    assert spec.api_keys == ("flag-key", "env-key")
    assert (spec.connections.max_headers, spec.connections.send_seconds) == (12, 4.0)
    assert spec.staleness == Staleness(None, None, 2.0)
    assert spec.images.fetch_networks == ("10.0.0.0/8",) and spec.images.allow_fetch
    assert spec.rewrite_policy == "fork" and spec.ray is None
    assert spec.uvicorn_options()["timeout_keep_alive"] == 30  # what uvicorn is given


class _Updates(WeightUpdater):
    """Stands for a cluster's updater: built by the gateway from its own gate and engines."""


async def test_the_built_gateway_does_what_the_spec_says(renderer: Renderer) -> None:
    spec = ServeSpec(
        served_model_name="policy",
        rewrite_policy="strict",
        max_active=3,
        clip_max_tokens=True,
        match_prefix=True,
        staleness=Staleness(1, 2, 0.5),
        api_keys=("trainer",),
        max_body_bytes=2000,
    )
    served = build_served(spec, engine=ScriptedEngine([], 0), renderer=renderer, updates=_Updates, version=4)
    gateway = served.gateway
    assert served.model_id == "policy"
    assert gateway.sessions.default_policy == "strict" and gateway.sessions.match_prefix
    assert gateway.admission.max_active == 3 and gateway.clip_max_tokens
    assert gateway.staleness == Staleness(1, 2, 0.5)  # the admission wait (0.5 s) included
    assert gateway.group_admission is not None
    assert (gateway.gate.version, gateway.gate.label) == (4, "4")
    assert isinstance(gateway.updates, _Updates) and gateway.updates.gate is gateway.gate
    transport = httpx.ASGITransport(app=served.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/v1/models")).status_code == 401  # the spec's keys guard the app
        models = await http.get("/v1/models", headers={"authorization": "Bearer trainer"})
        assert models.json()["data"][0]["id"] == "policy"
        big = await http.post("/v1/chat/completions", content=b"x" * 3000, headers={"authorization": "Bearer trainer"})
        assert big.status_code == 413  # the spec's body limit
