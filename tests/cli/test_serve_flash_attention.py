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
    import tokentape.cli.serve as serve

    seen: list[Any] = []
    monkeypatch.setattr(serve, "_serve_here", seen.append)
    options = [] if value is None else ["--flash-attention", value]
    result = CliRunner().invoke(cli, ["serve", "--store", ":memory:", *options])
    assert result.exit_code == 0, result.output
    (spec,) = seen
    assert spec.flash is expected


def test_serve_refuses_another_value(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokentape.cli.serve as serve

    monkeypatch.setattr(serve, "_serve_here", lambda spec: pytest.fail("built despite a bad option"))
    result = CliRunner().invoke(cli, ["serve", "--flash-attention", "yes"])
    assert result.exit_code == 2
    assert "auto, on or off" in result.output
    assert "--flash-attention" in result.output
