"""`tokentape serve`: the gateway, on one process or as gateway actors on Ray."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tokentape.cli.root import app
from tokentape.gateway.sessions import REWRITE_POLICIES

if TYPE_CHECKING:
    from tokentape.served import ServeSpec


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind. Keep 127.0.0.1 unless the network is trusted.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    model: Annotated[
        Path | None, typer.Option(help="A GGUF model file. Default: the embedded SmolLM2-135M-Instruct.")
    ] = None,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            help="A remote engine as KIND=URL (vllm, vllm-generate, sglang); repeat for several. "
            "Sessions stick to one engine; new ones go to the least loaded."
        ),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="A Hugging Face model directory (tokenizer.json + chat template) to render and "
            "tokenize with, instead of the GGUF's own; its vocabulary must fit the engine's."
        ),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model name clients send. Default: derived from the model file.")
    ] = None,
    context_length: Annotated[int, typer.Option(help="Context window in tokens (prompt + generation).")] = 8192,
    threads: Annotated[
        int,
        typer.Option(
            help="CPU threads for the embedded engine. 0: every core while that runs faster, one core free while "
            "something else computes on the machine (learnt from its own step times)."
        ),
    ] = 0,
    parallel: Annotated[
        int,
        typer.Option(min=0, help="Generations the embedded engine decodes together (continuous batching). 0: 16."),
    ] = 0,
    flash_attention: Annotated[
        str,
        typer.Option(
            help="The embedded engine's flash attention (auto, on, off). auto: on, so that the KV kept for "
            "sessions' next turns costs other generations little; an F32 KV cache keeps it off."
        ),
    ] = "auto",
    rewrite_policy: Annotated[
        str,
        typer.Option(
            help=f"What to do when a request rewrites recorded history ({', '.join(REWRITE_POLICIES)}): "
            "tape keeps the recorded tokens, fork starts a new branch, strict rejects the request."
        ),
    ] = "tape",
    store: Annotated[
        str, typer.Option(help="SQLite file every turn is written to before it is answered; ':memory:' keeps none.")
    ] = "tokentape.sqlite3",
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            help="A trainer key (repeat for several; also TOKENTAPE_API_KEYS, comma-separated): allowed "
            "every route. Every route but /health then needs a key. Agents get their own session's key "
            "from POST /sessions (api_key), which reaches only that session's generation routes."
        ),
    ] = None,
    session_keys: Annotated[
        str,
        typer.Option(
            help="optional: generation may go without a session key (as trainer keys and open mode allow); "
            "required: every generation request needs a session key."
        ),
    ] = "optional",
    max_in_flight_per_key: Annotated[
        int | None,
        typer.Option(min=1, help="Requests one session key may have running at once (429 with Retry-After past it)."),
    ] = None,
    max_active: Annotated[
        int,
        typer.Option(
            "--max-active",
            "--max-waiting",  # its earlier name
            help="Requests admitted at once (the tokentape_requests_active gauge); more get 429 with Retry-After.",
        ),
    ] = 64,
    max_sessions_in_memory: Annotated[
        int, typer.Option(help="Sessions kept in memory (all stay in the store and reload on use).")
    ] = 10_000,
    idle_seconds: Annotated[float, typer.Option(help="A session idle this long leaves memory.")] = 3600.0,
    max_memory_bytes: Annotated[
        int,
        typer.Option(
            help="Bytes the gateway may hold in memory (sessions' tokens, retry records, cached image bytes); past "
            "it the least recently used sessions leave memory (they stay in the store), and if the running ones "
            "alone hold it, new requests get 429."
        ),
    ] = 4 * 1024**3,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body (413 past it).")] = 16 * 1024 * 1024,
    max_header_bytes: Annotated[
        int,
        typer.Option(min=1, help="Largest request head: request line and headers (431 past it, before the app)."),
    ] = 64 * 1024,
    max_headers: Annotated[int, typer.Option(min=1, help="Most headers one request may carry (431 past it).")] = 256,
    header_timeout: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Seconds a request's headers may take to arrive, from its first byte (a new connection's: "
            "from its opening); then 408 and the connection closes.",
        ),
    ] = 20.0,
    body_timeout: Annotated[
        float,
        typer.Option(min=0.001, help="Seconds a request's body may stop arriving; then 408 and the connection closes."),
    ] = 30.0,
    send_timeout: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Seconds a client may read nothing of a response waiting to be written; then its connection is "
            "dropped: a stream stops, its turn is recorded as cut off, its slot is released.",
        ),
    ] = 30.0,
    prompt_token_ids: Annotated[
        str,
        typer.Option(
            help="always: every response carries prompt_token_ids (the whole history's token IDs); asked: only "
            "responses to requests with return_token_ids: true, as vLLM does (agents that never read them "
            "then neither wait for nor parse them; the tape and its exports hold them either way)."
        ),
    ] = "always",
    allow_image_urls: Annotated[
        bool,
        typer.Option(
            help="Fetch http(s) image URLs clients send, from public addresses only (off: only inline base64 images)."
        ),
    ] = False,
    image_url_network: Annotated[
        list[str] | None,
        typer.Option(
            help="A network (CIDR) image URLs may also be fetched from although it is not public, such as an "
            "internal image store (repeatable; needs --allow-image-urls)."
        ),
    ] = None,
    drain_seconds: Annotated[
        int, typer.Option(help="On SIGTERM, how long in-flight requests may finish before the store is closed.")
    ] = 30,
    keep_alive_seconds: Annotated[
        int, typer.Option(help="How long an idle client connection stays open (past the clients' own, 5-15 s).")
    ] = 75,
    match_prefix: Annotated[
        bool,
        typer.Option(
            help="A chat request that names no session continues the one live session whose history it "
            "extends; several candidates or an edited history open a new session (response header "
            "X-Tokentape-Prefix-Match says which)."
        ),
    ] = False,
    max_staleness: Annotated[
        int | None,
        typer.Option(
            help="A session whose first sampled token is more than this many weights versions old takes no "
            "new turns (409 session_stale; its data stays exportable, marked stale). A session's own "
            'max_staleness (POST /sessions {"max_staleness": K}) overrides it.'
        ),
    ] = None,
    admit_per_version: Annotated[
        int | None,
        typer.Option(
            help="Admit new groups (sessions of one group_id) only while at most (max_staleness + version + 1) "
            "x this many were admitted since version 0; others get 429 with Retry-After."
        ),
    ] = None,
    admission_wait: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="With --admit-per-version: a new group that does not fit waits up to this many seconds for a "
            "weights update to make room before its 429 (0: refused at once).",
        ),
    ] = 0.0,
    log_level: Annotated[str, typer.Option(help="Log level: debug, info, warning, error.")] = "info",
    ray: Annotated[
        str | None,
        typer.Option(
            help="Run gateways as Ray actors: 'local' (a single-machine Ray on loopback), 'auto' (the cluster "
            "this machine joined with `ray start`) or a Ray address. This process then serves the same API "
            "on --port and hands each request to the gateway that owns its session."
        ),
    ] = None,
    gateways: Annotated[int, typer.Option(help="With --ray: gateway actors (gateway i serves on --port + 1 + i).")] = 2,
    store_dir: Annotated[
        str, typer.Option(help="With --ray: where each gateway keeps its store shard on its node.")
    ] = "tokentape-shards",
    trajectory_queue: Annotated[
        str | None,
        typer.Option(help="With --ray: hand every finished session to this queue (tokentape.ray.trajectories)."),
    ] = None,
    insecure_open: Annotated[
        bool,
        typer.Option(
            help="Serve on an address other machines reach with no trainer key (every route open to them). "
            "Without it such a start is refused."
        ),
    ] = False,
    weights_dir: Annotated[
        list[Path] | None,
        typer.Option(
            help="A directory POST /admin/weights may load from (repeat for several; the path as the engine "
            "sees it). Default: tokentape's cache and ./runs (where tokentape train writes). Others: 403."
        ),
    ] = None,
) -> None:
    """Serve the gateway until stopped (Ctrl-C or SIGTERM, which drains in-flight requests)."""
    import os

    from tokentape.core.staleness import Staleness
    from tokentape.gateway.sessions import MemoryLimits
    from tokentape.served import RayOptions, ServeSpec, SpecError
    from tokentape.server.connections import ConnectionLimits
    from tokentape.server.dialects.images import ImageLimits
    from tokentape.server.exposure import default_weights_dirs
    from tokentape.train.weights import cache_dir

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = ServeSpec(
            model=model,
            tokenizer=tokenizer,
            engines=tuple(engine or ()),
            served_model_name=served_model_name,
            context_length=context_length,
            threads=threads,
            parallel=parallel,
            flash_attention=flash_attention,
            rewrite_policy=rewrite_policy,
            store=store,
            memory=MemoryLimits(
                max_sessions=max_sessions_in_memory, idle_seconds=idle_seconds, max_bytes=max_memory_bytes
            ),
            max_active=max_active,
            match_prefix=match_prefix,
            staleness=Staleness(max_staleness, admit_per_version, admission_wait),
            host=host,
            port=port,
            api_keys=(*(api_key or ()), *filter(None, os.environ.get("TOKENTAPE_API_KEYS", "").split(","))),
            insecure_open=insecure_open,
            session_keys=session_keys,
            max_in_flight_per_key=max_in_flight_per_key,
            max_body_bytes=max_body_bytes,
            connections=ConnectionLimits(max_header_bytes, max_headers, header_timeout, body_timeout, send_timeout),
            weights_dirs=tuple(weights_dir or default_weights_dirs(cache_dir())),
            images=ImageLimits(allow_fetch=allow_image_urls, fetch_networks=tuple(image_url_network or ())),
            prompt_token_ids=prompt_token_ids,
            drain_seconds=drain_seconds,
            keep_alive_seconds=keep_alive_seconds,
            log_level=log_level.lower(),
            ray=None if ray is None else RayOptions(ray, gateways, store_dir, trajectory_queue),
        )
    except SpecError as exc:
        raise typer.BadParameter(exc.message, param_hint=exc.option) from None
    if (warning := spec.exposure_warning) is not None:
        logging.getLogger("tokentape").warning(warning)
    if spec.ray is not None:
        from tokentape.ray.cluster import serve_cluster

        serve_cluster(spec)
        return
    _serve_here(spec)


def _serve_here(spec: ServeSpec) -> None:
    """One process: the gateway `spec` describes, served until stopped."""
    import uvicorn

    from tokentape.served import build_served

    served = build_served(spec, owns_gateway=True, serving_process=True)
    typer.echo(
        f"tokentape: serving {served.model_id or 'the engines model'} at http://{spec.host}:{spec.port}/v1 "
        f"(sessions: /sessions/<id>/v1; store: {spec.store}"
        f"{'; API keys required' if spec.api_keys else ''})",
        err=True,
    )
    uvicorn.run(served.app, host=spec.host, port=spec.port, **spec.uvicorn_options())
