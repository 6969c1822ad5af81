"""/health, /status (JSON) and the status page: one snapshot, two renderings.

/health says only "ok" or "starting" (it is what a load balancer polls, so it leaks
nothing). The page is plain server-rendered HTML with inline CSS and an inline SVG
of the coverage map: one cell per layer (and per expert range of MoE layers),
coloured by replicas against the target. No script, no external asset; the page
reloads itself every 5 seconds.
"""

from __future__ import annotations

from html import escape
from typing import Any

from kvasird.gateway.service import Gateway
from kvasird.settlement.token import format_kvr

COLOURS = {"full": "#2e9e44", "partial": "#e0a800", "missing": "#d9363e"}
WIDTH = 720
ROW = 22
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1d232a;background:#fafbfc}
h1{font-size:20px;margin:0 0 12px} h2{font-size:16px;margin:22px 0 8px}
table{border-collapse:collapse} th{white-space:nowrap}
td,th{padding:3px 12px 3px 0;text-align:left;vertical-align:top} code{font-size:12px}
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;
vertical-align:middle}
"""


def health(gw: Gateway) -> tuple[int, dict[str, str]]:
    return (200, {"status": "ok"}) if gw.ready else (503, {"status": "starting"})


def snapshot(gw: Gateway) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ready": gw.ready,
        "gateway": {"url": gw.url, **gw.stats.snapshot()},
        "models": [{"id": m.model_id, "label": m.label, "context_length": m.context_length}
                   for m in gw.models()],
    }
    node = gw.node
    if node is not None:
        status = node.status()
        out["node"] = {k: status[k] for k in ("peer_id", "network", "join_addr", "peers",
                                               "uptime_s", "version", "protocol", "earnings")
                       if k in status}
        out["peers"] = [p.to_json() for p in node.p2p.peers.snapshot()]
        cov = node.market.coverage()
        out["coverage"] = {k: cov.get(k) for k in ("state", "held", "held_bytes", "budget_bytes",
                                                   "model", "segments", "fully_covered")}
    return out


def page(snap: dict[str, Any]) -> str:
    node, gw, cov = snap.get("node", {}), snap["gateway"], snap.get("coverage") or {}
    rows = [("state", "ready" if snap["ready"] else "starting"),
            ("peer id", node.get("peer_id", "")), ("network", node.get("network", "")),
            ("join address", node.get("join_addr", "")), ("version", node.get("version", "")),
            ("uptime", f"{node.get('uptime_s', 0):.0f} s"),
            ("requests served", gw["requests_served"]), ("in flight", gw["in_flight"]),
            ("tokens generated", gw["tokens_generated"]),
            ("decode tokens/s", _or_dash(gw["decode_tokens_per_s"])),
            ("time to first token (median)", _or_dash(gw["ttft_ms_median"], " ms"))]
    if earned := node.get("earnings"):
        rows += [("earned (receipts)", f"{format_kvr(earned['earned'])} KVR"),
                 ("received on chain", f"{format_kvr(earned['received'])} KVR"),
                 ("pending", f"{format_kvr(earned['pending'])} KVR")]
    models = "".join(f"<li><code>{escape(m['id'])}</code> {escape(m['label'])} "
                     f"(context {m['context_length']})</li>" for m in snap["models"]) \
        or "<li>none yet</li>"
    peers = "".join(f"<tr><td><code>{escape(p['peer_id'])}</code></td>"
                    f"<td>{_or_dash(p.get('rtt_ms'), ' ms')}</td>"
                    f"<td>{escape(str(p.get('version') or ''))}</td></tr>"
                    for p in snap.get("peers", [])) or "<tr><td colspan=3>no peers</td></tr>"
    held = escape(_holdings(cov.get("held") or [])) or "nothing"
    table = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    legend = "".join(f'<span style="background:{c}"></span>{k}' for k, c in COLOURS.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>kvasird status</title>
<style>{STYLE}</style></head><body>
<h1>kvasird node</h1>
<table>{table}</table>
<h2>Models served</h2><ul>{models}</ul>
<h2>Coverage</h2>{coverage_svg(cov)}
<div class="legend">{legend}</div>
<p>This node holds: {held}</p>
<h2>Peers</h2><table><tr><th>peer</th><th>RTT</th><th>version</th></tr>{peers}</table>
</body></html>
"""


def coverage_svg(cov: dict[str, Any]) -> str:
    """Head, the dense path of every layer, and each MoE layer's experts, coloured by replicas."""
    model = cov.get("model")
    if not model:
        return "<p>This node tracks no model ([market] model is empty).</p>"
    n_layer, n_expert = model["n_layer"], model["n_expert"]
    label_w, plot_w = 80, WIDTH - 80
    rects = []
    labels = [(0, "head"), (ROW, "layers")]
    for seg in cov.get("segments") or []:
        colour = _colour(seg["replicas"], seg["target"])
        tip = f"{_name(seg)}: {seg['replicas']}/{seg['target']} replicas"
        for x, w, y, h in _cells(seg, plot_w, n_layer, n_expert):
            rects.append(f'<rect x="{label_w + x:.1f}" y="{y}" width="{max(w - 1, 1):.1f}" '
                         f'height="{h}" fill="{colour}"><title>{escape(tip)}</title></rect>')
    if n_expert:
        labels.append((2 * ROW, f"experts ({n_layer}×{n_expert})"))
    total = 2 * ROW + (n_layer * 8 if n_expert else 0)
    text = "".join(f'<text x="0" y="{y + 14}" font-size="12">{escape(t)}</text>'
                   for y, t in labels)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{total}" '
            f'role="img" aria-label="coverage map">{text}{"".join(rects)}</svg>')


def _cells(seg: dict[str, Any], plot_w: float, n_layer: int,
           n_expert: int) -> list[tuple[float, float, int, int]]:
    """(x, width, y, height) of a segment's cells: the head, one per layer, one per expert run."""
    if seg["unit"] == "head":
        return [(0.0, plot_w, 0, ROW - 4)]
    if seg["unit"] == "layers":
        w = plot_w / n_layer
        return [(i * w, w, ROW, ROW - 4) for i in range(*seg["layers"])]
    a, b = seg["experts"]
    w = plot_w / n_expert
    return [(a * w, (b - a) * w, 2 * ROW + seg["layer"] * 8, 6)]


def _colour(replicas: int, target: int) -> str:
    if replicas >= target:
        return COLOURS["full"]
    return COLOURS["partial"] if replicas > 0 else COLOURS["missing"]


def _name(seg: dict[str, Any]) -> str:
    if seg["unit"] == "head":
        return "head"
    if seg["unit"] == "layers":
        a, b = seg["layers"]
        return f"layers {a}-{b - 1}"
    a, b = seg["experts"]
    return f"layer {seg['layer']} experts {a}-{b - 1}"


def _holdings(units: list[str]) -> str:
    """"head, layer:0, layer:1, layer:2" -> "head, layers 0-2" (runs of whole layers merged)."""
    layers = sorted(int(u.split(":")[1]) for u in units if u.startswith("layer:"))
    out = [u for u in units if not u.startswith("layer:")]
    start = None
    for i, n in enumerate(layers):
        start = n if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(f"layers {start}-{n}" if n > start else f"layer {n}")
            start = None
    return ", ".join(out)


def _or_dash(value: Any, unit: str = "") -> str:
    return "–" if value is None else f"{value}{unit}"
