"""Gateway: the HTTP service of a node, and what every API handler shares.

A handler parses its body (openai.py, anthropic.py), asks the Gateway to resolve the
model, build and check the prompt, and bound max_tokens, then returns a
GenerationResponse for the resulting Job. The Gateway holds the Generator (a local
engine or a swarm route: only the contract in kvasird.inference.api is used), the
tokenizer of each model (read from the model's manifest: a node that holds no part of the
model is a gateway too), the limits, and the counters the status page shows.
"""

from __future__ import annotations

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
    """Choices asked for: each is a generation of its own (``requests``)."""

    def requests(self) -> tuple[GenerationRequest, ...]:
        """What the Generator gets for each choice (``request`` is choice 0's)."""
        return tuple(for_choice(self.request, i) for i in range(self.n))


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
    ) -> list[int]:
        """Token ids of the messages (and tools offered) through the model's chat template
        (no limits applied)."""
        try:
            text = template.render(messages, tools)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), field) from None
        return tokenizer.encode(text, special=True)

    def check_prompt(self, info: ModelInfo, prompt: list[int], field: str) -> list[int]:
        """The prompt, if it is not empty and leaves room for at least one token."""
        if not prompt:
            raise BadRequest(f"`{field}` is empty: there is nothing to continue", field)
        limit = self.config.max_prompt_tokens
        what = "this gateway's limit ([gateway] max_prompt_tokens)"
        if info.context_length - 1 < limit:
            limit, what = info.context_length - 1, "what the model's context leaves room for"
        if len(prompt) > limit:
            raise BadRequest(
                f"the prompt is {len(prompt)} tokens, over {what}: {limit}",
                field,
                "context_length_exceeded",
            )
        return prompt

    def max_tokens(self, requested: int | None, field: str) -> int:
        cap = self.config.max_tokens
        if requested is None:
            return cap
        if requested < 1:
            raise BadRequest(f"`{field}` must be at least 1, got {requested}", field)
        if requested > cap:
            raise BadRequest(
                f"`{field}` = {requested} exceeds this gateway's limit of {cap} "
                "([gateway] max_tokens)",
                field,
            )
        return requested

    def choices(self, requested: int) -> int:
        """OpenAI's ``n``, within [gateway] max_n."""
        cap = self.config.max_n
        if requested < 1:
            raise BadRequest(f"`n` must be at least 1, got {requested}", "n")
        if requested > cap:
            raise BadRequest(
                f"`n` = {requested} exceeds this gateway's limit of {cap} choices "
                "([gateway] max_n)",
                "n",
            )
        return requested

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
