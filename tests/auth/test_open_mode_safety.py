"""Open mode made safe by default: `serve` on an address other machines reach refuses to start with no
trainer key (unless --insecure-open, which warns), `--session-keys required` needs a trainer key,
`/admin/weights` loads only from the directories the operator allows (403 naming the rule, nothing
changed), and two creates of one session id at once give one key, not two."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.cli import app as cli
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.renderer import Renderer
from tokentape.served import Served
from tokentape.server.exposure import OpenModeRefused, check_exposure, loopback


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        *[("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True), ("localhost", True)],
        *[("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("gateway.internal", False)],
    ],
)
def test_only_loopback_addresses_count_as_this_machine(host: str, expected: bool) -> None:
    assert loopback(host) is expected


def test_a_reachable_gateway_with_no_trainer_key_is_refused_unless_insecure_open() -> None:
    with pytest.raises(OpenModeRefused, match="--insecure-open"):
        check_exposure("0.0.0.0", [], insecure_open=False)
    assert check_exposure("0.0.0.0", ["k"], insecure_open=False) is None  # keyed: fine anywhere
    assert check_exposure("127.0.0.1", [], insecure_open=False) is None  # open on loopback: fine
    assert "no trainer key" in (check_exposure("0.0.0.0", [], insecure_open=True) or "")


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (["--host", "0.0.0.0"], "no trainer key is set"),
        (["--session-keys", "required"], "required needs a trainer key"),
    ],
)
def test_serve_refuses_to_start_before_loading_anything(
    arguments: list[str], words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOKENTAPE_API_KEYS", raising=False)
    result = CliRunner().invoke(cli, ["serve", "--store", ":memory:", *arguments])
    assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output


async def test_weights_load_only_from_the_allowed_directories(
    engine: LlamaCppEngine, renderer: Renderer, tmp_path: Path
) -> None:
    allowed = tmp_path / "adapters"
    allowed.mkdir()
    (tmp_path / "elsewhere.gguf").write_bytes(b"GGUF")
    app = build(engine, renderer, weights_dirs=(allowed,)).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        for path in (tmp_path / "elsewhere.gguf", allowed / ".." / "elsewhere.gguf", Path("/etc/passwd")):
            refused = await http.post("/admin/weights", json={"version": 1, "lora": str(path)})
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert error["code"] == "weights_dir_forbidden" and str(allowed) in error["message"]
            assert "--weights-dir" in error["message"] and error["param"] == "lora"
        # inside the allowed directory the update goes on to the engine's own check (no such file: 400)
        inside = await http.post("/admin/weights", json={"version": 1, "lora": str(allowed / "missing.gguf")})
        assert inside.status_code == 400 and inside.json()["error"]["code"] != "weights_dir_forbidden"
        state = (await http.get("/admin/status")).json()
        assert (state["weights_version"], state["paused"]) == (0, False)  # nothing changed


async def test_two_creates_of_one_session_id_at_once_give_one_key(built: Served) -> None:
    app = built.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        answers = await asyncio.gather(*(http.post("/sessions", json={"session_id": "twice"}) for _ in range(2)))
        assert sorted(a.status_code for a in answers) == [201, 400]
        (made,) = [a for a in answers if a.status_code == 201]
        lost = next(a for a in answers if a.status_code != 201)
        assert lost.json()["error"]["code"] == "session_exists"
        # the key handed out is the one that works
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        headers = {"authorization": f"Bearer {made.json()['api_key']}"}
        assert (await http.post("/v1/chat/completions", json=body, headers=headers)).status_code == 200
