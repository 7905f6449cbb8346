"""`tokentape doctor` on the embedded model and on real model directories."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.support.models import materialise
from tokentape.cli import app
from tokentape.errors import InvalidRequest
from tokentape.runtime import RuntimeSettings, build_gateway

runner = CliRunner()


def _doctor(*args: str) -> str:
    result = runner.invoke(app, ["doctor", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_doctor_on_the_embedded_model() -> None:
    out = _doctor()
    assert "1 turn close" in out and "'<|im_end|>'=2" in out
    assert "Hermes-style" in out  # SmolLM2's template knows no tools: the default format is used


def test_doctor_reports_qwen3_reasoning_rewrites(tmp_path: Path) -> None:
    out = _doctor(str(materialise("qwen3", tmp_path)))
    assert "rewrite" in out and "drops earlier reasoning" in out


def test_doctor_reports_glm_turns_without_close(tmp_path: Path) -> None:
    out = _doctor(str(materialise("glm-4.7", tmp_path)))
    assert "renders no turn close" in out
    assert "opens a reasoning block" in out


def test_doctor_reports_llama_date_header_and_trim(tmp_path: Path) -> None:
    out = _doctor(str(materialise("llama3.2", tmp_path)))
    assert "strftime_now" in out and "trims" in out


def test_a_tokenizer_must_fit_the_engine(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="vocabulary"):
        build_gateway(RuntimeSettings(tokenizer_dir=materialise("qwen3", tmp_path), context_length=512))
