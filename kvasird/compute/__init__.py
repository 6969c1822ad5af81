"""Compute: the ggml runtime and the engine built on it.

    runtime     what the installed ggml build offers (backends, devices, version, threads)
    errors      ComputeError and its kinds: WeightsError, InputError, KVCacheFull
    ggufview    a GGUF as the engine sees it: header and tensor table from model.gguffile, tensor
                bytes memory-mapped (nothing read whole)
    hparams     a model's hyper-parameters from its metadata
    graph       Backend (CPU, threads, lock), TensorArena (weights/KV buffers), cached Graphs
    weights     load named tensors (and expert ranges) from a GGUF or slice mini-GGUFs
    kv/         the KV cache by concept: the bounded pool of a stage, handed to Sessions in
                pages; the sliding-window ring; the delta-net layers' state slots; prefix
                reuse; and the page keys (free of ggml: the gateway computes them)
    blocks      graph building blocks: norms, attention over the pool, gated delta-net,
                FFNs, router, experts
    arch/       one module per architecture (llama, llama with experts, qwen3, qwen3moe,
                gemma3, qwen35, qwen35moe) composing the blocks
    experts     ExpertWorker (the pure expert function) and split / dispatch / combine
    stage       Stage: a layer window [a, b) with optional embedding and head; generate()
    steps       computations written as generators of what they need from outside (a remote
                expert's rows), and their drivers
    sampling    greedy / temperature / top-k / top-p / repetition penalty, seeded

Data flow of one forward on a stage:

    token ids or hidden rows ─▶ validate ─▶ Session.reserve (KV pages)
      ─▶ segment graph (embed?, layers, [router]) ─┬▶ hidden / logits
                                                   └▶ router out ─▶ experts.dispatch ─▶ shards
                                                        (ExpertWorker locally, or a remote hook)
                                                      ◀─ combine ◀─┘ ─▶ next segment ...

Nothing reaches ggml before Python has checked it: ggml aborts or segfaults on bad
shapes and ids, and a peer's request must never take the node down.
"""
