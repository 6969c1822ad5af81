"""Real-width benchmark models: the shapes hobbyists serve, random weights, llama.cpp's Q4_K_M.

    dense   Llama-3.2-1B's shapes: n_embd 2048, 16 layers, 32 query / 8 KV heads of 64,
            n_ff 8192, RoPE base 500000, tied output (1.07 B parameters, 0.62 GiB)
    moe     Qwen3-30B-A3B's shapes: n_embd 2048, 32 query / 4 KV heads of 128, 128 experts
            of n_ff 768, top-8 (5.1 B parameters at 8 layers, 2.9 GiB; the real model has 48)

Both carry the bundled SmolLM2 tokenizer (49,152 tokens, so the head is 100 M parameters
where Llama 3.2's is 263 M) and are written by kvasird_dev.testmodels, whose K-quants are
ggml's own kernels (``ggml_quantize_chunk``, what llama.cpp's quantizer calls), in the
Q4_K_M mix llama.cpp gives such files. Weights are N(0, 1/fan_in): activations keep their
scale through the layers, so the compute is that of a trained model of the same shapes
(numbers do not change the cost of a matrix product); what they generate is noise. The
MoE's experts repeat every 16 (``distinct_experts``): ggml's K-quantizer needs minutes per
billion weights, and an expert costs the same to read and compute whatever its numbers.

They are a pure function of their spec: generated once (about a minute per GB on two
cores) and cached as ``<cache>/bench-models/<name>-<hash>.gguf``; ``python -m
kvasird_dev bench-models`` writes them, ``bench/bench_scale.py`` uses them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from kvasird_dev.testmodels import TestModelSpec, write_model

SPECS: dict[str, TestModelSpec] = {
    "dense": TestModelSpec(arch="llama", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8,
                           head_dim=64, n_ff=8192, rope_base=500000.0, dtype="q4_k_m",
                           context_length=32768, rms_eps=1e-5, seed=1,
                           name="kvasir-bench llama-3.2-1b shapes Q4_K_M"),
    "moe": TestModelSpec(arch="qwen3moe", n_layer=8, n_embd=2048, n_head=32, n_head_kv=4,
                         head_dim=128, n_ff=6144, n_expert=128, n_expert_used=8, n_ff_exp=768,
                         rope_base=1000000.0, dtype="q4_k_m", context_length=32768, seed=2,
                         distinct_experts=16,
                         name="kvasir-bench qwen3-30b-a3b shapes (8 layers) Q4_K_M"),
}


def spec_of(name: str, n_layer: int = 0) -> TestModelSpec:
    """SPECS[name], with ``n_layer`` layers instead when given."""
    if name not in SPECS:
        raise ValueError(f"unknown benchmark model {name!r}: use one of {', '.join(SPECS)}")
    spec = SPECS[name]
    return dataclasses.replace(spec, n_layer=n_layer) if n_layer else spec


def path_of(cache: Path, spec: TestModelSpec, name: str) -> Path:
    fields = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    digest = hashlib.sha256(fields.encode()).hexdigest()[:12]
    return cache / "bench-models" / f"{name}-{digest}.gguf"


def bench_model(cache: Path, name: str, n_layer: int = 0) -> Path:
    """The cached file of benchmark model ``name``, written first if missing."""
    spec = spec_of(name, n_layer)
    path = path_of(cache, spec, name)
    if not path.exists():
        part = path.with_suffix(".part")
        write_model(part, spec)
        part.rename(path)
    return path
