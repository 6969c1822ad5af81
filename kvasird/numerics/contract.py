"""The numerics contract: how close this node's engine is to the float64 oracle, PASS or FAIL.

Measured, in order of depth:
  1. per-op deltas (rms_norm, softmax, swiglu, rope both modes, matmul per weight type;
     the delta-net's ops for the hybrids, softmax with sinks, clamped SwiGLU and YaRN RoPE
     for gpt-oss)
  2. layer-boundary drift: each layer run as its own window, fed the engine's previous
     output, compared with the oracle's hidden state at that depth
  3. end-to-end logits over a prompt set: L∞, relative L2, cosine, KL, top-1 agreement
  4. greedy generation: tokens from engine and oracle, the first index where they part

Tolerances depend on the weights: F32 weights must match to float32 rounding; F16 and
quantized weights are held to what their activation quantization allows (STACK.md:
Q8_0 gives cosine ~0.99993 against pure f32 math, Q4_K ~0.99984). Generation
divergence is reported, not judged: on small logit margins one rounding flips a token,
and the logit metrics already bound how far apart the distributions are.

The resulting Verdict (backend, precision, pass) is what a node advertises.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

import kvasird.compute.arch as archs
from kvasird.compute.ggufview import GGUFFile
from kvasird.compute.graph import Backend
from kvasird.compute.kv.pool import KVSpec
from kvasird.compute.runtime import compute_threads
from kvasird.compute.stage import Stage, generate
from kvasird.numerics.metrics import Delta, compare, first_divergence
from kvasird.numerics.ops import OpDelta, probe_ops
from kvasird.numerics.oracle import Oracle


@dataclass(frozen=True)
class Tolerances:
    """Bounds a node must meet; one preset per weight precision."""

    op_rel_linf: float
    """Elementwise ops (norm, softmax, swiglu): worst error over the reference's scale."""
    rope_rel_linf: float
    """RoPE at positions up to 4k: ggml computes angles in float32."""
    matmul_cosine: float
    """Matmul with the model's weight types (quantized ones quantize activations)."""
    rounded_matmul_rel_l2: float
    """Matmul against the oracle that rounds activations as ggml's CPU kernels do."""
    drift_cosine: float
    """Hidden state after the last layer vs the oracle."""
    logits_cosine: float
    """End-to-end logits, all positions of all prompts."""
    logits_kl: float
    """Mean KL(oracle || engine) of the next-token distributions."""
    top1: float
    """Fraction of positions whose argmax agrees."""


EXACT = Tolerances(
    op_rel_linf=1e-5,
    rope_rel_linf=1e-3,
    matmul_cosine=0.999999,
    rounded_matmul_rel_l2=1e-5,
    drift_cosine=0.99999,
    logits_cosine=0.99999,
    logits_kl=1e-6,
    top1=0.99,
)
"""All-F32 weights: float32 rounding only (measured rel-L2 ~1e-7 on generated models)."""
QUANTIZED = Tolerances(
    op_rel_linf=1e-5,
    rope_rel_linf=1e-3,
    matmul_cosine=0.9995,
    rounded_matmul_rel_l2=1e-5,
    drift_cosine=0.995,
    logits_cosine=0.999,
    logits_kl=0.05,
    top1=0.85,
)
"""F16 or quantized weights: the activation rounding of every matmul compounds over depth.
Measured on the bundled Q4_1 model (30 layers, random-token prompts, F16 KV): logits
cosine 0.9997, KL 0.011-0.014, top-1 0.92; the bounds leave about 3x room."""


@dataclass(frozen=True)
class Check:
    """One measured number against its bound."""

    name: str
    """What was measured."""
    value: float
    """The measurement."""
    bound: float
    """The tolerance."""
    kind: str
    """"max" (value must be <= bound) or "min" (value must be >= bound)."""

    @property
    def ok(self) -> bool:
        return self.value <= self.bound if self.kind == "max" else self.value >= self.bound


@dataclass(frozen=True)
class Verdict:
    """What `kvasird verify` concludes, and what the node advertises as its capability."""

    backend: str
    """ggml backend that computed ("CPU", "CUDA0"...)."""
    precision: str
    """Accumulation, weight and KV precision, e.g. "f32 accumulate; weights Q4_1+Q8_0; kv f16"."""
    passed: bool
    """Every check within its tolerance."""
    model: str
    """File name and architecture of the model measured."""
    checks: tuple[Check, ...]
    """Each measured number with its bound."""
    ops: tuple[OpDelta, ...]
    """Per-op deltas."""
    drift: tuple[Delta, ...]
    """Per-layer hidden-state distance from the oracle (index = layer)."""
    logits: Delta
    """End-to-end logits distance over the prompt set."""
    greedy_divergence: tuple[int | None, ...]
    """First differing token index per greedy prompt (None = all tokens equal)."""

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["checks"] = [dict(asdict(c), ok=c.ok) for c in self.checks]
        return d

    def capability(self) -> dict[str, object]:
        """The small record a node gossips: no measurements beyond the verdict."""
        return {"backend": self.backend, "precision": self.precision, "numerics_pass": self.passed}


@dataclass(frozen=True)
class VerifyPlan:
    """How much to measure (the CLI's defaults take about a minute on the bundled model)."""

    prompts: int = 6
    """Prompts in the logits set."""
    prompt_len: int = 12
    """Tokens per prompt."""
    greedy_prompts: int = 2
    """Prompts generated greedily by both engine and oracle."""
    greedy_tokens: int = 12
    """Tokens generated per greedy prompt."""
    kv_dtype: str = "f16"
    """KV cache type under test (the serving default)."""
    seed: int = 0
    """Seed of the prompt set and the op inputs."""


def verify(path: str | Path, threads: int = 0, plan: VerifyPlan = VerifyPlan()) -> Verdict:
    path = Path(path)
    f = GGUFFile(path)
    threads = compute_threads(threads)
    types = sorted(
        {GGMLQuantizationType(t.type).name for t in f.tensors.values() if len(t.ne) >= 2}
    )
    tol = EXACT if set(types) == {"F32"} else QUANTIZED
    oracle = Oracle(path, kv_f16=plan.kv_dtype == "f16")  # the KV type is a declared precision
    kv = KVSpec(n_slots=max(256, plan.prompt_len + plan.greedy_tokens + 64), dtype=plan.kv_dtype)
    backend = Backend(threads)
    ops = probe_ops(str(path), backend, plan.seed)
    rng = np.random.default_rng(plan.seed)
    prompts = [rng.integers(0, oracle.hp.n_vocab, plan.prompt_len) for _ in range(plan.prompts)]
    drift = _drift(path, oracle, prompts[0], threads, kv)
    stage = Stage.load(path, threads=threads, kv=kv)
    try:
        got, want = [], []
        for p in prompts:
            with stage.open_session() as s:
                got.append(stage.forward(s, p, logits="all"))
            want.append(oracle.logits(p))
        logits = compare(np.concatenate(got), np.concatenate(want))
        divergence = tuple(
            first_divergence(
                generate(stage, p.tolist(), plan.greedy_tokens),
                oracle.generate(p, plan.greedy_tokens)[0],
            )
            for p in prompts[: plan.greedy_prompts]
        )
    finally:
        stage.close()
    checks = [
        Check(
            f"op {d.op} rel_linf",
            d.delta.rel_linf,
            tol.rope_rel_linf if d.op.startswith("rope") else tol.op_rel_linf,
            "max",
        )
        for d in ops
        if not d.op.startswith("matmul")
    ]
    checks += [
        Check(f"op {d.op} cosine", d.delta.cosine, tol.matmul_cosine, "min")
        for d in ops
        if d.op.startswith("matmul") and not d.op.endswith("rounded")
    ]
    checks += [
        Check(f"op {d.op} rel_l2", d.delta.rel_l2, tol.rounded_matmul_rel_l2, "max")
        for d in ops
        if d.op.endswith("rounded")
    ]
    checks += [
        Check("last layer hidden cosine", drift[-1].cosine, tol.drift_cosine, "min"),
        Check("logits cosine", logits.cosine, tol.logits_cosine, "min"),
        Check("logits KL", logits.kl, tol.logits_kl, "max"),
        Check("top-1 agreement", logits.top1, tol.top1, "min"),
    ]
    return Verdict(
        backend=backend.name,
        precision=f"f32 accumulate; weights {'+'.join(types)}; kv {plan.kv_dtype}",
        passed=all(c.ok for c in checks),
        model=f"{path.name} ({archs.for_hparams(oracle.hp).label}, {oracle.hp.n_layer} layers)",
        checks=tuple(checks),
        ops=tuple(ops),
        drift=tuple(drift),
        logits=logits,
        greedy_divergence=divergence,
    )


def _drift(path: Path, oracle: Oracle, prompt: np.ndarray, threads: int, kv: KVSpec) -> list[Delta]:
    """Engine hidden state after each layer, each layer its own window fed the engine's output."""
    want = oracle.hidden(prompt)
    x: np.ndarray = prompt
    out = []
    for layer in range(oracle.hp.n_layer):
        stage = Stage.load(path, (layer, layer + 1), head=False, threads=threads, kv=kv)
        try:
            with stage.open_session() as s:
                x = stage.forward(s, x)
        finally:
            stage.close()
        out.append(compare(x, want[layer + 1]))
    return out
