"""What reading a reply hands on: a whole reply (Reply), or, as it streams, its events (Said,
CallOpened, Args, CallClosed, Broken, Thought) from a Reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvasird.text.toolcalls.calls import ToolCall


@dataclass(frozen=True)
class Reply:
    """A whole reply, read (``Format.read``)."""

    text: str
    """The text outside calls: the content."""
    calls: tuple[ToolCall, ...] = ()
    """Its complete calls, in order."""
    reasoning: str = ""
    """What the model reasoned before answering (Thought): never content."""


@dataclass(frozen=True)
class Said:
    """Text outside calls."""

    text: str


@dataclass(frozen=True)
class CallOpened:
    """A call began; ``index`` counts the reply's calls from 0."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Args:
    """More of call ``index``'s arguments, as JSON text."""

    index: int
    text: str


@dataclass(frozen=True)
class CallClosed:
    """Call ``index`` is complete."""

    index: int
    call: ToolCall


@dataclass(frozen=True)
class Broken:
    """Call ``index`` ended before its arguments did: it was no call. ``text`` is the block
    as written (a whole reply keeps it as text; a stream has sent its start already)."""

    index: int
    text: str


@dataclass(frozen=True)
class Thought:
    """The model's reasoning (harmony's analysis channel): not content."""

    text: str


Event = Said | CallOpened | Args | CallClosed | Broken | Thought


class Reader(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def end(self) -> list[Event]:
        """The events left once the reply has ended."""
        ...

    @property
    def cut(self) -> bool:
        """Whether the reply ended inside a call."""
        ...
