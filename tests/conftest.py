"""Shared fixtures: the embedded model is loaded once per test run and shared.

The suite runs the embedded engine in its sampling-salt mode (`tokentape.engines.sampling_salt`): what
the model samples changes from run to run, as it would on another machine, so no test may rest on a
particular sample. The salt is printed in the header; `TOKENTAPE_SAMPLING_SALT=N` reproduces a run,
`TOKENTAPE_SAMPLING_SALT=` (empty) turns the mode off. Tests marked `numerics` compare logprobs with an
independent computation and run without it."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tokentape.engines import sampling_salt
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
from tokentape.gateway.service import Gateway
from tokentape.render.renderer import Renderer
from tokentape.render.template import ChatTemplate
from tokentape.render.tokenizer import GGUFTokenizer
from tokentape.runtime import embedded_model_path
from tokentape.served import Served, ServeSpec, build_served

MODEL_NAME = "smollm2-135m-instruct"
OUTPUT_DIR = Path(__file__).resolve().parent.parent / "test-output"


def pytest_configure(config: pytest.Config) -> None:
    # Set once, in the controller, before xdist starts its workers (they and every server subprocess
    # inherit it); a salt given by the caller is kept.
    if sampling_salt.SALT_ENV not in os.environ:
        os.environ[sampling_salt.SALT_ENV] = str(secrets.randbelow(2**31))
    if hasattr(config, "workerinput"):
        # xdist runs a worker per core: torch's and OpenMP's own pools of one thread per core in each
        # worker (and the servers it starts) would contend for the same cores, spinning. One thread
        # each (before torch is imported), as each worker's embedded engine runs one: about 10% less
        # time for the trainer tests on 2 cores. A value the caller set is kept.
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files marked `heavy` (a trainer step, a float64 forward: a minute or more each, in few tests)
    go first, each part in the order it was given (pytest-randomly's shuffle is kept). Under xdist's
    `--dist loadfile` a file is one unit: a long one handed out last would leave the other workers
    idle until it ends. `make unit` passes `--no-loadscope-reorder`, or xdist would put the files of
    many tests first and so these last."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


def pytest_report_header(config: pytest.Config) -> str:
    salt = os.environ.get(sampling_salt.SALT_ENV) or "off"
    return f"sampling salt: {salt} (reproduce with {sampling_salt.SALT_ENV}={salt if salt != 'off' else ''})"


@pytest.fixture(autouse=True)
def _numerics_without_jitter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `numerics` test compares recorded logprobs with an independent forward pass: no jitter."""
    if request.node.get_closest_marker("numerics") is not None:
        monkeypatch.delenv(sampling_salt.SALT_ENV, raising=False)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return embedded_model_path()


@pytest.fixture(scope="session")
def f32_model_path(model_path: Path) -> Path:
    """The embedded model with every tensor in F32 (written once per machine, cached): where logprobs
    are compared across kernels with a bound (see BATCHED_F32_BOUND in tests/engines/test_llamacpp.py)."""
    from tokentape.train.weights import f32_gguf

    return f32_gguf(model_path)


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> GGUFTokenizer:
    return GGUFTokenizer(model_path)


@pytest.fixture(scope="session")
def template(tokenizer: GGUFTokenizer) -> ChatTemplate:
    return ChatTemplate(
        tokenizer.metadata["tokenizer.chat_template"],
        bos_token=tokenizer.token_name("tokenizer.ggml.bos_token_id"),
        eos_token=tokenizer.token_name("tokenizer.ggml.eos_token_id"),
    )


@pytest.fixture(scope="session")
def renderer(template: ChatTemplate, tokenizer: GGUFTokenizer) -> Renderer:
    return Renderer(template, tokenizer)


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[LlamaCppEngine]:
    yield LlamaCppEngine(LlamaCppSettings(model_path=model_path, context_length=1024))


@pytest.fixture
def built(engine: LlamaCppEngine, renderer: Renderer) -> Served:
    """A gateway with no sessions yet, on the shared model, and its app: built as `tokentape serve`
    builds them, from a `ServeSpec`."""
    return build_served(ServeSpec(served_model_name=MODEL_NAME), engine=engine, renderer=renderer)


@pytest.fixture(scope="session")
def small_engine(model_path: Path) -> Iterator[LlamaCppEngine]:
    """The shared model with a 256-token context, for the tests that fill a context: they read a
    quarter of the prompt the shared engine's 1024 would take (about 10 ms of CPU a token on 2 cores)."""
    yield LlamaCppEngine(LlamaCppSettings(model_path=model_path, context_length=256))


@pytest.fixture
def small_built(small_engine: LlamaCppEngine, renderer: Renderer) -> Served:
    """`built` on `small_engine`."""
    return build_served(ServeSpec(served_model_name=MODEL_NAME), engine=small_engine, renderer=renderer)


@pytest.fixture
def gateway(built: Served) -> Gateway:
    return built.gateway


@pytest.fixture
async def http(built: Served) -> AsyncIterator[httpx.AsyncClient]:
    """The real ASGI app, called in-process."""
    app = built.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tokentape") as client:
        yield client


@pytest.fixture
def sdk(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The real openai SDK over the in-process app."""
    return openai.AsyncOpenAI(base_url="http://tokentape/v1", api_key="unused", http_client=http, max_retries=0)


def output_dir() -> Path:
    OUTPUT_DIR.mkdir(exist_ok=True)
    return OUTPUT_DIR
