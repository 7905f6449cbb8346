"""verifiers 0.4.0's training client through /inference/v1/generate. verifiers pins openai<3, so it
runs in its own virtualenv, created on first use from PyPI and kept per machine, as the llama.cpp
wheel is (~/.cache/tokentape/venv-verifiers-<pins>: a fresh clone does not pay for it again)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.clients.conftest import API_KEY, export
from tests.conftest import output_dir
from tests.support.wire import Turn, assert_on_tape
from tokentape.launcher import RunningServer
from tokentape.render.tokenizer import GGUFTokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.heavy]

VERIFIERS = ["verifiers==0.4.0", "gguf==0.19.0"]  # gguf: to read the model's vocabulary
SCRIPT = Path(__file__).with_name("verifiers_train_client.py")


def _venv() -> Path:
    pins = hashlib.sha1(" ".join([*VERIFIERS, sys.version]).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokentape"
    target = cache / f"venv-verifiers-{pins}"
    python = target / "bin" / "python"
    stamp = target / ".installed"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f"venv-verifiers-{pins}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two checkouts testing at once build it once
        if not stamp.exists():
            venv.create(target, with_pip=True, clear=True)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", *VERIFIERS], check=True, timeout=1200)
            stamp.write_text(" ".join(VERIFIERS))
    return python


@pytest.mark.timeout(1800)
def test_verifiers_training_client_is_recorded_exactly(server: RunningServer, model: str, model_path: Path) -> None:
    python = _venv()
    template = output_dir() / "smollm2-template.jinja"
    template.write_text(GGUFTokenizer(model_path).metadata["tokenizer.chat_template"])
    work = output_dir() / "verifiers-work"
    work.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TOKENTAPE_TEST_KEY": API_KEY}
    done = subprocess.run(
        [str(python), str(SCRIPT), server.base_url, "verifiers", model, str(model_path), str(template), str(work)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 2 and all(r["completion_ids"] for r in results)
    tape = export(server, "verifiers")
    turns = [Turn(r["prompt_ids"], r["completion_ids"], r["completion_logprobs"]) for r in results]
    assert_on_tape(tape, turns)
    # its X-Session-ID (an eval trace id) did not split the session: the base URL named it
    assert all(trace == "vf-trace-1" for branch in tape["branches"] for trace in branch["trace_ids"])
