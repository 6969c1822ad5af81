"""Gateway: the HTTP service of a node, and what every API handler shares.

A handler parses its body (openai.py, anthropic.py), asks the Gateway to resolve the
model, build and check the prompt, and bound max_tokens, then returns a
GenerationResponse for the resulting Job. The Gateway holds the Generator (a local
engine or a swarm route: only the contract in kvasird.inference.api is used), the
tokenizer of each model (read from the model's manifest: a node that holds no part of the
model is a gateway too), the limits, and the counters the status page shows.

Limits are llama-server's: a prompt may fill the model's context but for one token (or
``[gateway] max_prompt_tokens``, when set smaller), and an output limit above what the
context leaves after the prompt is clamped to it, not refused (OutputLimit says how it was
reported). Reasoning asked for (OpenAI's ``reasoning_effort``, Anthropic's ``thinking``)
sets the effort of a model that reasons (its format's ``reasons``: harmony), switches the
think-tag mode of a template that has one (``thinks``: Qwen3's ``enable_thinking``; effort
"none" turns it off, and so does an Anthropic request without ``thinking``), and is
ignored, said in the ``x-kvasir-reasoning`` header, by a model with neither.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import trio

from kvasird.config import GatewayConfig
from kvasird.errors import KvasirError
from kvasird.gateway.errors import BadRequest, NotFound, Unavailable
from kvasird.gateway.generation import for_choice
from kvasird.gateway.stats import GatewayStats
from kvasird.http import serve_asgi
from kvasird.inference.api import GenerationRequest, Generator, ModelInfo, NoRoute, Sampling
from kvasird.logs import get_logger
from kvasird.text.chat import ChatTemplate, ChatTemplateError, Message
from kvasird.text.tokenizer import Tokenizer
from kvasird.text.toolcalls.calls import Tool

if TYPE_CHECKING:
    from kvasird.gateway.payment import Settling
    from kvasird.gateway.status import NodeView
    from kvasird.inference.client.routing import Route
    from kvasird.inference.client.swarm import Progress
    from kvasird.model.manifest import Manifest

log = get_logger("kvasird.gateway")


EFFORTS = {
    "none": "low",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
}
"""A reasoning effort as the APIs name it -> the level harmony's template takes (it cannot
reason less than low, nor more than high)."""
REASONING_IGNORED = "ignored (this model has no reasoning mode)"


@dataclass(frozen=True)
class OutputLimit:
    """How many tokens a request may generate, and whether that is less than it asked for.

    A clamp is reported twice: in the usage (``requested_max_tokens`` and
    ``clamped_max_tokens``, integers the official SDKs keep as extra usage fields, whatever
    the field the request named) and in the ``x-kvasir-max-tokens`` response header, which
    a stream carries before its first token too."""

    field: str
    """The request's field that sets it: max_tokens, max_completion_tokens, max_output_tokens."""
    asked: int | None
    """What the request asked for (None: nothing, so ``[gateway] max_tokens``)."""
    granted: int
    """What it may generate: what it asked for within what the context leaves after the
    prompt. A paid request is priced for this."""
    context: int
    """The model's context (prompt and output), in tokens."""

    @property
    def clamped(self) -> bool:
        return self.asked is not None and self.granted < self.asked

    def usage(self) -> dict[str, int]:
        """The usage fields that report a clamp (none when the request got what it asked)."""
        if not self.clamped:
            return {}
        assert self.asked is not None
        return {"requested_max_tokens": self.asked, "clamped_max_tokens": self.granted}

    def header(self) -> str:
        """The ``x-kvasir-max-tokens`` header of a clamped request ("" when none)."""
        if not self.clamped:
            return ""
        return (
            f"{self.granted} (`{self.field}` {self.asked} clamped to what the model's "
            f"context of {self.context} tokens leaves after the prompt)"
        )


@dataclass(frozen=True)
class Reasoning:
    """What a request asked of the model's reasoning, and what this gateway made of it."""

    options: dict[str, str | bool]
    """Chat template variables that set it (harmony's ``reasoning_effort``, think-tag
    templates' ``enable_thinking``); none when the request asked nothing of a model whose
    default stands, or the model does not reason."""
    shown: bool
    """The reply carries the model's reasoning: Anthropic thinking blocks, the Responses
    API's reasoning item (OpenAI chat's ``reasoning_content`` is always sent)."""
    header: str
    """The ``x-kvasir-reasoning`` response header ("" when the request asked nothing)."""


NO_REASONING = Reasoning({}, False, "")


@dataclass(frozen=True)
class Job:
    """A checked request, ready to generate."""

    request: GenerationRequest
    """What the Generator gets (token ids only)."""
    generator: Generator
    """Who generates it (resolved when the request was checked)."""
    tokenizer: Tokenizer
    """Decodes the tokens back into text."""
    model_name: str
    """The model as the client named it (echoed in responses)."""
    stops: tuple[str, ...] = ()
    """Text-level stop sequences."""
    stream: bool = False
    """Answer with server-sent events."""
    include_usage: bool = False
    """OpenAI's stream_options.include_usage: a last chunk with usage and no choices."""
    top_logprobs: int = -1
    """Alternatives reported per token; -1 = no logprobs at all."""
    n: int = 1
    """Choices of the whole request: each is a generation of its own (``requests``)."""
    prompts: tuple[tuple[int, ...], ...] = ()
    """The prompts of a request that sends several (legacy completions), each answered by
    ``n // len(prompts)`` choices in turn; none: the one prompt of ``request``."""
    limit: OutputLimit | None = None
    """The output limit, as asked and as granted (None: set by the gateway, not asked)."""
    reasoning: Reasoning = NO_REASONING
    """What the request asked of the model's reasoning."""

    @property
    def per_prompt(self) -> int:
        """Choices per prompt (OpenAI's ``n``)."""
        return self.n // max(len(self.prompts), 1)

    def requests(self) -> tuple[GenerationRequest, ...]:
        """What the Generator gets for each choice (``request`` is choice 0's); choice i
        continues prompt i // per_prompt, as OpenAI numbers the choices of several prompts."""
        if not self.prompts:
            return tuple(for_choice(self.request, i) for i in range(self.n))
        return tuple(
            for_choice(
                dataclasses.replace(self.request, prompt=self.prompts[i // self.per_prompt]), i
            )
            for i in range(self.n)
        )

    @property
    def prompt_positions(self) -> int:
        """Prompt tokens all choices compute together (each computes its prompt)."""
        return sum(len(r.prompt) for r in self.requests())

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers that say what the gateway made of the request's limits and
        reasoning (none when it did as asked)."""
        out = [
            (b"x-kvasir-max-tokens", self.limit.header() if self.limit else ""),
            (b"x-kvasir-reasoning", self.reasoning.header),
        ]
        return [(name, value.encode()) for name, value in out if value]


HealthStatus = Literal["ok", "starting", "no_model", "no_route", "not_served"]
REFUSAL_SHOWN_S = 120.0
"""How long the peers' last refusal of this gateway stands in /health (unless a request is
served in between)."""


@dataclass(frozen=True)
class Health:
    """Whether this gateway can serve its model now, and why not. Never carries a secret
    (a path, a key, an address): /health shows it to anyone who asks."""

    status: HealthStatus
    """ok: a request would be served now; starting: the model's manifest (tokenizer, chat
    template) is not here yet, or the model is loading; no_model: this gateway has no model
    to serve; no_route: the online peers do not cover the model; not_served: the peers
    refused this gateway's last request (unpaid receipts, no stake, no credit left), and
    why."""
    reason: str
    """In words, for a person."""


@runtime_checkable
class Routing(Protocol):
    """A generator that plans a route through the swarm (SwarmGenerator)."""

    active: dict[str, Progress]
    """Generations in flight, by request id."""

    def plan(self) -> Route: ...

    def missing(self) -> str: ...


ModelSource = Callable[[], "Manifest | None"]
"""The manifest of the model served (the whole GGUF's metadata: tokenizer, chat template,
special tokens), or None while this node has not got it yet (read in a worker thread)."""
Waiting = Callable[[], str]
"""What the gateway waits for while its ModelSource has no manifest, in words a user can act on."""
Loader = Callable[[str], Generator]
"""Builds a Generator of the whole model, by its id (blocking; run in a worker thread)."""

SOURCE_POLL_S = 0.5


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        node: NodeView | None = None,
        settling: Settling | None = None,
        free_local: bool = False,
        generator: Generator | None = None,
        model: ModelSource | None = None,
        waiting: Waiting | None = None,
        load: Loader | None = None,
        config_path: str = "kvasird.toml",
    ) -> None:
        """``model`` gives the manifest the tokenizer and chat template are read from, so a
        gateway needs no byte of the model itself; ``waiting`` says what it waits for until
        then.

        ``generator`` serves at once; ``load`` builds one in a worker thread once the
        gateway listens and has the manifest. Until a generator and the tokenizer are
        there, the gateway answers 503 and /health says "starting".

        ``node`` is what /status shows of the node the gateway runs on, ``settling`` what
        its payments use of it (both None: a gateway without a node, requests free), and
        ``free_local`` whether this machine's own requests need no quote.
        """
        self.config = config
        self.node = node
        self.settling = settling
        self.free_local = free_local
        self.generator = generator
        self.stats = GatewayStats()
        self.url = ""
        self.created = int(time.time())
        """When this gateway started: the ``created`` of its models in OpenAI's model
        objects (a model file carries no date of its own)."""
        self._model = model
        self._load = load
        self.refusal: tuple[float, str] | None = None
        """When the peers last refused to serve this gateway, and why (cleared once a
        request is served)."""
        self._tokenizers: dict[str, tuple[Tokenizer, ChatTemplate]] = {}
        self._pooling = 0
        """The model's pooling type (GGUF ``{arch}.pooling_type``; 0: none said)."""
        self._width = 0
        """The model's hidden width (``{arch}.embedding_length``): its embeddings' size."""
        self._loaded = model is None
        self._waiting = waiting or (lambda: "waiting for the model's manifest")
        self._loading = ""
        """What the gateway does once it has the manifest, while it starts, in words."""
        self._config_path = config_path

    @property
    def ready(self) -> bool:
        """A request for the model would be served now (health is ok)."""
        return self.health().status == "ok"

    def health(self) -> Health:
        if self.generator is None and self._model is None:
            return Health(
                "no_model", "this node serves no model: set [market] model in its kvasird.toml"
            )
        if not self._loaded:
            return Health("starting", self._loading or self._waiting())
        models = self.models()
        if not models:
            return Health(
                "no_model",
                "the model could not be loaded for generation here (see the node's log)"
                if self._load is not None
                else "the generator serves no model yet",
            )
        route, missing = self.route_now()
        if route is None and missing:
            return Health("no_route", f"the online peers do not cover the model: {missing}")
        if self.refusal is not None and time.monotonic() - self.refusal[0] < REFUSAL_SHOWN_S:
            return Health("not_served", self.refusal[1])
        return Health("ok", f"serving {models[0].label}")

    def route_now(self) -> tuple[Route | None, str]:
        """The route a request would take now and, when there is none, what is missing.
        (None, "") for a generator that needs no route (the whole model loaded here)."""
        if not isinstance(self.generator, Routing):
            return None, ""
        try:
            return self.generator.plan(), ""
        except NoRoute:
            return None, self.generator.missing()

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, report the URL, then read the tokenizer and load the generator off-loop."""
        if not self.config.enabled:
            task_status.started("")
            return
        from kvasird.gateway.app import build_app

        owned = None
        try:
            async with trio.open_nursery() as nursery:
                self.url = await nursery.start(
                    partial(
                        serve_asgi,
                        build_app(self),
                        self.config.listen,
                        what="gateway",
                        section="gateway",
                        config_path=self._config_path,
                        allowed_hosts=self.config.allowed_hosts,
                        favours_this_machine=self.free_local,
                    )
                )
                task_status.started(self.url)
                if self._model is not None:
                    model_id, tok = await self._wait_for_model(self._model)
                    self._tokenizers[model_id] = (tok, ChatTemplate.of(tok))
                    if self._load is not None:
                        self._loading = "loading the model for local generation"
                        owned = self.generator = await self._load_generator(model_id)
                    self._loaded = True
                health = self.health()
                log.info(f"gateway {health.status}", url=self.url, reason=health.reason)
        finally:
            if owned is not None and hasattr(owned, "close"):
                owned.close()

    async def _wait_for_model(self, source: ModelSource) -> tuple[str, Tokenizer]:
        """The model's id and tokenizer, once its manifest is here. The manifest arrives
        through the market and the shard store, which have no event to wait on; a read that
        fails (a file being replaced) is logged and tried again, never the end of the node.
        The tokenizer is keyed by the manifest's id: the whole model's, never a slice's."""
        while True:
            try:
                manifest = await trio.to_thread.run_sync(source)
                if manifest is not None:
                    self._loading = "reading the model's tokenizer from its manifest"
                    tok = await trio.to_thread.run_sync(
                        Tokenizer.from_metadata,
                        manifest.metadata,
                        f"model {manifest.model_id[:16]}",
                    )
                    meta = manifest.meta
                    self._pooling = int(meta(f"{manifest.arch}.pooling_type", 0) or 0)
                    self._width = int(meta(f"{manifest.arch}.embedding_length", 0) or 0)
                    return manifest.model_id, tok
            except (KvasirError, OSError, ValueError) as exc:
                log.warning(
                    "the gateway cannot read its model yet: trying again", error=str(exc)[:300]
                )
            await trio.sleep(SOURCE_POLL_S)

    async def _load_generator(self, model_id: str) -> Generator | None:
        """The local generator, or None (logged, the gateway keeps answering 503) when the
        model cannot be loaded whole here."""
        assert self._load is not None
        try:
            return await trio.to_thread.run_sync(self._load, model_id)
        except KvasirError as exc:
            log.error(f"the gateway cannot load model {model_id[:16]} for local generation: {exc}")
            return None

    # --- what handlers share ------------------------------------------------------------

    def models(self) -> list[ModelInfo]:
        return self.generator.models() if self.generator is not None else []

    def resolve(self, name: str) -> tuple[ModelInfo, Tokenizer, ChatTemplate]:
        """The model a request names (ModelInfo.answers_to) and its tokenizer."""
        if self.generator is None:
            raise Unavailable(
                "this gateway has no generator yet: it is still loading, or the "
                "node serves no model ([gateway] local / [market] model)",
                code="not_ready",
            )
        for info in self.generator.models():
            if info.answers_to(name):
                if info.model_id not in self._tokenizers:
                    raise Unavailable(
                        f"the tokenizer of {info.label} is not loaded yet", code="not_ready"
                    )
                tok, template = self._tokenizers[info.model_id]
                return info, tok, template
        known = ", ".join(f"{m.model_id} ({m.label})" for m in self.generator.models()) or "none"
        raise NotFound(
            f"model {name!r} is not served by this gateway; models: {known}",
            "model",
            "model_not_found",
        )

    def chat_prompt(
        self,
        template: ChatTemplate,
        tokenizer: Tokenizer,
        messages: Sequence[Message],
        field: str,
        tools: Sequence[Tool] = (),
        reasoning: Reasoning = NO_REASONING,
    ) -> list[int]:
        """Token ids of the messages (and tools offered) through the model's chat template,
        with the reasoning effort asked for (no limits applied)."""
        text = self.chat_text(template, messages, field, tools, reasoning)
        return tokenizer.encode(text, special=True)

    def chat_text(
        self,
        template: ChatTemplate,
        messages: Sequence[Message],
        field: str,
        tools: Sequence[Tool] = (),
        reasoning: Reasoning = NO_REASONING,
    ) -> str:
        """The text chat_prompt encodes (what /apply-template shows)."""
        try:
            return template.render(messages, tools, reasoning.options)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), field) from None

    def check_prompt(self, info: ModelInfo, prompt: list[int], field: str) -> list[int]:
        """The prompt, if it is not empty and leaves room in the model's context for at
        least one token (and is within ``[gateway] max_prompt_tokens`` when that is set)."""
        if not prompt:
            raise BadRequest(f"`{field}` is empty: there is nothing to continue", field)
        limit = info.context_length - 1
        what = (
            f"what the model's context of {info.context_length} tokens leaves room for "
            "(one token of it for the reply): shorten the prompt"
        )
        if 0 < self.config.max_prompt_tokens < limit:
            limit = self.config.max_prompt_tokens
            what = (
                "this gateway's limit ([gateway] max_prompt_tokens): shorten the prompt, or "
                "ask the gateway's operator to raise the limit"
            )
        if len(prompt) > limit:
            raise BadRequest(
                f"the prompt is {len(prompt)} tokens, over {what}: {limit}",
                field,
                "context_length_exceeded",
            )
        return prompt

    def output_limit(
        self, info: ModelInfo, prompt: Sequence[int], asked: int | None, field: str
    ) -> OutputLimit:
        """How many tokens a request with this (checked) prompt may generate: what it asked
        for, or ``[gateway] max_tokens`` when it asked nothing, within what the model's
        context leaves after the prompt (a clamp, as llama-server does, never a refusal)."""
        if asked is not None and asked < 1:
            raise BadRequest(f"`{field}` must be at least 1, got {asked}", field)
        room = info.context_length - len(prompt)
        wanted = self.config.max_tokens if asked is None else asked
        return OutputLimit(field, asked, max(min(wanted, room), 1), info.context_length)

    def pooling_type(self) -> int:
        """How the model's GGUF says to pool its hidden states into an embedding (llama.cpp's
        numbering: 1 mean, 2 cls, 3 last; 0: it says nothing)."""
        return self._pooling

    def embedding_width(self) -> int:
        """The size of the model's embeddings (0 until its manifest is read)."""
        return self._width

    def context(self) -> int:
        """The longest context of the models served (``[gateway] max_tokens`` while none is):
        the most output a quote need cover."""
        return max((m.context_length for m in self.models()), default=self.config.max_tokens)

    def reasoning(
        self, template: ChatTemplate, effort: str | None, field: str, off: bool = False
    ) -> Reasoning:
        """What a request's reasoning ``effort`` (None: it asked nothing) does on this
        model: sets the effort of a model that reasons on a channel (harmony), switches the
        think-tag mode of one that has it ("none" turns it off; so does asking nothing,
        with ``off``: Anthropic's API thinks only when asked), is ignored by the others."""
        fmt = template.tool_format
        if effort is None:
            return (
                Reasoning({"enable_thinking": False}, False, "")
                if off and fmt.thinks
                else NO_REASONING
            )
        if effort not in EFFORTS:
            raise BadRequest(
                f"`{field}` must be one of {', '.join(EFFORTS)}, got {effort!r}", field
            )
        if fmt.thinks:
            on = effort != "none"
            return Reasoning({"enable_thinking": on}, on, "on" if on else "off")
        if not fmt.reasons:
            return Reasoning({}, False, REASONING_IGNORED)
        level = EFFORTS[effort]
        return Reasoning({"reasoning_effort": level}, True, f"on (effort {level})")

    def choices(self, requested: int, prompts: int = 1) -> int:
        """OpenAI's ``n`` for each of ``prompts`` prompts: the choices of the whole
        request, within [gateway] max_n."""
        cap = self.config.max_n
        if requested < 1:
            raise BadRequest(f"`n` must be at least 1, got {requested}", "n")
        if requested * prompts > cap:
            asked = f"{prompts} prompts × n = {requested}" if prompts > 1 else f"`n` = {requested}"
            raise BadRequest(
                f"{asked} exceeds this gateway's limit of {cap} choices "
                "([gateway] max_n): each choice is a generation of its own",
                "n",
            )
        return requested * prompts

    def job(
        self,
        info: ModelInfo,
        tokenizer: Tokenizer,
        name: str,
        prompt: list[int],
        sampling: Sampling,
        *,
        ignore_eos: bool = False,
        **options: object,
    ) -> Job:
        """``ignore_eos`` (vLLM's extension) generates max_tokens whatever the model says."""
        ends = frozenset() if ignore_eos else tokenizer.special.end_of_generation
        request = GenerationRequest(
            model=info.model_id,
            prompt=tuple(prompt),
            sampling=sampling,
            stop_tokens=ends,
            request_id=secrets.token_hex(12),
        )
        assert self.generator is not None, "resolve() found the model first"
        return Job(request, self.generator, tokenizer, name, **options)  # type: ignore[arg-type]
