"""The KV cache of a stage, one module per concept.

    keys       PAGE, the page keys (a hash chain over a session's tokens) and their
               splitting; pure Python, no ggml: the gateway and the stage protocol use it
    pool       KVSpec, KVPool (the stage's bounded K/V tensors and the free lists of its
               main pages, window pages and state slots) and Session (one generation's
               pages, ring and state, taken in `reserve`, given back in `close`)
    window     the sliding-window ring's arithmetic: ring_pages, which pages a chunk
               reads and where its positions go
    recurrent  StateSlots: the delta-net layers' fixed-size states, a slot per session
    prefix     PrefixCache: closed sessions' pages, rings and states by page key

pool builds on the other four; window and prefix build on keys; prefix and recurrent name
the pool's classes only as types, so the modules import one way.

Prefix reuse, from the gateway's tokens to the pages a new session starts from:

    tokens ─▶ page_keys: key[i] = H(key[i-1], tokens of page i)  (computed by the gateway,
              which alone sees every token; a stage behind the first sees hidden rows only)
    open:  Session.attach(scope, keys) ─▶ the longest run key[0..m) the cache holds ─▶
           those pages, shared (a reference each), n_past = m * PAGE
    step:  reserve(start) first gives up the shared pages at or after `start` (a fresh page
           each, the part before `start` copied: copy-on-write), so a session writes only
           pages it alone holds
    close: Session.close(keep) hands its first len(keep) full pages to the cache under keep
"""
