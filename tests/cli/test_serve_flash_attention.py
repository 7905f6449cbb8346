"""`tokentape serve --flash-attention auto|on|off` reaches the embedded engine's settings; anything
else is refused before a model loads."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from tokentape.cli import app as cli


@pytest.mark.parametrize(("value", "expected"), [("auto", None), ("on", True), ("off", False), (None, None)])
def test_serve_hands_flash_attention_to_the_runtime(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: bool | None
) -> None:
    import uvicorn

    import tokentape.runtime as runtime
    import tokentape.server.app as server_app

    seen: list[Any] = []

    def build(settings: Any) -> tuple[object, str]:
        seen.append(settings)
        return object(), "m"

    monkeypatch.setattr(runtime, "build_gateway", build)
    monkeypatch.setattr(server_app, "create_app", lambda *a, **k: None)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    options = [] if value is None else ["--flash-attention", value]
    result = CliRunner().invoke(cli, ["serve", "--store", ":memory:", *options])
    assert result.exit_code == 0, result.output
    (settings,) = seen
    assert settings.flash_attention is expected


def test_serve_refuses_another_value(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokentape.runtime as runtime

    monkeypatch.setattr(runtime, "build_gateway", lambda settings: pytest.fail("built despite a bad option"))
    result = CliRunner().invoke(cli, ["serve", "--flash-attention", "yes"])
    assert result.exit_code == 2
    assert "auto, on or off" in result.output
