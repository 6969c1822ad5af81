"""The node's dashboard: the /status snapshot as one server-rendered HTML page.

Cards for the state (ready only when a route exists), the charts, the topology (which
peer holds which layers and experts, the route a request would take now, the routes
generations ran on lately), the peers, earnings and claims, the price band, shard
downloads, and a chat that posts to this gateway's own /v1/chat/completions. Everything
is inline (CSS, SVG, one small script); the network may be closed, so nothing is fetched
from elsewhere. The script polls /status for the charts and re-reads the page's live
sections; without it the page is still complete, only still.
"""

from __future__ import annotations

import json
import math
from html import escape
from typing import Any

from kvasird.settlement.token import KVR_DECIMALS

COLOURS = {"full": "#2e9e44", "partial": "#e0a800", "missing": "#d9363e"}
"""Coverage of a unit: replicas at the target, some, none."""
PEER_COLOURS = (
    "#3b6fd6",
    "#c2487a",
    "#1f9e8f",
    "#8a5cd0",
    "#d9822b",
    "#5a8f29",
    "#b5473a",
    "#4a90a4",
)
STATE_COLOURS = {
    "ok": "#2e9e44",
    "starting": "#3b6fd6",
    "no_route": "#d9363e",
    "no_model": "#6b7380",
}
WIDTH, LABEL_W, ROW, GAP = 960, 130, 22, 5
"""Topology picture: viewBox width, row label width, row height, gap between rows."""


def page(snap: dict[str, Any]) -> str:
    health = snap["health"]
    node = snap.get("node", {})
    model = snap["models"][0] if snap["models"] else None
    title = escape(model["label"]) if model else "no model"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvasird · {title}</title>
<style>{STYLE}</style></head><body>
<header data-live id="head">{_header(health, node, model)}</header>
<main>
<section class="card" data-live id="summary"><h2>Serving</h2>{_summary(snap)}</section>
<section class="card"><h2>Live</h2>{_charts()}</section>
<section class="card"><h2>Chat</h2>{_chat(model)}</section>
<section class="card wide" data-live id="topology"><h2>Topology</h2>{_topology(snap)}</section>
<section class="card wide" data-live id="peers"><h2>Peers</h2>{_peers(snap)}</section>
<section class="card" data-live id="checks"><h2>Spot checks</h2>{_checks(snap)}</section>
<section class="card" data-live id="earnings"><h2>Earnings</h2>{_earnings(snap)}</section>
<section class="card" data-live id="price"><h2>Price</h2>{_price(snap.get("price"))}</section>
<section class="card" data-live id="shards"><h2>Shards</h2>{_shards(snap.get("shards"))}</section>
</main>
<script type="application/json" id="snapshot">{_json(snap["gateway"]["series"])}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def _header(health: dict[str, str], node: dict[str, Any], model: dict[str, Any] | None) -> str:
    state = health["status"]
    label = {"ok": "ready", "no_route": "no route", "no_model": "no model"}.get(state, state)
    facts = [
        "" if state == "ok" else escape(model["label"]) if model else "no model",
        f"network {escape(node['network'])}" if node.get("network") else "",
        f"up {_duration(node['uptime_s'])}" if "uptime_s" in node else "",
        f"v{escape(node['version'])}" if node.get("version") else "",
    ]
    join = (
        f'<p class="join">join: <code>{escape(node["join_addr"])}</code></p>'
        if node.get("join_addr")
        else ""
    )
    return (
        f'<h1>kvasird <span class="pill" id="state" data-state="{escape(state)}" '
        f'style="background:{STATE_COLOURS.get(state, "#6b7380")}">{label}</span></h1>'
        f'<p class="reason">{escape(health["reason"])}</p>'
        f'<p class="facts">{" · ".join(f for f in facts if f)}</p>{join}'
    )


def _summary(snap: dict[str, Any]) -> str:
    gw = snap["gateway"]
    rows = [
        ("requests served", gw["requests_served"]),
        ("in flight", gw["in_flight"]),
        ("tokens generated", gw["tokens_generated"]),
        ("decode speed", _unit(gw["decode_tokens_per_s"], "tokens/s")),
        ("time to first token", _unit(gw["ttft_ms_median"], "ms", "median ")),
    ]
    refused = {k: v for k, v in gw["requests_by_status"].items() if k != "200"}
    if refused:
        rows.append(("other answers", ", ".join(f"{v}× {k}" for k, v in refused.items())))
    return _table(rows)


def _charts() -> str:
    return "".join(
        f'<figure><figcaption>{what} <b id="chart-{key}-now">–</b></figcaption>'
        f'<svg id="chart-{key}" class="spark" viewBox="0 0 300 64" preserveAspectRatio="none" '
        f'role="img" aria-label="{what}, last five minutes"></svg></figure>'
        for key, what in (("tps", "tokens/s, last minute"), ("ttft", "time to first token"))
    )


def _topology(snap: dict[str, Any]) -> str:
    cov = snap.get("coverage") or {}
    model = cov.get("model")
    if not model:
        return "<p>This node tracks no model ([market] model is empty).</p>"
    holders = _holders(cov, snap.get("node", {}).get("peer_id", ""))
    gw = snap["gateway"]
    colour = _colours(holders)
    rows = [_coverage_row(cov, holders)]
    rows += [_peer_row(model, peer, held, colour[peer]) for peer, held in holders.items()]
    rows.append(_route_row(model["n_layer"], gw["route_now"], gw["missing"], colour))
    height = len(rows) * (ROW + GAP) + 18
    body = "".join(
        _row(i, label, cells, model["n_layer"] + 1) for i, (label, cells) in enumerate(rows)
    )
    svg = (
        f'<div class="scroll"><svg class="topo" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="topology: layers across, '
        f'peers as rows">{body}{_axis(model["n_layer"], height - 4)}</svg></div>'
    )
    legend = "".join(f'<span><i style="background:{c}"></i>{k}</span>' for k, c in COLOURS.items())
    what = f"{model['n_layer']} layers" + (
        f" × {model['n_expert']} experts" if model["n_expert"] else ""
    )
    warn = f'<p class="warn">No route now: {escape(gw["missing"])}.</p>' if gw["missing"] else ""
    return (
        f"<p>{escape(what)}, {_bytes(model['bytes'])}; column H is the head "
        f'(embedding and output).</p>{warn}{svg}<p class="legend">{legend}</p>'
        f"{_recent_routes(gw['routes'], colour)}"
    )


def _holders(cov: dict[str, Any], me: str) -> dict[str, list[list[Any]]]:
    """Peer -> its holdings (wire form), this node first."""
    held = {p: e["holdings"] for p, e in (cov.get("holders") or {}).items() if e["holdings"]}
    return dict(sorted(held.items(), key=lambda kv: (kv[0] != me, kv[0])))


def _colours(holders: dict[str, list[list[Any]]]) -> dict[str, str]:
    """Each holder's colour, the same in the topology, the routes and the peers table."""
    return {peer: PEER_COLOURS[i % len(PEER_COLOURS)] for i, peer in enumerate(holders)}


Cell = tuple[int, float, float, str, str]
"""(column, top, height as fractions of the row, fill, tooltip); column 0 is the head."""


def _coverage_row(
    cov: dict[str, Any], holders: dict[str, list[list[Any]]]
) -> tuple[str, list[Cell]]:
    n_layer = cov["model"]["n_layer"]
    worst: dict[int, tuple[float, int, int]] = {}
    for seg in cov.get("segments") or []:
        r, t = seg["replicas"], seg["target"]
        cols = (
            [0]
            if seg["unit"] == "head"
            else range(seg["layers"][0] + 1, seg["layers"][1] + 1)
            if seg["unit"] == "layers"
            else [seg["layer"] + 1]
        )
        for col in cols:
            if col not in worst or r / max(t, 1) < worst[col][0]:
                worst[col] = (r / max(t, 1), r, t)
    cells: list[Cell] = []
    for col in range(n_layer + 1):
        _, r, t = worst.get(col, (0.0, 0, 1))
        who = ", ".join(_short(p) for p, held in holders.items() if _holds(held, col))
        name = "head" if col == 0 else f"layer {col - 1}"
        tip = f"{name}: {r}/{t} replicas" + (f" · held by {who}" if who else "")
        cells.append((col, 0.0, 1.0, _coverage_colour(r, t), tip))
    return "coverage", cells


def _holds(holdings: list[list[Any]], col: int) -> bool:
    """Whether a holding covers topology column ``col`` (0 the head, layer i at i + 1)."""
    return any(
        (h[0] == "H" and col == 0)
        or (h[0] == "L" and h[1] < col <= h[2])
        or (h[0] == "E" and h[1] + 1 == col)
        for h in holdings
    )


def _peer_row(
    model: dict[str, Any], peer: str, holdings: list[list[Any]], colour: str
) -> tuple[str, list[Cell]]:
    """One cell per unit the peer holds; units not online yet (or draining) are faded."""
    cells: list[Cell] = []
    name = _short(peer)
    for h in holdings:
        kind, state = h[0], h[-1]
        fill = colour if state == "online" else colour + "66"
        if kind == "H":
            cells.append((0, 0.0, 1.0, fill, f"{name}: head ({state})"))
        elif kind == "L":
            cells += [
                (layer + 1, 0.0, 1.0, fill, f"{name}: layer {layer} ({state})")
                for layer in range(h[1], h[2])
            ]
        else:
            layer, e0, e1 = h[1], h[2], h[3]
            n = max(model["n_expert"], 1)
            cells.append(
                (
                    layer + 1,
                    e0 / n,
                    (e1 - e0) / n,
                    fill,
                    f"{name}: layer {layer} experts {e0}-{e1 - 1} ({state})",
                )
            )
    return name, cells


def _route_row(
    n_layer: int, hops: list[dict[str, Any]] | None, missing: str | None, colour: dict[str, str]
) -> tuple[str, list[Cell]]:
    if not hops:
        tip = f"no route: {missing}" if missing else "no route is needed: the whole model runs here"
        fill = COLOURS["missing"] if missing else "#c9ced6"
        return "route now", [(col, 0.35, 0.3, fill, tip) for col in range(n_layer + 1)]
    cells: list[Cell] = []
    for i, hop in enumerate(hops, 1):
        fill = colour.get(hop["peer"], "#6b7380")
        parts = (
            (["embedding"] if hop["embed"] else [])
            + ([f"layers {hop['first']}-{hop['end'] - 1}"] if hop["end"] > hop["first"] else [])
            + (["output"] if hop["head"] else [])
        )
        tip = f"hop {i}: {_short(hop['peer'])} · {' + '.join(parts)}"
        cols = ([0] if hop["embed"] or hop["head"] else []) + list(
            range(hop["first"] + 1, hop["end"] + 1)
        )
        cells += [(col, 0.2, 0.6, fill, tip) for col in cols]
    return "route now", cells


def _row(i: int, label: str, cells: list[Cell], n_col: int) -> str:
    y = i * (ROW + GAP)
    out = [
        f'<text x="0" y="{y + 16}" font-size="14">{escape(label)}</text>',
        f'<rect x="{LABEL_W}" y="{y}" width="{WIDTH - LABEL_W}" height="{ROW}" fill="#eef0f3"/>',
    ]
    kind = "cov" if label == "coverage" else "cell"
    for col, top, h, fill, tip in cells:
        x, w = _col_x(col, n_col)
        out.append(
            f'<rect class="{kind}" data-col="{col}" x="{x:.1f}" y="{y + top * ROW:.1f}" '
            f'width="{max(w - 1, 1):.1f}" height="{max(h * ROW, 1):.1f}" fill="{fill}">'
            f"<title>{escape(tip)}</title></rect>"
        )
    return "".join(out)


def _col_x(col: int, n_col: int) -> tuple[float, float]:
    w = (WIDTH - LABEL_W) / n_col
    return LABEL_W + col * w, w


def _axis(n_layer: int, y: int) -> str:
    step = 5 if n_layer > 12 else 1
    marks = [(0, "H")] + [(layer + 1, str(layer)) for layer in range(0, n_layer, step)]
    return "".join(
        f'<text x="{_col_x(col, n_layer + 1)[0] + 1:.1f}" y="{y}" font-size="12" '
        f'fill="#6b7380">{t}</text>'
        for col, t in marks
    )


def _recent_routes(routes: list[dict[str, Any]], colour: dict[str, str]) -> str:
    if not routes:
        return "<p>No generation has run through the swarm lately.</p>"
    items = "".join(
        "<li>"
        + " → ".join(
            f'<span class="chip" style="border-color:'
            f'{colour.get(p, "#6b7380")}">{escape(_short(p))}</span>'
            for p in r["peers"]
        )
        + f" · {_duration(r['seen_s_ago'])} ago</li>"
        for r in routes
    )
    return f'<p>Routes generations ran on lately:</p><ul class="routes">{items}</ul>'


def _peers(snap: dict[str, Any]) -> str:
    if "node" not in snap:
        return "<p>This gateway runs without a node.</p>"
    me = snap["node"]["peer_id"]
    holders = _holders(snap.get("coverage") or {}, me)
    colour = _colours(holders)
    connected = {p["peer_id"]: p for p in snap.get("peers", [])}
    ids = [me] + [p for p in holders if p != me] + [p for p in connected if p not in holders]
    rows = []
    for peer in ids:
        info = connected.get(peer, {})
        dot = (
            f'<i class="dot" style="background:{colour[peer]}"></i>'
            if peer in colour
            else '<i class="dot"></i>'
        )
        you = ' <span class="tag">this node</span>' if peer == me else ""
        rtt = "–" if peer == me else _unit(info.get("rtt_ms"), "ms")
        held = _holding_text(holders.get(peer, [])) or "nothing"
        rows.append(
            f'<tr><td title="{escape(peer)}">{dot}<code>{escape(_short(peer))}</code>'
            f"{you}</td><td>{rtt}</td><td>{escape(held)}</td>"
            f"<td>{escape(str(info.get('version') or ''))}</td></tr>"
        )
    return (
        '<div class="scroll"><table class="peers"><tr><th>peer</th><th>RTT</th>'
        f"<th>holds</th><th>version</th></tr>{''.join(rows)}</table></div>"
    )


def _checks(snap: dict[str, Any]) -> str:
    """What this node's spot checks saw: how much was checked, who was caught, and the
    units drawn that nobody else could recompute (their work is taken on trust: a replica
    makes them checkable)."""
    view = snap.get("checks")
    if view is None:
        return "<p>This gateway runs without a node.</p>"
    rows = []
    for kind, what in (("stages", "stage sessions"), ("experts", "expert calls")):
        t = view[kind]
        odds = (
            f", a cheat caught within {t['within_95']} (95 %)" if t["within_95"] is not None else ""
        )
        rows.append(
            (
                what,
                f"{t['checked']} checked, {t['caught']} caught"
                + (f", {t['unresolved']} undecided" if t["unresolved"] else "")
                + f" ({t['rate']:.0%} drawn{odds})",
            )
        )
    d = view["decode"]
    rows.append(
        (
            "later steps",
            f"{d['checked']} checked, {d['caught']} caught"
            + (f", {d['unresolved']} undecided" if d["unresolved"] else "")
            + f", {d['unshown']} hop-sessions unpaid: could not show their work",
        )
    )
    out = _table(rows)
    if view["evidence"]:
        out += "<h3>Caught</h3>" + _grid(
            ["peer", "unit", "off by", "sessions"],
            [
                [_short(e["peer"]), e["unit"], f"{e['divergence']:.3g}", str(e["sessions"])]
                for e in view["evidence"]
            ],
        )
    unchecked = view["unchecked_units"]
    if unchecked:
        out += (
            '<p class="warn">Drawn but not checkable: '
            + escape(", ".join(f"{unit} ×{n}" for unit, n in sorted(unchecked.items())))
            + ".</p>"
        )
    return out


def _holding_text(holdings: list[list[Any]]) -> str:
    """[["H", "online"], ["L", 0, 10, "loading"]] -> "head, layers 0-9 (loading)"."""
    out = []
    for h in holdings:
        state = "" if h[-1] == "online" else f" ({h[-1]})"
        if h[0] == "H":
            out.append(f"head{state}")
        elif h[0] == "L":
            out.append(
                (f"layer {h[1]}" if h[2] - h[1] == 1 else f"layers {h[1]}-{h[2] - 1}") + state
            )
        else:
            out.append(f"layer {h[1]} experts {h[2]}-{h[3] - 1}{state}")
    return ", ".join(out)


def _earnings(snap: dict[str, Any]) -> str:
    claims = snap.get("claims") or {}
    if not claims.get("enabled"):
        return "<p>Settlement is off on this node: it serves for free and earns nothing.</p>"
    total = snap["node"].get("earnings") or {}
    out = _table(
        [
            ("earned (receipts)", kvr(total.get("earned", 0))),
            ("received on chain", kvr(total.get("received", 0))),
            ("pending", kvr(total.get("pending", 0))),
        ]
    )
    if claims["gateways"]:
        out += "<h3>From gateways</h3>" + _grid(
            ["gateway", "earned", "received", "pending"],
            [
                [_short(g["peer_id"]), kvr(g["earned"]), kvr(g["received"]), kvr(g["pending"])]
                for g in claims["gateways"]
            ],
        )
    if claims.get("owed_to_peers"):
        out += "<h3>This gateway owes</h3>" + _grid(
            ["peer", "earned", "paid", "units"],
            [
                [_short(p["peer_id"]), kvr(p["earned"]), kvr(p["paid"]), str(p["measured_units"])]
                for p in claims["owed_to_peers"]
            ],
        )
    own = claims.get("own_use") or {}
    if own.get("requests"):
        out += (
            f"<p>Your own requests from this machine: {own['requests']}, paid to the "
            f"peers from your wallet: {kvr(own['spent'])}.</p>"
        )
    if claims.get("pending"):
        out += "<p>Claim what is pending with <code>kvasird wallet claim</code>.</p>"
    return out


def _price(price: dict[str, int] | None) -> str:
    if price is None:
        return "<p>This gateway takes no payments: requests are free.</p>"
    p, lo, hi = price["per_1k_tokens"], price["floor"], price["ceiling"]
    if hi <= 0:
        return "<p>The network is free (its governance set the price to zero).</p>"
    # the controller moves the price by factors, so the band is drawn on a log scale
    at = 0.0 if hi <= lo else (math.log(max(p, lo)) - math.log(lo)) / (math.log(hi) - math.log(lo))
    given = price.get("per_1k_input_tokens")
    inputs = f"<p>Prompt tokens: {kvr(given)} per 1000.</p>" if given is not None else ""
    return (
        f'<p class="big">{kvr(p)} <small>per 1000 output tokens</small></p>{inputs}'
        f'<div class="band" role="img" aria-label="price inside its band">'
        f'<i style="left:{100 * min(max(at, 0.0), 1.0):.1f}%"></i></div>'
        f'<p class="ends"><span>floor {kvr(lo)}</span><span>ceiling {kvr(hi)}</span></p>'
        "<p>Utilization moves the price inside the band governance sets.</p>"
    )


def _shards(view: dict[str, Any] | None) -> str:
    if view is None:
        return "<p>This gateway runs without a node.</p>"
    out = []
    p = view.get("progress")
    if p and p["done_bytes"] < p["total_bytes"]:
        done, total, rate = p["done_bytes"], p["total_bytes"], p["rate"] or 0
        eta = f", {_duration((total - done) / rate)} left" if rate > 0 else ""
        out.append(
            f"<p>Downloading: {_bytes(done)} of {_bytes(total)}, "
            f"{rate / 2**20:.1f} MB/s{eta}</p>{_bar(done, total)}"
        )
    for m in view.get("models", []):
        name = m.get("name") or m["model_id"][:12]
        out.append(
            f"<p>{escape(name)}: {_bytes(m['held_bytes'])} of "
            f"{_bytes(m['total_bytes'])} held</p>{_bar(m['held_bytes'], m['total_bytes'])}"
        )
    if r := view.get("last_download"):
        out.append(
            f"<p>Last download: {r['units']} units, {_bytes(r['received_bytes'])} in "
            f"{_duration(r['seconds'])}</p>"
        )
    return "".join(out) or "<p>No model in this node's store.</p>"


def _chat(model: dict[str, Any] | None) -> str:
    model_id = escape(model["id"]) if model else ""
    return (
        f'<div id="chat-log" class="chat-log" aria-live="polite"></div>'
        f'<form id="chat" data-model="{model_id}">'
        '<textarea name="q" rows="2" placeholder="Ask the model…" required></textarea>'
        '<label>temperature<input name="temperature" type="number" min="0" max="2" '
        'step="0.1" value="0.7"></label>'
        '<button type="submit" name="send">Send</button></form>'
    )


def _table(rows: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _grid(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<div class="scroll"><table class="grid"><tr>{th}</tr>{body}</table></div>'


def _bar(done: int, total: int) -> str:
    share = 100 * done / total if total else 0
    return f'<div class="bar"><i style="width:{min(share, 100):.0f}%"></i></div>'


def _coverage_colour(replicas: int, target: int) -> str:
    if replicas >= target:
        return COLOURS["full"]
    return COLOURS["partial"] if replicas > 0 else COLOURS["missing"]


def _short(peer: str) -> str:
    return f"{peer[:4]}…{peer[-6:]}" if len(peer) > 12 else peer


def _unit(value: float | None, unit: str, prefix: str = "") -> str:
    if value is None:
        return "–"
    return f"{prefix}{value:.0f} {unit}" if value >= 10 else f"{prefix}{value:.1f} {unit}"


def kvr(base_units: int) -> str:
    """KVR as the page shows it: to 3 significant digits (2 decimals from 100 KVR)."""
    amount = base_units / 10**KVR_DECIMALS
    if amount == 0 or amount >= 100:
        return f"{amount:,.2f} KVR"
    digits = min(KVR_DECIMALS, max(2, 2 - math.floor(math.log10(amount))))  # 3 significant
    return f"{amount:.{digits}f} KVR"


def _bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s // 3600:.0f} h {s % 3600 / 60:.0f} min"


def _json(value: Any) -> str:
    """JSON safe inside a <script> element."""
    return json.dumps(value).replace("<", "\\u003c")


STYLE = """
:root{--fg:#1d232a;--muted:#6b7380;--bg:#f4f6f8;--card:#fff;--line:#e3e6ea}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:var(--fg);background:var(--bg)}
header{padding:16px 20px 4px} h1{font-size:20px;margin:0}
h2{font-size:15px;margin:0 0 10px} h3{font-size:13px;margin:12px 0 6px;color:var(--muted)}
.pill{color:#fff;border-radius:10px;padding:1px 10px;font-size:13px;vertical-align:2px}
.reason,.facts,.join{margin:4px 0;color:var(--muted)} .join code{word-break:break-all}
main{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:14px;
padding:12px 20px 24px}
.card{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:14px;
min-width:0}
.wide{grid-column:1/-1}
table{border-collapse:collapse;width:100%} th{white-space:nowrap;font-weight:600}
td,th{padding:3px 10px 3px 0;text-align:left;vertical-align:top}
.peers td,.grid td{white-space:nowrap} .peers td:nth-child(3){white-space:normal;min-width:150px}
.scroll{overflow-x:auto} .topo{display:block;width:100%;min-width:760px;height:auto}
.warn{color:#b3262d;font-weight:600}
.topo rect.cell:hover,.topo rect.cov:hover{stroke:#1d232a}
.legend span{margin-right:14px;color:var(--muted)}
.legend i,.dot{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;
vertical-align:-1px;background:#c9ced6}
.tag{font-size:11px;background:#eef0f3;border-radius:6px;padding:0 6px}
.chip{display:inline-block;white-space:nowrap;border:2px solid;border-radius:6px;padding:0 5px;
font-family:monospace;font-size:12px;margin:1px 0}
.routes{padding-left:18px;margin:4px 0}
figure{margin:0 0 10px} figcaption{color:var(--muted)} figcaption b{color:var(--fg)}
.spark{width:100%;height:64px;background:#f7f8fa;border-radius:4px;color:#3b6fd6}
.spark text{font-size:10px;fill:var(--muted)}
.big{font-size:20px;margin:0 0 8px} .big small{font-size:13px;color:var(--muted)}
.band{position:relative;height:10px;border-radius:5px;
background:linear-gradient(90deg,#2e9e44,#e0a800,#d9363e)}
.band i{position:absolute;top:-4px;width:4px;height:18px;margin-left:-2px;background:#1d232a}
.ends{display:flex;justify-content:space-between;color:var(--muted);font-size:12px}
.bar{height:8px;background:#eef0f3;border-radius:4px;overflow:hidden;margin:-6px 0 10px}
.bar i{display:block;height:100%;background:#3b6fd6}
.chat-log{max-height:260px;overflow-y:auto;margin-bottom:8px}
.chat-log p{margin:4px 0;padding:6px 8px;border-radius:6px;background:#f4f6f8;
white-space:pre-wrap} .chat-log p.user{background:#e4ecfb}
.chat-log p.error{background:#fbe4e4}
#chat{display:flex;flex-wrap:wrap;gap:8px;align-items:center}
#chat textarea{flex:1 1 100%;font:inherit;padding:6px;min-width:0}
#chat label{flex:1;color:var(--muted);font-size:12px}
#chat input{width:4.5em;margin-left:6px;font:inherit} #chat button{font:inherit;padding:6px 14px}
@media (max-width:600px){header{padding:12px 12px 0} main{padding:10px 12px;gap:10px;
grid-template-columns:1fr} .card{padding:12px}
.peers tr>:nth-child(4){display:none} .peers td:nth-child(3){min-width:0}}
"""

SCRIPT = r"""
const $ = id => document.getElementById(id);
function spark(key, values, unit, now) {
  const svg = $('chart-' + key), seen = values.map((v, i) => [i, v]).filter(p => p[1] !== null);
  const max = Math.max(1, ...seen.map(p => p[1])), n = Math.max(values.length - 1, 1);
  const at = ([i, v]) => [(i / n * 300).toFixed(1), (60 - v / max * 52).toFixed(1)];
  svg.innerHTML = `<polyline points="${seen.map(p => at(p).join(',')).join(' ')}" fill="none"
    stroke="currentColor" stroke-width="2" vector-effect="non-scaling-stroke"/>` +
    seen.map(p => `<circle cx="${at(p)[0]}" cy="${at(p)[1]}" r="1.5" fill="currentColor"/>`)
      .join('') + `<text x="296" y="11" text-anchor="end">${seen.some(p => p[1] > 0) ?
        `max ${Math.round(max)} ${unit}` : 'nothing served in the last 5 minutes'}</text>`;
  const value = now(seen.map(p => p[1]));
  $('chart-' + key + '-now').textContent =
    value === null ? '–' : `${value.toFixed(value < 10 ? 1 : 0)} ${unit}`;
}
function draw(series) {
  // a generation's tokens count once it has finished: the last minute's mean, not the last 5 s
  spark('tps', series.map(s => s.tokens_per_s), 'tokens/s',
        v => v.slice(-12).reduce((a, b) => a + b, 0) / Math.max(Math.min(v.length, 12), 1));
  spark('ttft', series.map(s => s.ttft_ms), 'ms', v => v.length ? v[v.length - 1] : null);
}
let polls = 0;
async function poll() {
  try {
    draw((await (await fetch('/status', {cache: 'no-store'})).json()).gateway.series);
    if (++polls % 3 === 0) {
      const html = await (await fetch('/', {cache: 'no-store'})).text();
      const fresh = new DOMParser().parseFromString(html, 'text/html');
      for (const el of document.querySelectorAll('[data-live]')) {
        const now = fresh.getElementById(el.id);
        if (now) el.innerHTML = now.innerHTML;
      }
    }
  } catch (e) { /* the node is restarting: try again */ }
  setTimeout(poll, 2000);
}
draw(JSON.parse($('snapshot').textContent));
setTimeout(poll, 2000);

const form = $('chat'), log = $('chat-log'), turns = [];
function say(cls, text) {
  const p = document.createElement('p');
  p.className = cls; p.textContent = text; log.append(p); log.scrollTop = log.scrollHeight;
  return p;
}
form.addEventListener('submit', async e => {
  e.preventDefault();
  const q = form.q.value.trim();
  if (!q) return;
  form.q.value = '';
  form.send.disabled = true;
  say('user', q);
  turns.push({role: 'user', content: q});
  const out = say('assistant', '');
  try {
    const r = await fetch('/v1/chat/completions', {method: 'POST',
      headers: {'content-type': 'application/json'},
      body: JSON.stringify({model: form.dataset.model, messages: turns, stream: true,
                            max_tokens: 200, temperature: Number(form.temperature.value)})});
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      out.className = 'error';
      out.textContent = (body.error && body.error.message) || `HTTP ${r.status}`;
      turns.pop();
      return;
    }
    const reader = r.body.getReader(), text = new TextDecoder();
    let buf = '';
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += text.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf('\n\n')) >= 0) {
        for (const line of buf.slice(0, cut).split('\n')) {
          if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
          const d = JSON.parse(line.slice(6)).choices;
          if (d && d[0] && d[0].delta.content) out.textContent += d[0].delta.content;
        }
        buf = buf.slice(cut + 2);
      }
    }
    turns.push({role: 'assistant', content: out.textContent});
  } catch (err) {
    out.className = 'error'; out.textContent = String(err); turns.pop();
  } finally {
    form.send.disabled = false;
  }
});
"""
