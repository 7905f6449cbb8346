"""Command line: `tokentape serve` runs the gateway; `tokentape demo` runs the bundled agent."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from tokentape.gateway.sessions import REWRITE_POLICIES, check_policy

__all__ = ["app", "main"]

app = typer.Typer(
    help="tokentape: an OpenAI-compatible gateway that records every sampled token for RL training.",
    no_args_is_help=True,
    add_completion=False,
)


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
        int, typer.Option(help="CPU threads for the embedded engine. 0: all cores but one (ggml busy-waits).")
    ] = 0,
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
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body (413 past it).")] = 16 * 1024 * 1024,
    drain_seconds: Annotated[
        int, typer.Option(help="On SIGTERM, how long in-flight requests may finish before the store is closed.")
    ] = 30,
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

    import uvicorn

    from tokentape.gateway.sessions import MemoryLimits
    from tokentape.runtime import RuntimeSettings, build_gateway
    from tokentape.server.app import create_app
    from tokentape.server.exposure import OpenModeRefused, check_exposure, default_weights_dirs
    from tokentape.server.middleware import GuardSettings
    from tokentape.train.weights import cache_dir

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = RuntimeSettings(
        model_path=model,
        tokenizer_dir=tokenizer,
        engines=tuple(engine or ()),
        context_length=context_length,
        threads=threads,
        rewrite_policy=check_policy(rewrite_policy),
        served_model_name=served_model_name,
        store_path=store,
        max_active=max_active,
        memory=MemoryLimits(max_sessions=max_sessions_in_memory, idle_seconds=idle_seconds),
        match_prefix=match_prefix,
    )
    keys = [*(api_key or []), *filter(None, os.environ.get("TOKENTAPE_API_KEYS", "").split(","))]
    if session_keys not in ("optional", "required"):
        raise typer.BadParameter("optional or required", param_hint="--session-keys")
    if session_keys == "required" and not keys:
        raise typer.BadParameter("required needs a trainer key (--api-key)", param_hint="--session-keys")
    try:
        warning = check_exposure(host, keys, insecure_open=insecure_open)
    except OpenModeRefused as exc:
        raise typer.BadParameter(str(exc), param_hint="--host") from None
    if warning is not None:
        logging.getLogger("tokentape").warning(warning)
    guard = GuardSettings(
        api_keys=keys,
        max_body_bytes=max_body_bytes,
        require_session_keys=session_keys == "required",
        max_in_flight_per_key=max_in_flight_per_key,
        weights_dirs=weights_dir or default_weights_dirs(cache_dir()),
    )
    staleness = None
    if max_staleness is not None or admit_per_version is not None:
        from tokentape.core.staleness import Staleness

        staleness = Staleness(max_staleness, admit_per_version, admission_wait)
    if ray is not None:
        from tokentape.ray.cluster import ClusterSettings, serve_cluster

        cluster = ClusterSettings(
            gateways=gateways,
            host=host,
            first_port=port + 1,
            store_dir=store_dir,
            runtime=settings,
            model_id=served_model_name,
            trajectory_queue=trajectory_queue,
            guard=guard,
            staleness=staleness,
        )
        serve_cluster(ray, cluster, port=port, log_level=log_level.lower())
        return
    gateway, name = build_gateway(settings)
    if staleness is not None:
        gateway.set_staleness(staleness)
    typer.echo(
        f"tokentape: serving {name or 'the engines model'} at http://{host}:{port}/v1 "
        f"(sessions: /sessions/<id>/v1; store: {store}"
        f"{'; API keys required' if keys else ''})",
        err=True,
    )
    uvicorn.run(
        create_app(gateway, model_id=name, guard=guard, owns_gateway=True, serving_process=True),
        host=host,
        port=port,
        log_level=log_level.lower(),
        # libuv's event loop and llhttp's parser: less CPU per request than asyncio + h11. httptools
        # sets no header limit of its own, so oversized headers reach the app, which answers 431.
        loop="uvloop",
        http="httptools",
        proxy_headers=False,  # nothing reads the client address; one ASGI layer less per request
        # below info an access line is never shown, yet uvicorn formats its fields for every request
        access_log=log_level.lower() in ("debug", "info"),
        timeout_graceful_shutdown=drain_seconds,
    )


@app.command()
def status(
    address: Annotated[
        str, typer.Option(help="The Ray cluster to look at (as given to `ray start` / serve --ray).")
    ] = ("auto"),
) -> None:
    """The cluster started by `tokentape serve --ray`: gateways, engines, sessions, load, queues."""
    from rich.console import Console
    from rich.table import Table

    from tokentape.ray.cluster import cluster_status, connect

    connect(address)
    state = cluster_status()
    console = Console()
    gateways = Table(
        "gateway", "url", "node", "open sessions", "in memory", "requests active", "engine calls", "weights version"
    )
    for g in state["gateways"]:
        gateways.add_row(
            str(g["index"]),
            g["url"],
            g["node"][:12],
            str(g["open_sessions"]),
            str(g["sessions_in_memory"]),
            str(g["requests_active"]),
            str(g["engine_calls"]),
            str(g["weights_version"]),
        )
    console.print(gateways)
    engines = Table("engine", "in flight", "sessions", "weights version")
    # the version each engine actor holds (the registry updates them); a remote engine's is its gateways'
    versions = state["engines"].get("engine_versions", {})
    for name, flying in sorted(state["engines"]["in_flight"].items()):
        actor = name.removeprefix("ray://")
        version = versions.get(actor, 0) if actor != name else "-"
        engines.add_row(name, str(flying), str(state["engines"]["sessions"].get(name, 0)), str(version))
    console.print(engines)
    if state["queues"]:
        queues = Table("trajectory queue", "waiting", "capacity", "taken")
        for name, size in sorted(state["queues"].items()):
            queues.add_row(name, str(size["waiting"]), str(size["capacity"]), str(size["taken"]))
        console.print(queues)


@app.command()
def demo(
    episodes: Annotated[int, typer.Option(min=4, help="Episodes to run (at least 4: one of each kind).")] = 4,
    out: Annotated[Path, typer.Option(help="Folder for the exported sessions.")] = Path("runs/demo"),
    port: Annotated[int, typer.Option(help="Port for the gateway; 0 picks a free one.")] = 0,
) -> None:
    """Start the gateway on the embedded model, run the bundled agent through it, export the tapes."""
    from tokentape.demo import run_demo

    run_demo(episodes=episodes, out=out, port=port)


@app.command()
def doctor(
    model: Annotated[
        Path | None,
        typer.Argument(help="A Hugging Face model directory or a GGUF file. Default: the embedded model."),
    ] = None,
) -> None:
    """Audit a model's chat template against the hard cases: what is exact, what is bridged, what a
    rewrite will do."""
    from rich.console import Console
    from rich.table import Table

    from tokentape.render.doctor import audit
    from tokentape.runtime import embedded_model_path, gguf_renderer, hf_renderer

    target = model or embedded_model_path()
    renderer = hf_renderer(target) if target.is_dir() else gguf_renderer(target)
    table = Table(title=f"tokentape doctor: {target.name}", show_lines=True)
    for column in ("case", "verdict", "what happens"):
        table.add_column(column, overflow="fold")
    colours = {"exact": "green", "bridged": "cyan", "rewrite": "yellow", "note": "white", "problem": "red"}
    findings = audit(renderer)
    for finding in findings:
        table.add_row(finding.case, f"[{colours[finding.verdict]}]{finding.verdict}[/]", finding.detail)
    Console(width=140).print(table)
    if any(f.verdict == "problem" for f in findings):
        raise typer.Exit(code=1)


@app.command()
def rollout(
    agent: Annotated[
        str,
        typer.Argument(
            help="An example name (arithmetic, calculator: examples/NAME_agent.py), "
            "path/to/file.py:func or package.module:func."
        ),
    ],
    episodes: Annotated[int, typer.Option(min=1, help="Episodes to run.")] = 16,
    concurrency: Annotated[int, typer.Option(min=1, help="Episodes in flight at once.")] = 4,
    group_size: Annotated[int, typer.Option(min=1, help="Episodes per group (same task; GRPO groups).")] = 4,
    url: Annotated[
        str | None, typer.Option(help="A running gateway (tokentape serve). Default: one in this process.")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="TOKENTAPE_API_KEY",
            help="A trainer key of the gateway at --url, for creating, rewarding and exporting sessions; "
            "each agent gets only its own session's key.",
        ),
    ] = None,
    format: Annotated[str, typer.Option(help="Dataset format: tokentape, openrlhf, atropos, verifiers, stepwise.")] = (
        "tokentape"
    ),
    out: Annotated[Path, typer.Option(help="Dataset file (.parquet or .jsonl).")] = Path("runs/rollout.parquet"),
) -> None:
    """Run an async agent N times through the gateway and write the episodes as a dataset."""
    import asyncio

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tokentape.client import GatewayClient, InProcessGateway
    from tokentape.core.formats import check_format
    from tokentape.rollout import RolloutStats, load_agent, run_rollout
    from tokentape.store.datasets import write_dataset

    fmt = check_format(format)
    run = load_agent(agent)
    console = Console()

    async def go() -> tuple[RolloutStats, int]:
        gateway = await GatewayClient.connect(url, api_key=api_key) if url else InProcessGateway()
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "turns {task.fields[turns]}  {task.fields[tps]:.0f} tok/s  errors {task.fields[errors]}"
                "  mean reward {task.fields[reward]}"
            ),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("episodes", total=episodes, turns=0, tps=0.0, errors=0, reward="-")

            def show(stats: RolloutStats) -> None:
                mean = stats.mean_reward
                progress.update(
                    task,
                    completed=stats.done,
                    turns=stats.turns,
                    tps=stats.tokens_per_second,
                    errors=stats.errors,
                    reward="-" if mean is None else f"{mean:.3f}",
                )

            stats = await run_rollout(
                run, gateway, episodes=episodes, concurrency=concurrency, group_size=group_size, on_progress=show
            )
        rows = (await gateway.export_all(format=fmt, prefix=f"{stats.run_id}-"))["data"]
        write_dataset(rows, out, fmt)
        await gateway.aclose()
        return stats, len(rows)

    stats, count = asyncio.run(go())
    mean = stats.mean_reward
    console.print(
        f"{stats.done} episodes ({stats.errors} errors, {stats.context_full} ended with a full context), "
        f"{stats.turns} turns, {stats.sampled_tokens} "
        f"sampled tokens, mean reward {'-' if mean is None else f'{mean:.3f}'}"
    )
    console.print(f"dataset: {out} ({count} {fmt} rows, run {stats.run_id})")
    for message in stats.error_messages[:5]:
        console.print(f"[red]{message}[/]")


@app.command()
def train(
    agent: Annotated[
        str,
        typer.Argument(help="The agent: an example name (arithmetic), path/to/file.py:func or package.module:func."),
    ] = "arithmetic",
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps (one batch of rollouts each).")] = 20,
    groups: Annotated[int, typer.Option(min=1, help="Tasks per step.")] = 4,
    group_size: Annotated[int, typer.Option(min=2, help="Episodes per task (GRPO group).")] = 4,
    learning_rate: Annotated[float, typer.Option(help="AdamW learning rate of the LoRA.")] = 1e-3,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank.")] = 8,
    clip: Annotated[float, typer.Option(help="Truncated importance weight: min(p_trainer / p_engine, clip).")] = 2.0,
    temperature: Annotated[
        float, typer.Option(help="The agent's sampling temperature (logprobs are scaled by it).")
    ] = 0.8,
    weights: Annotated[
        str, typer.Option(help="What the engine serves: f32 (a dequantized copy) or q4_1 (as shipped).")
    ] = ("f32"),
    seed: Annotated[int, typer.Option(help="Seeds the LoRA, torch and the tasks.")] = 0,
    eval_every: Annotated[
        int,
        typer.Option(min=0, help="Greedy evaluation on the agent's held-out tasks every this many updates (0: none)."),
    ] = 5,
    out: Annotated[Path, typer.Option(help="steps.jsonl, train.png and the adapters go here.")] = Path("runs/train"),
    url: Annotated[
        str | None,
        typer.Option(
            help="A gateway you run (tokentape serve, in front of the embedded model's F32 copy, vLLM or Ray) "
            "instead of one in this process; it must read the adapters written under --out."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="TOKENTAPE_API_KEY",
            help="A trainer key of the gateway at --url: sessions, rewards, exports and weight updates carry it.",
        ),
    ] = None,
) -> None:
    """The reference RL loop: GRPO on a LoRA of the embedded model, learning from the tape, pushing each
    update to the engine (POST /admin/weights)."""
    import asyncio

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tokentape.rollout import load_agent
    from tokentape.train.loop import EvalRecord, StepRecord, TrainConfig
    from tokentape.train.loop import train as run_training
    from tokentape.train.plot import plot_steps

    if weights not in ("f32", "q4_1"):
        raise typer.BadParameter("weights: f32 or q4_1")
    config = TrainConfig(
        steps=steps,
        groups=groups,
        group_size=group_size,
        learning_rate=learning_rate,
        rank=rank,
        clip=clip,
        temperature=temperature,
        weights="f32" if weights == "f32" else "q4_1",
        seed=seed,
        out=out,
        url=url,
        api_key=api_key,
        eval_every=eval_every,
    )
    console = Console()
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("steps", total=steps, reward="-")

        def show(record: StepRecord) -> None:
            m, t = record.metrics, record.seconds
            progress.console.print(
                f"step {record.step:3d} v{record.version}  reward {record.reward_mean:.3f}  "
                f"|dlogp| mean {m['logprob_diff_mean']:.2e} max {m['logprob_diff_max']:.2e}  "
                f"k3 {m['kl_k3']:.2e}  ratio {m['ratio_min']:.3f}/{m['ratio_mean']:.3f}/{m['ratio_max']:.3f}  "
                f"clipped {m['clipped_share']:.1%}  "
                f"({t['rollout']:.1f}s rollout, {t['forward_backward']:.1f}s fwd/bwd, {t['push']:.2f}s push)"
            )
            progress.update(task, advance=1, reward=f"{record.reward_mean:.3f}")

        evaluations: list[EvalRecord] = []

        def evaluated(record: EvalRecord) -> None:
            evaluations.append(record)
            progress.console.print(
                f"held-out after {record.updates} updates: reward {record.reward_mean:.3f} "
                f"({len(record.rewards)} tasks, greedy{f', {record.errors} errors' if record.errors else ''})"
            )

        records = asyncio.run(run_training(config, load_agent(agent), on_step=show, on_eval=evaluated))
    png = plot_steps(out / "steps.jsonl", out / "train.png", title=f"tokentape train {agent} ({weights}, seed {seed})")
    first = [r.reward_mean for r in records[:5]]
    last = [r.reward_mean for r in records[-5:]]
    console.print(
        f"mean reward: first {len(first)} steps {sum(first) / len(first):.3f}, last {len(last)} steps "
        f"{sum(last) / len(last):.3f}; steps: {out / 'steps.jsonl'}, plot: {png}"
    )
    if evaluations:
        console.print(
            f"held-out reward (greedy): base {evaluations[0].reward_mean:.3f}, "
            f"final {evaluations[-1].reward_mean:.3f} ({out / 'heldout.jsonl'})"
        )


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="Dataset file (.parquet or .jsonl).")],
    url: Annotated[str, typer.Option(help="The gateway to export from.")] = "http://127.0.0.1:8000",
    format: Annotated[str, typer.Option(help="tokentape, openrlhf, atropos, verifiers or stepwise.")] = "tokentape",
    group_id: Annotated[str | None, typer.Option(help="Only this group.")] = None,
    finished: Annotated[bool | None, typer.Option("--finished/--unfinished", help="Only (un)finished sessions.")] = (
        None
    ),
    since: Annotated[float | None, typer.Option(help="Only sessions created at or after this Unix time.")] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="TOKENTAPE_API_KEY", help="A trainer key of the gateway, if it has keys.")
    ] = None,
    max_lag: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Leave out (or mask, see --lag-mode) tokens sampled more than this many weights versions "
            "before the gateway's current one.",
        ),
    ] = None,
    lag_mode: Annotated[
        str | None,
        typer.Option(help="With --max-lag: drop (the sample; default) or mask (its too-old tokens out of the loss)."),
    ] = None,
) -> None:
    """Export recorded sessions from a running gateway as a dataset file, streamed to disk as the
    gateway reads its store (the dataset is never held in memory)."""
    import httpx

    from tokentape.core.formats import check_format
    from tokentape.store.datasets import DATASET_SUFFIXES

    fmt = check_format(format)
    if out.suffix not in DATASET_SUFFIXES:
        typer.echo(f"export failed: a dataset file ends in {' or '.join(DATASET_SUFFIXES)}", err=True)
        raise typer.Exit(code=1)
    params = {
        "format": fmt,
        "output": out.suffix.removeprefix("."),
        "group_id": group_id,
        "since": since,
        "finished": None if finished is None else str(finished).lower(),
        "max_lag": max_lag,
        "lag_mode": lag_mode,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # a failed export never leaves a truncated dataset
    query = {k: v for k, v in params.items() if v is not None}
    headers = _trainer_headers(api_key)
    with httpx.stream("GET", f"{url}/export", params=query, headers=headers, timeout=None) as response:
        if response.status_code != 200:
            typer.echo(f"export failed: {response.read().decode(errors='replace')}", err=True)
            raise typer.Exit(code=1)
        with partial.open("wb") as sink:
            for chunk in response.iter_bytes():
                sink.write(chunk)
    partial.replace(out)
    if out.suffix == ".jsonl":
        with out.open("rb") as lines:
            count = sum(1 for line in lines if line.strip())
    else:
        import pyarrow.parquet as pq

        count = pq.read_metadata(out).num_rows
    typer.echo(f"{out}: {count} {fmt} rows")


@app.command()
def view(
    url: Annotated[str, typer.Option(help="The gateway whose sessions to show.")] = "http://127.0.0.1:8000",
    out: Annotated[
        Path | None, typer.Option(help="Write a static HTML snapshot to this file instead of serving.")
    ] = None,
    port: Annotated[int, typer.Option(help="Port to serve the viewer on.")] = 8050,
    api_key: Annotated[
        str | None, typer.Option(envvar="TOKENTAPE_API_KEY", help="A trainer key of the gateway, if it has keys.")
    ] = None,
) -> None:
    """Show recorded sessions token by token: origin and loss mask by colour, logprob as heat, turns,
    branches as a tree, rewrites marked; hover a token for its ID, text and logprob."""
    import httpx

    from tokentape.viewer import static_page

    headers = _trainer_headers(api_key)

    def snapshot() -> str:
        listing = httpx.get(f"{url}/sessions", headers=headers, timeout=60)
        if listing.status_code != 200:
            raise SystemExit(f"view failed: {listing.text}")
        listed = listing.json()["data"]
        exports = {
            s["session_id"]: httpx.get(
                f"{url}/sessions/{s['session_id']}/export", params={"texts": "true"}, headers=headers, timeout=60
            ).json()
            for s in listed
        }
        return static_page({"sessions": listed, "exports": exports})

    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(snapshot(), encoding="utf-8")
        typer.echo(f"{out}: a static snapshot of {url}")
        return
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    async def home(_: Request) -> HTMLResponse:
        return HTMLResponse(snapshot())

    typer.echo(f"tokentape viewer: http://127.0.0.1:{port}/ (sessions of {url}; reload to refresh)", err=True)
    uvicorn.run(Starlette(routes=[Route("/", home)]), host="127.0.0.1", port=port, log_level="warning")


def _trainer_headers(api_key: str | None) -> dict[str, str]:
    """What a trainer's own call carries on a gateway with keys (none: open mode)."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def main() -> None:
    app()


if __name__ == "__main__":
    main()
