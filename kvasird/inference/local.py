"""LocalGenerator: the Generator of a node that holds the whole model itself.

ggml computes in a worker thread (``trio.to_thread``) so the event loop keeps serving
HTTP, gossip and heartbeats while a token is computed. One stage computes one graph at
a time, so every step of every generation takes one FIFO lock: concurrent requests
advance in turn, a token (or a prefill chunk) each, and a long prompt cannot starve
the others. KV room is promised at admission (prompt + max_tokens, rounded to pages);
a request the pool cannot promise gets Busy up front instead of failing half-way.
Cancelling the consumer closes the session and returns its pages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import trio

from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.kv.keys import PAGE
from kvasird.compute.kv.pool import KVSpec, Session
from kvasird.compute.sampling import Recommended, Sampler, log_softmax
from kvasird.compute.stage import Stage
from kvasird.inference.api import (
    Busy,
    EmbeddingRequest,
    Finished,
    GenerationRequest,
    HopWork,
    ModelInfo,
    TokenEvent,
    UnknownModel,
    check_embedding_input,
)
from kvasird.text.grammar import Constraint, vocabulary
from kvasird.text.tokenizer import Tokenizer

PREFILL_CHUNK = 128
"""Prompt tokens computed per turn of the lock (a turn of a decoding request is 1 token)."""


class LocalGenerator:
    """A Generator over one Stage holding embedding, every layer and the head."""

    def __init__(self, stage: Stage, info: ModelInfo) -> None:
        if not (stage.embed and stage.head and stage.window == (0, stage.hp.n_layer)):
            raise UnknownModel("a local generator needs a stage holding the whole model")
        self.stage = stage
        self.info = info
        self._lock = trio.Lock()
        self._promised = 0
        self.path: Path | None = None
        """The GGUF it was loaded from (its tokenizer compiles grammars)."""
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def open(
        cls, path: str | Path, model_id: str, label: str, *, threads: int = 0, kv_tokens: int = 4096
    ) -> LocalGenerator:
        """Load the whole GGUF at ``path`` (blocking: call it from a worker thread)."""
        stage = Stage.load(path, threads=threads, kv=KVSpec(n_slots=kv_tokens))
        context = min(stage.hp.n_ctx_train, stage.kv.max_session_tokens)
        meta = GGUFFile(path).get
        generator = cls(stage, ModelInfo(model_id, label, context, Recommended.of(meta)))
        generator.path = Path(path)
        return generator

    def _constraint(self, grammar: str) -> Constraint | None:
        """A generation's grammar state (None without a grammar)."""
        if not grammar:
            return None
        if self._tokenizer is None:
            if self.path is None:
                raise UnknownModel(
                    "this generator was not loaded from a file: it has no "
                    "tokenizer to compile a grammar against"
                )
            self._tokenizer = Tokenizer.from_gguf(self.path)
        return Constraint(vocabulary(self._tokenizer), grammar)

    def work(self, request_id: str) -> tuple[HopWork, ...]:
        """Nothing to tell: this node computed all of it (the gateway counts it itself)."""
        return ()

    def models(self) -> list[ModelInfo]:
        return [self.info]

    def close(self) -> None:
        self.stage.close()

    def resolve(self, name: str) -> ModelInfo:
        """The model a request names (ModelInfo.answers_to)."""
        info = self.info
        if info.answers_to(name):
            return info
        raise UnknownModel(
            f"model {name!r} is not served here; GET /v1/models lists "
            f"{info.model_id} ({info.label})"
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | Finished]:
        self.resolve(request.model)
        s = request.sampling
        n_prompt = len(request.prompt)
        budget = min(s.max_tokens, self.info.context_length - n_prompt)
        promise = -(-(n_prompt + max(budget, 0)) // PAGE) * PAGE
        if n_prompt == 0 or budget < 1:
            raise Busy(
                f"the prompt of {n_prompt} tokens leaves no room in the context of "
                f"{self.info.context_length}: shorten it"
            )
        if self._promised + promise > self.stage.kv.n_slots:
            raise Busy(
                f"the KV cache is fully promised ({self._promised} of "
                f"{self.stage.kv.n_slots} slots in use): retry shortly"
            )
        self._promised += promise
        session: Session | None = None
        try:
            session = await self._step(self.stage.open_session)
            sampler = Sampler(s.params, self._constraint(s.params.grammar), n_prompt)
            history = list(request.prompt)
            logits = None
            for c in range(0, n_prompt, PREFILL_CHUNK):
                chunk = np.asarray(history[c : c + PREFILL_CHUNK], np.int64)
                logits = await self._step(self.stage.forward, session, chunk)
            produced = 0
            while True:
                assert logits is not None
                token = sampler(logits[-1], history)
                if token in request.stop_tokens:
                    reason = "stop"
                    break
                yield _event(token, logits[-1], s.logprobs)
                produced += 1
                history.append(token)
                if produced >= budget:
                    reason = "length"
                    break
                logits = await self._step(self.stage.forward, session, np.array([token]))
        finally:
            self._promised -= promise
            if session is not None:
                with trio.CancelScope(shield=True):
                    async with self._lock:
                        session.close()
        yield Finished(reason, n_prompt, produced)  # resources already freed: no close needed

    async def embed(self, request: EmbeddingRequest) -> list[np.ndarray]:
        """Each input's final-norm rows, one session each, in the prefill's chunks."""
        self.resolve(request.model)
        out: list[np.ndarray] = []
        for ids in request.inputs:
            check_embedding_input(ids, self.info.context_length)
            session = await self._step(self.stage.open_session)
            try:
                rows = [
                    await self._step(
                        self.stage.forward,
                        session,
                        np.asarray(ids[c : c + PREFILL_CHUNK], np.int64),
                        c,
                        "embd",
                    )
                    for c in range(0, len(ids), PREFILL_CHUNK)
                ]
            finally:
                with trio.CancelScope(shield=True):
                    async with self._lock:
                        session.close()
            out.append(np.concatenate(rows))
        return out

    async def _step(self, fn, *args):  # noqa: ANN001, ANN202 - a thin pass-through
        async with self._lock:
            return await trio.to_thread.run_sync(fn, *args)


def _event(token: int, logits: np.ndarray, n_top: int) -> TokenEvent:
    if n_top <= 0:
        return TokenEvent(token)
    lp = log_softmax(logits)
    top = np.argsort(-lp, kind="stable")[:n_top]
    return TokenEvent(token, float(lp[token]), tuple((int(i), float(lp[i])) for i in top))
