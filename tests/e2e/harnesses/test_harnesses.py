"""Today's coding-agent harnesses, unmodified, against a live gateway: one two-turn tool episode each.

The gateway runs in uvicorn on a loopback port over Qwen2.5's real tokenizer and chat template, with
a scripted engine that records every prompt it is sent and answers from what the prompt holds:
a call that offers tools and holds no tool result gets a Hermes tool call of the harness's shell tool
(`<tool_call>{"name": .., "arguments": ..}</tool_call>`, as Qwen samples it), one that holds a tool
result gets the final answer, and one that offers no tools (a side call: a title) gets a short text.
Each harness runs as a user runs it (`claude -p`, `codex exec`, `opencode run`, `mini`), configured
through its own environment and config files, in a scratch directory and a private HOME.

For each run: the harness exits 0 and its tool really ran (out.txt holds "hello"); the gateway
holds the expected sessions (one for the episode, and one per kind of side call); and the
episode's exported branch is, token for token, the last prompt the engine received plus what it
sampled, with the earlier turn's prompt and sampled tokens as its prefix and the loss mask on
exactly the sampled tokens.

Opt-in: `make e2e-harnesses` installs the pinned harnesses (tests/e2e/harnesses/install.py) and
sets TOKENTAPE_HARNESSES; without it, or for a harness not installed, the tests skip. A failing run
shows the harness's output and every request the gateway refused (status and error body);
TOKENTAPE_HARNESS_LOGS=<folder> keeps each harness's HOME (its own logs) after its run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.e2e.harnesses.install import HARNESSES, ROOT_ENV, Harness
from tests.support.fake_engines import serving
from tests.support.models import materialise
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.runtime import hf_renderer
from tokentape.served import ServeSpec, build_served

ONLY_ENV = "TOKENTAPE_HARNESSES_ONLY"  # e.g. "codex": the others skip (make unit runs Codex's, the quickest)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get(ROOT_ENV), reason=f"opt-in: make e2e-harnesses (sets {ROOT_ENV})"),
    pytest.mark.timeout(300),
]

MODEL = "qwen"
TASK = "Create a file out.txt containing hello, using the shell."
COMMAND = "echo hello > out.txt"
FINAL = "I wrote hello to out.txt."
TITLE = "Hello file"
RUN_TIMEOUT = 180
RUN_SESSION = "harness-run"  # the session `tokentape run` opens
LOGS_ENV = "TOKENTAPE_HARNESS_LOGS"  # a folder: each harness's HOME is copied there after its run


# -- the engine -------------------------------------------------------------------------------------
@dataclass
class EngineCall:
    prompt: list[int]
    sampled: list[int]
    kind: str  # "tool call", "answer" or "side"


class ReadingEngine(ScriptedEngine):
    """A scripted engine that answers from what its prompt holds and records every call."""

    def __init__(self, renderer: Renderer, answers: Callable[[str, str], str]) -> None:
        self.renderer = renderer
        end = renderer.tokenizer.encode("<|im_end|>")
        super().__init__([], end[0])
        self.answers = answers  # (kind, prompt text) -> the text to sample
        self.recorded: list[EngineCall] = []

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
    ) -> AsyncGenerator[SampledToken, None]:
        text = self.renderer.tokenizer.decode_all(prompt)
        kind = "side" if "<tools>" not in text else "answer" if "<tool_response>" in text else "tool call"
        tokens = [*self.renderer.tokenizer.encode(self.answers(kind, text)), self.end_of_turn]
        if params.max_tokens is not None:
            tokens = tokens[: params.max_tokens]
        self.recorded.append(EngineCall(list(prompt), tokens, kind))
        self.push(tokens)
        async for token in super().generate(prompt, params, seed=seed, session_id=session_id, constraint=constraint):
            yield token


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- what the gateway refused -----------------------------------------------------------------------
@dataclass
class Refusal:
    method: str
    path: str
    status: int
    body: str


class RefusalLog:
    """ASGI middleware: keeps the status and body of every response of 400 and above."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.refusals: list[Refusal] = []
        self.requests: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.requests.append(f"{scope['method']} {scope['path']}")
        status, chunks = 0, []

        async def keep(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400:
                chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, keep)
        if status >= 400:
            body = b"".join(chunks).decode(errors="replace")
            self.refusals.append(Refusal(scope["method"], scope["path"], status, body[:2000]))


# -- the harnesses ----------------------------------------------------------------------------------
@dataclass
class Run:
    """How one harness is run: its command line and environment (config files written in `home`)."""

    argv: list[str]
    env: dict[str, str]
    side_sessions: int = 0  # the side calls it makes that get sessions of their own


@dataclass
class Case:
    harness: Harness
    tool: str  # its shell tool's name
    arguments: dict[str, Any]  # turn 1's arguments for it
    prepare: Callable[[Harness, str, Path], Run]
    session: str  # the episode's session id, as a pattern: the harness's own id, or the base URL's
    under_run: Callable[[Harness, Path], Run]  # its command and environment under `tokentape run`
    final: Callable[[], str] = field(default=lambda: FINAL)  # turn 2's text


def _base_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TERM": "dumb", "NO_COLOR": "1"}


def claude_code(harness: Harness, url: str, home: Path) -> Run:
    env = _base_env(home) | {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "sk-ant-unused",
        # it asks for claude-* models by default, which the gateway does not serve (404 not_found_error)
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    return Run([str(harness.executable), "-p", TASK, "--allowedTools", "Bash"], env)


def codex(harness: Harness, url: str, home: Path) -> Run:
    codex_home = home / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "tokentape"\napproval_policy = "never"\n'
        'sandbox_mode = "danger-full-access"\ncheck_for_update_on_startup = false\n\n'
        "[analytics]\nenabled = false\n\n"
        f'[model_providers.tokentape]\nname = "tokentape"\nbase_url = "{url}/v1"\n'
        'wire_api = "responses"\nenv_key = "TOKENTAPE_KEY"\n'
    )
    env = _base_env(home) | {"CODEX_HOME": str(codex_home), "TOKENTAPE_KEY": "unused"}
    return Run([str(harness.executable), "exec", "--skip-git-repo-check", TASK], env)


def opencode(harness: Harness, url: str, home: Path) -> Run:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"bash": "allow", "edit": "allow"},
        "provider": {
            "tokentape": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "tokentape",
                "options": {"baseURL": f"{url}/v1", "apiKey": "unused"},
                "models": {MODEL: {"name": MODEL, "tool_call": True}},
            }
        },
        "model": f"tokentape/{MODEL}",
        "small_model": f"tokentape/{MODEL}",
    }
    (home / ".config" / "opencode").mkdir(parents=True)
    (home / ".config" / "opencode" / "opencode.json").write_text(json.dumps(config))
    env = _opencode_env(home)
    # its title request (no tools, sent beside turn 1) is a side call: a session of its own
    return Run([str(harness.executable), "run", TASK], env, side_sessions=1)


def _opencode_env(home: Path) -> dict[str, str]:
    """opencode's directories in the scratch home, and none of its own downloads or updates."""
    return _base_env(home) | {
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    }


def mini_swe_agent(harness: Harness, url: str, home: Path) -> Run:
    # it sends no session id of its own: it is pointed at a session's base URL
    base = f"{url}/sessions/mini-swe-agent-run/v1"
    env = _base_env(home) | {
        "OPENAI_API_KEY": "unused",
        "MSWEA_CONFIGURED": "true",  # else it asks for a model interactively
        "MSWEA_COST_TRACKING": "ignore_errors",  # no price for a local model
        "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    argv = [str(harness.executable), "-m", f"openai/{MODEL}", "-t", TASK, "--yolo", "--exit-immediately"]
    argv += ["--cost-limit", "0", "-c", "mini.yaml", "-c", f"model.model_kwargs.api_base={base}"]
    return Run(argv, env)


UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def claude_code_under_run(harness: Harness, home: Path) -> Run:
    return Run([str(harness.executable), "-p", TASK, "--allowedTools", "Bash"], _base_env(home))


def codex_under_run(harness: Harness, home: Path) -> Run:
    # the run writes its provider into a CODEX_HOME of its own; sandbox and approvals are the user's
    argv = [str(harness.executable), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    return Run([*argv, TASK], _base_env(home))


def opencode_under_run(harness: Harness, home: Path) -> Run:
    env = _opencode_env(home)
    return Run([str(harness.executable), "run", TASK], env, side_sessions=1)


def mini_swe_agent_under_run(harness: Harness, home: Path) -> Run:
    env = _base_env(home) | {"MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    argv = [str(harness.executable), "-t", TASK, "--yolo", "--exit-immediately", "--cost-limit", "0"]
    return Run(argv, env)


SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent ends its episode on this command

CASES = {
    # X-Claude-Code-Session-Id
    "claude-code": Case(
        HARNESSES["claude-code"], "Bash", {"command": COMMAND}, claude_code, UUID, claude_code_under_run
    ),
    # session-id / thread-id headers, prompt_cache_key
    "codex": Case(HARNESSES["codex"], "exec_command", {"cmd": COMMAND}, codex, UUID, codex_under_run),
    # its x-session-id header
    "opencode": Case(HARNESSES["opencode"], "bash", {"command": COMMAND}, opencode, r"ses_\w+", opencode_under_run),
    # its episode ends with a tool call, not text: the submit command (which it does not run)
    "mini-swe-agent": Case(
        HARNESSES["mini-swe-agent"],
        "bash",
        {"command": COMMAND},
        mini_swe_agent,
        "mini-swe-agent-run",
        mini_swe_agent_under_run,
        final=lambda: f"Done.\n{hermes_call('bash', {'command': SUBMIT})}",
    ),
}


# -- the test ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialise("qwen2.5", tmp_path_factory.mktemp("models"))


@dataclass
class Served:
    url: str
    engine: ReadingEngine
    log: RefusalLog
    took: float = 0.0  # seconds the last harness run took


@pytest.fixture
def served(request: pytest.FixtureRequest, qwen_dir: Path) -> Iterator[Served]:
    case: Case = CASES[request.param]
    renderer = hf_renderer(qwen_dir)

    def answers(kind: str, _: str) -> str:
        if kind == "tool call":
            return hermes_call(case.tool, case.arguments)
        return case.final() if kind == "answer" else TITLE

    engine = ReadingEngine(renderer, answers)
    built = build_served(ServeSpec(served_model_name=MODEL), engine=engine, renderer=renderer, owns_gateway=True)
    log = RefusalLog(built.app)
    with serving(log) as url:
        yield Served(url, engine, log)


def _report(result: subprocess.CompletedProcess[str] | None, served: Served, note: str = "") -> str:
    lines = [note] if note else []
    if result is not None:
        lines += [
            f"exit status {result.returncode}",
            f"stdout: {result.stdout[-3000:]}",
            f"stderr: {result.stderr[-3000:]}",
        ]
    lines += [f"requests: {served.log.requests}"]
    lines += [f"refused: {r.method} {r.path} -> {r.status} {r.body}" for r in served.log.refusals]
    lines += [f"engine calls: {[(c.kind, len(c.prompt), len(c.sampled)) for c in served.engine.recorded]}"]
    return "\n".join(lines)


def _run(case: Case, served: Served, tmp_path: Path, how: str) -> tuple[Run, Path, subprocess.CompletedProcess[str]]:
    """Run the harness (`how`: "alone", configured for the gateway, or "under run", through
    `tokentape run`) in a scratch directory; its Run, that directory, and what it did."""
    only = os.environ.get(ONLY_ENV)
    if only and case.harness.name not in only.split(","):
        pytest.skip(f"{case.harness.name}: only {only} run here ({ONLY_ENV}; all four: make e2e-harnesses)")
    if not case.harness.installed:
        pytest.skip(f"{case.harness.name} {case.harness.version} is not installed (make e2e-harnesses)")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    if how == "alone":
        run = case.prepare(case.harness, served.url, home)
        argv = run.argv
    else:
        run = case.under_run(case.harness, home)
        argv = [sys.executable, "-m", "tokentape", "run", "--url", served.url, "--session-id", RUN_SESSION]
        argv += ["--", *run.argv]
    start = time.monotonic()
    try:
        result = subprocess.run(
            argv, cwd=work, env=run.env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        pytest.fail(_report(None, served, f"{case.harness.name} did not finish in {RUN_TIMEOUT} s"))
    served.took = time.monotonic() - start
    if os.environ.get(LOGS_ENV):  # keep what the harness wrote in its HOME (opencode's log, Codex's sessions)
        keep = Path(os.environ[LOGS_ENV]) / f"{case.harness.name}-{how.replace(' ', '-')}"
        shutil.copytree(home, keep, symlinks=True, dirs_exist_ok=True)
    return run, work, result


def _check_episode(
    case: Case, served: Served, run: Run, work: Path, result: subprocess.CompletedProcess[str], session: str
) -> dict[str, Any]:
    """Everything a run must show (see the module's docstring); the episode session's summary."""
    report = _report(result, served, f"{case.harness.name} ran {served.took:.1f} s")
    assert result.returncode == 0, report
    assert (work / "out.txt").read_text() == "hello\n", report
    assert not served.log.refusals, report

    calls = served.engine.recorded
    episode = [c for c in calls if c.kind != "side"]
    assert [c.kind for c in episode] == ["tool call", "answer"], report
    (first, second) = episode
    # turn 2's prompt extends turn 1's prompt and what it sampled, token for token
    head = first.prompt + first.sampled
    assert second.prompt[: len(head)] == head, report

    with httpx.Client(base_url=served.url, timeout=30) as client:
        listed = client.get("/sessions").json()["data"]
        exports = {s["session_id"]: client.get(f"/sessions/{s['session_id']}/export").json() for s in listed}
    summaries = {s["session_id"]: s for s in listed}

    def holding(tokens: list[int]) -> list[str]:
        return [sid for sid, export in exports.items() if any(b["tokens"] == tokens for b in export["branches"])]

    expected_tape = second.prompt + second.sampled
    shapes = {sid: [len(b["tokens"]) for b in e["branches"]] for sid, e in exports.items()}
    report += f"\nsessions (tokens per branch): {shapes}"
    episodes = holding(expected_tape)
    assert len(episodes) == 1, report
    assert len(listed) == 1 + run.side_sessions, report
    assert re.fullmatch(session, episodes[0]), f"{report}\nthe episode's session: {episodes[0]}"
    (branch,) = exports[episodes[0]]["branches"]
    sampled_at = {*range(len(first.prompt), len(head)), *range(len(second.prompt), len(expected_tape))}
    assert [i for i, m in enumerate(branch["loss_mask"]) if m] == sorted(sampled_at), report
    # each side call is recorded too, whole, in a session other than the episode's
    sides = [c for c in calls if c.kind == "side"]
    assert len(sides) >= run.side_sessions, report
    for side in sides:
        held = holding(side.prompt + side.sampled)
        assert held and episodes[0] not in held, report
    return dict(summaries[episodes[0]])


@pytest.mark.parametrize("served", list(CASES), indirect=True)
def test_harness_episode_is_on_the_tape(served: Served, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The harness alone, configured for the gateway: its own session id names the session."""
    case = CASES[request.node.callspec.params["served"]]
    run, work, result = _run(case, served, tmp_path, "alone")
    _check_episode(case, served, run, work, result, case.session)


@pytest.mark.parametrize("served", list(CASES), indirect=True)
def test_harness_under_tokentape_run(served: Served, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """`tokentape run -- <harness>` with nothing configured but what the user chooses (permissions):
    the run's session holds the episode and, finished, the harness's exit status."""
    case = CASES[request.node.callspec.params["served"]]
    run, work, result = _run(case, served, tmp_path, "under run")
    summary = _check_episode(case, served, run, work, result, re.escape(RUN_SESSION))
    with httpx.Client(base_url=served.url, timeout=30) as client:
        session = client.get(f"/sessions/{RUN_SESSION}").json()
    assert session["finished"], session
    assert session["metadata"]["exit_status"] == 0, session
    assert summary["turns"] == 2, summary
