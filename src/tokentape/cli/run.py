"""`tokentape run -- <agent command>`: one run of an agent harness, recorded as one session.

It opens a session on a running gateway (with the session's own key), points the command at it
through what the harness reads (`harness_environment`), runs it, and finishes the session with the
command's exit status in its metadata. The session is marked with the harness, so its side calls
(titles, summaries, subagents) go to sessions of their own (`core.episodes`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated

import typer

from tokentape.cli.options import TrainerKey, trainer_headers
from tokentape.cli.root import app

__all__ = ["harness_environment", "harness_of", "run"]

# a harness by its program's name: what tells its side calls apart (core.episodes.HARNESSES_WITH_TOOLS)
_HARNESS_PROGRAMS = {"claude": "claude-code", "codex": "codex", "opencode": "opencode", "mini": "mini-swe-agent"}


def harness_of(command: Sequence[str]) -> str:
    """The harness a command runs, by its program's name (any other program: `agent`)."""
    program = Path(command[0]).name if command else ""
    return _HARNESS_PROGRAMS.get(program, "mini-swe-agent" if program.startswith("mini") else "agent")


def harness_environment(
    gateway: str, session_id: str, key: str, model: str, config_dir: Path, environ: Mapping[str, str]
) -> dict[str, str]:
    """What the harnesses read to find their model server, all set at once (a program reads its
    own and ignores the rest). Settings the user set already are kept, but the base URLs and keys:
    those are what the run is about."""
    base = f"{gateway.rstrip('/')}/sessions/{session_id}"
    env = {
        # the OpenAI SDKs, LiteLLM (mini-swe-agent), and any program that reads them
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_BASE": f"{base}/v1",
        "OPENAI_API_KEY": key,
        # the Anthropic SDKs and Claude Code (which also takes its model names from these)
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": key,
        "TOKENTAPE_SESSION_ID": session_id,
        "TOKENTAPE_SESSION_KEY": key,
    }
    defaults = {
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "MSWEA_MODEL_NAME": f"openai/{model}",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "MSWEA_CONFIGURED": "true",  # else its first run on a machine asks for set-up on the terminal
        "OPENCODE_CONFIG_CONTENT": json.dumps(_opencode_config(f"{base}/v1", model)),
    }
    if "CODEX_HOME" not in environ:  # Codex reads its provider from a config file only
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "config.toml").write_text(_codex_config(f"{base}/v1", model))
        env["CODEX_HOME"] = str(config_dir)
    return {**{k: v for k, v in defaults.items() if k not in environ}, **env}


def _opencode_config(base_url: str, model: str) -> dict[str, object]:
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "tokentape",
        "options": {"baseURL": base_url, "apiKey": "{env:TOKENTAPE_SESSION_KEY}"},
        "models": {model: {"name": model}},
    }
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"tokentape": provider},
        "model": f"tokentape/{model}",
    }


def _codex_config(base_url: str, model: str) -> str:
    return (
        f"model = {json.dumps(model)}\n"
        'model_provider = "tokentape"\n\n'
        "[model_providers.tokentape]\n"
        'name = "tokentape"\n'
        f"base_url = {json.dumps(base_url)}\n"
        'env_key = "TOKENTAPE_SESSION_KEY"\n'
        'wire_api = "responses"\n'
    )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    command: Annotated[list[str], typer.Argument(help="The agent's command line, after `--`.")],
    url: Annotated[str, typer.Option(help="The gateway the agent calls.")] = "http://127.0.0.1:8000",
    session_id: Annotated[str | None, typer.Option(help="The session's id (else the gateway makes one).")] = None,
    group_id: Annotated[str | None, typer.Option(help="The session's group (e.g. a GRPO group).")] = None,
    harness: Annotated[
        str | None, typer.Option(help="The harness (claude-code, codex, opencode, mini-swe-agent); else by program.")
    ] = None,
    api_key: TrainerKey = None,
) -> None:
    """Run an agent harness (Claude Code, Codex, opencode, mini-swe-agent, or any program that reads
    OPENAI_BASE_URL or ANTHROPIC_BASE_URL) as one recorded session, and print how to export it."""
    import httpx

    headers = trainer_headers(api_key)
    name = harness or harness_of(command)
    body: dict[str, object] = {"metadata": {"harness": name, "max_tokens": "clip"}}
    if session_id is not None:
        body["session_id"] = session_id
    if group_id is not None:
        body["group_id"] = group_id
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        created = client.post("/sessions", json=body)
        if created.status_code != 201:
            typer.echo(f"run failed: the gateway answered {created.status_code}: {created.text}", err=True)
            raise typer.Exit(code=1)
        session = created.json()
        models = client.get("/v1/models", headers={"authorization": f"Bearer {session['api_key']}"})
        model = models.json()["data"][0]["id"] if models.status_code == 200 else "tokentape"
    sid = session["session_id"]
    with tempfile.TemporaryDirectory(prefix="tokentape-run-") as scratch:
        env = {
            **os.environ,
            **harness_environment(url, sid, session["api_key"], model, Path(scratch) / "codex", os.environ),
        }
        typer.echo(f"tokentape: session {sid} ({name}) on {url}", err=True)
        try:
            status = subprocess.call(command, env=env)
        except FileNotFoundError:
            typer.echo(f"run failed: no program {command[0]!r}", err=True)
            status = 127
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        finished = client.post(f"/sessions/{sid}/finish", json={"metadata": {"exit_status": status}})
        if finished.status_code != 200:
            typer.echo(f"tokentape: finishing {sid} failed: {finished.text}", err=True)
    summary = finished.json() if finished.status_code == 200 else {}
    typer.echo(
        f"tokentape: session {sid}: exit status {status}, {summary.get('turns', '?')} turns recorded\n"
        f"  export it:  curl -s '{url}/sessions/{sid}/export?output=jsonl' > {sid}.jsonl\n"
        f"  its side calls:  tokentape export {sid}-side.jsonl --url {url} --prefix {sid}.side- --side-calls only",
        err=True,
    )
    sys.exit(status)
