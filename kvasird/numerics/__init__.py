"""Numerics: the equivalence contract between this node's engine and exact math.

oracle      llama (dense, with experts), qwen3, qwen3moe, gemma3, qwen35, qwen35moe in
            float64 numpy from dequantized weights, a layer computed from its
            architecture's features (tests, verify)
metrics     L∞, relative L2, cosine, KL, top-1 agreement, first greedy divergence
ops         single ggml ops probed against their float64 definitions
contract    verify(): per-op deltas, layer drift, end-to-end logits, greedy divergence,
            tolerances, and the Verdict (backend, precision, pass) a node advertises
"""
