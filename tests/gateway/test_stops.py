"""Text-level stop sequences while streaming: nothing of a stop sequence ever reaches the client."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvasird.gateway.stops import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], str | None]:
    matcher, sent = StopMatcher(stops), []
    for piece in pieces:
        text, hit = matcher.feed(piece)
        sent.append(text)
        if hit is not None:
            return sent, hit
    sent.append(matcher.flush())
    return sent, None


def test_a_stop_split_across_pieces_is_held_back_then_dropped() -> None:
    sent, hit = run(["Observation:"], ["The answer", " is 4. Obs", "erv", "ation: x"])
    assert "".join(sent) == "The answer is 4. " and hit == "Observation:"
    assert sent[1] == " is 4. "  # "Obs" waited for the next piece


def test_a_false_start_is_released_when_it_stops_matching() -> None:
    sent, hit = run(["END"], ["an EN", "D", "ing"])
    assert hit == "END" and "".join(sent) == "an "
    sent, hit = run(["END"], ["an EN", "VY of it"])
    assert hit is None and "".join(sent) == "an ENVY of it"


def test_the_earliest_of_several_stops_wins() -> None:
    sent, hit = run(["world", "lo w"], ["hello world"])
    assert (hit, "".join(sent)) == ("lo w", "hel")


def test_text_held_at_the_end_is_flushed_when_no_stop_came() -> None:
    sent, hit = run(["STOP"], ["last ST"])
    assert hit is None and sent == ["last ", "ST"]


@given(st.text(max_size=40), st.lists(st.integers(1, 8), max_size=10), st.text(min_size=1,
                                                                              max_size=4))
def test_output_is_the_text_before_the_first_stop_however_it_is_split(
        text: str, cuts: list[int], stop: str) -> None:
    pieces, rest = [], text
    for n in cuts:
        pieces.append(rest[:n])
        rest = rest[n:]
    pieces.append(rest)
    sent, hit = run([stop], pieces)
    i = text.find(stop)
    assert "".join(sent) == (text[:i] if i >= 0 else text)
    assert hit == (stop if i >= 0 else None)
