"""`tokentape serve` logs each request at info (an access line); below info uvicorn is told not to
format one (nothing would show it)."""

from __future__ import annotations

import httpx

from tests.support.fake_engines import FakeState, serving, vllm_app
from tokentape.launcher import running_server


def test_access_lines_are_logged_at_info() -> None:
    # a stand-in remote engine: the access line is the server's, and this starts without loading a model
    with (
        serving(vllm_app(FakeState())) as url,
        running_server(["--engine", f"vllm={url}", "--log-level", "info"]) as server,
    ):
        assert httpx.get(f"{server.base_url}/v1/models").status_code == 200
    assert '"GET /v1/models HTTP/1.1" 200' in server.log_path.read_text()
