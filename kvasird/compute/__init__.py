"""Compute: the ggml runtime and the engine built on it.

    runtime    what the installed ggml build offers (backends, devices, version, threads)
"""
