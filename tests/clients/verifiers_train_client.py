"""Run inside a virtualenv that has verifiers 0.4.0 (it pins openai<3, so not the project's): drive
verifiers' training client, which renders tokens itself and posts them to the token route, against a
running tokentape server, and print what the client returned as JSON.

usage: python verifiers_train_client.py BASE_URL SESSION MODEL GGUF TEMPLATE_FILE WORK_DIR
(the API key comes in TOKENTAPE_TEST_KEY)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any


def _tokenizer_dir(gguf: Path, template: Path, work: Path) -> str:
    """The GGUF's byte-level BPE vocabulary as a Hugging Face tokenizer directory, which verifiers'
    renderers load (built with `tokenizers` from the GGUF's own tokens and merges: no model hub).

    Kept in WORK under a digest of what it is built from (the GGUF's name and size, the template,
    this file), so a later run reuses it: reading every field of the GGUF takes seconds."""
    key = hashlib.sha1(
        b"\0".join(
            [gguf.name.encode(), str(gguf.stat().st_size).encode(), template.read_bytes(), Path(__file__).read_bytes()]
        )
    ).hexdigest()[:16]
    target = work / f"tokenizer-{key}"
    if (target / "tokenizer.json").exists():
        return str(target)

    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(gguf))

    def strings(name: str) -> list[str]:
        field = reader.fields[name]
        return [bytes(field.parts[i]).decode() for i in field.data]

    tokens = strings("tokenizer.ggml.tokens")
    kinds = reader.fields["tokenizer.ggml.token_type"]
    control = [tokens[i] for i, at in enumerate(kinds.data) if int(kinds.parts[at][0]) == 3]
    merges = [tuple(merge.split(" ", 1)) for merge in strings("tokenizer.ggml.merges")]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(control)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.chat_template = template.read_text()
    staging = Path(tempfile.mkdtemp(prefix="tokenizer-", dir=work))
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(target)  # whole or not at all, whoever builds it first
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


async def _run(base_url: str, session: str, model: str, tokenizer: str) -> list[dict[str, Any]]:
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.types import SamplingConfig

    config = TrainClientConfig(
        base_url=f"{base_url}/sessions/{session}/v1", api_key_var="TOKENTAPE_TEST_KEY", renderer_model_name=tokenizer
    )
    client = TrainClient(config)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
    out = []
    for follow_up in ("Name another one.", None):
        response = await client.get_response(
            ChatDialect(),
            {"model": model, "messages": messages},
            SamplingConfig(temperature=0, max_tokens=12),
            session_id="vf-trace-1",  # its eval trace id, sent as X-Session-ID
        )
        tokens = response.tokens
        out.append(
            {
                "prompt_ids": list(tokens.prompt_ids),
                "completion_ids": list(tokens.completion_ids),
                "completion_logprobs": list(tokens.completion_logprobs),
                "content": response.message.content,
            }
        )
        if follow_up is None:
            break
        messages += [
            {"role": "assistant", "content": response.message.content or ""},
            {"role": "user", "content": follow_up},
        ]
    await client.close()
    return out


def main() -> None:
    base_url, session, model, gguf, template, work = sys.argv[1:7]
    tokenizer = _tokenizer_dir(Path(gguf), Path(template), Path(work))
    print(json.dumps(asyncio.run(_run(base_url, session, model, tokenizer))))


if __name__ == "__main__":
    main()
