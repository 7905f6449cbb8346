"""`tokentape doctor` on the embedded model and on real model directories."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.support.models import materialise
from tokentape.cli import app
from tokentape.errors import InvalidRequest
from tokentape.render.doctor import Finding, audit
from tokentape.runtime import hf_renderer
from tokentape.served import ServeSpec, build_served

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
        build_served(ServeSpec(tokenizer=materialise("qwen3", tmp_path), context_length=512))


def _findings(family: str, tmp_path: Path) -> dict[str, Finding]:
    return {f.case.strip(): f for f in audit(hf_renderer(materialise(family, tmp_path)))}


def test_doctor_reports_deepseek_state_across_messages(tmp_path: Path) -> None:
    state = _findings("deepseek-r1", tmp_path)["state across messages"]
    assert state.verdict == "note" and "from the first message" in state.detail
    assert "tool▁outputs▁begin" in state.detail


def test_doctor_reports_tools_listed_in_the_history(tmp_path: Path) -> None:
    findings = _findings("qwen2.5", tmp_path)
    assert findings["tools in history"].verdict == "rewrite"
    assert "system prompt (by the template)" in findings["tools in history"].detail
    assert findings["state across messages"].verdict == "exact"  # Qwen2.5 carries no state across messages


@pytest.mark.parametrize("family", ["minimax-m2", "glm-5", "qwen3.6"])
def test_doctor_finds_no_problem_on_the_new_families(tmp_path: Path, family: str) -> None:
    findings = _findings(family, tmp_path)
    assert [case for case, f in findings.items() if f.verdict == "problem"] == []
    assert findings["2 truncated turn"].verdict == "bridged"


def test_doctor_names_the_settings_under_which_a_template_carries_state(tmp_path: Path) -> None:
    """Qwen2-VL numbers images across the conversation under add_vision_id: the doctor says so; Qwen3's
    enable_thinking reaches only the generation prompt."""
    (vl,) = [f for f in audit(hf_renderer(materialise("qwen2-vl", tmp_path))) if f.case.strip() == "template settings"]
    assert vl.verdict == "note" and "with add_vision_id set and images" in vl.detail
    (qwen3,) = [f for f in audit(hf_renderer(materialise("qwen3", tmp_path))) if f.case.strip() == "template settings"]
    assert qwen3.verdict == "exact" and "enable_thinking" in qwen3.detail
