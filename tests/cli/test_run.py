"""`tokentape run -- <command>`: the command's calls, through whatever base URL variable it reads,
land in one session, finished with the command's exit status. The command here is a small program
on the real `openai` and `anthropic` SDKs (the harnesses themselves: `make e2e-harnesses`); the engine
is a scripted one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.fake_engines import serving
from tests.support.served import build
from tokentape.cli.run import harness_environment, harness_of
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer

TOKENTAPE = Path(sys.executable).with_name("tokentape")

AGENT = textwrap.dedent(
    """
    import os, sys
    import anthropic, openai

    chat = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL, OPENAI_API_KEY
    model = os.environ["ANTHROPIC_MODEL"]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Hi"}]
    reply = chat.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=4)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    messages.append({"role": "user", "content": "More"})
    chat.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=4)
    # a side call: no tools
    chat.chat.completions.create(model=model, messages=[{"role": "user", "content": "Title?"}], max_tokens=4)
    messages_api = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY
    messages_api.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "Hello"}])
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture
def gateway_url(renderer: Renderer) -> Iterator[str]:
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    with serving(build(ScriptedEngine(renderer.tokenizer.encode("Ok."), end), renderer).app) as url:
        yield url


@pytest.mark.parametrize("status", [0, 3])
def test_a_run_is_one_session_finished_with_the_commands_exit_status(
    gateway_url: str, tmp_path: Path, status: int
) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    done = subprocess.run(
        [str(TOKENTAPE), "run", "--url", gateway_url, "--session-id", f"run-{status}", "--harness", "opencode", "--",
         sys.executable, str(agent), str(status)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == status, done.stderr
    assert f"session run-{status}" in done.stderr and f"/sessions/run-{status}/export" in done.stderr
    summary = httpx.get(f"{gateway_url}/sessions/run-{status}").json()
    assert summary["metadata"]["exit_status"] == status and summary["finished"] is True
    assert (summary["turns"], summary["branches"]) == (2, 1)  # the two chat turns, one path
    sessions = {s["session_id"]: s for s in httpx.get(f"{gateway_url}/sessions").json()["data"]}
    sides = [s for s in sessions.values() if s["metadata"].get("side_of") == f"run-{status}"]
    # the title call and the Messages call (another system prompt: none) are side calls, finished too
    assert len(sides) == 2 and all(s["finished"] for s in sides)


def test_a_missing_program_is_127_and_the_session_still_finishes(gateway_url: str) -> None:
    done = subprocess.run(
        [str(TOKENTAPE), "run", "--url", gateway_url, "--session-id", "nothing", "--", "no-such-program-here"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 127
    assert httpx.get(f"{gateway_url}/sessions/nothing").json()["metadata"]["exit_status"] == 127


def test_what_each_harness_reads_points_at_the_session(tmp_path: Path) -> None:
    env = harness_environment("http://gw:8000/", "s1", "tts.s1.k", "m", tmp_path / "codex", {"ANTHROPIC_MODEL": "mine"})
    assert env["OPENAI_BASE_URL"] == "http://gw:8000/sessions/s1/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://gw:8000/sessions/s1"  # the SDK adds /v1/messages
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == "tts.s1.k"
    assert "ANTHROPIC_MODEL" not in env  # the user's own setting is kept
    config = (tmp_path / "codex" / "config.toml").read_text()
    assert 'base_url = "http://gw:8000/sessions/s1/v1"' in config and 'wire_api = "responses"' in config
    assert [harness_of([p]) for p in ("/usr/bin/claude", "codex", "opencode", "mini", "python")] == [
        "claude-code",
        "codex",
        "opencode",
        "mini-swe-agent",
        "agent",
    ]
