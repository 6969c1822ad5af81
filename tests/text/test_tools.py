"""Tool calls per format: model output in the family's syntax parsed into calls, grammars
that only allow valid calls, and tools and tool messages rendered into the prompt."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from kvasird.compute.sampling import Sampler, SamplingParams
from kvasird.model.bundled import bundled_path
from kvasird.text.chat import ChatTemplate, Message
from kvasird.text.grammar import Constraint, GrammarError, vocabulary
from kvasird.text.tokenizer import Tokenizer
from kvasird.text.toolcalls.calls import MAX_PARALLEL_CALLS, Tool, ToolCall
from kvasird.text.toolcalls.events import (
    Args,
    Broken,
    CallClosed,
    CallOpened,
    Event,
    Reply,
    Said,
    Thought,
)
from kvasird.text.toolcalls.registry import FORMATS, format_of
from kvasird_dev.testmodels import bundled_tokenizer

WEATHER = Tool("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False})
TIME = Tool("get_time", "The time in a zone", {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False})
TOOLS = [WEATHER, TIME]


HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                   "<|call|>", "<|return|>"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(bundled_path())


@pytest.fixture(scope="module")
def harmony_tok() -> Tokenizer:
    """The bundled vocabulary with gpt-oss's markers added as control tokens."""
    meta = []
    for key, (kind, sub, value) in bundled_tokenizer().items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value + (HARMONY_MARKERS if key.endswith("tokens") else
                             [3] * len(HARMONY_MARKERS))
        meta.append((key, kind, (sub, value) if isinstance(value, list) else value))
    return Tokenizer.from_metadata(meta, "the bundled vocabulary with harmony's markers")


def test_hermes_output_with_two_calls_and_text_is_parsed() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"zone": "cet"}}\n</tool_call>')
    content, calls = FORMATS["hermes"].parse(text, TOOLS)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": "cet"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',     # a tool not offered
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>',  # broken JSON
    "The weather is fine."])
def test_hermes_blocks_that_are_no_call_of_an_offered_tool_stay_text(text: str) -> None:
    assert FORMATS["hermes"].parse(text, TOOLS) == (text, [])


def streamed(fmt: str, text: str, step: int) -> list[Event]:
    """``text`` fed to a reader ``step`` characters at a time, then ended."""
    reader = FORMATS[fmt].stream(TOOLS)
    events = [e for i in range(0, len(text), step) for e in reader.feed(text[i:i + step])]
    return events + reader.end()


TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"a}</tool_call>\\"{", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": '
             '"get_time", "arguments": {"zone": "cet"}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 1000])
def test_a_streamed_reply_holds_the_text_and_calls_of_the_whole_one(step: int) -> None:
    events = streamed("hermes", TWO_CALLS, step)
    content, calls = FORMATS["hermes"].parse(TWO_CALLS, TOOLS)
    assert "".join(e.text for e in events if isinstance(e, Said)) == content
    closed = [e.call for e in events if isinstance(e, CallClosed)]
    assert [(c.name, c.arguments) for c in closed] == [(c.name, c.arguments) for c in calls]
    for k, call in enumerate(closed):  # the arguments sent are the call's, exactly
        assert "".join(e.text for e in events if isinstance(e, Args) and e.index == k) == \
            call.arguments
    assert json.loads(closed[0].arguments) == {"city": 'a}</tool_call>"{', "unit": "c"}
    opened = [e for e in events if isinstance(e, CallOpened)]
    assert [(o.index, o.id, o.name) for o in opened] == [(k, c.id, c.name)
                                                         for k, c in enumerate(closed)]


def test_a_call_is_announced_as_soon_as_its_name_is_written() -> None:
    reader = FORMATS["hermes"].stream(TOOLS)
    assert reader.feed("Sure. <tool") == [Said("Sure.")]  # "<tool" may begin a call
    assert reader.feed('_call>\n{"name": "get_time", "arguments": ') == []
    (opened, args) = reader.feed('{"zo')
    assert isinstance(opened, CallOpened) and opened.name == "get_time"
    assert args == Args(0, '{"zo')
    assert reader.feed('ne": "utc"}') == [Args(0, 'ne": "utc"}')]
    assert reader.feed("}\n</tool_") == []
    (closed,) = reader.feed("call>")
    assert isinstance(closed, CallClosed) and closed.call.arguments == '{"zone": "utc"}'
    assert not reader.cut and reader.end() == []


def test_a_reply_cut_inside_a_call_keeps_it_out_of_a_whole_reply() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "ut'
    events = streamed("hermes", text, 4)
    assert [type(e) for e in events][:2] == [CallOpened, Args] and not any(
        isinstance(e, CallClosed) for e in events)
    assert FORMATS["hermes"].parse(text, TOOLS) == ("", [])


def test_a_call_that_ends_inside_its_arguments_was_no_call() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call> Noon.'
    events = streamed("hermes", text, 3)
    (broken,) = [e for e in events if isinstance(e, Broken)]
    assert broken.text == text[:-len(" Noon.")]
    assert "".join(e.text for e in events if isinstance(e, Said)) == " Noon."


def test_llama3_replies_are_read_whole() -> None:
    text = '{"name": "get_time", "parameters": {"zone": "utc"}}'
    reader = FORMATS["llama3"].stream(TOOLS)
    assert reader.feed(text) == []
    assert [type(e) for e in reader.end()] == [CallOpened, Args, CallClosed]


def test_llama3_output_is_parsed_with_or_without_the_python_tag() -> None:
    f = FORMATS["llama3"]
    _, calls = f.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}', TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "utc"})]
    _, two = f.parse('{"name": "get_time", "parameters": {"zone": "utc"}}; '
                     '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}', TOOLS)
    assert [c.name for c in two] == ["get_time"]  # its template takes one call back, no more
    assert f.parse("It is noon.", TOOLS) == ("It is noon.", [])


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_tool_grammar_only_lets_a_model_write_valid_calls_and_then_end(
        tok: Tokenizer, harmony_tok: Tokenizer, name: str, parallel: bool) -> None:
    """Random logits under the grammar: every output parses into calls of offered tools whose
    arguments validate against their schemas, and it ends: after one call, or with parallel
    calls asked for (in a format that has them), after at most MAX_PARALLEL_CALLS."""
    f = FORMATS[name]
    tok = harmony_tok if name == "harmony" else tok
    grammar = f.grammar(TOOLS, parallel)
    schemas = {t.name: t.parameters for t in TOOLS}
    most = MAX_PARALLEL_CALLS if parallel and f.parallel else 1
    for seed in range(6 if most == 1 else 2):
        rng = np.random.default_rng(seed)
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed),
                          Constraint(vocabulary(tok), grammar))
        out: list[int] = []
        for _ in range(400 * most):
            token = sampler(rng.normal(size=tok.n_vocab).astype(np.float32), out)
            if token in tok.special.end_of_generation:
                break
            out.append(token)
        else:
            raise AssertionError(f"no end: {tok.decode(out)!r}")
        content, calls = f.parse(tok.decode(out), TOOLS)
        assert 1 <= len(calls) <= most and content == "", tok.decode(out)
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_once_its_last_call_is_written_a_forced_reply_may_only_end(
        tok: Tokenizer, parallel: bool) -> None:
    """A forced reply is one call, or MAX_PARALLEL_CALLS when parallel calls were asked for:
    then the grammar allows the end of generation and nothing else, so the reply ends as
    its calls instead of opening another until the token limit."""
    f = FORMATS["hermes"]
    call = ToolCall("call_1", "get_time", '{"zone": "utc"}')
    written = f.separator.join([f.call_text(call)] * (MAX_PARALLEL_CALLS if parallel else 1))
    c = Constraint(vocabulary(tok), f.grammar([TIME], parallel))
    for t in tok.encode(written):
        c.consume(t)
    assert c.complete
    allowed = c.allowed(tok.encode(written))
    assert set(np.flatnonzero(allowed)) == set(tok.special.end_of_generation)
    if parallel:  # and before the last, another call may follow
        fewer = Constraint(vocabulary(tok), f.grammar([TIME], parallel))
        two = tok.encode(f.separator.join([f.call_text(call)] * 2))
        assert fewer.allowed(two)[tok.encode(f.separator + f.start)[0]]


def test_a_call_of_one_named_tool_is_all_its_grammar_allows(tok: Tokenizer) -> None:
    c = Constraint(vocabulary(tok), FORMATS["hermes"].grammar([TIME], parallel=False))
    good = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    for t in tok.encode(good):
        assert c.allowed([])[t]
        c.consume(t)
    assert c.complete
    bad = Constraint(vocabulary(tok), FORMATS["hermes"].grammar([TIME], parallel=False))
    prefix = tok.encode('<tool_call>\n{"name": "get_weather"')
    with pytest.raises(GrammarError):
        for t in prefix:
            bad.consume(t)


def test_the_format_follows_the_template() -> None:
    assert format_of(None).name == "hermes"
    assert format_of("{{ '<|python_tag|>' }}{{ '<|eom_id|>' }}").name == "llama3"
    assert format_of("<|start|>assistant<|channel|>analysis").name == "harmony"


# --- harmony (gpt-oss) ------------------------------------------------------------------

THINK = "<|channel|>analysis<|message|>The user wants the time in Berlin.<|end|>"
HARMONY_CALLS = [
    THINK + '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json'
            '<|message|>{"zone": "cet"}',
    THINK + '<|start|>assistant<|channel|>commentary to=functions.get_time json<|message|>'
            '{"zone": "cet"}<|call|>',
    THINK + '<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json'
            '<|message|>{"zone": "cet"}',
    '<|channel|>commentary to=functions.get_time<|message|>{"zone": "cet"}',
]


def read(text: str) -> Reply:
    return FORMATS["harmony"].read(text, TOOLS)


def test_harmony_analysis_is_reasoning_and_the_final_channel_is_the_content() -> None:
    text = THINK + "<|start|>assistant<|channel|>final<|message|>It is noon in Berlin."
    assert read(text) == Reply("It is noon in Berlin.", (), "The user wants the time in Berlin.")
    assert read(text + "<|return|>") == read(text)


@pytest.mark.parametrize("text", HARMONY_CALLS)
def test_harmony_calls_are_read_in_every_header_form(text: str) -> None:
    reply = read(text)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("get_time",
                                                                         {"zone": "cet"})]
    assert reply.text == "" and reply.reasoning == ("" if text.startswith(
        "<|channel|>commentary") else "The user wants the time in Berlin.")


def test_harmony_text_outside_messages_is_content() -> None:
    assert read('{"zone": "utc"}') == Reply('{"zone": "utc"}')  # held to a JSON schema


def test_a_harmony_message_to_a_tool_not_offered_stays_text() -> None:
    text = '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>'
    assert read(text) == Reply(text)
    assert read(THINK + "<|start|>assistant to=browser.search<|channel|>analysis<|message|>"
                "{}<|end|>").text == "<|start|>assistant to=browser.search<|channel|>analysis" \
                                     "<|message|>{}<|end|>"


def test_a_harmony_call_that_ends_inside_its_arguments_was_no_call() -> None:
    call = '<|channel|>commentary to=functions.get_time json<|message|>{"zone": <|end|>'
    events = harmony_streamed(call + "<|start|>assistant<|channel|>final<|message|>Noon.", 3)
    (broken,) = [e for e in events if isinstance(e, Broken)]
    assert broken.text == call
    assert "".join(e.text for e in events if isinstance(e, Said)) == "Noon."
    assert read(call) == Reply(call)


def test_a_harmony_reply_cut_inside_a_call_is_never_closed() -> None:
    text = '<|channel|>commentary to=functions.get_time json<|message|>{"zone": "ut'
    reader = FORMATS["harmony"].stream(TOOLS)
    events = [*reader.feed(text), *reader.end()]
    assert [type(e) for e in events] == [CallOpened, Args] and reader.cut
    assert read(text) == Reply("")


def harmony_streamed(text: str, step: int) -> list[Event]:
    reader = FORMATS["harmony"].stream(TOOLS)
    events = [e for i in range(0, len(text), step) for e in reader.feed(text[i:i + step])]
    return events + reader.end()


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text", [
    *HARMONY_CALLS,
    THINK + "<|start|>assistant<|channel|>final<|message|>It is <noon> |here|.<|return|>",
    THINK + "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "<|Oslo", "unit": "c"}'])
def test_a_streamed_harmony_reply_holds_what_the_whole_one_does(text: str, step: int) -> None:
    events, whole = harmony_streamed(text, step), read(text)
    assert "".join(e.text for e in events if isinstance(e, Said)) == whole.text
    assert "".join(e.text for e in events if isinstance(e, Thought)) == whole.reasoning
    closed = [e.call for e in events if isinstance(e, CallClosed)]
    assert [(c.name, c.arguments) for c in closed] == [(c.name, c.arguments)
                                                       for c in whole.calls]
    for k, call in enumerate(closed):
        assert "".join(e.text for e in events if isinstance(e, Args) and e.index == k) == \
            call.arguments
        assert json.loads(call.arguments)


def test_a_harmony_call_is_announced_once_its_header_is_read() -> None:
    reader = FORMATS["harmony"].stream(TOOLS)
    assert reader.feed("<|channel|>analysis<|message|>Hm<|") == [Thought("Hm")]
    assert reader.feed("end|><|start|>assistant<|channel|>commentary to=functions.get_time "
                       "<|constrain|>json") == []
    (opened,) = reader.feed("<|message|>")
    assert isinstance(opened, CallOpened) and opened.name == "get_time"
    assert reader.feed('{"zone": "utc"}') == [Args(0, '{"zone": "utc"}')]
    (closed,) = reader.end()
    assert isinstance(closed, CallClosed) and closed.call.arguments == '{"zone": "utc"}'
    assert not reader.cut


def test_a_harmony_grammar_holds_the_markers_to_their_special_tokens(
        harmony_tok: Tokenizer) -> None:
    grammar = FORMATS["harmony"].grammar([TIME], parallel=False)
    good = Constraint(vocabulary(harmony_tok), grammar)
    text = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "utc"}'
    for t in harmony_tok.encode(text, special=True):
        assert good.allowed([])[t]
        good.consume(t)
    assert good.complete
    spelled = harmony_tok.encode("<|channel|>")  # the marker's text, not its token
    assert not Constraint(vocabulary(harmony_tok), grammar).allowed([])[spelled[0]]


def test_a_harmony_template_without_tools_gets_them_declared_and_calls_in_harmony() -> None:
    source = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>"
              "{{ m.content }}<|end|>{% endfor %}<|start|>assistant")
    call = ToolCall("call_1", "get_time", '{"zone": "utc"}')
    text = ChatTemplate(source).render([Message("user", "Time?"), Message("assistant", "", (call,)),
                                        Message("tool", "12:00", tool_call_id="call_1")], TOOLS)
    assert "namespace functions {" in text
    assert 'type get_time = (_: {\nzone: "utc" | "cet",\n}) => any;' in text
    assert ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>'
            '{"zone": "utc"}<|call|>') in text
    assert ("<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>12:00"
            "<|end|>") in text


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_as_text(
        tok: Tokenizer) -> None:
    template = ChatTemplate.of(tok)  # the bundled ChatML template knows no tools
    call = ToolCall("call_1", "get_time", '{"zone": "utc"}')
    text = template.render([Message("user", "What time is it?"),
                            Message("assistant", "", (call,)),
                            Message("tool", "12:00", tool_call_id="call_1", name="get_time")],
                           TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
            '"utc"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_reads_tools_gets_them_and_the_calls_itself() -> None:
    source = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}{{ m.role }}:{{ m.content }}"
              "{% for c in m.tool_calls or [] %}<{{ c.function.name }} "
              "{{ c.function.arguments | tojson }}>{% endfor %}"
              "{% if m.role == 'tool' %}({{ m.tool_call_id }}){% endif %};{% endfor %}")
    call = ToolCall("call_9", "get_time", '{"zone": "cet"}')
    text = ChatTemplate(source).render([Message("user", "hi"), Message("assistant", "", (call,)),
                                        Message("tool", "13:00", tool_call_id="call_9")], TOOLS)
    assert text == ('[get_weather][get_time]user:hi;assistant:<get_time {"zone": "cet"}>;'
                    'tool:13:00(call_9);')


# --- Qwen 3.5 / Qwen3-Coder XML ---------------------------------------------------------

FORECAST = Tool("get_forecast", "The forecast", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hourly": {"type": "boolean"},
                                     "fields": {"type": "array", "items": {"type": "string"}}},
    "required": ["city", "days"], "additionalProperties": False})
XML_TOOLS = [*TOOLS, FORECAST]
XML_CALLS = ("Let me check.\n\n<tool_call>\n<function=get_forecast>\n<parameter=city>\nNew York\n"
             "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\nTrue\n"
             "</parameter>\n<parameter=fields>\n[\"rain\", \"wind\"]\n</parameter>\n</function>\n"
             "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\n"
             "a</tool_call> b\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n"
             "</tool_call>")


def xml_streamed(text: str, step: int) -> list[Event]:
    reader = FORMATS["qwen_xml"].stream(XML_TOOLS)
    events = [e for i in range(0, len(text), step) for e in reader.feed(text[i:i + step])]
    return events + reader.end()


def test_qwen_xml_calls_are_parsed_with_values_typed_by_their_schema() -> None:
    content, calls = FORMATS["qwen_xml"].parse(XML_CALLS, XML_TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_forecast", {"city": "New York", "days": 3, "hourly": True,
                          "fields": ["rain", "wind"]}),
        ("get_weather", {"city": "line one\na</tool_call> b", "unit": "c"})]


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_a_streamed_qwen_xml_reply_holds_the_text_and_calls_of_the_whole_one(step: int) -> None:
    events = xml_streamed(XML_CALLS, step)
    content, calls = FORMATS["qwen_xml"].parse(XML_CALLS, XML_TOOLS)
    assert "".join(e.text for e in events if isinstance(e, Said)) == content
    closed = [e.call for e in events if isinstance(e, CallClosed)]
    assert [(c.name, c.arguments) for c in closed] == [(c.name, c.arguments) for c in calls]
    for k, call in enumerate(closed):
        assert "".join(e.text for e in events if isinstance(e, Args) and e.index == k) == \
            call.arguments


def test_a_qwen_xml_call_is_announced_at_its_function_tag() -> None:
    reader = FORMATS["qwen_xml"].stream(XML_TOOLS)
    assert reader.feed("<tool_call>\n<function=get_ti") == []
    (opened,) = reader.feed("me>\n")
    assert isinstance(opened, CallOpened) and opened.name == "get_time"
    assert reader.feed("<parameter=zone>\nut") == []
    assert reader.feed("c\n</parameter>\n") == [Args(0, '{"zone": "utc"')]
    args, closed = reader.feed("</function>")
    assert args == Args(0, "}") and isinstance(closed, CallClosed)
    assert closed.call.arguments == '{"zone": "utc"}'
    assert reader.feed("\n</tool_call>") == [] and not reader.cut


def test_a_qwen_xml_reply_cut_inside_a_call_is_never_closed() -> None:
    text = "<tool_call>\n<function=get_time>\n<parameter=zone>\nut"
    events = xml_streamed(text, 3)
    assert [type(e) for e in events] == [CallOpened]
    assert FORMATS["qwen_xml"].parse(text, XML_TOOLS) == ("", [])


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",
    "The weather is fine."])
def test_qwen_xml_blocks_that_are_no_call_of_an_offered_tool_stay_text(text: str) -> None:
    assert FORMATS["qwen_xml"].parse(text, XML_TOOLS) == (text, [])


def test_a_qwen_xml_call_with_text_where_a_tag_belongs_was_no_call() -> None:
    text = "<tool_call>\n<function=get_time>\nzone is utc\n</tool_call> Noon."
    events = xml_streamed(text, 1)
    (broken,) = [e for e in events if isinstance(e, Broken)]
    assert broken.text == text[:-len(" Noon.")]
    assert "".join(e.text for e in events if isinstance(e, Said)) == " Noon."


def test_a_qwen_xml_grammar_allows_a_valid_call_and_no_other(tok: Tokenizer) -> None:
    grammar = FORMATS["qwen_xml"].grammar([FORECAST], parallel=False)
    good = Constraint(vocabulary(tok), grammar)
    text = ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nNew </para York\n</parameter>"
            "\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    for t in tok.encode(text):
        assert good.allowed([])[t]
        good.consume(t)
    assert good.complete
    for bad in ["<tool_call>\n<function=get_forecast>\n<parameter=days>",  # city is required first
                "<tool_call>\n<function=get_forecast>\n<parameter=city>\nX\n</parameter>\n"
                "<parameter=days>\nthree"]:
        c = Constraint(vocabulary(tok), grammar)
        with pytest.raises(GrammarError):
            for t in tok.encode(bad):
                c.consume(t)


def test_a_qwen_xml_template_without_tools_gets_the_calls_in_xml() -> None:
    call = ToolCall("call_1", "get_forecast", '{"city": "Oslo", "days": 2}')
    assert FORMATS["qwen_xml"].call_text(call) == (
        "<tool_call>\n<function=get_forecast>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


# --- Mistral -------------------------------------------------------------------------------

MISTRAL_MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
MISTRAL_CALLS = {
    "mistral": 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "a}[ARGS]\\"{", "unit": "c"}'
               '[TOOL_CALLS]get_time[CALL_ID]abcdefghi[ARGS]{"zone": "cet"}',
    "mistral_list": 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
                    '"a}[ARGS]\\"{", "unit": "c"}, "id": "abcdefghi"}, {"arguments": '
                    '{"zone": "cet"}, "name": "get_time"}]'}


@pytest.mark.parametrize("name", list(MISTRAL_CALLS))
def test_mistral_calls_are_parsed_in_both_forms(name: str) -> None:
    content, calls = FORMATS[name].parse(MISTRAL_CALLS[name], TOOLS)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'a}[ARGS]"{', "unit": "c"}), ("get_time", {"zone": "cet"})]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("name", list(MISTRAL_CALLS))
def test_a_streamed_mistral_reply_holds_the_text_and_calls_of_the_whole_one(
        name: str, step: int) -> None:
    reader = FORMATS[name].stream(TOOLS)
    text = MISTRAL_CALLS[name]
    events = [e for i in range(0, len(text), step) for e in reader.feed(text[i:i + step])]
    events += reader.end()
    content, calls = FORMATS[name].parse(text, TOOLS)
    assert "".join(e.text for e in events if isinstance(e, Said)) == content
    closed = [e.call for e in events if isinstance(e, CallClosed)]
    assert [(c.name, c.arguments) for c in closed] == [(c.name, c.arguments) for c in calls]
    for k, call in enumerate(closed):
        assert "".join(e.text for e in events if isinstance(e, Args) and e.index == k) == \
            call.arguments
    assert not reader.cut


def test_a_mistral_call_is_announced_at_its_args_marker() -> None:
    reader = FORMATS["mistral"].stream(TOOLS)
    assert reader.feed("[TOOL_CALLS]get_time") == []
    (opened,) = reader.feed("[ARGS]")
    assert isinstance(opened, CallOpened) and opened.name == "get_time"
    assert reader.feed('{"zone": "ut') == [Args(0, '{"zone": "ut')] and reader.cut
    assert reader.end() == []  # cut: never CallClosed
    assert FORMATS["mistral"].parse('[TOOL_CALLS]get_time[ARGS]{"zone": "ut', TOOLS) == ("", [])


@pytest.mark.parametrize(("name", "text"), [
    ("mistral", "[TOOL_CALLS]rm_rf[ARGS]{}"),
    ("mistral", "The weather is fine."),
    ("mistral_list", "The weather is fine.")])
def test_mistral_calls_of_no_tool_offered_stay_text(name: str, text: str) -> None:
    assert FORMATS[name].parse(text, TOOLS) == (text, [])


def test_mistral_arguments_that_are_no_object_make_no_call() -> None:
    reader = FORMATS["mistral"].stream(TOOLS)
    events = [*reader.feed("[TOOL_CALLS]get_time[ARGS]utc, please"), *reader.end()]
    assert [type(e) for e in events] == [CallOpened, Broken, Said]
    assert events[1] == Broken(0, "[TOOL_CALLS]get_time[ARGS]")


@pytest.fixture(scope="module")
def mistral_tok() -> Tokenizer:
    """The bundled vocabulary with Mistral's markers added as control tokens."""
    meta = []
    for key, (kind, sub, value) in bundled_tokenizer().items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value + (MISTRAL_MARKERS if key.endswith("tokens") else
                             [3] * len(MISTRAL_MARKERS))
        meta.append((key, kind, (sub, value) if isinstance(value, list) else value))
    return Tokenizer.from_metadata(meta, "the bundled vocabulary with Mistral's markers")


@pytest.mark.parametrize("name", list(MISTRAL_CALLS))
def test_a_mistral_grammar_allows_a_valid_call_and_no_other(mistral_tok: Tokenizer,
                                                           name: str) -> None:
    grammar = FORMATS[name].grammar([TIME], parallel=False)
    good = Constraint(vocabulary(mistral_tok), grammar)
    call = ToolCall("call_1", "get_time", '{"zone": "utc"}')
    for t in mistral_tok.encode(FORMATS[name].call_text(call)):  # the markers spelled out
        assert good.allowed([])[t]
        good.consume(t)
    assert good.complete
    assert FORMATS[name].parse(mistral_tok.decode(mistral_tok.encode(
        FORMATS[name].call_text(call))), [TIME])[1][0].arguments == '{"zone": "utc"}'
    bad = Constraint(vocabulary(mistral_tok), grammar)
    with pytest.raises(GrammarError):
        for t in mistral_tok.encode(FORMATS[name].call_text(call).replace("utc", "gmt")):
            bad.consume(t)


# --- which format a template points to ---------------------------------------------------

@pytest.mark.parametrize(("template", "name"), [
    ("<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>"
     "{% for k, v in tool_call.arguments|items %}", "qwen_xml"),            # Qwen 3.5, Coder
    ('<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}', "hermes"),
    ("<|start_header_id|>ipython<|end_header_id|>\\n\\n{{ 'Environment: ipython' }}",
     "llama3"),                                                            # Llama 3.2
    ("<|python_tag|>{{ tool_call.name }}.call(<|eom_id|>", "llama3"),       # Llama 3.1, 3.3
    ("{{ '[TOOL_CALLS]' + name }}{{ '[CALL_ID]' + id }}{{ '[ARGS]' + args|tojson }}",
     "mistral"),                                                           # Small 3.2
    ('{{- "[TOOL_CALLS][" }}{{ tool_call.function|tojson }}', "mistral_list"),  # Nemo
    ("<start_of_turn>user\\n{{ content }}<end_of_turn>", "hermes"),          # gemma
])
def test_the_format_follows_each_familys_template(template: str, name: str) -> None:
    assert format_of(template).name == name


def test_the_mistral_markers_are_kept_in_the_decoded_text() -> None:
    assert FORMATS["mistral"].markers >= {"[TOOL_CALLS]", "[ARGS]"}
    assert "[TOOL_CALLS]" in FORMATS["mistral_list"].markers
