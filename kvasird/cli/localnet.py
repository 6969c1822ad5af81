"""``kvasird localnet up|down|status``: a local network of daemons on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from kvasird.errors import KvasirError
from kvasird.localnet import LocalNet, demo
from kvasird.localnet.launcher import LocalNetError
from kvasird.model.names import model_name
from kvasird.model.ref import ModelRef
from kvasird.model.slice import contiguous_runs
from kvasird.settlement.token import format_kvr


def _default_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvasird" / "localnet"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("localnet", help="run a local network of daemons on 127.0.0.1")
    cmds = p.add_subparsers(dest="localnet_command", metavar="ACTION", required=True)
    up = cmds.add_parser(
        "up", help="start a local chain and N daemons that split a model, then answer a paid prompt"
    )
    up.add_argument("--nodes", type=int, default=3, help="number of daemons (default 3)")
    up.add_argument("--dir", type=Path, default=None, help="where their homes live")
    up.add_argument(
        "--model",
        default="bundled:smollm2",
        help="bundled:smollm2 (default), a GGUF path, or none (peers only)",
    )
    up.add_argument(
        "--prompt",
        default="What is the capital of France?",
        help="the question the demo pays for and asks",
    )
    mode = up.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true", help="leave them running; stop with `down`")
    mode.add_argument("--once", action="store_true", help="stop them again after the answer")
    up.set_defaults(func=_up)
    for name, func, text in (
        ("down", _down, "stop a detached local network"),
        ("status", _status, "peers of each local daemon"),
    ):
        c = cmds.add_parser(name, help=text)
        c.add_argument("--dir", type=Path, default=None, help="where their homes live")
        c.set_defaults(func=func)


def _up(args: argparse.Namespace) -> int:
    root = (args.dir or _default_dir()).resolve()
    if (root / "localnet.json").exists():
        raise LocalNetError(
            f"a local network already runs from {root}: stop it with `kvasird localnet down` first"
        )
    if not 1 <= args.nodes <= 32:
        raise LocalNetError("--nodes must be between 1 and 32")
    model = None if args.model == "none" else ModelRef.parse(args.model).gguf()
    with_model = model is not None
    net = LocalNet(root, args.nodes, chain=with_model, outlive_parent=args.detach)
    try:
        if model is not None:
            manifest = demo.serve_model(net, model)
            name = model_name({k: v for k, _, v in manifest.metadata}, model.name)
            print(
                f"model {name} ({manifest.total_bytes / 2**20:.0f} MiB, id "
                f"{manifest.model_id[:16]}…) will be split among {args.nodes} daemons"
            )
        print(
            f"starting {'a local chain and ' if with_model else ''}{args.nodes} daemons "
            f"under {root} ...",
            flush=True,
        )
        began = time.monotonic()
        net.up()
        took = net.wait_until(
            "every daemon lists every other one as a peer",
            net.fully_connected,
            timeout=30 + 5 * args.nodes,
        )
        print(f"all {args.nodes} daemons joined in {took:.1f} s\n")
        _print_table(net)
        if with_model:
            gateway = demo.wait_served(net)
            print(f"\nthe market split the model in {time.monotonic() - began:.0f} s:")
            _print_holdings(net)
            answer = demo.ask(net, gateway, args.prompt)
            print(f"\nQ: {args.prompt}\nA: {answer.text.strip()}")
            print(
                f"   paid {answer.paid / 10**6:.6f} KVR on the local chain (transaction "
                f"{answer.signature[:16]}…), answered in {answer.seconds:.1f} s"
            )
            _print_earnings(demo.earnings(net))
            if args.once:
                _print_claims(demo.claim_all(net))
            _print_snippets(gateway, answer.model)
        if args.detach:
            print(f"\nleft running; stop with: kvasird localnet down --dir {root}")
            return 0
        if not args.once:
            print("\nrunning; press Ctrl-C to stop", flush=True)
            while all(n.alive() for n in net.nodes):
                time.sleep(1)
            raise LocalNetError(f"a daemon exited unexpectedly; logs are in {root}")
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if not args.detach:
            codes = net.down()
            print(f"stopped {len(codes)} daemons")


def _print_earnings(earned: list[demo.Earned]) -> None:
    print("\nwhat each node earned for it (the gateway's measured work; receipts it signed):")
    for e in earned:
        extra = (
            (
                f" + operator fee {format_kvr(e.operator)} + insurance pool "
                f"{format_kvr(e.insurance)} (gateway)"
            )
            if e.index == 0
            else ""
        )
        print(f"  node{e.index}: {format_kvr(e.earned)} KVR{extra}")


def _print_claims(claims: list[demo.Paid]) -> None:
    print("\nevery node claims; payouts on the local chain:")
    for c in claims:
        how = f"transaction {c.signature[:16]}…" if c.signature else c.note
        print(
            f"  node{c.index}: +{format_kvr(c.amount)} KVR, wallet now "
            f"{format_kvr(c.balance)} KVR ({how})"
        )


def _print_holdings(net: LocalNet) -> None:
    for node in net.nodes:
        held = node.get("/v0/coverage")["held"]
        layers = sorted(int(u.split(":")[1]) for u in held if u.startswith("layer:"))
        span = (
            ", ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in contiguous_runs(layers))
            or "none"
        )
        head = " + head" if "head" in held else ""
        experts = sum(u.startswith("expert:") for u in held)
        print(
            f"  node{node.index}: layers {span}{head}"
            + (f" + {experts} experts" if experts else "")
        )


def _print_snippets(gateway: str, model: str) -> None:
    print(f"""
gateway: {gateway}  (requests from this machine need no quote: node0's operator pays the
         peers for them from its wallet; others pay per quote)
try it:
  curl -s {gateway}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
  python -c "import openai; c = openai.OpenAI(base_url='{gateway}/v1', api_key='-'); \\
print(c.chat.completions.create(model=c.models.list().data[0].id, \\
messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"
status page: {gateway}/""")


def _print_table(net: LocalNet) -> None:
    print(f"{'node':5} {'peer id':54} peers")
    for node in net.nodes:
        peers = sorted(node.peer_ids())
        names = [f"node{m.index}" for m in net.nodes if m.peer_id in peers]
        print(f"node{node.index:<1} {node.peer_id:54} {', '.join(names)}")


def _state(args: argparse.Namespace) -> tuple[Path, dict]:
    root = (args.dir or _default_dir()).resolve()
    try:
        return root, json.loads((root / "localnet.json").read_text())
    except FileNotFoundError:
        raise LocalNetError(f"no detached local network runs from {root}") from None


def _down(args: argparse.Namespace) -> int:
    root, state = _state(args)
    pids = [n["pid"] for n in state["nodes"] if n["pid"]]
    chain = state.get("chain_pid")
    # the daemons first (they flush their state and may still talk to the chain), then it
    for group in (pids, [chain] if chain else []):
        for pid in group:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(pid) for pid in group):
            time.sleep(0.2)
        for pid in group:
            _signal(pid, signal.SIGKILL)
    (root / "localnet.json").unlink(missing_ok=True)
    print(f"stopped {len(pids)} daemons" + (" and the local chain" if chain else ""))
    return 0


def _running(pid: int) -> bool:
    """Alive and not a zombie (a process that exited but whose parent has not reaped it
    is gone for every purpose here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return _signal(pid, 0)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _status(args: argparse.Namespace) -> int:
    from kvasird.admin import client
    from kvasird.home import Home

    _, state = _state(args)
    for n in state["nodes"]:
        try:
            status = client.get(Home(Path(n["home"])), "/v0/status")
            print(
                f"node{n['index']} {status['peer_id']} peers={status['peers']} "
                f"uptime={status['uptime_s']:.0f}s"
            )
        except KvasirError as exc:
            print(f"node{n['index']} {n['peer_id']} not answering: {exc}")
    return 0
