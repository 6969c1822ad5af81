"""Gateway: the HTTP service of a node, and what every API handler shares.

A handler parses its body (openai.py, anthropic.py), asks the Gateway to resolve the
model, build and check the prompt, and bound max_tokens, then returns a
GenerationResponse for the resulting Job. The Gateway holds the Generator (a local
engine or a swarm route: only the contract in kvasird.inference.api is used), the
tokenizer of each model, the limits, and the counters the status page shows.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from kvasird.config import GatewayConfig
from kvasird.gateway.errors import BadRequest, NotFound, Unavailable
from kvasird.gateway.stats import GatewayStats
from kvasird.http import serve_asgi
from kvasird.inference.api import GenerationRequest, Generator, ModelInfo, Sampling
from kvasird.inference.chat import ChatTemplate, ChatTemplateError, Message
from kvasird.inference.tokenizer import Tokenizer
from kvasird.logs import get_logger

if TYPE_CHECKING:
    from kvasird.daemon.node import Node

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


class Gateway:
    def __init__(self, config: GatewayConfig, *, node: Node | None = None,
                 generator: Generator | None = None,
                 load: Callable[[dict[str, Path]], Generator] | None = None,
                 models: Sequence[Path] = (), config_path: str = "kvasird.toml") -> None:
        """``models`` are the GGUFs whose tokenizers and chat templates the gateway uses.

        ``generator`` serves at once; ``load`` builds one in a worker thread once the
        gateway listens and the tokenizers are read (it gets {model id: GGUF path});
        until then the gateway answers 503 and /health says "starting".
        """
        self.config = config
        self.node = node
        self.generator = generator
        self.stats = GatewayStats()
        self.url = ""
        self._load = load
        self._paths = list(models)
        self._tokenizers: dict[str, tuple[Tokenizer, ChatTemplate]] = {}
        self._loaded = False
        self._config_path = config_path

    @classmethod
    def for_node(cls, node: Node) -> Gateway:
        """The node's gateway: tokenizer from [market] model; local generation when configured."""
        cfg = node.config
        if not cfg.market.model:
            return cls(cfg.gateway, node=node, config_path=str(node.home.config))
        path = Path(cfg.market.model).expanduser()
        load = None
        if cfg.gateway.local:
            from kvasird.inference.local import LocalGenerator  # deferred: loads ggml

            def load(ids: dict[str, Path]) -> Generator:
                model_id = next(i for i, p in ids.items() if p == path)
                return LocalGenerator.open(path, model_id, _label(path),
                                           threads=cfg.compute.threads,
                                           kv_tokens=cfg.gateway.kv_tokens)
        return cls(cfg.gateway, node=node, load=load, models=[path],
                   config_path=str(node.home.config))

    @property
    def ready(self) -> bool:
        return self.generator is not None and self._loaded

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, report the URL, then load tokenizers and the generator (if any) off-loop."""
        if not self.config.enabled:
            task_status.started("")
            return
        from kvasird.gateway.app import build_app

        owned = None
        try:
            async with trio.open_nursery() as nursery:
                self.url = await nursery.start(partial(
                    serve_asgi, build_app(self), self.config.listen, what="gateway",
                    config_hint=f"[gateway] listen in {self._config_path}"))
                task_status.started(self.url)
                ids = {}
                for path in self._paths:
                    model_id, tok = await trio.to_thread.run_sync(_read_model, path)
                    self._tokenizers[model_id] = (tok, ChatTemplate.of(tok))
                    ids[model_id] = path
                if self._load is not None:
                    owned = self.generator = await trio.to_thread.run_sync(self._load, ids)
                self._loaded = True
                log.info("gateway ready" if self.ready else "gateway listening without a model",
                         url=self.url)
        finally:
            if owned is not None and hasattr(owned, "close"):
                owned.close()

    # --- what handlers share ------------------------------------------------------------

    def models(self) -> list[ModelInfo]:
        return self.generator.models() if self.generator is not None else []

    def resolve(self, name: str) -> tuple[ModelInfo, Tokenizer, ChatTemplate]:
        """The model a request names (id, 8+ hex digit id prefix, or label) and its tokenizer."""
        if self.generator is None:
            raise Unavailable("this gateway has no generator yet: it is still loading, or the "
                              "node serves no model ([gateway] local / [market] model)",
                              code="not_ready")
        for info in self.generator.models():
            if name in (info.model_id, info.label) or (
                    len(name) >= 8 and info.model_id.startswith(name.lower())):
                if info.model_id not in self._tokenizers:
                    raise Unavailable(f"the tokenizer of {info.label} is not loaded yet",
                                      code="not_ready")
                tok, template = self._tokenizers[info.model_id]
                return info, tok, template
        known = ", ".join(f"{m.model_id} ({m.label})" for m in self.generator.models()) or "none"
        raise NotFound(f"model {name!r} is not served by this gateway; models: {known}",
                       "model", "model_not_found")

    def chat_prompt(self, template: ChatTemplate, tokenizer: Tokenizer,
                    messages: Sequence[Message], field: str) -> list[int]:
        try:
            text = template.render(messages)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), field) from None
        return self.check_prompt(tokenizer.encode(text, special=True), field)

    def check_prompt(self, prompt: list[int], field: str) -> list[int]:
        limit = self.config.max_prompt_tokens
        if not prompt:
            raise BadRequest(f"`{field}` is empty: there is nothing to continue", field)
        if len(prompt) > limit:
            raise BadRequest(f"the prompt is {len(prompt)} tokens, over this gateway's limit of "
                             f"{limit} ([gateway] max_prompt_tokens)", field,
                             "context_length_exceeded")
        return prompt

    def max_tokens(self, requested: int | None, field: str) -> int:
        cap = self.config.max_tokens
        if requested is None:
            return cap
        if requested < 1:
            raise BadRequest(f"`{field}` must be at least 1, got {requested}", field)
        if requested > cap:
            raise BadRequest(f"`{field}` = {requested} exceeds this gateway's limit of {cap} "
                             "([gateway] max_tokens)", field)
        return requested

    def job(self, info: ModelInfo, tokenizer: Tokenizer, name: str, prompt: list[int],
            sampling: Sampling, **options: object) -> Job:
        request = GenerationRequest(model=info.model_id, prompt=tuple(prompt), sampling=sampling,
                                    stop_tokens=tokenizer.special.end_of_generation,
                                    request_id=secrets.token_hex(12))
        assert self.generator is not None, "resolve() found the model first"
        return Job(request, self.generator, tokenizer, name, **options)  # type: ignore[arg-type]


def _read_model(path: Path) -> tuple[str, Tokenizer]:
    from kvasird.model.manifest import Manifest

    return Manifest.from_gguf(path).model_id, Tokenizer.from_gguf(path)


def _label(path: Path) -> str:
    from kvasird.compute.gguffile import GGUFFile

    name = GGUFFile(path).get("general.name")
    return str(name) if name else path.stem
