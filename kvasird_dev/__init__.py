"""Developer tools for kvasird: generated models, the market simulator, the churn soak.

Used by the tests, the benchmarks and developers, never by a daemon, so this package lives
beside ``kvasird`` in the repository and is not part of what pyproject.toml ships. It is
importable from the repository root: the tests put the root on sys.path (pytest's
``pythonpath``), the bench scripts insert it themselves, and ``python -m kvasird_dev``
finds it from there.

    testmodels   random-weight GGUFs with real llama.cpp metadata and the bundled tokenizer;
                 TestModelError when no test model has the dimensions asked for
    testvocab    vocabulary-only GGUFs under each pre-tokenizer name, and a SentencePiece one
    benchmodels  real-width benchmark models (Llama-3.2-1B and Qwen3-30B-A3B shapes,
                 Q4_K_M), cached by spec
    marketsim    a gossip-level simulator of thousands of virtual nodes over the market's
                 pure decision code (bench/sim_market.py)
    soak         the churn soak: clients through one gateway while its peers die, restart
                 and stall (bench/soak.py, tests/integration/test_soak.py)
    cli          ``python -m kvasird_dev make-model | bench-models``: write those models

Data flow: testmodels ──► testvocab, benchmodels ──► cli; marketsim and soak drive the
real ``kvasird.market`` and ``kvasird.localnet`` code and add nothing to it.
"""
