"""A real vLLM for the end-to-end tests: its CPU build from PyPI, in its own virtualenv (`make e2e-vllm`
makes it and names its Python in TOKENTAPE_VLLM_PYTHON), serving the embedded SmolLM2 model
converted from the GGUF to a safetensors directory. Without that variable these tests are skipped:
they take minutes, so `make test` does not run them. TOKENTAPE_VLLM_URL points them at a vLLM already
serving the converted model with the flags below, to iterate without restarting it.

Between the gateways and vLLM sits a recording proxy (a test instrument) that keeps what vLLM sent,
so the tape is compared with vLLM's own answers; the gateway used for the throughput figures talks
to vLLM directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fake_engines import serving
from tests.support.recording_proxy import RecordingProxy
from tokentape.engines.remote.vllm import LORA_NAME
from tokentape.launcher import RunningServer, free_port, running_server
from tokentape.runtime import embedded_model_path

VLLM_PYTHON = os.environ.get("TOKENTAPE_VLLM_PYTHON")
# A vLLM already serving the converted model (with the flags below) is used instead of starting one.
VLLM_URL = os.environ.get("TOKENTAPE_VLLM_URL")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CACHE = ROOT / ".cache" / "vllm"
OUTPUT = ROOT / "test-output"
MODEL = "smollm2-135m-instruct"
KINDS = ("vllm", "vllm-generate")
CONTEXT = 4096
# An explicit KV cache: without it vLLM's CPU backend reserves 92% of the machine's memory and
# refuses to start when other processes hold some of it. 512 MiB holds ~20k tokens of this model.
KV_CACHE_BYTES = 512 * 2**20
START_TIMEOUT = 600.0  # seconds; about 30 on an idle 2-core machine, several times that under load

FIGURES: dict[str, Any] = {}  # measured figures, printed at the end of the run


@dataclass(frozen=True, slots=True)
class VLLMServer:
    url: str
    model_dir: Path
    start_seconds: float

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges, keyed by name and labels as printed."""
        values: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                values[key] = float(value)
        return values

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric over the series whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            series, _, rest = key.partition("{")
            if series == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("real vLLM (CPU build): figures")
    for name, value in FIGURES.items():
        terminalreporter.write_line(f"{name}: {value}")
    OUTPUT.mkdir(exist_ok=True)
    (OUTPUT / "vllm-figures.json").write_text(json.dumps(FIGURES, indent=2) + "\n")


def _vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VLLM_HOST_IP="127.0.0.1",  # vLLM's own sockets between its processes stay on loopback
        VLLM_LOOPBACK_IP="127.0.0.1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


@pytest.fixture(scope="session")
def vllm_model_dir() -> Path:
    """The embedded GGUF as a Hugging Face directory, converted once and cached (~540 MB)."""
    assert VLLM_PYTHON
    gguf = embedded_model_path()
    target = CACHE / gguf.stem
    if not (target / "model.safetensors").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [VLLM_PYTHON, str(HERE / "convert_gguf.py"), str(gguf), str(target)],
            check=True,
            env=_vllm_env(),
            timeout=900,
            stdout=subprocess.DEVNULL,
        )
    return target


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir: Path) -> Iterator[VLLMServer]:
    assert VLLM_PYTHON
    if VLLM_URL:
        yield VLLMServer(VLLM_URL.rstrip("/"), vllm_model_dir, 0.0)
        return
    with _launched(vllm_model_dir, "vllm-serve.log") as server:
        FIGURES["vLLM start (s, --enforce-eager)"] = round(server.start_seconds, 1)
        yield server


@pytest.fixture(scope="session")
def _vllm_lora_process(vllm_model_dir: Path) -> Iterator[VLLMServer]:
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with _launched(vllm_model_dir, "vllm-lora-serve.log", ["--enable-lora", "--max-lora-rank", "8"], env) as server:
        # vLLM builds its OpenAPI schema on the first request for it (seconds under load): done here,
        # not inside the first timed weight update
        httpx.get(f"{server.url}/openapi.json", timeout=300).raise_for_status()
        yield server


@pytest.fixture
def vllm_lora_server(_vllm_lora_process: VLLMServer) -> VLLMServer:
    """A second vLLM that takes new weights at run time: LoRA adapters (rank up to 8) loaded in place,
    and the dev-mode routes (pause, resume, prefix-cache reset, collective RPC). Shared by the tests,
    each of which starts on the base model: an adapter an earlier test left loaded is unloaded (an
    engine that finds it among vLLM's models generates under it)."""
    server = _vllm_lora_process
    httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": LORA_NAME}, timeout=60)  # 4xx: none
    served = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]
    assert LORA_NAME not in served, served
    return server


@contextlib.contextmanager
def _launched(
    model_dir: Path,
    log_name: str,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    *,
    model: str = MODEL,
    context: int = CONTEXT,
    kv_cache_bytes: int = KV_CACHE_BYTES,
) -> Iterator[VLLMServer]:
    assert VLLM_PYTHON
    port = free_port()
    OUTPUT.mkdir(exist_ok=True)
    log_path = OUTPUT / log_name
    command = [
        VLLM_PYTHON,
        str(HERE / "launch_vllm.py"),
        "serve",
        str(model_dir),
        "--served-model-name",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",  # no graph compilation: starts in about 30 s
        "--logprobs-mode",
        "processed_logprobs",  # temperature-scaled logprobs, like the embedded engine's
        "--enable-scale-out",  # adds /inference/v1/generate
        "--max-model-len",
        str(context),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        *extra,
    ]
    started = time.monotonic()
    with log_path.open("wb") as log:
        # its own process group: vLLM starts an engine-core process that must go with it
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**_vllm_env(), **(env or {})}, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(process, url, log_path)
            yield VLLMServer(url, model_dir, time.monotonic() - started)
        finally:
            _stop_group(process)


def _wait_healthy(process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited early; its log:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"vLLM did not answer within {START_TIMEOUT:.0f} s; see {log_path}")


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with contextlib.suppress(ProcessLookupError):  # an engine-core child left behind
        os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def proxy(vllm_server: VLLMServer) -> Iterator[tuple[str, RecordingProxy]]:
    recorder = RecordingProxy(vllm_server.url)
    with serving(recorder) as url:  # type: ignore[arg-type]
        yield url, recorder


def _gateway(
    spec: str, model_dir: Path, weights_dir: Path | None = None
) -> contextlib.AbstractContextManager[RunningServer]:
    """`weights_dir`: where the adapters it may load are (serve refuses any other directory)."""
    args = ["--engine", spec, "--tokenizer", str(model_dir), "--store", ":memory:"]
    args += ["--weights-dir", str(weights_dir)] if weights_dir is not None else []
    OUTPUT.mkdir(exist_ok=True)
    kind = spec.partition("=")[0]
    return running_server(args, log_path=OUTPUT / f"tokentape-{kind}-{free_port()}.log")


@pytest.fixture(scope="session")
def gateways(proxy: tuple[str, RecordingProxy], vllm_model_dir: Path) -> Iterator[dict[str, RunningServer]]:
    """One `tokentape serve` per adapter, each in front of vLLM through the recording proxy."""
    url, _ = proxy
    with contextlib.ExitStack() as stack:
        yield {
            kind: stack.enter_context(_gateway(f"{kind}={url},logprobs-mode=processed_logprobs", vllm_model_dir))
            for kind in KINDS
        }


@pytest.fixture(scope="session")
def direct_gateway(vllm_server: VLLMServer, vllm_model_dir: Path) -> Iterator[RunningServer]:
    """`tokentape serve --engine vllm=URL` straight to vLLM, for the throughput figures."""
    with _gateway(f"vllm={vllm_server.url},logprobs-mode=processed_logprobs", vllm_model_dir) as server:
        yield server
