"""Think blocks (Qwen3, DeepSeek-R1, SmolLM3) read as reasoning, whole or fed a letter at a
time: the block at a reply's start is Thought, never content; the rest is the family's."""

from __future__ import annotations

import pytest

from kvasird.text.toolcalls.calls import Tool
from kvasird.text.toolcalls.events import CallClosed, Event, Said, Thought
from kvasird.text.toolcalls.registry import FORMATS, format_of
from kvasird.text.toolcalls.think import opens_thinking, thinks

QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}"
              "<think>\n\n</think>\n\n{% endif %}{% endif %}")
WEATHER = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}})


def split(events: list[Event]) -> tuple[str, str, list[str]]:
    """(reasoning, text, names of the calls) of a reply's events."""
    return ("".join(e.text for e in events if isinstance(e, Thought)),
            "".join(e.text for e in events if isinstance(e, Said)),
            [e.call.name for e in events if isinstance(e, CallClosed)])


def read(text: str, by_letter: bool, tools: tuple[Tool, ...] = ()) -> tuple[str, str, list[str]]:
    reader = format_of(QWEN3_LIKE).reader(tools)
    pieces = list(text) if by_letter else [text]
    return split([e for p in pieces for e in reader.feed(p)] + reader.end())


def test_a_template_with_think_tags_reads_them_and_one_without_does_not() -> None:
    assert thinks(QWEN3_LIKE) and format_of(QWEN3_LIKE).thinks
    assert format_of(QWEN3_LIKE).name == "hermes"
    assert not format_of(None).thinks and not thinks("<|im_start|>{{ m.content }}")
    assert FORMATS["hermes"].thinks is False  # the shared format is left as it was


@pytest.mark.parametrize("by_letter", [False, True], ids=["whole", "by letter"])
@pytest.mark.parametrize(("reply", "want"), [
    ("<think>\nThe user asks the time.\n</think>\n\nIt is noon.",
     ("The user asks the time.", "It is noon.", [])),
    ("It is noon.", ("", "It is noon.", [])),
    ("\n<think>a</think>b", ("a", "b", [])),
    ("<think>\nstill thinking when cut", ("still thinking when cut", "", [])),
    ("<thin", ("", "<thin", [])),
    ("<think>\n\n</think>\n\nThe answer <think> is text here.",
     ("", "The answer <think> is text here.", [])),
    ("<think>\nx < y and </thin is not the end\n</think>\n\nok",
     ("x < y and </thin is not the end", "ok", [])),
], ids=["block then answer", "no block", "tight", "cut inside", "a tag's start only",
        "empty block", "lookalikes"])
def test_a_think_block_is_reasoning_and_the_rest_is_the_answer(
        reply: str, want: tuple[str, str, list[str]], by_letter: bool) -> None:
    assert read(reply, by_letter) == want


@pytest.mark.parametrize("by_letter", [False, True], ids=["whole", "by letter"])
def test_a_call_after_the_block_is_read_by_the_family(by_letter: bool) -> None:
    reply = ('<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert read(reply, by_letter, (WEATHER,)) == ("I need the weather tool.", "", ["get_weather"])
    whole = format_of(QWEN3_LIKE).read(reply, (WEATHER,))
    assert whole.reasoning == "I need the weather tool." and whole.text == ""
    assert [c.name for c in whole.calls] == ["get_weather"]


@pytest.mark.parametrize("by_letter", [False, True], ids=["whole", "by letter"])
def test_a_reply_to_a_prompt_that_opened_the_block_starts_with_reasoning(by_letter: bool) -> None:
    """Qwen3-Thinking and DeepSeek-R1 templates end the prompt with <think>: the reply is
    reasoning up to </think>."""
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and not opens_thinking("x\n")
    reader = format_of(QWEN3_LIKE).reader((), opened=True)
    text = "The user asks the time.\n</think>\n\nIt is noon."
    pieces = list(text) if by_letter else [text]
    events = [e for p in pieces for e in reader.feed(p)] + reader.end()
    assert split(events) == ("The user asks the time.", "It is noon.", [])
