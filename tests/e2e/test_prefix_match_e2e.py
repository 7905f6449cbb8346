"""`tokentape serve --match-prefix` with an unmodified agent: plain `/v1` base URL, no session named,
the real openai SDK; its second call continues the session of its first."""

from __future__ import annotations

import httpx
import openai
import pytest

from tokentape.launcher import running_server

pytestmark = pytest.mark.e2e


async def test_serve_match_prefix_continues_an_unnamed_episode() -> None:
    with running_server(["--context-length", "1024", "--match-prefix"]) as server:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        model = (await client.models.list()).data[0].id
        messages = [{"role": "user", "content": "Name an animal."}]
        first = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=6, temperature=0
        )
        reply = first.parse()
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "Another one?"},
        ]
        second = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=6, temperature=0
        )
        assert first.headers["x-tokentape-prefix-match"] == "new"
        assert second.headers["x-tokentape-prefix-match"] == "matched"
        session = first.headers["x-session-id"]
        assert second.headers["x-session-id"] == session
        export = httpx.get(f"{server.base_url}/sessions/{session}/export").json()
        (branch,) = export["branches"]
        assert branch["tokens"][: len(reply.prompt_token_ids)] == reply.prompt_token_ids  # type: ignore[attr-defined]
        assert len(branch["turn_ids"]) == 2
        await client.close()
