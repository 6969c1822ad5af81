"""OpenAI's API: /v1/chat/completions, /v1/completions, /v1/models, /v1/models/{model}.

Streams exactly as the official client parses them: ``data: {chunk}`` events, the
first chat delta carrying the role, a last chunk with ``finish_reason``, then (with
``stream_options.include_usage``) a chunk with empty ``choices`` and the usage, and
``data: [DONE]`` always last, after an error too. Keep-alives are SSE comments. With
``n`` choices every chunk carries its choice's ``index``, each choice gets its own
first and last chunk, and the usage counts the prompt once and the tokens of every choice.
A legacy completion may send several prompts: each gets ``n`` choices, prompt i's choices
numbered from i × n, and the usage counts each prompt once.

The model list answers an Anthropic client (one that sends ``anthropic-version``) in
Anthropic's shape, so both SDKs' ``models.list()`` read it.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvasird import __version__
from kvasird.gateway.body import Fields, objects, read_json, text
from kvasird.gateway.errors import ApiError, BadRequest, NotFound
from kvasird.gateway.generation import Choice, Done, Piece
from kvasird.gateway.response import GenerationResponse, sse
from kvasird.gateway.service import Gateway, Job
from kvasird.gateway.tools import (
    ToolUse,
    finish_with_calls,
    openai_calls,
    openai_tool_calls,
    openai_tool_use,
    thinking_in,
)
from kvasird.inference.api import (
    LLAMA_SERVER,
    ModelInfo,
    Recommended,
    Sampling,
    SamplingParams,
    TokenEvent,
)
from kvasird.model.names import slug
from kvasird.text.chat import Message
from kvasird.text.grammar import JSON_OBJECT, GrammarError, check, for_json_schema
from kvasird.text.tokenizer import Tokenizer
from kvasird.text.toolcalls.events import Args, CallOpened, Event, Reader, Said, Thought

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
MAX_STOPS = 16
FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}
DONE = b"data: [DONE]\n\n"


async def chat_completions(gw: Gateway, request: Request) -> GenerationResponse:
    f = await read_json(request, gw.config.max_body_bytes)
    name = f.string("model")
    info, tok, template = gw.resolve(name)
    use = openai_tool_use(f, template)
    reasoning = gw.reasoning(template, f.string("reasoning_effort", None), "reasoning_effort")
    prompt = gw.check_prompt(
        info,
        gw.chat_prompt(template, tok, messages(f), "messages", use.tools, reasoning),
        "messages",
    )
    logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", 0, 0, 20)
    if top and not logprobs:
        raise BadRequest("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    field = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    limit = gw.output_limit(info, prompt, f.integer(field, None), field)
    job = gw.job(
        info,
        tok,
        name,
        prompt,
        sampling(f, limit.granted, top if logprobs else -1, use.grammar, tok, info.sampling),
        stops=stops(f),
        stream=f.boolean("stream", False),
        include_usage=f.obj("stream_options").boolean("include_usage", False),
        top_logprobs=top if logprobs else -1,
        ignore_eos=f.boolean("ignore_eos", False),
        n=gw.choices(f.integer("n", 1)),
        limit=limit,
        reasoning=reasoning,
    )
    return GenerationResponse(gw, job, ChatRenderer(job, thinking_in(use, tok, prompt)))


async def completions(gw: Gateway, request: Request) -> GenerationResponse:
    """A legacy completion of one prompt or several (each answered by ``n`` choices, numbered
    as OpenAI numbers them); with ``echo`` each choice's text starts with its prompt."""
    f = await read_json(request, gw.config.max_body_bytes)
    name = f.string("model")
    info, tok, _ = gw.resolve(name)
    given = completion_prompts(f, tok, gw.config.parse_special)
    prompts = [gw.check_prompt(info, ids, "prompt") for ids, _ in given]
    if f.has("suffix"):
        raise BadRequest("`suffix` is not supported by this gateway", "suffix")
    f.integer("best_of", 1, 1, 1)
    asked = f.integer("logprobs", None, 0, 20)
    top = -1 if asked is None else asked
    echo = f.boolean("echo", False)
    if echo and asked is not None:
        raise BadRequest(
            "`echo` with `logprobs` would need the prompt's log probabilities, which this "
            "gateway does not compute: drop one of them",
            "echo",
        )
    longest = max(prompts, key=len)
    limit = gw.output_limit(info, longest, f.integer("max_tokens", 16), "max_tokens")
    job = gw.job(
        info,
        tok,
        name,
        prompts[0],
        sampling(f, limit.granted, top, tok=tok, defaults=info.sampling),
        stops=stops(f),
        stream=f.boolean("stream", False),
        include_usage=f.obj("stream_options").boolean("include_usage", False),
        top_logprobs=top,
        ignore_eos=f.boolean("ignore_eos", False),
        n=gw.choices(f.integer("n", 1), len(prompts)),
        prompts=tuple(tuple(p) for p in prompts) if len(prompts) > 1 else (),
        limit=limit,
    )
    echoed = tuple(text_ for _, text_ in given) if echo else ()
    return GenerationResponse(gw, job, CompletionRenderer(job, echoed))


async def models(gw: Gateway, request: Request) -> JSONResponse:
    """The models served, as a list in the calling API's shape: Anthropic's for a client that
    sends ``anthropic-version`` (its SDK always does), else OpenAI's."""
    if _anthropic_client(request):
        data = [anthropic_model(m, gw.created) for m in gw.models()]
        return JSONResponse(
            {
                "data": data,
                "has_more": False,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        )
    return JSONResponse(
        {"object": "list", "data": [model_object(m, gw.created) for m in gw.models()]}
    )


async def model(gw: Gateway, request: Request) -> JSONResponse:
    """One model object, found by any name a request may give it (``model_object``), in the
    calling API's shape."""
    name = request.path_params["model"]
    shape = anthropic_model if _anthropic_client(request) else model_object
    for m in gw.models():
        if m.answers_to(name):
            return JSONResponse(shape(m, gw.created))
    known = ", ".join(f"{m.label} (id {m.model_id})" for m in gw.models()) or "none"
    raise NotFound(
        f"model {name!r} is not served by this gateway; models: {known} (name one "
        "by its name, its id or 8+ hex digits of it)",
        "model",
        "model_not_found",
    )


def model_object(m: ModelInfo, created: int) -> dict[str, Any]:
    """OpenAI's model object. ``id`` is the model's name on the network
    ("smollm2:135m-instruct"), the same on every node (names travel in the holders' signed
    records, and a name two models claim is refused) and what clients send back, as with
    ollama; ``model_id`` is the content id underneath it. ``name`` and ``label`` repeat
    the name for chat UIs that show them (Open WebUI does); ``slug`` is the form requests
    carried before names were ``family:tag``. A request may name the model by any of
    these, or by an 8+ hex digit prefix of the id."""
    return {
        "id": m.label,
        "object": "model",
        "created": created,
        "owned_by": "kvasir",
        "model_id": m.model_id,
        "name": m.label,
        "slug": slug(m.label),
        "label": m.label,
        "context_length": m.context_length,
    }


def anthropic_model(m: ModelInfo, created: int) -> dict[str, Any]:
    """Anthropic's model object: the same ``id`` as OpenAI's (the network's name)."""
    when = datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": m.label, "display_name": m.label, "created_at": when}


def _anthropic_client(request: Request) -> bool:
    return "anthropic-version" in request.headers


def messages(f: Fields) -> list[Message]:
    raw = f.array("messages")
    if not raw:
        raise BadRequest("`messages` must hold at least one message", "messages")
    out = []
    for m in objects(raw, "messages"):
        role = m.string("role")
        if role not in ROLES:
            raise BadRequest(
                f"`{m.where('role')}` must be one of {', '.join(ROLES)}, got {role!r}",
                m.where("role"),
            )
        content = m.value.get("content")
        if content is None and role != "assistant":
            raise BadRequest(f"`{m.where('content')}` is required", m.where("content"))
        text_ = content_text(content, m.where("content"))
        if role == "tool":
            out.append(
                Message(
                    "tool",
                    text_,
                    tool_call_id=m.string("tool_call_id", ""),
                    name=m.string("name", ""),
                )
            )
        elif role == "assistant" and m.has("tool_calls"):
            out.append(Message("assistant", text_, openai_calls(m)))
        else:
            out.append(Message(ROLES[role], text_))
    return out


def content_text(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A message's text: a string, or the text parts (of ``kinds``) of a content array."""
    if content is None:
        return ""
    if isinstance(content, str):
        return str(text(content, where))
    if not isinstance(content, list):
        raise BadRequest(f"`{where}` must be a string or an array of text parts", where)
    parts = []
    for part in objects(content, where):
        kind = part.string("type")
        if kind not in kinds:
            raise BadRequest(
                f"`{part.where('type')}` is {kind!r}: only text content is supported",
                part.where("type"),
            )
        parts.append(part.string("text"))
    return "".join(parts)


MAX_PROMPTS = 128
"""Prompts one legacy completion request may send (each is at least one generation, so
``[gateway] max_n`` bounds them first where it is lower)."""


def completion_prompts(
    f: Fields, tok: Tokenizer, special: bool, field: str = "prompt", most: int = MAX_PROMPTS
) -> list[tuple[list[int], str]]:
    """A legacy completion's prompts (or an embedding request's inputs: `field`), each as
    token ids and as text (what ``echo`` repeats): a string, an array of strings, an array
    of token ids, or an array of such arrays. With ``special`` (``[gateway] parse_special``)
    a string's control-token markers become those tokens, as llama-server reads them."""
    raw = f.value.get(field)
    if raw is None:
        raise BadRequest(f"`{field}` is required", field)
    if isinstance(raw, str) or (isinstance(raw, list) and raw and _ids(raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise BadRequest(
            f"`{field}` must be a string, an array of strings, an array of token ids or an "
            "array of such arrays",
            field,
        )
    if len(raw) > most:
        raise BadRequest(f"`{field}` holds {len(raw)} items, more than {most}", field)
    out = []
    for i, one in enumerate(raw):
        where = f"{field}[{i}]" if len(raw) > 1 else field
        if isinstance(one, str):
            out.append((tok.encode(text(one, where), special=special), one))
        elif isinstance(one, list) and _ids(one):
            bad = [t for t in one if not 0 <= t < tok.n_vocab]
            if bad:
                raise BadRequest(
                    f"`{where}` holds token id {bad[0]}, outside the vocabulary "
                    f"0..{tok.n_vocab - 1}",
                    where,
                )
            out.append((list(one), tok.decode(one)))
        else:
            raise BadRequest(f"`{where}` must be a string or an array of token ids", where)
    return out


def _ids(values: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def sampling(
    f: Fields,
    max_tokens: int,
    top_logprobs: int,
    tool_grammar: str = "",
    tok: Tokenizer | None = None,
    defaults: Recommended = LLAMA_SERVER,
) -> Sampling:
    """The sampling settings of a request; ``tool_grammar`` forces tool calls (tools);
    ``logit_bias`` ids are checked against ``tok``'s vocabulary (None: no model at hand, as
    for the defaults /props shows, and no token may be biased). Besides OpenAI's settings,
    llama-server's ``top_k``, ``min_p``, ``repetition_penalty`` and ``repeat_last_n`` (how
    many of the last tokens the penalties count). What the request leaves unset of
    temperature, top-k, top-p and min-p is the model's ``defaults``, as llama-server's."""
    if f.value.get("functions"):
        raise BadRequest("`functions` is not supported by this gateway: use `tools`", "functions")
    seed = f.integer("seed", None)
    params = SamplingParams(
        **unset_as(f, defaults, 2),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0.01, 10),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2, 2),
        presence_penalty=f.number("presence_penalty", 0.0, -2, 2),
        penalty_last_n=f.integer("repeat_last_n", SamplingParams.penalty_last_n, 0, (1 << 31) - 1),
        logit_bias=logit_bias(f.obj("logit_bias"), tok.n_vocab if tok is not None else 0),
        seed=None if seed is None else seed % (1 << 64),
        grammar=tool_grammar or response_format(f.obj("response_format")),
    )
    if tool_grammar and response_format(f.obj("response_format")):
        raise BadRequest(
            "`response_format` and a `tool_choice` that forces a call cannot "
            "both hold the reply: drop one",
            "response_format",
        )
    return Sampling(params, max_tokens, max(top_logprobs, 1) if top_logprobs >= 0 else 0)


def logit_bias(f: Fields, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids (as decimal strings) to values in -100..100, each
    added to its token's logit before sampling."""
    pairs = {}
    for key in f.value:
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not 0 <= token < n_vocab:
            raise BadRequest(
                f"`{f.path}` keys must be token ids of this model, 0..{n_vocab - 1}, "
                f"as decimal strings; got {key!r:.40}",
                f.path,
            )
        if token in pairs:
            raise BadRequest(f"`{f.path}` names token {token} twice", f.path)
        pairs[token] = float(f.number(key, lo=-100, hi=100))
    return tuple(sorted(pairs.items()))


def response_format(f: Fields) -> str:
    """The grammar a ``response_format`` asks for ("" for text): ``json_object`` (any JSON
    object) or ``json_schema`` (``{"json_schema": {"name", "schema", "strict"}}``: output
    that validates against the schema, whether ``strict`` is set or not)."""
    kind = f.string("type", "text")
    try:
        if kind == "text":
            return ""
        if kind == "json_object":
            grammar = for_json_schema(JSON_OBJECT)
        elif kind == "json_schema":
            spec = f.obj("json_schema")
            spec.string("name", "")
            grammar = for_json_schema(spec.value.get("schema", {}), f"{spec.where('schema')}")
        else:
            raise BadRequest(
                f'`{f.where("type")}` must be "text", "json_object" or "json_schema", got {kind!r}',
                f.where("type"),
            )
        check(grammar, f.path)
    except GrammarError as exc:
        raise BadRequest(f"`{f.path}`: {exc}", f.path) from None
    return grammar


def unset_as(f: Fields, defaults: Recommended, hottest: float) -> dict[str, Any]:
    """A request's temperature (0..`hottest`), top-k, top-p and min-p, each the model's
    default where the request leaves it unset (every API)."""
    return {
        "temperature": f.number("temperature", defaults.temperature, 0, hottest),
        "top_p": top_p(f, defaults.top_p),
        "top_k": f.integer("top_k", defaults.top_k, 0, 1 << 20),
        "min_p": f.number("min_p", defaults.min_p, 0, 1),
    }


def top_p(f: Fields, default: float = 1.0) -> float:
    """`top_p` in (0, 1], `default` when absent (every API)."""
    value = float(f.number("top_p", default, 0, 1))
    if value == 0:
        raise BadRequest("`top_p` must be greater than 0", "top_p")
    return value


def stops(f: Fields, name: str = "stop") -> tuple[str, ...]:
    raw = f.value.get(name)
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise BadRequest(f"`{name}` must be a string or an array of strings", name)
    if len(items) > MAX_STOPS or any(not s or len(s) > 256 for s in items):
        raise BadRequest(
            f"`{name}` takes up to {MAX_STOPS} non-empty sequences of at most 256 characters", name
        )
    return tuple(text(s, name) for s in items)


class _OpenAIRenderer:
    """What chat and text completions share: envelope, usage, errors, the stream's end."""

    ping = b": ping\n\n"
    prefix = ""
    """Of the response id ("chatcmpl", "cmpl")."""
    kind = ""
    """The ``object`` of a chunk."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.id = f"{self.prefix}-{job.request.request_id}"
        self.created = int(time.time())

    def error(self, err: ApiError) -> dict[str, Any]:
        return err.openai()

    def stream_error(self, err: ApiError) -> list[bytes]:
        return [sse(err.openai()), DONE]

    def usage(self, dones: list[Done]) -> dict[str, Any]:
        """Each prompt once (its choices all continue it), the tokens of all choices; the
        prompt tokens each prompt's first choice's route started from kept KV (OpenAI's
        cached tokens); and, when the output limit was clamped, what was asked and granted
        (``OutputLimit.usage``)."""
        firsts = dones[:: self.job.per_prompt]
        prompt, completion = (
            sum(d.prompt_tokens for d in firsts),
            sum(d.completion_tokens for d in dones),
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in firsts)},
            **(self.job.limit.usage() if self.job.limit else {}),
        }

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        return {
            **self.envelope([self.choice(c) for c in choices]),
            "usage": self.usage([c.done for c in choices]),
        }

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.job.model_name,
            "system_fingerprint": f"kvasird-{__version__}",
            "choices": choices,
            **extra,
        }
        if self.job.stream and self.job.include_usage:
            out.setdefault("usage", None)
        return out

    def stream_end(self, dones: list[Done]) -> list[bytes]:
        out = [sse(self.envelope([self.final_choice(d)])) for d in dones]
        if self.job.include_usage:
            out.append(sse(self.envelope([], usage=self.usage(dones))))
        return [*out, DONE]

    def choice(self, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def final_choice(self, done: Done) -> dict[str, Any]:
        raise NotImplementedError


class ChatRenderer(_OpenAIRenderer):
    """Chat completions. With tools, each choice's text is parsed into its content and its
    tool calls; a stream sends content as soon as it cannot be the start of a call, and
    each call as it is written: a first ``delta.tool_calls`` entry with its id and name,
    then its arguments as partial JSON (as OpenAI streams them). The model's reasoning
    (harmony's analysis channel) is ``reasoning_content``, as llama-server sends it."""

    prefix, kind = "chatcmpl", "chat.completion.chunk"

    def __init__(self, job: Job, use: ToolUse | None = None) -> None:
        super().__init__(job)
        self.use = use or ToolUse()
        self._readers: dict[int, Reader] = {}
        """Each choice's reply being read for calls, while tools are offered."""
        self._called: set[int] = set()
        """Choices that made a call."""

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        return {**super().body(choices), "object": "chat.completion"}

    def choice(self, c: Choice) -> dict[str, Any]:
        reply = self.use.read(c.text)
        calls = list(reply.calls)
        message: dict[str, Any] = {"role": "assistant", "content": reply.text, "refusal": None}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if calls:
            message.update(content=reply.text or None, tool_calls=openai_tool_calls(calls))
        return {
            "index": c.done.index,
            "message": message,
            "logprobs": self.logprobs(list(c.tokens)),
            "finish_reason": self.finish(c.done, bool(calls)),
        }

    def finish(self, done: Done, called: bool) -> str:
        return "tool_calls" if finish_with_calls(done.reason, called) else FINISH[done.reason]

    def stream_start(self) -> list[bytes]:
        return [
            sse(
                self.envelope(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
            for i in range(self.job.n)
        ]

    def stream_piece(self, piece: Piece) -> list[bytes]:
        if self.use.reads:
            return self._deltas(piece.index, self._reader(piece.index).feed(piece.text))
        if not piece.text and self.job.top_logprobs < 0:
            return []
        return [
            sse(
                self.envelope(
                    [
                        {
                            "index": piece.index,
                            "delta": {"content": piece.text},
                            "logprobs": self.logprobs(list(piece.tokens)),
                            "finish_reason": None,
                        }
                    ]
                )
            )
        ]

    def stream_end(self, dones: list[Done]) -> list[bytes]:
        out = []
        if self.use.reads:
            for done in dones:
                out += self._deltas(done.index, self._reader(done.index).end())
        return out + super().stream_end(dones)

    def _reader(self, index: int) -> Reader:
        if index not in self._readers:
            self._readers[index] = self.use.reader()
        return self._readers[index]

    def _deltas(self, index: int, events: list[Event]) -> list[bytes]:
        out = []
        for e in events:
            if isinstance(e, Said):
                delta: dict[str, Any] = {"content": e.text}
            elif isinstance(e, Thought):
                delta = {"reasoning_content": e.text}
            elif isinstance(e, CallOpened):
                self._called.add(index)
                delta = {
                    "tool_calls": [
                        {
                            "index": e.index,
                            "id": e.id,
                            "type": "function",
                            "function": {"name": e.name, "arguments": ""},
                        }
                    ]
                }
            elif isinstance(e, Args):
                delta = {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
            else:
                continue
            out.append(
                sse(
                    self.envelope(
                        [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
                    )
                )
            )
        return out

    def final_choice(self, done: Done) -> dict[str, Any]:
        return {
            "index": done.index,
            "delta": {},
            "logprobs": None,
            "finish_reason": self.finish(done, done.index in self._called),
        }

    def logprobs(self, tokens: list[TokenEvent]) -> dict[str, Any] | None:
        if self.job.top_logprobs < 0:
            return None
        tok, n = self.job.tokenizer, self.job.top_logprobs
        return {
            "content": [
                {
                    **_token(tok, t.token, t.logprob),
                    "top_logprobs": [_token(tok, i, lp) for i, lp in t.top[:n]],
                }
                for t in tokens
            ],
            "refusal": None,
        }


class CompletionRenderer(_OpenAIRenderer):
    """Legacy completions; with ``echo``, each choice's text begins with its prompt (a stream
    sends it in a first chunk of each choice)."""

    prefix, kind = "cmpl", "text_completion"

    def __init__(self, job: Job, echo: tuple[str, ...] = ()) -> None:
        super().__init__(job)
        self.echo = echo
        """Each prompt's text, when the request asked for ``echo``."""

    def echoed(self, index: int) -> str:
        """What choice ``index``'s text begins with: its prompt, when echoed."""
        return self.echo[index // self.job.per_prompt] if self.echo else ""

    def choice(self, c: Choice) -> dict[str, Any]:
        return {
            "index": c.done.index,
            "text": self.echoed(c.done.index) + c.text,
            "logprobs": self.logprobs(list(c.tokens)),
            "finish_reason": FINISH[c.done.reason],
        }

    def stream_start(self) -> list[bytes]:
        return [
            sse(
                self.envelope(
                    [{"index": i, "text": self.echoed(i), "logprobs": None, "finish_reason": None}]
                )
            )
            for i in range(self.job.n)
            if self.echo
        ]

    def stream_piece(self, piece: Piece) -> list[bytes]:
        if not piece.text and self.job.top_logprobs < 0:
            return []
        return [
            sse(
                self.envelope(
                    [
                        {
                            "index": piece.index,
                            "text": piece.text,
                            "logprobs": self.logprobs(list(piece.tokens)),
                            "finish_reason": None,
                        }
                    ]
                )
            )
        ]

    def final_choice(self, done: Done) -> dict[str, Any]:
        return {
            "index": done.index,
            "text": "",
            "logprobs": None,
            "finish_reason": FINISH[done.reason],
        }

    def logprobs(self, tokens: list[TokenEvent]) -> dict[str, Any] | None:
        if self.job.top_logprobs < 0:
            return None
        tok, n = self.job.tokenizer, self.job.top_logprobs
        texts = [tok.token_bytes(t.token).decode("utf-8", "replace") for t in tokens]
        offsets = [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                {tok.token_bytes(i).decode("utf-8", "replace"): lp for i, lp in t.top[:n]}
                for t in tokens
            ],
            "text_offset": offsets,
        }


def _token(tok: Tokenizer, token: int, logprob: float | None) -> dict[str, Any]:
    raw = tok.token_bytes(token)
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}
