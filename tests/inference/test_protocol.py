"""The inference protocols' messages: strict validation naming the field, the wire form
round trip, and bytes identical to what the nodes sent before the messages were typed."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import numpy as np
import pytest

from kvasird.compute.sampling import SamplingParams
from kvasird.errors import WireError
from kvasird.inference.api import TokenEvent
from kvasird.inference.protocol import experts, stage, tensors
from kvasird.inference.protocol.stage import (
    MAX_TRACE,
    Close,
    Closed,
    Failure,
    Forward,
    Hidden,
    Open,
    Opened,
    Ping,
    Pong,
    Result,
    Step,
)
from kvasird.wire import pack, unpack

GONE: Any = object()
"""A field's value meaning: leave the field out."""
ROWS = tensors.encode(np.ones((2, 8), np.float32), "f32")
SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1,
            "seed": 7}


def open_wire() -> dict[str, Any]:
    """An open as the gateway has always sent it (the key order too)."""
    return {"op": "open", "sid": "ab.1", "model": "f" * 64, "first": 2, "end": 5,
            "embed": False, "head": True, "max_tokens": 300, "sampling": dict(SAMPLING),
            "logprobs": 3, "draws": 4, "prev": "peerA"}


def forwarded_wire() -> dict[str, Any]:
    """A traced chain step as the gateway has always sent it."""
    return {"op": "step", "sid": "ab.0", "start": 9, "x": tensors.encode(np.array([5, 6]), "i32"),
            "ids": [5, 6], "owner": "gw", "back": {"ticket": "t1"},
            "next": [["peerB", "ab.1"], ["peerC", "ab.2"]], "trace": [[1.0, 2.0, 3.0, 4.0, 0.0]]}


def relayed_wire() -> dict[str, Any]:
    return {"op": "step", "sid": "ab.1", "start": 9, "x": ROWS}


def result_wire() -> dict[str, Any]:
    return {"op": "result", "ticket": "t1", "token": 17, "logprob": -0.25,
            "top": [[17, -0.25], [3, -1.5]], "trace": [[1.0, 2.0, 3.0, 4.0, 0.5]]}


def failure_wire() -> dict[str, Any]:
    return {"op": "result", "ticket": "t1", "error": "no such session", "code": "gone",
            "peer": "peerB"}


def experts_wire() -> dict[str, Any]:
    return {"op": "experts", "layer": 3, "first": 4, "rows": ROWS,
            "ids": tensors.encode(np.array([[0, 1], [2, 2]]), "i32"),
            "for": [[b"delegation of gw1", 1], [b"delegation of gw2", 1]]}


def edited(msg: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """`msg` with the field at dotted `path` set to `value` (or removed: GONE)."""
    out = copy.deepcopy(msg)
    *inner, last = path.split(".")
    at = out
    for key in inner:
        at = at[key]
    if value is GONE:
        del at[last]
    else:
        at[last] = value
    return out


def close_wire() -> dict[str, Any]:
    return {"op": "close", "sid": "ab.1", "keep": b"k" * 32}


WIRE = {"open": open_wire, "close": close_wire, "forwarded": forwarded_wire, "relayed": relayed_wire,
        "result": result_wire, "failure": failure_wire, "experts": experts_wire}
PARSE = {"experts": experts.parse}
BAD = [
    # (message, field, bad value, what the error must name)
    ("open", "sid", 5, "stage.sid"), ("open", "sid", "s" * 65, "stage.sid"),
    ("open", "model", GONE, "stage.model"), ("open", "first", -1, "stage.first"),
    ("open", "first", "2", "stage.first"), ("open", "first", True, "stage.first"),
    ("open", "end", 1, "stage.end"), ("open", "end", 5000, "stage.end"),
    ("open", "embed", 1, "stage.embed"), ("open", "head", 1, "stage.head"),
    ("open", "prompt", -1, "stage.prompt"), ("open", "prompt", "3", "stage.prompt"),
    ("open", "sampling.grammar", 7, "stage.sampling.grammar"),
    ("open", "sampling.grammar", "x" * (256 * 1024 + 1), "stage.sampling.grammar"),
    ("open", "head", "true", "stage.head"), ("open", "embed", GONE, "stage.embed"),
    ("open", "max_tokens", 0, "stage.max_tokens"),
    ("open", "max_tokens", 1 << 23, "stage.max_tokens"),
    ("open", "logprobs", 21, "stage.logprobs"), ("open", "logprobs", -1, "stage.logprobs"),
    ("open", "prev", 7, "stage.prev"), ("open", "draws", -1, "stage.draws"),
    ("open", "draws", GONE, "stage.draws"),  # a sampled stream's replay must say how far
    ("open", "sampling", "greedy", "stage.sampling"), ("open", "sampling", GONE, "stage.sampling"),
    ("open", "sampling.temperature", -1, "stage.sampling.temperature"),
    ("open", "sampling.temperature", "1", "stage.sampling.temperature"),
    ("open", "sampling.top_k", -1, "stage.sampling.top_k"),
    ("open", "sampling.top_k", 1.5, "stage.sampling.top_k"),
    ("open", "sampling.top_p", 2, "stage.sampling.top_p"),
    ("open", "sampling.top_p", 0, "top_p"),
    ("open", "sampling.repetition_penalty", 0, "stage.sampling.repetition_penalty"),
    ("open", "sampling.seed", 1.5, "stage.sampling.seed"),
    ("open", "sampling.seed", True, "stage.sampling.seed"),
    ("open", "sampling.seed", -1, "seed"),
    ("open", "prefix", "ab" * 8, "stage.prefix"), ("open", "prefix", b"k" * 17, "stage.prefix"),
    ("open", "prefix", b"k" * 16 * 5, "stage.prefix"),  # 300 positions hold 4 full pages
    ("close", "keep", [b"k" * 16], "stage.keep"), ("close", "keep", b"k" * 15, "stage.keep"),
    ("forwarded", "sid", None, "stage.sid"), ("forwarded", "start", -1, "stage.start"),
    ("forwarded", "start", True, "stage.start"), ("forwarded", "x", "ids", "stage.x"),
    ("forwarded", "x.dt", "i64", "stage.x.dt"), ("forwarded", "x.shape", [2, 1], "stage.x.shape"),
    ("forwarded", "x.data", b"\0" * 4, "stage.x.data"),
    ("forwarded", "ids", [5], "stage.ids"), ("forwarded", "ids", [5, -6], "stage.ids"),
    ("forwarded", "ids", [5, True], "stage.ids"), ("forwarded", "ids", "56", "stage.ids"),
    ("forwarded", "back", "t1", "stage.back"), ("forwarded", "back.ticket", 1, "stage.back.ticket"),
    ("forwarded", "next", "peerB", "stage.next"), ("forwarded", "next", [[1, 2]], "stage.next"),
    ("forwarded", "next", [["peerB"]], "stage.next"),
    ("forwarded", "next", [["peerB", "s"]] * 65, "stage.next"),
    ("forwarded", "owner", 5, "stage.owner"), ("forwarded", "trace", "now", "stage.trace"),
    ("forwarded", "trace", [["1.0"]], "stage.trace"), ("forwarded", "trace", [[1]], "stage.trace"),
    ("relayed", "x.shape", [2], "stage.x.shape"),
    ("result", "ticket", GONE, "stage.ticket"), ("result", "token", -1, "stage.token"),
    ("result", "token", True, "stage.token"), ("result", "logprob", "x", "stage.logprob"),
    ("result", "logprob", math.nan, "stage.logprob"), ("result", "top", [[17]], "stage.top"),
    ("result", "top", [[17, "x"]], "stage.top"), ("result", "top", [[17, -1.0]] * 21, "stage.top"),
    ("result", "trace", [[1.0, "2"]], "stage.trace"),
    ("failure", "error", 5, "stage.error"), ("failure", "peer", GONE, "stage.peer"),
    ("failure", "ticket", 3, "stage.ticket"),
    ("experts", "layer", -1, "experts.layer"), ("experts", "layer", 4096, "experts.layer"),
    ("experts", "layer", False, "experts.layer"), ("experts", "first", -1, "experts.first"),
    ("experts", "rows", GONE, "experts.rows"), ("experts", "rows.dt", "i32", "experts.rows.dt"),
    ("experts", "ids", tensors.encode(np.array([[0, 1]]), "i32"), "experts.ids.shape"),
    ("experts", "for", "gw1", "experts.for"), ("experts", "for", [1], "experts.for"),
    ("experts", "for", ["gw1", "gw2"], "experts.for"),  # bare names prove nothing
    ("experts", "for", [[b"d", 1]], "experts.for"),  # one row of the two unaccounted for
    ("experts", "for", [[b"d", 1], [b"e", 0], [b"f", 1]], "experts.for"),
    ("experts", "for", [[b"d" * 513, 2]], "experts.for"),
    ("experts", "for", [["d", 2]], "experts.for"),
    ("open", "delegation", "signed", "stage.delegation"),
    ("open", "delegation", b"", "stage.delegation"),
    ("open", "delegation", b"d" * 513, "stage.delegation"),
]


@pytest.mark.parametrize(("kind", "field", "value", "named"), BAD,
                         ids=[f"{k}.{f}={v!r:.20}" for k, f, v, _ in BAD])
def test_a_field_of_the_wrong_type_or_out_of_range_is_refused_by_name(
        kind: str, field: str, value: Any, named: str) -> None:
    parse = PARSE.get(kind, stage.parse)
    parse(WIRE[kind]())  # the message itself is fine
    with pytest.raises(WireError, match=re.escape(named)):
        parse(edited(WIRE[kind](), field, value))


@pytest.mark.parametrize("field", ["embed", "head"])
def test_a_boolean_given_as_1_is_refused(field: str) -> None:
    with pytest.raises(WireError, match=f"stage.{field}: expected true or false, got 1"):
        stage.parse(edited(open_wire(), field, 1))


@pytest.mark.parametrize("msg", [{"op": "lane"}, {"op": "Step"}, {"op": 3}, {"sid": "s"}])
def test_an_unknown_op_is_refused(msg: dict[str, Any]) -> None:
    with pytest.raises(WireError, match="stage.op: unknown op"):
        stage.parse(msg)
    with pytest.raises(WireError, match="experts.op: unknown op"):
        experts.parse(msg)


@pytest.mark.parametrize("kind", list(WIRE))
def test_every_message_survives_the_wire_unchanged(kind: str) -> None:
    """A message parsed, written and sent again is what arrived: the same keys and values,
    in the same order, so nodes of either version read each other's messages."""
    msg = WIRE[kind]()
    parse = PARSE.get(kind, stage.parse)
    once = parse(unpack(pack(msg)))
    assert pack(once.to_wire()) == pack(msg)
    assert pack(parse(unpack(pack(once.to_wire()))).to_wire()) == pack(msg)


def test_the_typed_messages_carry_the_values_the_wire_held() -> None:
    o = stage.parse(open_wire())
    assert o == Open("ab.1", "f" * 64, 2, 5, False, True, 300, 3, "peerA",
                     SamplingParams(0.7, 40, 0.9, 1.1, 7), 4)
    s = stage.parse(forwarded_wire())
    assert isinstance(s, Step) and s.forward == Forward(
        "t1", (("peerB", "ab.1"), ("peerC", "ab.2")), "gw", ((1.0, 2.0, 3.0, 4.0, 0.0),))
    assert s.x.tolist() == [5, 6] and s.dt == "i32" and s.ids == (5, 6)
    r = stage.parse(relayed_wire())
    assert isinstance(r, Step) and r.forward is None and r.ids is None
    assert r.x.shape == (2, 8) and r.dt == "f32"
    assert stage.parse(result_wire()) == Result(
        "t1", (TokenEvent(17, -0.25, ((17, -0.25), (3, -1.5))),), ((1.0, 2.0, 3.0, 4.0, 0.5),))
    assert stage.parse(failure_wire()) == Failure("t1", "gone", "no such session", "peerB")
    assert stage.parse({"op": "close", "sid": "s"}) == Close("s")
    assert stage.parse({"op": "ping", "sid": "s"}) == Ping("s")
    e = experts.parse(experts_wire())
    assert (e.layer, e.first, e.groups, e.dt) == (
        3, 4, ((b"delegation of gw1", 1), (b"delegation of gw2", 1)), "f32")
    assert e.rows.shape == (2, 8) and e.ids.tolist() == [[0, 1], [2, 2]]


def test_optional_fields_take_their_meaning_when_left_out() -> None:
    # a hop before the head needs no sampling, a greedy one no draws, and none a prev
    bare = {k: v for k, v in open_wire().items() if k not in ("sampling", "draws", "prev")}
    o = stage.parse({**bare, "head": False})
    assert isinstance(o, Open) and (o.prev, o.draws, o.sampling) == ("", 0, SamplingParams())
    greedy = stage.parse({**bare, "sampling": {**SAMPLING, "temperature": 0.0}})
    assert isinstance(greedy, Open) and greedy.draws == 0
    # a step whose owner is left out is its caller's; an expert request without `for`
    # names no gateway (which the worker refuses), an open without a delegation none
    s = stage.parse(edited(forwarded_wire(), "owner", GONE))
    assert isinstance(s, Step) and s.forward is not None and s.forward.owner is None
    assert experts.parse(edited(experts_wire(), "for", GONE)).groups == ()
    assert stage.parse(open_wire()).delegation == b"" and \
        "delegation" not in stage.parse(open_wire()).to_wire()
    # a token without logprobs, a seed left to the node
    assert stage.parse({"op": "result", "ticket": "t", "token": 2}) == Result("t", (TokenEvent(2),))
    assert stage.sampling_from_wire({**SAMPLING, "seed": None}, "s").seed is None


def test_a_replay_of_decode_steps_says_so_only_when_it_is_one() -> None:
    step = stage.parse(forwarded_wire())
    assert isinstance(step, Step) and not step.singly and "singly" not in step.to_wire()
    replay = stage.parse({**forwarded_wire(), "singly": True})
    assert isinstance(replay, Step) and replay.singly and replay.to_wire()["singly"] is True
    with pytest.raises(WireError, match="stage.singly: expected true or false, got 1"):
        stage.parse({**forwarded_wire(), "singly": 1})


def test_a_trace_past_its_hops_is_dropped_and_the_step_goes_on() -> None:
    long = [[1.0] * 5] * MAX_TRACE
    s = stage.parse(edited(forwarded_wire(), "trace", long))
    assert isinstance(s, Step) and s.forward is not None and s.forward.trace is None
    r = stage.parse(edited(result_wire(), "trace", long))
    assert isinstance(r, Result) and r.trace is not None
    r = stage.parse(edited(result_wire(), "trace", [*long, [1.0]]))
    assert isinstance(r, Result) and r.trace is None


def test_a_failure_code_outside_the_closed_set_reads_as_bad() -> None:
    for code in ("teapot", 7, None, ["busy"]):
        f = stage.parse(edited(failure_wire(), "code", code))
        assert isinstance(f, Failure) and f.code == "bad"
    for code in ("busy", "gone", "bad", "unpaid", "unreachable"):
        f = stage.parse(edited(failure_wire(), "code", code))
        assert isinstance(f, Failure) and f.code == code


def test_the_replies_the_client_reads_are_validated_too() -> None:
    assert Pong.from_wire({"at": 12, "id": 4}) == Pong(12)
    assert Closed.from_wire({"id": 4}) == Closed()
    assert Closed.from_wire({"experts": {"w1": 3, "w2": 1}}) == Closed((("w1", 3), ("w2", 1)))
    assert stage.token_from_wire({"token": 3, "logprob": -0.5, "top": [[3, -0.5]]}, "r") == \
        TokenEvent(3, -0.5, ((3, -0.5),))
    h = Hidden.from_wire({"x": tensors.encode(np.ones((1, 4)), "f16")})
    assert h.dt == "f16" and h.x.dtype == np.float32 and h.x.shape == (1, 4)
    out = experts.Outputs.from_wire({"out": tensors.encode(np.ones((2, 1, 4)), "f32")})
    assert out.out.shape == (2, 1, 4)
    for read, reply, named in [
            (Pong.from_wire, {"at": -1}, "reply.at"), (Pong.from_wire, {}, "reply.at"),
            (Closed.from_wire, {"experts": {"w1": 0}}, "reply.experts"),
            (Closed.from_wire, {"experts": {"w1": True}}, "reply.experts"),
            (Closed.from_wire, {"experts": [["w1", 1]]}, "reply.experts"),
            (Hidden.from_wire, {"x": tensors.encode(np.array([1]), "i32")}, "reply.x.dt"),
            (experts.Outputs.from_wire, {"out": ROWS}, "reply.out.shape")]:
        with pytest.raises(WireError, match=re.escape(named)):
            read(reply)


def test_sampling_has_one_wire_form() -> None:
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, repetition_penalty=1.2,
                       seed=(1 << 64) - 1)
    assert stage.sampling_to_wire(p) == {"temperature": 0.8, "top_k": 5, "top_p": 0.95,
                                         "repetition_penalty": 1.2, "seed": (1 << 64) - 1}
    assert stage.sampling_from_wire(unpack(pack(stage.sampling_to_wire(p))), "s") == p
    assert Open.from_wire(Open("s", "m", 0, 1, True, True, 8, sampling=p).to_wire()).sampling == p


def test_the_messages_are_the_bytes_the_untyped_code_sent() -> None:
    """What the stage server and the gateway wrote as dicts before: the same frames."""
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    hop = Step("s.2", 9, x, "f16", (4,), Forward("t", (("p3", "s.3"),), "gw", ((1.0,),)))
    assert pack(hop.to_wire()) == pack({
        "op": "step", "sid": "s.2", "start": 9, "x": tensors.encode(x, "f16"), "ids": [4],
        "owner": "gw", "back": {"ticket": "t"}, "next": [["p3", "s.3"]], "trace": [[1.0]]})
    head = TokenEvent(4, -0.1, ((4, -0.1), (2, -2.5)))
    assert pack(stage.token_to_wire(head)) == pack(
        {"token": 4, "logprob": -0.1, "top": [[4, -0.1], [2, -2.5]]})
    assert pack(Result("t", (head,)).to_wire()) == pack(
        {"op": "result", "ticket": "t", "token": 4, "logprob": -0.1,
         "top": [[4, -0.1], [2, -2.5]]})
    assert pack(Failure("t", "unreachable", "x" * 600, "p3").to_wire()) == pack(
        {"op": "result", "ticket": "t", "error": "x" * 500, "code": "unreachable", "peer": "p3"})
    assert Closed((("w", 2),)).to_wire() == {"experts": {"w": 2}} and Closed().to_wire() == {}
    rows, ids = np.ones((1, 8), np.float32), np.array([[3, 1]])
    assert pack(experts.ExpertRequest(2, 0, rows, ids, ((b"d", 1),), "f32").to_wire()) == pack(
        {"op": "experts", "layer": 2, "first": 0, "rows": tensors.encode(rows, "f32"),
         "ids": tensors.encode(ids, "i32"), "for": [[b"d", 1]]})


def test_each_api_builds_the_one_sampling_type_with_its_own_defaults() -> None:
    """OpenAI's APIs sample with the model's defaults (llama-server's, where its GGUF
    recommends none) unless told otherwise, the admin API greedily; the settings reach the
    head as they were asked for."""
    from kvasird.admin.generate import parse_request
    from kvasird.config import GatewayConfig
    from kvasird.gateway.body import Fields
    from kvasird.gateway.openai import sampling

    assert sampling(Fields({}), 16, -1).params == SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    admin = parse_request(Fields({"prompt": [1, 2]}), GatewayConfig()).sampling
    assert admin.params == SamplingParams(temperature=0.0) and admin.logprobs == 0
    asked = sampling(Fields({"temperature": 0.5, "top_p": 0.8, "top_k": 3, "seed": -1,
                             "repetition_penalty": 1.3, "min_p": 0.2}), 16, 2)
    assert asked.params == SamplingParams(0.5, 3, 0.8, 1.3, (1 << 64) - 1, min_p=0.2)
    assert asked.logprobs == 2 and asked.max_tokens == 16
    wire = Open("s", "m", 0, 1, True, True, 16, sampling=asked.params).to_wire()
    assert stage.sampling_from_wire(unpack(pack(wire))["sampling"], "s") == asked.params


def test_a_grammar_and_the_prompt_length_travel_to_the_head() -> None:
    o = stage.parse(edited(edited(open_wire(), "prompt", 6), "sampling.grammar", "start: /a+/"))
    assert o.prompt == 6 and o.sampling.grammar == "start: /a+/"
    assert stage.parse(unpack(pack(o.to_wire()))) == o
    assert "grammar" not in stage.parse(open_wire()).to_wire()["sampling"]


def test_prefix_keys_travel_as_one_byte_string_and_the_open_says_what_was_kept() -> None:
    keys = bytes(range(64))
    m = stage.parse(unpack(pack({**open_wire(), "prefix": keys})))
    assert isinstance(m, Open) and m.prefix == keys and m.to_wire()["prefix"] == keys
    assert stage.parse(open_wire()).prefix == b"" and "prefix" not in stage.parse(
        open_wire()).to_wire()
    c = stage.parse(close_wire())
    assert isinstance(c, Close) and c.keep == b"k" * 32 and Close("s").to_wire() == {
        "op": "close", "sid": "s"}
    assert Opened.from_wire({}) == Opened(0) and Opened(128).to_wire() == {"cached": 128}
    with pytest.raises(WireError, match="reply.cached"):
        Opened.from_wire({"cached": -1})


def test_rows_are_only_viewed_when_parsed_and_widened_when_the_server_asks() -> None:
    """Parsing a frame copies none of its rows (a stranger's frame costs nothing more than
    its bytes); the server widens them once it knows it works for the sender, and only then
    are they checked finite (a forwarded step's NaN reaches the stage, to name its sender)."""
    halves = tensors.encode(np.full((2, 8), 0.5, np.float32), "f16")
    step = stage.parse({**relayed_wire(), "x": halves})
    assert isinstance(step, Step) and step.x.dtype == np.float16 and not step.x.flags.writeable
    wide = step.widened()
    assert wide.x.dtype == np.float32 and wide.x.flags.writeable and (wide.x == 0.5).all()
    nan = tensors.encode(np.full((2, 8), np.nan, np.float32), "f32")
    relayed = stage.parse({**relayed_wire(), "x": nan})
    assert isinstance(relayed, Step)
    with pytest.raises(WireError, match="stage.x: contains NaN"):
        relayed.widened()
    forwarded = stage.parse({**forwarded_wire(), "x": nan})
    assert isinstance(forwarded, Step) and np.isnan(forwarded.widened().x).all()
    request = experts.parse({**experts_wire(), "rows": halves})
    assert request.rows.dtype == np.float16 and request.widened().rows.dtype == np.float32
    with pytest.raises(WireError, match="experts.rows: contains NaN"):
        experts.parse({**experts_wire(), "rows": nan}).widened()


def test_expert_units_are_the_experts_rows_selected_whatever_the_grouping() -> None:
    """Rows come padded with repeats of their first id; a worker meters each gateway's rows
    by the count its stage keeps, and the count of a request is the sum of its groups'."""
    ids = np.array([[3, 3], [1, 2], [5, 5], [0, 7]])
    assert experts.selections(ids) == 1 + 2 + 1 + 2
    assert experts.selections(ids[:1]) + experts.selections(ids[1:]) == experts.selections(ids)
    assert experts.selections(np.array([[4]])) == 1


def test_a_row_of_a_check_sent_on_alone_carries_its_place_and_every_id() -> None:
    """Step.part: row j of n of a forwarded speculative step computed singly, with the n
    ids the head draws against; anything else named part is refused, saying what it is."""
    row = {**forwarded_wire(), "x": tensors.encode(np.ones((1, 4), np.float32), "f32"),
           "singly": True, "verify": True, "part": [1, 2]}
    step = stage.parse(row)
    assert isinstance(step, Step) and step.part == (1, 2) and step.ids == (5, 6)
    assert step.to_wire()["part"] == [1, 2]
    assert stage.parse(step.to_wire()).part == (1, 2)
    assert "part" not in stage.parse(forwarded_wire()).to_wire()
    for bad in ([2, 2], [-1, 2], [0, 99], [0], "0/2", [0.0, 2]):
        with pytest.raises(WireError, match=r"stage.part: expected \[row, rows\]"):
            stage.parse({**row, "part": bad})
    two_rows = tensors.encode(np.ones((2, 4), np.float32), "f32")
    for bad_step in ({**row, "x": two_rows}, {**row, "singly": False},
                     {k: v for k, v in row.items() if k != "verify"},
                     {k: v for k, v in row.items() if k != "back"}):
        with pytest.raises(WireError, match="a part is one row of a forwarded speculative"):
            stage.parse(bad_step)
    with pytest.raises(WireError, match="stage.ids: expected the 2 token ids"):
        stage.parse({**row, "ids": [5]})
