"""Reasoning between think tags, as Qwen3, DeepSeek-R1 and SmolLM3 write it:

    <think>
    the reasoning
    </think>

    the answer (text and calls, in the family's own format)

A chat template with such a mode holds both tags (``thinks``); Qwen3's switches it with the
variable ``enable_thinking`` (false: the template writes an empty think block itself, so
the reply is only the answer). Some templates open the block themselves (Qwen3-Thinking,
DeepSeek-R1: the prompt ends with ``<think>``), and the reply starts inside it
(``opens_thinking``). ThinkStream reads a reply of any family: a think block at its start
is Thought (never content), what follows goes to the family's own reader.
"""

from __future__ import annotations

from kvasird.text.toolcalls.events import Event, Reader, Thought

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template has a think-tag reasoning mode."""
    return bool(template) and OPEN in template and CLOSE in template  # type: ignore[operator]


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending with ``prompt_tail`` leaves its reply inside a think block."""
    return prompt_tail.rstrip().endswith(OPEN)


class ThinkStream:
    """A reply's think block as Thought (without the blank lines around it), the rest fed to
    ``inner``. Text is held back only while it may still be a tag."""

    def __init__(self, inner: Reader, opened: bool = False) -> None:
        self.inner = inner
        self._state = "think" if opened else "start"
        """start (nothing but blanks yet) -> think -> after (blanks after the block) -> said"""
        self._held = ""
        self._fresh = True
        """Nothing of the reasoning handed on yet (its leading blank lines are dropped)."""

    @property
    def cut(self) -> bool:
        return self.inner.cut

    def feed(self, text: str) -> list[Event]:
        self._held += text
        out: list[Event] = []
        if self._state == "start":
            lead = self._held.lstrip()
            if lead.startswith(OPEN):
                self._state, self._held = "think", lead[len(OPEN) :]
            elif OPEN.startswith(lead):
                return out  # blanks, or the first letters of the tag
            else:
                self._state = "said"
        if self._state == "think":
            at = self._held.find(CLOSE)
            if at < 0:
                keep = len(self._held) - _partial(self._held, CLOSE)
                keep = len(self._held[:keep].rstrip())  # blanks before the tag are not reasoning
                self._think(self._held[:keep], out)
                self._held = self._held[keep:]
                return out
            self._think(self._held[:at].rstrip(), out)
            self._state, self._held = "after", self._held[at + len(CLOSE) :]
        if self._state == "after":
            if not self._held.strip():
                return out
            self._state, self._held = "said", self._held.lstrip()
        rest, self._held = self._held, ""
        return out + (self.inner.feed(rest) if rest else [])

    def end(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "think":  # cut off while reasoning: all of it was reasoning
            self._think(self._held.rstrip(), out)
        elif self._state == "start" and self._held:
            out += self.inner.feed(self._held)
        self._held = ""
        return out + self.inner.end()

    def _think(self, text: str, out: list[Event]) -> None:
        if self._fresh:
            text = text.lstrip()
        if text:
            self._fresh = False
            out.append(Thought(text))


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
