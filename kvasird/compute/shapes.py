"""The tensor shapes a GGUF's own metadata implies, checked before anything reaches ggml.

A GGUF states its hyper-parameters (HParams) and lists its tensors, and nothing makes the
two agree: a converter's bug, a damaged file or a manifest written by a hostile peer can
pair `n_head` 32 with a query projection of another width, or `expert_count` 8 with
expert tensors holding 6. Such a file would get as far as a graph, where a failed
GGML_ASSERT aborts the whole daemon; here it is refused first, as a WeightsError that
names each tensor, the shape the metadata implies and the shape the file holds.

Shapes are in ggml order (ne[0] is the row) and compared without trailing 1s, as
llama.cpp compares them. A row that is not a whole number of quant blocks never gets
this far: reading the header refuses it (kvasird.model.gguffile.tensor_nbytes).

Blocks past the trunk (`n_layer`) are llama.cpp's multi-token-prediction draft layers
(`nextn_predict_layers`): never loaded, so not checked. Tensors no architecture reads are
not checked either; the whole-model check (`check_model`) refuses a missing one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvasird.compute.errors import WeightsError
from kvasird.compute.ggufview import GGUFFile, TensorInfo
from kvasird.compute.hparams import HParams

if TYPE_CHECKING:
    from kvasird.compute.arch import Architecture

SHOWN = 5
"""Mismatches an error lists; the rest are counted."""

_RULES: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("n_embd", "n_vocab"),
    "output.weight": ("n_embd", "n_vocab"),
    "output_norm.weight": ("n_embd",),
    "attn_norm.weight": ("n_embd",),
    "ffn_norm.weight": ("n_embd",),
    "post_attention_norm.weight": ("n_embd",),
    "post_ffw_norm.weight": ("n_embd",),
    "attn_q.weight": ("n_embd", "n_head*head_dim"),
    "attn_k.weight": ("n_embd", "n_head_kv*head_dim"),
    "attn_v.weight": ("n_embd", "n_head_kv*head_dim"),
    "attn_q_norm.weight": ("head_dim",),
    "attn_k_norm.weight": ("head_dim",),
    "attn_output.weight": ("n_head*head_dim", "n_embd"),
    "attn_sinks.weight": ("n_head",),
    "ffn_gate.weight": ("n_embd", "n_ff"),
    "ffn_up.weight": ("n_embd", "n_ff"),
    "ffn_down.weight": ("n_ff", "n_embd"),
    "ffn_gate_inp.weight": ("n_embd", "n_expert"),
    "ffn_gate_exps.weight": ("n_embd", "n_ff_exp", "experts"),
    "ffn_up_exps.weight": ("n_embd", "n_ff_exp", "experts"),
    "ffn_down_exps.weight": ("n_ff_exp", "n_embd", "experts"),
    "ffn_gate_inp_shexp.weight": ("n_embd",),
    "ffn_gate_shexp.weight": ("n_embd", "n_ff_shexp"),
    "ffn_up_shexp.weight": ("n_embd", "n_ff_shexp"),
    "ffn_down_shexp.weight": ("n_ff_shexp", "n_embd"),
    "attn_qkv.weight": ("n_embd", "ssm_channels"),
    "attn_gate.weight": ("n_embd", "ssm_head_dim*ssm_v_heads"),
    "ssm_conv1d.weight": ("ssm_conv", "ssm_channels"),
    "ssm_dt.bias": ("ssm_v_heads",),
    "ssm_a": ("ssm_v_heads",),
    "ssm_beta.weight": ("n_embd", "ssm_v_heads"),
    "ssm_alpha.weight": ("n_embd", "ssm_v_heads"),
    "ssm_norm.weight": ("ssm_head_dim",),
    "ssm_out.weight": ("ssm_head_dim*ssm_v_heads", "n_embd"),
}
"""Each tensor's shape by the HParams sizes it is made of (a `.bias` without a rule of its
own has its weight's shape less the row: one value per output)."""

_GATED_QUERY = ("qwen35", "qwen35moe")
"""Architectures whose attn_q holds each head's query and its output gate: twice as wide."""

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_FUSED = re.compile(r"^blk\.\d+\.ffn_gate_up_exps\.weight$")


def check_tensors(
    hp: HParams,
    tensors: Mapping[str, TensorInfo],
    source: str | Path,
    held: tuple[int, int, int] | None = None,
) -> None:
    """Refuse tensors whose shapes `hp` does not imply. `held` is (layer, e0, e1) of a
    slice recording experts [e0, e1) of one layer: its expert tensors hold e1 - e0. Other
    files' expert tensors may hold any count: a whole layer's or the range a caller asks
    for (the loader checks it against that range and expert_count)."""
    _refuse(source, _mismatches(hp, tensors, held, None))


def check_model(f: GGUFFile, hp: HParams, arch: Architecture) -> None:
    """What `check_tensors` checks, on a whole model, and that it holds every tensor the
    architecture computes with, no layer past its metadata's, in a layout that is loaded."""
    from kvasird.compute.stage import tensor_names  # stage imports what imports this module

    fused = next((n for n in f.tensors if _FUSED.match(n)), None)
    if fused is not None:
        raise WeightsError(
            f"{f.path}: {fused} holds a layer's gate and up experts in one "
            "tensor, a layout kvasird does not load yet: use a file with "
            "ffn_gate_exps and ffn_up_exps apart (convert the model again with "
            "llama.cpp's convert_hf_to_gguf.py, writing them unfused)"
        )
    problems = _layout(f, hp)
    if not problems:
        tied = "output.weight" not in f.tensors
        needed = tensor_names(arch, hp, (0, hp.n_layer), embed=True, head=True, tied=tied)
        problems = [f"{n}: missing" for n in needed if n not in f.tensors]
    _refuse(f.path, problems + _mismatches(hp, f.tensors, None, hp.n_expert))


def _layout(f: GGUFFile, hp: HParams) -> list[str]:
    """What keeps a whole model's tensor list from being looked at layer by layer."""
    if hp.n_layer < 1:
        return [f"block_count less nextn_predict_layers leaves {hp.n_layer} layers"]
    if hp.recurrent_layers and len(hp.recurrent_layers) < hp.n_layer:
        return [
            f"attention.recurrent_layers lists {len(hp.recurrent_layers)} layers, not {hp.n_layer}"
        ]
    blocks = int(f.get(f"{hp.arch}.block_count", hp.n_layer))
    beyond = sorted(
        {int(m.group(1)) for m in map(_BLOCK.match, f.tensors) if m and int(m.group(1)) >= blocks}
    )
    if beyond:
        return [
            f"blk.{beyond[0]}: a block past block_count {blocks} (draft layers are "
            f"counted in block_count and in nextn_predict_layers)"
        ]
    return []


def _mismatches(
    hp: HParams,
    tensors: Mapping[str, TensorInfo],
    held: tuple[int, int, int] | None,
    experts: int | None,
) -> list[str]:
    """Each tensor not of its rule's shape; `experts`: what expert tensors hold, outside
    the layer of `held` (None: any count, the same in each of a layer's expert tensors)."""
    sizes = _sizes(hp)
    counts = {} if held is None else {held[0]: held[2] - held[1]}
    rules = {
        **_RULES,
        **({"attn_q.weight": ("n_embd", "2*n_head*head_dim")} if hp.arch in _GATED_QUERY else {}),
    }
    out = []
    for name, info in tensors.items():
        m = _BLOCK.match(name)
        layer, suffix = (int(m.group(1)), m.group(2)) if m else (-1, name)
        if layer >= hp.n_layer:
            continue
        dims = _rule(rules, suffix)
        if dims is None:
            continue
        if dims[-1] == "experts":
            counts.setdefault(layer, info.ne[-1] if experts is None else experts)
        want = tuple(counts[layer] if d == "experts" else sizes[d] for d in dims)
        if not _same(want, info.ne):
            out.append(f"{name} is {list(info.ne)}, expected {_show(want)} = [{', '.join(dims)}]")
    return out


def _rule(rules: Mapping[str, tuple[str, ...]], suffix: str) -> tuple[str, ...] | None:
    if suffix in rules:
        return rules[suffix]
    weight = rules.get(suffix.removesuffix(".bias") + ".weight")
    return weight[1:] if suffix.endswith(".bias") and weight else None


def _sizes(hp: HParams) -> dict[str, int | None]:
    """The sizes tensors are made of; None where the metadata cannot tell (a slice without
    the tokenizer does not know n_vocab)."""
    d, v = hp.ssm_head_dim, hp.ssm_v_heads
    return {
        "n_embd": hp.n_embd,
        "n_vocab": hp.n_vocab or None,
        "head_dim": hp.head_dim,
        "n_head": hp.n_head,
        "n_head*head_dim": hp.n_head * hp.head_dim,
        "2*n_head*head_dim": 2 * hp.n_head * hp.head_dim,
        "n_head_kv*head_dim": hp.kv_dim,
        "n_ff": hp.n_ff,
        "n_expert": hp.n_expert,
        "n_ff_exp": hp.n_ff_exp,
        "n_ff_shexp": hp.n_ff_shexp,
        "ssm_channels": hp.conv_channels,
        "ssm_head_dim*ssm_v_heads": d * v,
        "ssm_conv": hp.ssm_conv,
        "ssm_v_heads": v,
        "ssm_head_dim": d,
    }


def _same(want: tuple[int | None, ...], got: Iterable[int]) -> bool:
    have = _trim(tuple(got))
    want = _trim(want)
    return len(have) == len(want) and all(
        w is None or w == g for w, g in zip(want, have, strict=True)
    )


def _trim(ne: tuple[int | None, ...]) -> tuple[int | None, ...]:
    while len(ne) > 1 and ne[-1] == 1:
        ne = ne[:-1]
    return ne


def _show(want: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("any" if w is None else str(w) for w in want) + "]"


def _refuse(source: str | Path, problems: list[str]) -> None:
    if not problems:
        return
    more = len(problems) - SHOWN
    raise WeightsError(
        f"{source} does not match its own metadata: convert it again with a current "
        "llama.cpp, or fetch it again if it is damaged:\n  "
        + "\n  ".join(problems[:SHOWN])
        + (f"\n  (and {more} more)" if more > 0 else "")
    )
