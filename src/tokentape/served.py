"""A served gateway from one settings object.

`ServeSpec` holds everything `tokentape serve` takes (the model and engines, the sessions and their
store, keys and limits, images, staleness, the HTTP server's bounds, Ray), checked once when it is
made: a bad value raises `SpecError` naming the command-line option. It is frozen and pickles as it
is, so the same object reaches a cluster's gateway actors.

`build_served` is the one place a gateway and its app are made from it, whole: `tokentape serve`, the
Ray gateway actors, the in-process client, the trainers' integrations, `tokentape train` and the
tests' fixtures all call it, and nothing is set on the gateway afterwards. An engine or renderer given
to it replaces the one the spec describes (a trainer's engine, a cluster's shared engines, a test's
scripted engine); a store given to it replaces `spec.store`.

A new server option is one field here and its one use (`build_served` or `uvicorn_options`), plus its
flag in `cli/serve.py`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokentape.core.staleness import Staleness
from tokentape.core.tape import RewritePolicy
from tokentape.errors import NotFound
from tokentape.gateway.service import Gateway, UpdaterFactory
from tokentape.gateway.sessions import REWRITE_POLICIES, MemoryLimits, SessionRegistry, check_policy
from tokentape.gateway.updates import WeightUpdater
from tokentape.server.connections import ConnectionLimits
from tokentape.server.dialects.images import ImageLimits
from tokentape.server.exposure import OpenModeRefused, check_exposure
from tokentape.server.middleware import DEFAULT_MAX_BODY_BYTES, GuardSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tokentape.engines.base import Engine
    from tokentape.render.renderer import Renderer
    from tokentape.store.base import TrajectoryStore

__all__ = ["RayOptions", "ServeSpec", "Served", "SpecError", "build_served"]

SWITCHES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
PROMPT_TOKEN_IDS = ("always", "asked")
SESSION_KEYS = ("optional", "required")


class SpecError(ValueError):
    """A value a served gateway cannot take; `option` is the command-line option that gives it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option
        self.message = message


@dataclass(frozen=True, slots=True)
class RayOptions:
    """`tokentape serve --ray`: gateway i serves on the spec's port + 1 + i, its store shard on its
    node under `store_dir`; the front serves on the spec's port."""

    address: str = "local"  # 'local', 'auto' or a Ray address
    gateways: int = 2
    store_dir: str = "tokentape-shards"  # on each node: gateway-<i>.sqlite3
    trajectory_queue: str | None = None  # a queue name: finished sessions are handed to it
    queue_capacity: int = 1024
    engine_actors: int = 1  # embedded llama.cpp engines as actors, shared by all gateways (no engine URLs)


@dataclass(frozen=True, slots=True)
class ServeSpec:
    """Everything a served gateway takes. Defaults are a throwaway gateway on the embedded model in
    this process (`:memory:` store, no keys); `tokentape serve` gives its own."""

    # what serves: the model, its tokenizer, the engines
    model: Path | None = None  # a GGUF file; None: the embedded model
    tokenizer: Path | None = None  # a Hugging Face model directory; None: the GGUF's own tokenizer
    engines: tuple[str, ...] = ()  # KIND=URL remote engines; none: the embedded llama.cpp engine
    served_model_name: str | None = None
    context_length: int = 8192
    threads: int = 0
    parallel: int = 0  # the embedded engine's generations decoded together; 0: its default
    flash_attention: str = "auto"  # auto, on, off: the embedded engine's
    # sessions and their store
    rewrite_policy: str = "tape"
    store: str = ":memory:"  # a SQLite file keeps every turn across restarts
    memory: MemoryLimits = field(default_factory=MemoryLimits)
    max_active: int = 64  # requests admitted at once
    match_prefix: bool = False  # unnamed chat requests continue the one live session their history extends
    clip_max_tokens: bool = False  # max_tokens past the room left gets the room (as trainers' servers do)
    staleness: Staleness = field(default_factory=Staleness)
    # who may call, and what a request may send
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # trainer keys; none: open mode
    insecure_open: bool = False  # open mode on an address other machines reach
    session_keys: str = "optional"  # optional, required
    max_in_flight_per_key: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # the HTTP server's bounds: heads, slow heads and bodies, clients that stop reading
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    weights_dirs: tuple[Path, ...] | None = None  # where POST /admin/weights may load from; None: anywhere
    images: ImageLimits = field(default_factory=ImageLimits)
    # How long an idle client connection stays open (uvicorn's default is 5 s). Longer than clients keep
    # theirs idle (httpx, under the openai SDK: 5 s; aiohttp: 15 s): a server that closes first races a
    # client reusing the connection at that moment, and the request fails with a connection error. A
    # busy agent's event loop can leave its connections idle for seconds between calls.
    keep_alive_seconds: int = 75
    prompt_token_ids: str = "always"  # always, asked
    # the process
    drain_seconds: int = 30
    log_level: str = "info"
    ray: RayOptions | None = None  # gateways as Ray actors

    def __post_init__(self) -> None:
        _one_of(self.rewrite_policy, REWRITE_POLICIES, "--rewrite-policy")
        _one_of(self.flash_attention, tuple(SWITCHES), "--flash-attention")
        _one_of(self.prompt_token_ids, PROMPT_TOKEN_IDS, "--prompt-token-ids")
        _one_of(self.session_keys, SESSION_KEYS, "--session-keys")
        if self.session_keys == "required" and not self.api_keys:
            raise SpecError("--session-keys", "required needs a trainer key (--api-key)")
        for value, least, option in (
            (self.context_length, 1, "--context-length"),
            (self.threads, 0, "--threads"),
            (self.parallel, 0, "--parallel"),
            (self.max_active, 1, "--max-active"),
            (self.max_body_bytes, 1, "--max-body-bytes"),
            (1 if self.max_in_flight_per_key is None else self.max_in_flight_per_key, 1, "--max-in-flight-per-key"),
            (self.connections.max_header_bytes, 1, "--max-header-bytes"),
            (self.connections.max_headers, 1, "--max-headers"),
            (self.drain_seconds, 0, "--drain-seconds"),
            (self.keep_alive_seconds, 1, "--keep-alive-seconds"),
        ):
            if value < least:
                raise SpecError(option, f"must be {least} or more")
        for seconds, option in (
            (self.connections.header_seconds, "--header-timeout"),
            (self.connections.body_seconds, "--body-timeout"),
            (self.connections.send_seconds, "--send-timeout"),
        ):
            if seconds <= 0:
                raise SpecError(option, "must be more than 0 seconds")
        _check_staleness(self.staleness)
        _check_images(self.images)
        try:
            check_exposure(self.host, self.api_keys, insecure_open=self.insecure_open)
        except OpenModeRefused as exc:
            raise SpecError("--host", str(exc)) from None
        if self.ray is not None and self.ray.gateways < 1:
            raise SpecError("--gateways", "must be 1 or more")

    @property
    def policy(self) -> RewritePolicy:
        return check_policy(self.rewrite_policy)  # checked in __post_init__: typed here

    @property
    def flash(self) -> bool | None:
        """`flash_attention` for the engine: None (its default), True, False."""
        return SWITCHES[self.flash_attention]

    @property
    def exposure_warning(self) -> str | None:
        """What to log at start: open mode on an address other machines reach (`insecure_open`)."""
        return check_exposure(self.host, self.api_keys, insecure_open=self.insecure_open)

    @property
    def trainer_key(self) -> str | None:
        """The key a trainer's own calls in this process carry: the first trainer key."""
        return self.api_keys[0] if self.api_keys else None

    def guard(self) -> GuardSettings:
        return GuardSettings(
            self.api_keys,
            self.max_body_bytes,
            self.connections.max_header_bytes,
            require_session_keys=self.session_keys == "required",
            max_in_flight_per_key=self.max_in_flight_per_key,
            weights_dirs=self.weights_dirs,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """What every uvicorn server of a served gateway is given (one process, a cluster's gateways
        and its front): its log level, uvloop, the bounded protocol (`server.connections`: a request's
        head, the time its head and body take to come, the time a client may stop reading; what a turn
        of the loop writes to a client goes out in one write, `server.write_combining`), keep-alive
        and the drain."""
        from tokentape.server.connections import bounded_protocol

        return {
            "log_level": self.log_level,
            # below info an access line is never shown, yet uvicorn formats its fields for every request
            "access_log": self.log_level in ("debug", "info"),
            # libuv's event loop and llhttp's parser: less CPU per request than asyncio + h11
            "loop": "uvloop",
            "http": bounded_protocol(self.connections),
            "proxy_headers": False,  # nothing reads the client address; one ASGI layer less per request
            "timeout_keep_alive": self.keep_alive_seconds,
            "timeout_graceful_shutdown": self.drain_seconds,
        }


def _one_of(value: str, allowed: tuple[str, ...], option: str) -> None:
    if value not in allowed:
        raise SpecError(option, f"{', '.join(allowed[:-1])} or {allowed[-1]}, not {value!r}")


def _check_staleness(staleness: Staleness) -> None:
    if staleness.max_staleness is not None and staleness.max_staleness < 0:
        raise SpecError("--max-staleness", "must be 0 or more")
    if staleness.admit_per_version is not None and staleness.admit_per_version < 1:
        raise SpecError("--admit-per-version", "must be 1 or more")
    if staleness.admission_wait < 0:
        raise SpecError("--admission-wait", "must be 0 seconds or more")


def _check_images(images: ImageLimits) -> None:
    if images.fetch_networks and not images.allow_fetch:
        raise SpecError("--image-url-network", "needs --allow-image-urls")
    for net in images.fetch_networks:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            raise SpecError("--image-url-network", f"{net!r} is not a network (10.0.0.0/8, fd00::/8)") from None


@dataclass(frozen=True, slots=True)
class Served:
    """A gateway and its app, as `build_served` made them; `model_id` is the model name clients send
    (None: whatever the remote engines serve)."""

    spec: ServeSpec
    gateway: Gateway
    app: FastAPI
    model_id: str | None


def build_served(
    spec: ServeSpec,
    *,
    engine: Engine | None = None,
    renderer: Renderer | None = None,
    store: TrajectoryStore | None = None,
    updates: UpdaterFactory = WeightUpdater,
    version: int = 0,
    owns_gateway: bool = False,
    serving_process: bool = False,
) -> Served:
    """The gateway `spec` describes and its app. `engine`, `renderer`, `store`: used instead of what
    the spec describes. `updates` and `version`: a cluster's gateway hands weight updates to its
    engine registry and starts at the version its engines hold. `owns_gateway`: the app closes the
    gateway when it shuts down; `serving_process`: the process exists to serve it (see `create_app`)."""
    from tokentape import runtime
    from tokentape.server.app import create_app
    from tokentape.store.sqlite import SqliteStore

    path = None
    if renderer is None or engine is None:
        path = spec.model or runtime.embedded_model_path()
        if not path.is_file():
            raise NotFound(f"no model file at {path}")
    if renderer is None:
        assert path is not None
        renderer = runtime.hf_renderer(spec.tokenizer) if spec.tokenizer else runtime.gguf_renderer(path)
    if engine is None:
        assert path is not None
        engine = runtime.make_engines(
            spec.engines, path, renderer, spec.context_length, spec.threads, spec.parallel, spec.flash
        )
    model_id = spec.served_model_name
    if model_id is None and not spec.engines:
        model_id = runtime.file_model_name(spec.model, path) if path is not None else engine.model_id
    registry = SessionRegistry(
        store if store is not None else SqliteStore(spec.store),
        default_policy=spec.policy,
        limits=spec.memory,
        match_prefix=spec.match_prefix,
    )
    gateway = Gateway(
        engine,
        renderer,
        registry,
        max_active=spec.max_active,
        clip_max_tokens=spec.clip_max_tokens,
        staleness=spec.staleness,
        version=version,
        updates=updates,
    )
    app = create_app(
        gateway,
        model_id=model_id,
        guard=spec.guard(),
        owns_gateway=owns_gateway,
        serving_process=serving_process,
        image_limits=spec.images,
        prompt_token_ids=spec.prompt_token_ids,
    )
    return Served(spec, gateway, app, model_id)
