"""The daemon a gateway test module talks to (imported by name; conftest puts this folder on
sys.path)."""

from __future__ import annotations

from dataclasses import dataclass

from kvasird.localnet import LocalNode
from kvasird.text.chat import ChatTemplate, Message
from kvasird.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Daemon:
    node: LocalNode
    """The daemon process."""
    url: str
    """Its gateway's base URL."""
    model: str
    """The id of the model it serves."""
    tokenizer: Tokenizer
    """The bundled model's tokenizer, for counting tokens in tests."""

    def prompt_tokens(self, messages: list[Message]) -> int:
        text = ChatTemplate.of(self.tokenizer).render(messages)
        return len(self.tokenizer.encode(text, special=True))
