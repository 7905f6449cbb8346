"""An instant scripted engine speaking vLLM's OpenAI wire format, for the overhead benchmark.

A test instrument, not a model: every request gets the same few tokens back at once. It serves what
each path under test calls: `/v1/completions` with a token-ID prompt (tokentape's vLLM adapter) and
`/v1/chat/completions` (the peer gateway and the direct client), streamed or not, with vLLM's extra
fields (`token_ids`, `prompt_token_ids`, logprobs). A raw ASGI app on orjson so that the engine's own
cost stays small beside the gateways it is measured behind.

    python benchmarks/scripted_vllm.py --port 8100 [--tokenizer MODEL_DIR]

By default its token IDs are SmolLM2's (the embedded model's vocabulary); `--tokenizer` takes a Hugging
Face model directory (Qwen2.5's, for the overhead benchmark) and answers in that vocabulary instead.

With `--tokenizer`, a request whose `max_tokens` is `TOOL_CALL_MAX_TOKENS` is answered with one tool call
instead (benchmarks/agent_load.py): Hermes-style text (`<tool_call>{...}</tool_call>`, what Qwen's
templates render) as token IDs on the token routes, and parsed into `message.tool_calls` on the chat
route, as vLLM's tool parser would. Both routes answer with the same tokens and cost about the same:
one orjson parse of the request, one of the prompt as token IDs (`_tokenize_stand_in` on the chat
route), one short answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

END_OF_TURN = 2  # SmolLM2's <|im_end|>: the gateway under test renders with the embedded tokenizer
# SmolLM2 token IDs of common English words, so the text a gateway decodes is ordinary text
WORDS = [(1032, " the"), (1607, " model"), (7468, " answers"), (314, " a"), (1745, " long"), (2024, " history")]
CONTEXT = 131_072
TOOL_CALL_MAX_TOKENS = 48  # the marker: answer with a tool call
REPLY_CAP = 16  # the most tokens a text reply has (--reply-cap), its end of turn included
EVENT_GAP = 0.0  # seconds between a stream's events (--event-gap-ms); 0: all at once
TOOL_CALL = {"name": "bash", "arguments": {"command": "grep -rn 'def parse' src/ | head -20"}}
TOOL_CALL_TOKENS: list[tuple[int, str, float]] = []  # the call as Hermes text, in the vocabulary (--tokenizer)


def _script(max_tokens: int) -> tuple[list[tuple[int, str, float]], str]:
    """The reply: words up to `max_tokens - 1`, then the end-of-turn token (finish `stop`); or the
    tool call, when `max_tokens` asks for it and a vocabulary has it."""
    if max_tokens == TOOL_CALL_MAX_TOKENS and TOOL_CALL_TOKENS:
        return [*TOOL_CALL_TOKENS, (END_OF_TURN, "", -0.05)], "stop"
    words = max(0, min(max_tokens, REPLY_CAP) - 1)
    tokens = [(*WORDS[i % len(WORDS)], -0.25 - 0.01 * i) for i in range(words)]
    if max_tokens > words:
        return [*tokens, (END_OF_TURN, "", -0.05)], "stop"
    return tokens, "length"


def use_vocabulary(model_dir: str) -> None:
    """Answer in the vocabulary of `model_dir`'s tokenizer.json: the same words, as its IDs, and its
    `<|im_end|>` (or `<|eot_id|>`) as the end-of-turn token."""
    import tokenizers

    global END_OF_TURN, WORDS
    tokenizer = tokenizers.Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    words = []
    for _, word in WORDS:
        ids = tokenizer.encode(word, add_special_tokens=False).ids
        if len(ids) == 1:  # a word that is one token in this vocabulary too
            words.append((ids[0], word))
    end = tokenizer.token_to_id("<|im_end|>")
    end = end if end is not None else tokenizer.token_to_id("<|eot_id|>")
    if not words or end is None:
        raise SystemExit(f"{model_dir}: no single-token words or no end-of-turn token")
    WORDS, END_OF_TURN = words, end
    text = "<tool_call>\n" + json.dumps(TOOL_CALL) + "\n</tool_call>"
    encoding = tokenizer.encode(text, add_special_tokens=False)
    for i, (token, (start, stop)) in enumerate(zip(encoding.ids, encoding.offsets, strict=True)):
        TOOL_CALL_TOKENS.append((token, text[start:stop], -0.1 - 0.001 * i))


async def json_body(receive: Receive) -> dict[str, Any]:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    data: dict[str, Any] = orjson.loads(b"".join(chunks))
    return data


async def _json(send: Send, payload: object, status: int = 200) -> None:
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _sse(send: Send, events: list[bytes]) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for event in events:
        await send({"type": "http.response.body", "body": b"data: " + event + b"\n\n", "more_body": True})
        if EVENT_GAP:  # paced, as an engine that samples one token a step
            await asyncio.sleep(EVENT_GAP)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _chat_logprobs(tokens: list[tuple[int, str, float]]) -> dict[str, Any]:
    return {
        "content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []} for t, _, lp in tokens]
    }


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    """Stand-in prompt token IDs for a chat request: one per 3.6 characters of content (code-like
    text under Qwen2.5's tokenizer), six-digit IDs as a real vocabulary's are."""
    size = sum(len(str(m.get("content") or "")) for m in body.get("messages", ()))
    return list(range(100_000, 100_000 + max(1, int(size / 3.6))))


def _tokenize_stand_in(prompt_ids: list[int]) -> None:
    """What the token route pays to read a prompt as token IDs (one orjson parse of that many IDs),
    paid on the chat route too, so that both routes cost the engine the same per prompt token."""
    orjson.loads(orjson.dumps(prompt_ids))


async def chat(body: dict[str, Any], send: Send) -> None:
    _tokenize_stand_in(_prompt_ids(body))
    tokens, finish = _script(int(body.get("max_tokens") or 16))
    text = "".join(word for _, word, _ in tokens)
    calls: list[dict[str, Any]] = []
    if tokens and tokens[0] == (TOOL_CALL_TOKENS[:1] or [None])[0]:  # as vLLM's Hermes tool parser answers
        arguments = json.dumps(TOOL_CALL["arguments"])
        calls = [{"id": "call_scripted", "type": "function", "function": {"name": "bash", "arguments": arguments}}]
        text, finish = "", "tool_calls"
    base = {"id": "chatcmpl-scripted", "created": int(time.time()), "model": body.get("model", "scripted")}
    prompt_ids = _prompt_ids(body)
    if not body.get("stream"):
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text or None, "tool_calls": calls},
            "logprobs": _chat_logprobs(tokens) if body.get("logprobs") else None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(tokens), "total_tokens": 0}
        payload = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
        if body.get("return_token_ids"):  # vLLM adds token IDs only when asked
            choice["token_ids"] = [t for t, _, _ in tokens]
            payload["prompt_token_ids"] = prompt_ids
        await _json(send, payload)
        return
    events = []
    if calls:  # the whole call in one chunk, as vLLM's parser sends a call it has read whole
        delta = {"role": "assistant", "tool_calls": [{"index": 0, **calls[0]}]}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        await _sse(send, [orjson.dumps({**base, "object": "chat.completion.chunk", "choices": [choice]})])
        return
    for i, (token, word, logprob) in enumerate(tokens):
        last = i == len(tokens) - 1
        delta = {"role": "assistant", "content": word} if i == 0 else {"content": word}
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": _chat_logprobs([(token, word, logprob)]) if body.get("logprobs") else None,
            "finish_reason": finish if last else None,
        }
        event: dict[str, Any] = {**base, "object": "chat.completion.chunk", "choices": [choice]}
        if body.get("return_token_ids"):
            choice["token_ids"] = [token]
            if i == 0:
                event["prompt_token_ids"] = prompt_ids
        events.append(orjson.dumps(event))
    await _sse(send, events)


async def completions(body: dict[str, Any], send: Send) -> None:
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        await _json(send, {"object": "error", "message": "prompt must be token IDs", "code": 400}, 400)
        return
    tokens, finish = _script(int(body.get("max_tokens") or 16))
    base = {"id": "cmpl-scripted", "object": "text_completion", "created": int(time.time()), "model": "scripted"}

    def choice(part: list[tuple[int, str, float]], last: bool) -> dict[str, Any]:
        return {
            "index": 0,
            "text": "".join(word for _, word, _ in part),
            "logprobs": {
                "text_offset": [0] * len(part),
                "token_logprobs": [lp for _, _, lp in part],
                "tokens": [f"token_id:{t}" for t, _, _ in part],
                "top_logprobs": [{f"token_id:{t}": lp} for t, _, lp in part],
            },
            "finish_reason": finish if last else None,
            "stop_reason": None,
            **({"token_ids": [t for t, _, _ in part]} if asked else {}),
        }

    asked = bool(body.get("return_token_ids"))  # vLLM adds token IDs, and echoes the prompt's, only when asked
    if not body.get("stream"):
        echo = {"prompt_token_ids": prompt} if asked else {}
        await _json(send, {**base, "choices": [{**choice(tokens, True), **echo}]})
        return
    events = [
        orjson.dumps({**base, "choices": [choice([token], i == len(tokens) - 1)]}) for i, token in enumerate(tokens)
    ]
    await _sse(send, events)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if path == "/health":
        await _json(send, {})
    elif path == "/v1/models":
        await _json(send, {"object": "list", "data": [{"id": "scripted", "object": "model", "max_model_len": CONTEXT}]})
    elif path == "/v1/chat/completions":
        await chat(await json_body(receive), send)
    elif path == "/v1/completions":
        await completions(await json_body(receive), send)
    else:
        await _json(send, {"object": "error", "message": f"no route {path}", "code": 404}, 404)


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokenizer", help="a Hugging Face model directory whose vocabulary to answer in")
    parser.add_argument("--reply-cap", type=int, default=REPLY_CAP, help="the most tokens a text reply has")
    parser.add_argument("--event-gap-ms", type=float, default=0.0, help="pause between a stream's events")
    args = parser.parse_args()
    REPLY_CAP = args.reply_cap
    EVENT_GAP = args.event_gap_ms / 1000
    if args.tokenizer:
        use_vocabulary(args.tokenizer)
    # idle keep-alive connections stay open for the whole run, so no gateway's pool races a server-side close
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, timeout_keep_alive=600)
