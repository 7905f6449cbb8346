"""The deployment recipes name only what exists: every `tokentape serve` option in the Deploy page's
commands, the Dockerfile's entry point and the systemd unit is an option of `tokentape serve`, and
the unit is one systemd can read."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import typer

from tokentape.cli import app as cli_app

ROOT = Path(__file__).resolve().parents[2]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _serve_options() -> set[str]:
    serve = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
    return {opt for param in serve.params for opt in [*param.opts, *param.secondary_opts]}


def _commands(text: str) -> list[str]:
    """Shell commands with their continuation lines joined."""
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def _gateway_options(command: str) -> set[str]:
    """The options given to tokentape in one command: after `tokentape serve`, or after the image
    name in a `docker run ... tokentape --option` line."""
    found = re.search(r"\btokentape serve\b|\btokentape(?= --)", command)
    return set(OPTION.findall(command[found.end() :])) if found else set()


def test_every_serve_option_the_deploy_page_names_exists() -> None:
    page = (ROOT / "docs/guides/deploy.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    named = {opt for block in blocks for line in _commands(block) for opt in _gateway_options(line)}
    assert {"--host", "--engine", "--tokenizer", "--store", "--weights-dir", "--session-keys"} <= named
    assert named <= _serve_options(), named - _serve_options()
    # options mentioned in the page's prose and tables, where they are written as `--option`
    prose = set(OPTION.findall(re.sub(r"```.*?```", "", page, flags=re.S)))
    # docker's, pip's, vLLM's
    others = {"--build-arg", "--env-file", "--no-cache-dir", "--logprobs-mode", "--mm-processor-cache-gb"}
    assert prose <= _serve_options() | others, prose - _serve_options() - others


def test_the_dockerfile_and_the_unit_start_serve_with_real_options() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    entry = re.search(r"^ENTRYPOINT (\[.*?\])$", dockerfile, re.M | re.S)
    assert entry is not None
    words = [w.strip(' "\\\n') for w in entry.group(1).strip("[]").split(",")]
    assert words[:2] == ["tokentape", "serve"]
    assert {w for w in words if w.startswith("--")} <= _serve_options()
    unit = (ROOT / "deploy/tokentape.service").read_text()
    [exec_start] = [line for line in _commands(unit) if line.startswith("ExecStart=")]
    assert "tokentape serve" in exec_start
    assert _gateway_options(exec_start) <= _serve_options()
    assert "TOKENTAPE_API_KEYS" in (ROOT / "deploy/env.example").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_reads_the_unit(tmp_path: Path) -> None:
    unit = tmp_path / "tokentape.service"
    # the binary it starts is not installed here: point it at one that is, and read the rest as written
    text = (ROOT / "deploy/tokentape.service").read_text()
    unit.write_text(text.replace("/opt/tokentape/bin/tokentape", shutil.which("true") or "/bin/true"))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in done.stderr.splitlines() if "tokentape.service" in line]
    assert not problems, done.stderr


def test_the_image_build_context_holds_what_the_wheel_is_built_from() -> None:
    """The Dockerfile copies, and .dockerignore lets through, every file pyproject.toml builds from."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {project["readme"], *project["license-files"], "pyproject.toml", "src"}
    kept = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert needed <= kept, needed - kept
    copied = {
        word.rstrip("/")
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from" not in line
        for word in line.split()[1:-1]
    }
    assert needed <= copied, needed - copied
