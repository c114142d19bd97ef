"""vLLM's ``--chat-template-content-format``: a message's content as the template gets it,
and ``auto``'s reading of the template."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kiln.frontends.openai.chat_input import chat_messages
from kiln.frontends.openai.content import (
    content_text,
    detect_content_format,
    for_template,
    template_content,
)
from kiln.frontends.openai.protocol import OpenAIError

PARTS = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]

LOOPS = {
    "attribute": "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}"
    "{% endfor %}",
    "item": "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
    "{% endfor %}",
    "filtered": "{% for m in messages %}{% for p in m.content | list %}{% endfor %}{% endfor %}",
    "sliced messages": "{% set rest = messages[1:] %}{% for m in rest %}"
    "{% for p in m['content'] %}{% endfor %}{% endfor %}",
    "set content": "{% for m in messages %}{% set c = m.content %}{% for p in c %}{% endfor %}"
    "{% endfor %}",
    "macro": "{% macro render(parts) %}{% for p in parts %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
    "macro keyword": "{% macro render(x, parts) %}{% for p in parts %}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ render(1, parts=m['content']) }}{% endfor %}",
    "content name": "{% for m in messages %}{% for p in content %}{% endfor %}{% endfor %}",
}
STRINGS = {
    "printed": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "string test": "{% for m in messages %}{% if m.content is string %}{{ m.content }}"
    "{% endif %}{% endfor %}",
    "other loop": "{% for t in tools %}{{ t }}{% endfor %}{{ messages[0].content }}",
    "not jinja": "{% for m in messages %}{{ m.content ",
    "empty": "",
}


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_a_template_looping_over_content_takes_parts(name: str) -> None:
    assert detect_content_format(LOOPS[name]) == "openai"


@pytest.mark.parametrize("name", sorted(STRINGS))
def test_a_template_printing_content_takes_a_string(name: str) -> None:
    assert detect_content_format(STRINGS[name]) == "string"
    assert detect_content_format(None) == "string"


def test_parts_are_kept_until_the_format_is_known() -> None:
    messages = chat_messages({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": PARTS},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {}}]},
        {"role": "tool", "tool_call_id": "c", "content": PARTS},
    ]})  # fmt: skip
    assert messages[1]["content"] == PARTS
    # string: vLLM joins text parts with newlines (kiln joined them with nothing before)
    as_string = template_content(messages, "string")
    assert [m["content"] for m in as_string] == ["be brief", "one\ntwo", "", "one\ntwo"]
    # openai: a string is one text part; a tool's answer stays one string, as vLLM's
    as_parts = template_content(messages, "openai")
    assert as_parts[0]["content"] == [{"type": "text", "text": "be brief"}]
    assert as_parts[1]["content"] == PARTS
    assert as_parts[2]["content"] == []  # only calls a tool
    assert as_parts[3]["content"] == "one\ntwo"
    assert as_parts[1]["role"] == "user" and messages[1]["content"] is not as_string[1]
    assert content_text(PARTS) == "one\ntwo" and content_text("x") == "x"


def test_hostile_parts_are_refused() -> None:
    for content in ([{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text"}],
                    [{"type": "text", "text": 3}], ["text"], 5, {"type": "text"}):  # fmt: skip
        with pytest.raises(OpenAIError, match=r"messages\[0\]\.content") as info:
            chat_messages({"messages": [{"role": "user", "content": content}]})
        assert info.value.status == 400


def _llm(fmt: str, template: str | None) -> Any:
    return SimpleNamespace(
        chat_template_content_format=fmt, tokenizer=SimpleNamespace(chat_template=template)
    )


def test_the_servers_flag_chooses_and_auto_reads_the_template_in_use() -> None:
    messages = [{"role": "user", "content": PARTS}]
    looping, printing = LOOPS["item"], STRINGS["printed"]
    assert for_template(_llm("auto", looping), messages, {})[0]["content"] == PARTS
    assert for_template(_llm("auto", printing), messages, {})[0]["content"] == "one\ntwo"
    # a request's own template is the one read
    own = {"chat_template": looping}
    assert for_template(_llm("auto", printing), messages, own)[0]["content"] == PARTS
    # the flag wins over what the template reads
    assert for_template(_llm("string", looping), messages, {})[0]["content"] == "one\ntwo"
    assert for_template(_llm("openai", printing), messages, {})[0]["content"] == PARTS


def test_a_template_renders_parts_or_a_string(tmp_path: Any) -> None:
    pytest.importorskip("tokenizers")
    from kiln.llm.tokenizer import Tokenizer
    from tests.llm_models import build_tokenizer

    build_tokenizer(tmp_path)
    messages = [{"role": "user", "content": PARTS}]
    loop = Tokenizer(tmp_path, "{% for p in messages[0]['content'] %}[{{ p.text }}]{% endfor %}")
    assert loop.apply_chat_template(template_content(messages, "openai")) == "[one][two]"
    printed = Tokenizer(tmp_path, "{{ messages[0]['content'] }}")
    assert printed.apply_chat_template(template_content(messages, "string")) == "one\ntwo"
    # continue_final_message finds the last message's text in either format
    # continue_final_message: the text goes on after the last part (transformers' rule)
    text = loop.apply_chat_template(
        template_content(messages, "openai"), add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
    assert text == "[one][two"
