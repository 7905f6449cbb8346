"""Long prompts: the embedded engine's prefill beside llama.cpp's own server, in one run.

A coding agent's first turn is a long prompt (a system prompt, tool schemas, a repository map: 5-10k
tokens). This measures how fast each side reads one: the embedded engine (`LlamaCppEngine` in this
process, as `tokentape serve` builds it: its default parallel, batch and flash attention, the shipped
SmolLM2-135M Q4_1 GGUF) and `llama-server` (llama.cpp's C++ server, `--llama-server BIN`, on the same
GGUF, its defaults but `-t/-tb THREADS -np 1 -c CONTEXT`, and past the model's training context
`--override-kv` raising it, where llama-server would cap a slot), both with the same threads, each
sent the same prompt of N token IDs and asked for one greedy token. The figure is N over the wall time of that
call: prefill and one sampled token (a few ms at most, next to seconds of prefill).

Every prompt is new to both (random token IDs, fresh each round, the same for both sides of a round;
llama-server is told `cache_prompt: false`), and each finds an empty cache: the engine's prompts are
one session's turns, whose slot drops what it held when its next prompt shares nothing with it. The
context is set to hold the longest prompt; SmolLM2 was trained on 8,192 positions, and RoPE past that
gives other logits but costs the same. The machine may be shared: the two sides take turns prompt by
prompt (A, B, then B, A in the next round), and the table shows medians over rounds with the load
average beside them.

    python benchmarks/prefill.py --llama-server path/to/llama-server [--lengths 1000,4000,8000,16000]
        [--rounds 3] [--threads 1] [--engine "flash_attention=False"] [--engine ""] [--beside 8000]

`--engine` (repeatable) adds an engine variant to the same rounds, its `LlamaCppSettings` fields
overridden (`flash_attention=False`, `batch_size=2048`, `kv_cache_f32=True`; "" is the default).
Without `--llama-server` only the engine variants run.

`--beside N`: before the rounds, another session's prompt of N tokens is read by each side and kept,
as a server that serves many sessions keeps the KV of those between turns. The engine keeps it in its
slot, in the KV cache every sequence shares; llama-server runs with `-np 2 --kv-unified` (one cache for
its two slots, as tokentape's) and its defaults otherwise, which save an idle slot's KV to host memory
(`--cache-ram`) and clear it from the cache when another task starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokentape.core.sampling import SamplingParams
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings, default_threads
from tokentape.formats.gguf import read_header
from tokentape.launcher import free_port
from tokentape.runtime import embedded_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import process  # a child process, waited for healthy, stopped on exit

SERVER = "llama-server"
FIRST_ID = 100  # random prompts use IDs from here up: no special tokens (SmolLM2's are below 17)


def variant_settings(spec: str, base: LlamaCppSettings) -> LlamaCppSettings:
    """`base` with the fields `spec` names ("flash_attention=False,batch_size=2048") replaced."""
    fields = {f.name: f for f in dataclasses.fields(LlamaCppSettings)}
    changes: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, text = item.partition("=")
        if name not in fields or name == "model_path":
            raise SystemExit(f"--engine: LlamaCppSettings has no field {name!r} to set")
        value: Any = {"true": True, "false": False, "none": None}.get(text.lower(), text)
        changes[name] = int(value) if isinstance(value, str) else value
    return dataclasses.replace(base, **changes)


async def engine_prefill(engine: LlamaCppEngine, prompt: list[int], session: str = "measured") -> float:
    """Seconds from the call to the one greedy token."""
    started = time.perf_counter()
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    async for _ in engine.generate(prompt, greedy, seed=0, session_id=session):
        pass
    return time.perf_counter() - started


def server_prefill(client: httpx.Client, prompt: list[int], slot: int = 0, keep: bool = False) -> float:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "cache_prompt": keep, "id_slot": slot}
    started = time.perf_counter()
    reply = client.post("/completion", json=body)
    seconds = time.perf_counter() - started
    reply.raise_for_status()
    evaluated = reply.json()["timings"]["prompt_n"]
    if evaluated != len(prompt):  # a prompt read in part from a cache would not measure prefill
        raise RuntimeError(f"llama-server evaluated {evaluated} of {len(prompt)} prompt tokens")
    return seconds


@contextlib.contextmanager
def llama_server(binary: str, model: Path, threads: int, context: int, slots: int) -> Iterator[httpx.Client]:
    port = free_port()
    command = [binary, "-m", str(model), "--port", str(port), "-t", str(threads), "-tb", str(threads)]
    command += ["-np", str(slots), "-c", str(context), "--no-webui"]
    trained = _trained_context(model)
    if context > trained:  # llama-server caps a slot at the training context; the engine does not
        command += ["--override-kv", f"{_architecture(model)}.context_length=int:{context}"]
    if slots > 1:
        command.append("--kv-unified")
    log = Path(tempfile.mkdtemp(prefix="tokentape-prefill-")) / "llama-server.log"
    with (
        process(command, f"http://127.0.0.1:{port}/health", log),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client,
    ):
        yield client


async def run(args: argparse.Namespace) -> None:
    lengths = [int(n) for n in args.lengths.split(",")]
    context = max(*lengths, args.beside) + 64  # per sequence: the longest prompt and its one token
    cache = context + args.beside  # KV cells: the longest prompt beside the kept one
    model = embedded_model_path()
    base = LlamaCppSettings(model_path=model, context_length=context, threads=args.threads, cache_tokens=cache)
    engines = {f"engine {spec}".strip(): LlamaCppEngine(variant_settings(spec, base)) for spec in args.engine or [""]}
    names = [*engines, *([SERVER] if args.llama_server else [])]
    vocab = next(iter(engines.values())).vocab_size
    seconds: dict[tuple[str, int], list[float]] = {}
    loads: list[float] = []
    with contextlib.ExitStack() as stack:
        client = None
        if args.llama_server:
            slots = 2 if args.beside else 1
            client = stack.enter_context(llama_server(args.llama_server, model, args.threads, cache, slots))
        rng = np.random.default_rng(args.seed)
        warm = [int(t) for t in rng.integers(FIRST_ID, vocab, 64)]  # first calls allocate buffers
        kept = [int(t) for t in rng.integers(FIRST_ID, vocab, args.beside)]  # another session's, kept
        for engine in engines.values():
            if kept:
                await engine_prefill(engine, kept, session="beside")
            await engine_prefill(engine, warm)
        if client is not None:
            if kept:
                server_prefill(client, kept, slot=1, keep=True)
            server_prefill(client, warm)
        for round_ in range(args.rounds):
            for length in lengths:
                prompt = [int(t) for t in rng.integers(FIRST_ID, vocab, length)]
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:  # each side first in turn
                    if name == SERVER:
                        assert client is not None
                        took = server_prefill(client, prompt)
                    else:
                        took = await engine_prefill(engines[name], prompt)
                    seconds.setdefault((name, length), []).append(took)
                    loads.append(os.getloadavg()[0])
                    print(
                        f"round {round_} {name:>28} {length:>6} tokens: {took:7.2f} s, {length / took:7.1f} tok/s"
                        f" (load average {loads[-1]:.1f})",
                        flush=True,
                    )
    for engine in engines.values():
        await engine.close()
    cpu = _cpu_name()
    print(
        f"\n{cpu}, {os.cpu_count()} cores, {args.threads} thread(s) each, context {context}; prompt tokens/s,"
        f" medians of {args.rounds} rounds; load average {min(loads):.1f}-{max(loads):.1f}"
        + (f"; beside another session's {args.beside} tokens" if args.beside else "")
    )
    header = f"{'tokens':>7}" + "".join(f" {name:>28}" for name in names)
    if args.llama_server:
        header += "".join(f" {'ratio ' + name.removeprefix('engine').strip():>18}" for name in engines)
    print(header)
    for length in lengths:
        rates = {name: length / statistics.median(seconds[(name, length)]) for name in names}
        row = f"{length:>7}" + "".join(f" {rates[name]:>28.1f}" for name in names)
        if args.llama_server:
            row += "".join(f" {rates[name] / rates[SERVER]:>17.2f}x" for name in engines)
        print(row)


def _architecture(model: Path) -> str:
    return str(read_header(model, frozenset({"general.architecture"})).metadata["general.architecture"])


def _trained_context(model: Path) -> int:
    key = f"{_architecture(model)}.context_length"
    return int(read_header(model, frozenset({key})).metadata[key])


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return "CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary, run beside the engine")
    parser.add_argument("--lengths", default="1000,4000,8000,16000", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=default_threads(), help="threads for both sides")
    parser.add_argument("--engine", action="append", help="an engine variant: LlamaCppSettings fields to set")
    parser.add_argument("--beside", type=int, default=0, help="tokens of another session's prompt kept meanwhile")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
