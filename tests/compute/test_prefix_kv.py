"""Prefix reuse in the KV pool (kv.prefix.PrefixCache): a session that starts from a closed
session's pages computes what a cold one computes, the pages are shared until written,
the cache gives way to new sessions, and it serves only the scope that filed a page."""

from __future__ import annotations

import numpy as np
import pytest

from kvasird.compute.errors import InputError, KVCacheFull
from kvasird.compute.kv.keys import KEY_BYTES, PAGE, page_keys, split_keys
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.stage import Stage
from kvasird_dev.testmodels import make_model

ME = ("gateway", (0, 3))


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("prefix") / "llama.gguf", arch="llama",
                      n_layer=3, seed=4)
    st = Stage.load(path, threads=1, kv=KVSpec(n_slots=16 * PAGE, dtype="f16"))
    yield st
    st.close()


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n)


def kept(stage: Stage, ids: np.ndarray, scope: object) -> list[bytes]:
    """Compute `ids` in a session, close it keeping its pages under `scope`: their keys."""
    keys = split_keys(page_keys(ids))
    with stage.open_session() as s:
        stage.forward(s, ids, 0)
        s.close(scope, keys)
    return keys


def cold(stage: Stage, ids: np.ndarray, chunks: list[int]) -> np.ndarray:
    """Logits of the last position, prefilled in `chunks` from position 0."""
    with stage.open_session() as s:
        at = 0
        for n in chunks:
            out = stage.forward(s, ids[at:at + n], at)
            at += n
        return out


def test_page_keys_chain_every_token_before_a_page() -> None:
    a, b = tokens(200), tokens(200)
    b[3] += 1
    ka, kb = split_keys(page_keys(a)), split_keys(page_keys(b))
    assert len(ka) == 200 // PAGE and all(len(k) == KEY_BYTES for k in ka)
    assert all(x != y for x, y in zip(ka, kb, strict=True))  # one token changes every later key
    assert split_keys(page_keys(a[:150])) == ka[:2]
    with pytest.raises(InputError, match="16-byte units"):
        split_keys(b"x" * 17)


def test_a_session_from_a_kept_prefix_computes_the_cold_logits_bit_for_bit(stage) -> None:
    ids = tokens(300)
    keys = split_keys(page_keys(ids))
    want = cold(stage, ids, [256, 44])
    with stage.open_session() as first:
        stage.forward(first, ids[:256], 0)
        stage.forward(first, ids[256:], 256)
        first.close(ME, keys)
    free = stage.kv.free_pages
    with stage.open_session() as again:
        n, _ = again.attach(ME, keys)
        assert n == 4 * PAGE and stage.kv.prefix.hits >= 4
        got = stage.forward(again, ids[256:], 256)
    assert np.array_equal(got, want)
    assert stage.kv.free_pages == free  # the kept pages count as free


def test_shared_pages_are_copied_before_a_write_into_them(stage) -> None:
    ids = tokens(260, seed=1)
    keys = split_keys(page_keys(ids))
    with stage.open_session() as first:
        stage.forward(first, ids, 0)
        first.close(ME, keys)
    kept = [stage.kv.prefix._pages[(ME, k)][0] for k in keys]
    other = np.concatenate([ids[:100], tokens(60, seed=2)])
    with stage.open_session() as s:
        stage.forward(s, ids[:260], 0)
        want_other = stage.forward(s, other[100:], 100)
    with stage.open_session() as s:
        assert s.attach(ME, keys)[0] == 4 * PAGE
        got = stage.forward(s, other[100:], 100)  # a rewind into the second kept page
        assert s.pages[0] == kept[0] and s.pages[1] != kept[1]  # page 1 copied, then written
    assert np.array_equal(got, want_other)
    with stage.open_session() as s:
        stage.forward(s, ids, 0)
        want = stage.forward(s, ids[256:], 256)
    with stage.open_session() as s:  # the kept pages were not written to
        assert s.attach(ME, keys)[0] == 4 * PAGE
        assert np.array_equal(stage.forward(s, ids[256:], 256), want)


def test_the_cache_serves_only_the_scope_that_kept_a_page(stage) -> None:
    keys = kept(stage, tokens(130, seed=3), ME)
    with stage.open_session() as s:
        assert s.attach(("someone else", (0, 3)), keys) == (0, None)
    with stage.open_session() as s:
        assert s.attach(ME, keys[:1] + [b"\0" * KEY_BYTES])[0] == PAGE


def test_kept_pages_give_way_to_new_sessions_tail_first(stage) -> None:
    kv = stage.kv
    keys = kept(stage, tokens(6 * PAGE, seed=4), ("a", (0, 3)))
    assert kv.free_pages == kv.n_pages  # everything is free or evictable
    with stage.open_session() as big:
        big.reserve(0, (kv.n_pages - 2) * PAGE)  # takes every free page and 4 kept ones
        with stage.open_session() as s:
            assert s.attach(("a", (0, 3)), keys)[0] == 2 * PAGE  # the head of the chain stays
        with stage.open_session() as more, pytest.raises(KVCacheFull):
            more.reserve(0, 3 * PAGE)


def test_a_page_in_use_by_a_session_is_never_evicted(stage) -> None:
    kv = stage.kv
    keys = kept(stage, tokens(2 * PAGE, seed=5), ("b", (0, 3)))
    with stage.open_session() as reader:
        assert reader.attach(("b", (0, 3)), keys)[0] == 2 * PAGE
        with stage.open_session() as big:
            big.reserve(0, kv.free_pages * PAGE)
            assert set(big.pages).isdisjoint(reader.pages)
            with stage.open_session() as more, pytest.raises(KVCacheFull):
                more.reserve(0, PAGE)


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss"])
def windowed(request, tmp_path_factory):
    """A model with sliding-window layers (gemma3: a 100-position window across pages;
    gpt-oss: 4 positions, sinks, experts), rings for two sessions."""
    extra = {"sliding_window": 100} if request.param == "gemma3" else {}
    path = make_model(tmp_path_factory.mktemp("prefix-swa") / f"{request.param}.gguf",
                      arch=request.param, n_layer=3, seed=7, **extra)
    st = Stage.load(path, threads=1, kv=KVSpec(n_slots=64 * PAGE, dtype="f16",
                                               window_sessions=2))
    assert st.kv.window_layers and st.kv.prefix is not None
    yield st
    st.close()


def test_a_windowed_session_from_a_kept_history_computes_the_cold_logits(windowed) -> None:
    """An agent's next call: the whole history of the last one (a prefill, then decoded
    tokens) and a new turn. The full layers' pages are shared, the window before the kept
    run's end is copied into the new session's ring: the logits are bitwise those of a
    cold run that computes the same positions in the same graphs."""
    stage, kv = windowed, windowed.kv
    ids = tokens(900, seed=8)
    with stage.open_session() as first:
        stage.forward(first, ids[:600], 0)
        for i in range(600, 650):
            stage.forward(first, ids[i:i + 1], i)
        first.close(ME, split_keys(page_keys(ids[:650])))
    assert kv.prefix.ring_pages > 0
    free = kv.free_tokens
    with stage.open_session() as again:
        n, _ = again.attach(ME, split_keys(page_keys(ids)))
        assert n == 640  # the 10 full pages the last call held
        got = stage.forward(again, ids[640:], 640)
        with pytest.raises(InputError, match="replay the history from position 0"):
            again.truncate(200)  # before the tail's window: never held here
    want = cold(stage, ids, [600, *[1] * 40, 260])  # its rows computed as the first call's
    assert np.array_equal(got, want)
    assert kv.free_tokens == free  # kept pages and tails count as free


def test_a_windowed_prefix_continues_only_where_the_kept_ring_holds_its_window(
        windowed) -> None:
    """A kept history of 1500 positions: a prompt that runs on from it past page 21
    (where the next call's template renders the last answer differently) starts from that
    page, bitwise as a cold run; one that shares only the first 300 positions (a common
    system prompt, then other turns) finds no window that far back and starts cold."""
    stage = windowed
    ids = tokens(1500, seed=9)
    kept(stage, ids, ("c", (0, 3)))
    late, early = ids.copy(), ids.copy()
    late[1400:] = tokens(100, seed=10)
    early[300:] = tokens(1200, seed=10)
    with stage.open_session() as s:
        assert s.attach(("c", (0, 3)), split_keys(page_keys(early))) == (0, None)
        assert s.pages == [] and s.ring == []
    with stage.open_session() as s:
        assert s.attach(("c", (0, 3)), split_keys(page_keys(late)))[0] == 21 * PAGE
        got = stage.forward(s, late[21 * PAGE:], 21 * PAGE)
    assert np.array_equal(got, cold(stage, late, [21 * PAGE, 1500 - 21 * PAGE]))


def test_kept_rings_give_way_to_new_sessions(windowed) -> None:
    """Kept rings hold window-pool pages: two new sessions that need whole rings evict
    them instead of being refused, and the evicted history is no longer found."""
    stage, kv = windowed, windowed.kv
    keys = kept(stage, tokens(700, seed=11), ("d", (0, 3)))
    assert kv.prefix.ring_pages > 0
    with stage.open_session() as a, stage.open_session() as b:
        for s in (a, b):
            stage.forward(s, tokens(kv.ring * PAGE, seed=12), 0)
        assert kv.prefix.ring_pages == 0
    with stage.open_session() as s:
        assert s.attach(("d", (0, 3)), keys)[0] == 0


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("hybrid") / "qwen35.gguf", arch="qwen35",
                      n_layer=4, seed=6)
    st = Stage.load(path, threads=1, kv=KVSpec(n_slots=16 * PAGE, dtype="f16", state_slots=4))
    yield st
    st.close()


def test_a_recurrent_session_from_a_kept_history_computes_the_cold_logits(hybrid) -> None:
    """qwen35 (delta-net layers): a closed session's pages up to its last page boundary are
    kept with its state there; a session whose tokens start the same way continues from
    that boundary, with the logits of a cold run bit for bit."""
    ids = tokens(300, seed=5)
    kept(hybrid, ids, ME)
    more = np.concatenate([ids, tokens(40, seed=6)])
    with hybrid.open_session() as s:
        n, _ = s.attach(ME, split_keys(page_keys(more)))
        assert n == 4 * PAGE  # the last boundary of the 300 kept: 256
        got = hybrid.forward(s, more[n:], n)
    np.testing.assert_array_equal(got, cold(hybrid, more, [len(more)]))
    with hybrid.open_session() as s:  # another history: nothing kept for it
        assert s.attach(ME, split_keys(page_keys(tokens(300, seed=7))))[0] == 0


def test_kept_states_and_marks_give_way_to_new_sessions(hybrid) -> None:
    """State slots kept for prefixes, and the copies live sessions keep at their page
    boundaries, are free for the taking: four sessions run on a pool of four slots."""
    kept(hybrid, tokens(130, seed=8), ME)
    assert hybrid.kv.prefix.states
    sessions = [hybrid.open_session() for _ in range(4)]
    try:
        for i, s in enumerate(sessions):
            hybrid.forward(s, tokens(70, seed=9 + i), 0)
        assert not hybrid.kv.prefix.states  # evicted for the sessions
        assert sum(s.mark is not None for s in sessions) == 0  # the marks gave way as well
        assert all(s.n_past == 70 for s in sessions)
    finally:
        for s in sessions:
            s.close()
    assert hybrid.kv.free_states == 4


def test_a_recurrent_session_goes_back_to_a_copy_it_kept_and_only_there(hybrid) -> None:
    """A speculative step computed one position at a time keeps the state after each
    position (keep_rewind): the next step may start at any of them, as an attention
    layer's KV could, with the logits of a session that never went past it; where no copy
    was kept it cannot go back. A session that needs a slot takes the copies' slots."""
    ids = tokens(40, seed=11)
    with hybrid.open_session() as s:
        hybrid.forward(s, ids[:30], 0)
        for i in range(30, 34):  # 30 is the step's own token; 31-33 guesses
            hybrid.forward(s, ids[i : i + 1], i)
            if i < 33:
                s.keep_rewind()
        assert sorted(s.rewinds) == [31, 32, 33] and s.n_past == 34
        got = hybrid.forward(s, ids[32:34], 32)  # the head kept one guess: on from 32
        assert not s.rewinds  # the others freed
        with pytest.raises(InputError, match="cannot go back to position 31"):
            hybrid.forward(s, ids[31:32], 31)
    np.testing.assert_array_equal(got, cold(hybrid, ids[:34], [30, 1, 1, 2]))
    sessions = [hybrid.open_session() for _ in range(2)]
    try:
        hybrid.forward(sessions[0], ids[:3], 0)
        for i in range(3):
            hybrid.forward(sessions[0], ids[3 + i : 4 + i], 3 + i)
            sessions[0].keep_rewind()
        assert len(sessions[0].rewinds) == 3  # with its state, all four slots
        hybrid.forward(sessions[1], ids[:5], 0)  # a new session takes a copy's slot
        assert not sessions[0].rewinds and sessions[1].n_past == 5
        # going back now is a hop out of capacity (the gateway's "busy"), not a bad request
        with pytest.raises(KVCacheFull, match="state_slots"):
            hybrid.forward(sessions[0], ids[4:5], 4)
    finally:
        for s in sessions:
            s.close()
    assert hybrid.kv.free_states == 4
