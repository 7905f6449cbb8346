"""The deployment recipes name only what exists: every `tokentape serve` option in the Deploy page's
commands, the Dockerfile's entry point and the systemd unit is an option of `tokentape serve`, and
the unit is one systemd can read."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
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
    others |= {"--stop-timeout", "--add-host", "--network", "--user"}
    assert prose <= _serve_options() | others, prose - _serve_options() - others


def test_the_dockerfile_and_the_unit_start_serve_with_real_options() -> None:
    script, *words = _entrypoint()  # the entry point script runs `tokentape serve ...` in its place
    assert (
        script == "tokentape-entrypoint"
        and "COPY deploy/docker-entrypoint.sh /usr/local/bin/tokentape-entrypoint" in (ROOT / "Dockerfile").read_text()
    )
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


def _entrypoint() -> list[str]:
    dockerfile = (ROOT / "Dockerfile").read_text()
    entry = re.search(r"^ENTRYPOINT (\[.*?\])$", dockerfile, re.M | re.S)
    assert entry is not None
    return [w.strip(' "\\\n') for w in entry.group(1).strip("[]").split(",")]


def _option(words: list[str], name: str) -> str:
    """The last value given to `name` (`--name value` or `--name=value`): click keeps the last."""
    values = [words[i + 1] for i, w in enumerate(words[:-1]) if w == name]
    values += [w.split("=", 1)[1] for w in words if w.startswith(name + "=")]
    assert values, name
    return values[-1]


def test_the_image_drains_within_docker_stops_timeout() -> None:
    """`docker stop` kills 10 s after SIGTERM: the image's drain ends before that."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^STOPSIGNAL SIGTERM$", dockerfile, re.M)
    assert int(_option(_entrypoint(), "--drain-seconds")) < 10


def test_compose_starts_the_gateway_in_front_of_its_vllm_and_stops_it_after_the_drain() -> None:
    import yaml

    compose = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
    vllm, gateway = compose["services"]["vllm"], compose["services"]["tokentape"]
    command = [str(w) for w in gateway["command"]]
    # every option is one of serve's, and an option given there replaces the image's
    assert {w.split("=", 1)[0] for w in command} <= _serve_options()
    words = _entrypoint()[1:] + command  # after the entry point script: `tokentape serve ...`, then Compose's
    engine = _option(words, "--engine")
    vllm_port = _option([str(w) for w in vllm["command"]], "--port")
    assert engine.startswith(f"vllm=http://vllm:{vllm_port},")  # the service name, the port vLLM listens on
    assert vllm_port == "8001" and "ports" not in vllm  # as the Deploy page says; only the gateway reaches it
    assert gateway["depends_on"]["vllm"]["condition"] == "service_healthy"
    grace = int(str(gateway["stop_grace_period"]).removesuffix("s"))
    assert grace > int(_option(words, "--drain-seconds"))
    assert gateway["build"] == ".." and "tokentape-data:/data" in gateway["volumes"]
    # the tokenizer is the engine's own model directory, mounted in both
    model = _option(words, "--tokenizer")
    assert model == next(w for w in vllm["command"] if str(w).startswith("/models/"))


def test_the_dockerfile_and_the_deploy_page_give_vllm_one_port() -> None:
    ports = set(re.findall(r"vllm(?:-host)?:(\d+)", (ROOT / "Dockerfile").read_text()))
    page = (ROOT / "docs/guides/deploy.md").read_text()
    ports |= set(re.findall(r"vllm=http://[\w.-]+:(\d+)", page))
    ports |= set(re.findall(r"vllm serve \S+ --port (\d+)", page))
    assert ports == {"8001"}


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="runs the script as another user")
def test_the_entrypoint_refuses_a_data_directory_it_cannot_write_and_says_how() -> None:
    """As the image's user (not root), the entry point on a root-owned directory exits 1 with the fixes;
    on one it can write, it runs the command it was given in its own place."""
    script = ROOT / "deploy/docker-entrypoint.sh"
    data = Path(tempfile.mkdtemp(prefix="tokentape-data-"))  # root's, as a host directory mounted at /data
    data.chmod(0o755)  # (under /tmp, which the other user can reach; pytest's own tmp_path is root's alone)
    as_nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "sh", str(script)]
    env = {"PATH": os.environ["PATH"], "TOKENTAPE_DATA_DIR": str(data), "HOME": "/nonexistent"}
    refused = subprocess.run([*as_nobody, "echo", "started"], capture_output=True, text=True, env=env, timeout=30)
    assert refused.returncode == 1 and "started" not in refused.stdout
    assert f"cannot write to {data} (owned by uid:gid 0:0" in refused.stderr
    assert "--user 0:0" in refused.stderr and "chown -R 65534:65534" in refused.stderr
    data.chmod(0o777)
    started = subprocess.run(
        [*as_nobody, "sh", "-c", 'echo "started $$ $HOME"'], capture_output=True, text=True, env=env, timeout=30
    )
    assert started.returncode == 0, started.stderr
    assert started.stdout.split()[0] == "started" and started.stdout.split()[2] == "/tmp/tokentape-home"
    assert list(data.iterdir()) == []  # the write check leaves nothing behind
    data.rmdir()
