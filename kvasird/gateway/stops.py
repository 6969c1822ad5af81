"""Text-level stop sequences, matched on the decoded text as it streams.

A stop sequence may arrive split across tokens ("Ob" + "serv" + "ation:"), so text
that could still be the start of one is held back until the next token decides;
nothing of a stop sequence is ever sent to the client.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to send now, the stop sequence that matched or None)."""
        buf = self._held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            i, stop = min(hits)
            self._held = ""
            return buf[:i], stop
        keep = max(
            (
                n
                for s in self.stops
                for n in range(min(len(s) - 1, len(buf)), 0, -1)
                if buf.endswith(s[:n])
            ),
            default=0,
        )
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """What was held back, once the generation ended without a stop sequence."""
        held, self._held = self._held, ""
        return held
