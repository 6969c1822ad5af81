"""Chat templates as model families write them: the renderer features they use, and the
shapes they expect tool calls, call ids and tool results in."""

from __future__ import annotations

import pytest

from kvasird.text.chat import ChatTemplate, ChatTemplateError, Message
from kvasird.text.toolcalls.calls import ToolCall

CALL = ToolCall("call_0123456789abcdef01234567", "get_weather", '{"city": "Zürich"}')
CONVERSATION = [Message("user", "Weather?"), Message("assistant", "", (CALL,)),
                Message("tool", "21 C", tool_call_id=CALL.id)]
READS_TOOLS = "{# tools and tool_calls are read #}"
"""Marks a snippet as a template that renders tools and calls itself."""


def test_tojson_takes_the_keyword_arguments_templates_pass() -> None:
    source = ("{{ messages[0].content | tojson(ensure_ascii=False) }} "
              "{{ messages[0].content | tojson(ensure_ascii=True) }} "
              "{{ {'b': 1, 'a': [2]} | tojson(indent=2, sort_keys=True) }} "
              "{{ {'a': 1} | tojson(separators=(',', ':')) }}")
    text = ChatTemplate(source).render([Message("user", "é")])
    assert text == '"é" "\\u00e9" {\n  "a": [\n    2\n  ],\n  "b": 1\n} {"a":1}'


def test_arguments_reach_a_template_that_reads_tools_as_an_object() -> None:
    source = READS_TOOLS + ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                            "{{ c.function.name }}{{ c.function.arguments | tojson }}"
                            "{% for k, v in c.function.arguments | items %}|{{ k }}={{ v }}"
                            "{% endfor %}{% endfor %}{% endfor %}")
    assert ChatTemplate(source).render(CONVERSATION) == 'get_weather{"city": "Zürich"}|city=Zürich'


def test_a_filter_refusing_the_messages_is_a_chat_template_error() -> None:
    source = READS_TOOLS + ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                            "{% for k, v in c.function.arguments | items %}{% endfor %}"
                            "{% endfor %}{% endfor %}")
    listed = ToolCall("call_1", "get_weather", "[1, 2]")
    with pytest.raises(ChatTemplateError, match="mapping"):
        ChatTemplate(source).render([Message("user", "hi"), Message("assistant", "", (listed,))])


def test_raise_exception_in_a_template_is_a_chat_template_error() -> None:
    source = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}"
              "{% endif %}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        ChatTemplate(source).render([Message("system", "be terse"), Message("user", "hi")])


MISTRAL_IDS = READS_TOOLS + (
    "{% for m in messages %}"
    "{% for c in m.tool_calls or [] %}"
    "{% if c.id | length != 9 %}{{ raise_exception('ids must be 9 long') }}{% endif %}"
    "[CALL]{{ c.id }}{% endfor %}"
    "{% if m.role == 'tool' %}"
    "{% if m.tool_call_id | length != 9 %}{{ raise_exception('ids must be 9 long') }}{% endif %}"
    "[RESULT]{{ m.tool_call_id }}{% endif %}"
    "{% endfor %}")


def test_a_template_taking_nine_character_ids_gets_them_for_a_call_and_its_result() -> None:
    text = ChatTemplate(MISTRAL_IDS).render(CONVERSATION)
    call, result = text.removeprefix("[CALL]").split("[RESULT]")
    assert call == result and len(call) == 9 and call.isalnum()


def test_a_nine_character_id_is_kept_as_it_is() -> None:
    call = ToolCall("abc123XYZ", "get_weather", "{}")
    text = ChatTemplate(MISTRAL_IDS).render(
        [Message("user", "hi"), Message("assistant", "", (call,)),
         Message("tool", "21 C", tool_call_id="abc123XYZ")])
    assert text == "[CALL]abc123XYZ[RESULT]abc123XYZ"


def test_other_templates_get_the_call_ids_unchanged() -> None:
    source = READS_TOOLS + ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.id }}"
                            "{% endfor %}{% if m.role == 'tool' %} {{ m.tool_call_id }}{% endif %}"
                            "{% endfor %}")
    assert ChatTemplate(source).render(CONVERSATION) == f"{CALL.id} {CALL.id}"


def test_a_result_without_a_name_is_named_after_its_call() -> None:
    source = READS_TOOLS + ("{% for m in messages %}{% if m.role == 'tool' %}"
                            "{{ m.get('name', 'unknown') }}: {{ m.content }}"
                            "{% endif %}{% endfor %}")
    assert ChatTemplate(source).render(CONVERSATION) == "get_weather: 21 C"

