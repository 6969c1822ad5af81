"""Reachability: can other nodes dial us? Peers dial our addresses back and say.

    we   --dialback? {addrs}-->  peer        (/kvasir/dialback/1, one request per stream)
         <--{reached: [...]}--   peer        (each addr: TCP/WS dial + Noise handshake
                                              proving our peer id, then closed)

The peer dials with its own transport and key but never registers the connection (it
closes after the security handshake), so the probe does not reuse the connection we
already share and nothing shows up in either peer table. A peer only dials addresses
whose IP is the one it sees our connection come from: the protocol cannot be used to
make others scan third parties.

Verdict over the peers asked in one round: ``public`` when a majority of those that
answered reached at least one address, ``private`` when they answered and none did,
``unknown`` otherwise (no peers, no answers, or a split). The verdict drives the DHT
mode, whether we offer relay service, and whether we keep relay reservations.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.security.pnet.protector import new_protected_conn

from kvasird.errors import WireError
from kvasird.logs import get_logger
from kvasird.p2p.messages import MAX_PROBED, DialBackAsk, Reached
from kvasird.p2p.peers import PeerTable
from kvasird.wire import read_frame, write_frame
from kvasird.wire.protocols import DIALBACK_PROTOCOL

PEERS_ASKED = 3
ASK_TIMEOUT_S = 12.0
PROBE_TIMEOUT_S = 4.0
RETRY_UNKNOWN_S = 5.0
_MAX_FRAME = 8 * 1024
VERDICTS = ("public", "private", "unknown")
log = get_logger("kvasird.p2p.reachability")


@dataclass(frozen=True)
class Reachability:
    verdict: str
    """"public" (peers dialled us), "private" (they could not) or "unknown"."""
    reached: tuple[str, ...] = ()
    """Our addresses at least one peer dialled successfully."""
    asked: int = 0
    """Peers asked in the last round."""
    answered: int = 0
    """Peers that answered in time."""
    confirmed: int = 0
    """Peers that reached at least one of our addresses."""
    checked_at: float = 0.0
    """Unix time of the last round (0 before the first)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "reached": list(self.reached),
            "asked": self.asked,
            "answered": self.answered,
            "confirmed": self.confirmed,
            "checked_at": self.checked_at,
        }


def decide(asked: int, answers: list[tuple[str, ...]]) -> Reachability:
    """The verdict of one round, from the addresses each answering peer reached."""
    confirmed = sum(1 for reached in answers if reached)
    if not answers or (confirmed and confirmed * 2 <= len(answers)):
        verdict = "unknown"
    else:
        verdict = "public" if confirmed else "private"
    reached = tuple(dict.fromkeys(a for r in answers for a in r))
    return Reachability(verdict, reached, asked, len(answers), confirmed, time.time())


def is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr


def _ip_of(addr: str) -> str | None:
    parts = addr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None


def advice(r: Reachability, addrs: list[str], config_path: str) -> str:
    """What the operator can do about a verdict, in one sentence."""
    if r.verdict == "public":
        return f"reachable from other nodes at {', '.join(r.reached)}"
    if r.verdict == "unknown":
        return "reachability unknown: no peer answered the dial-back check yet"
    ports = sorted({a.split("/")[4] for a in addrs if "/tcp/" in a and not is_circuit(a)})
    return (
        f"peers cannot dial this node at {', '.join(a for a in addrs if not is_circuit(a))}: "
        f"forward TCP port {'/'.join(ports) or '?'} on your router to this machine, or set "
        f"[p2p] announce in {config_path} to your public address; until then other nodes "
        "reach it only through relays (its /p2p-circuit addresses)"
    )


class DialBack:
    def __init__(
        self,
        host: IHost,
        peers: PeerTable,
        addrs: Callable[[], list[str]],
        psk: str | None,
        interval_s: float,
        on_change: Callable[[Reachability], None],
        config_path: str,
    ) -> None:
        self._host = host
        self._peers = peers
        self._addrs = addrs
        self._psk = psk
        self._interval = interval_s
        self._on_change = on_change
        self._config_path = config_path
        self.current = Reachability("unknown")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._host.set_stream_handler(DIALBACK_PROTOCOL, self._serve)
        task_status.started()
        while True:
            if len(self._peers):
                await self.check()
            wait = self._interval if self.current.verdict != "unknown" else RETRY_UNKNOWN_S
            await trio.sleep(min(wait, self._interval) * random.uniform(0.9, 1.1))

    def direct_addrs(self) -> list[str]:
        return [a for a in self._addrs() if not is_circuit(a)][:MAX_PROBED]

    async def check(self) -> Reachability:
        """Ask up to PEERS_ASKED connected peers, in parallel; publish and log the verdict."""
        addrs = self.direct_addrs()
        candidates = [
            p.peer_id
            for p in self._peers.snapshot()
            if p.addrs and not all(is_circuit(a) for a in p.addrs)
        ]
        asked = random.sample(candidates, min(PEERS_ASKED, len(candidates)))
        answers: list[tuple[str, ...]] = []

        async def ask(pid: str) -> None:
            if (reached := await self._ask(pid, addrs)) is not None:
                answers.append(reached)

        async with trio.open_nursery() as nursery:
            for pid in asked:
                nursery.start_soon(ask, pid)
        result = decide(len(asked), answers)
        if result.verdict == "unknown" and self.current.verdict != "unknown" and asked:
            result = self.current  # a failed round does not forget what we knew
        changed = result.verdict != self.current.verdict
        self.current = result
        if changed:
            text = advice(result, addrs, self._config_path)
            (log.warning if result.verdict == "private" else log.info)(
                text,
                reachability=result.verdict,
                asked=result.asked,
                answered=result.answered,
                confirmed=result.confirmed,
            )
            self._on_change(result)
        return result

    async def _ask(self, pid: str, addrs: list[str]) -> tuple[str, ...] | None:
        try:
            with trio.fail_after(ASK_TIMEOUT_S):
                stream = await self._host.new_stream(ID.from_base58(pid), [DIALBACK_PROTOCOL])
                try:
                    await write_frame(stream, DialBackAsk(tuple(addrs)).to_wire())
                    reached = Reached.from_wire(await read_frame(stream, _MAX_FRAME)).reached
                finally:
                    await stream.close()
        except Exception as exc:  # noqa: BLE001 - an old peer, a timeout, a reset: no answer
            log.debug("dial-back request failed", peer=pid, error=repr(exc)[:200])
            return None
        return tuple(a for a in reached if a in addrs)

    async def _serve(self, stream: INetStream) -> None:
        asker = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(ASK_TIMEOUT_S - 1):
                addrs = DialBackAsk.from_wire(await read_frame(stream, _MAX_FRAME)).addrs
                remote = stream.get_remote_address()
                seen_ip = remote[0] if remote else None
                wanted = [a for a in addrs if self._may_probe(a, asker, seen_ip)]
                reached: list[str] = []

                async def one(addr: str) -> None:
                    if await self.probe(addr, asker):
                        reached.append(addr)

                async with trio.open_nursery() as nursery:
                    for addr in wanted:
                        nursery.start_soon(one, addr)
                await write_frame(stream, Reached(tuple(reached)).to_wire())
        except (trio.TooSlowError, WireError) as exc:
            log.debug("dial-back request dropped", peer=asker.to_string(), reason=repr(exc))
        except Exception as exc:  # noqa: BLE001 - stream resets surface as many types
            log.debug("dial-back stream failed", peer=asker.to_string(), reason=repr(exc))
        finally:
            with trio.move_on_after(1) as scope:
                scope.shield = True
                with contextlib.suppress(Exception):
                    await stream.close()

    @staticmethod
    def _may_probe(addr: str, asker: ID, seen_ip: str | None) -> bool:
        """Only the asker's own non-relay addresses, and only at the IP it came from."""
        if is_circuit(addr) or not addr.endswith(f"/p2p/{asker.to_string()}"):
            return False
        ip = _ip_of(addr)
        if ip is None or seen_ip is None:
            return False
        try:
            return ipaddress.ip_address(ip) == ipaddress.ip_address(seen_ip)
        except ValueError:
            return False

    async def probe(self, addr: str, peer: ID) -> bool:
        """Dial ``addr`` on a fresh connection and run the Noise handshake against ``peer``."""
        swarm: Any = self._host.get_network()
        try:
            maddr = multiaddr.Multiaddr(addr)
            transport = swarm.transport_manager.transport_for_dialing(maddr)
        except Exception:  # noqa: BLE001 - a malformed address is simply not reached
            return False
        if transport is None:
            return False
        raw = None
        with trio.move_on_after(PROBE_TIMEOUT_S):
            try:
                raw = await transport.dial(maddr)
                conn = new_protected_conn(raw, self._psk) if self._psk else raw
                await swarm.upgrader.upgrade_security(conn, True, peer)
                return True
            except Exception as exc:  # noqa: BLE001 - refused, reset, wrong key: not reached
                log.debug("dial-back probe failed", addr=addr, error=repr(exc)[:200])
            finally:
                if raw is not None:
                    with trio.move_on_after(1) as scope:
                        scope.shield = True
                        with contextlib.suppress(Exception):
                            await raw.close()
        return False
