"""Circuit relay v2: public nodes relay for private ones; private ones stay reachable.

    private C --RESERVE--> relay R      (C keeps reservations on up to relay_reservations
                                         relays and announces <R addr>/p2p-circuit/p2p/<C>)
    A --CONNECT C--> R --STOP--> C      (A dials the circuit address; the relayed byte
                                         stream is secured end to end with Noise A<->C)

Every node runs the STOP side (accepting relayed connections) so all our stream
protocols work through a relay unchanged. The HOP side (relaying for others) is on
while the node is publicly reachable (``relay_service = "auto"``), with resource limits.

py-libp2p's ``host.connect()`` never uses the relay transport (STACK.md), so dials of
circuit addresses go through ``CircuitV2Transport`` here, wired into the dialer by
``CircuitDialer``. Its own ``dial()`` does not apply the private-network key that the
receiving side applies, so this module runs the same two steps with the key applied.

A node's addresses change when it gains or loses a reservation, but a hello is sent
once per connection; ``/kvasir/addrs/1`` pushes the new list to connected peers, which
record it exactly like a hello (the peer table keeps only addresses ending in the
sender's own id).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo as Libp2pPeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.security.pnet.protector import new_protected_conn
from libp2p.tools.anyio_service import background_trio_service

from kvasird.errors import WireError
from kvasird.logs import get_logger
from kvasird.p2p.dialer import Dialer, peer_id_of
from kvasird.p2p.messages import AddrsPush
from kvasird.p2p.peers import PeerTable
from kvasird.p2p.reachability import Reachability, is_circuit
from kvasird.wire import read_frame, write_frame
from kvasird.wire.protocols import ADDRS_PROTOCOL

# Per reservation: 16 circuits at once, each up to an hour and 1 GiB; 64 reservations.
LIMITS = RelayLimits(
    duration=3600, data=1 << 30, max_circuit_conns=16, max_reservations=64, reservation_ttl=3600
)
RESERVE_TIMEOUT_S = 8.0
DIAL_TIMEOUT_S = 10.0
PUSH_TIMEOUT_S = 5.0
MAINTAIN_EVERY_S = 2.0
REFRESH_BEFORE_S = 600.0
REFUSED_BACKOFF_S = 15.0
CIRCUIT_BACKOFF_S = 10.0
REDIAL_CAP_S = 15.0
log = get_logger("kvasird.p2p.relay")


@dataclass(frozen=True)
class Reservation:
    relay: str
    """Peer id of the relay."""
    expires: float
    """Unix time the relay lets the reservation lapse unless refreshed."""


class Relays:
    def __init__(
        self,
        host: IHost,
        peers: PeerTable,
        mode: str,
        wanted: int,
        psk: str | None,
        on_addrs_changed: Callable[[], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._host = host
        self._peers = peers
        self._clock = clock
        """Unix time, as the relays' reservations state their expiry: when to renew, and
        when a relay that refused us may be asked again."""
        self._mode = mode
        self._wanted_when_private = wanted
        self._wanted = 0
        self._psk = psk
        self._on_addrs_changed = on_addrs_changed
        self.protocol = CircuitV2Protocol(host, limits=LIMITS, allow_hop=False)
        self.transport = CircuitV2Transport(
            host, self.protocol, RelayConfig(roles=RelayRole.STOP, limits=LIMITS)
        )
        self.reservations: dict[str, Reservation] = {}
        self.serving = False
        self._refused: dict[str, float] = {}
        self._wake = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.protocol):
            await self.protocol.event_started.wait()
            self._set_serving(self._mode == "on")
            task_status.started()
            while True:
                await self._maintain()
                with trio.move_on_after(MAINTAIN_EVERY_S):
                    await self._wake.wait()
                self._wake = trio.Event()

    def on_reachability(self, r: Reachability) -> None:
        """Relay for others while public; hold reservations while private."""
        self._set_serving(self._mode == "on" or (self._mode == "auto" and r.verdict == "public"))
        self._wanted = self._wanted_when_private if r.verdict == "private" else 0
        self._wake.set()

    def _set_serving(self, on: bool) -> None:
        if on == self.serving:
            return
        self.serving = on
        if on:
            # The library registers HOP only at start; we switch it with reachability.
            self._host.set_stream_handler(HOP_PROTOCOL, self.protocol._handle_hop_stream)
        else:
            self._host.remove_stream_handler(HOP_PROTOCOL)
        log.info(
            "relay service " + ("offered to private peers" if on else "off"),
            max_reservations=LIMITS.max_reservations,
        )

    def circuit_addrs(self) -> list[str]:
        """Our /p2p-circuit addresses, one per direct address of each relay we hold."""
        me = self._host.get_id().to_string()
        out: list[str] = []
        for relay in self.reservations:
            info = self._peers.get(relay)
            direct = [a for a in (info.addrs if info else ()) if not is_circuit(a)]
            outside = [a for a in direct if "/ip4/127." not in a and "/ip6/::1/" not in a]
            out.extend(f"{a}/p2p-circuit/p2p/{me}" for a in (outside or direct))
        return out

    async def _maintain(self) -> None:
        now = self._clock()
        before = set(self.reservations)
        for relay, res in list(self.reservations.items()):
            if relay not in self._peers or res.expires < now or not self._wanted:
                del self.reservations[relay]
        for relay, res in list(self.reservations.items()):
            if res.expires - now < REFRESH_BEFORE_S:
                await self._reserve(relay)
        candidates = [
            p.peer_id
            for p in self._peers.snapshot()
            if p.peer_id not in self.reservations
            and p.addrs
            and not all(is_circuit(a) for a in p.addrs)
            and self._refused.get(p.peer_id, 0.0) < now
        ]
        random.shuffle(candidates)
        for relay in candidates:
            if len(self.reservations) >= self._wanted:
                break
            await self._reserve(relay)
        if set(self.reservations) != before:
            log.info(
                "relay reservations changed", relays=sorted(self.reservations), wanted=self._wanted
            )
            self._on_addrs_changed()

    async def _reserve(self, relay: str) -> None:
        try:
            with trio.fail_after(RESERVE_TIMEOUT_S):
                stream = await self._host.new_stream(ID.from_base58(relay), [HOP_PROTOCOL])
                try:
                    await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                    resp = await read_delimited_msg(stream, HopMessage)
                finally:
                    await stream.close()
            status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.OK
            if status != StatusCode.OK or not resp.HasField("reservation"):
                raise WireError(f"relay answered {status.name}")
        except Exception as exc:  # noqa: BLE001 - not a relay, full, or gone: try another later
            log.debug("relay reservation failed", relay=relay, error=repr(exc)[:200])
            self.reservations.pop(relay, None)
            self._refused[relay] = self._clock() + REFUSED_BACKOFF_S
            return
        self.reservations[relay] = Reservation(relay, float(resp.reservation.expire))

    async def dial(self, addrs: list[str]) -> bool:
        """Connect to a peer through one of its circuit addresses; True on success."""
        for addr in addrs:
            with trio.move_on_after(DIAL_TIMEOUT_S) as scope:
                try:
                    await self._dial_one(multiaddr.Multiaddr(addr))
                    return True
                except Exception as exc:  # noqa: BLE001 - the relay transport raises many types
                    log.debug("relayed dial failed", addr=addr, error=repr(exc)[:200])
            if scope.cancelled_caught:
                log.debug("relayed dial timed out", addr=addr, timeout_s=DIAL_TIMEOUT_S)
        return False

    async def _dial_one(self, maddr: multiaddr.Multiaddr) -> None:
        relay_maddr, dest = self.transport.parse_circuit_ma(maddr)
        relay_id = ID.from_base58(str(relay_maddr.get_peer_id()))
        raw = await self.transport.dial_peer_info(
            Libp2pPeerInfo(dest, [maddr]), relay_info=Libp2pPeerInfo(relay_id, [relay_maddr])
        )
        if self._psk:
            raw = new_protected_conn(raw, self._psk)
        await self._host.upgrade_outbound_connection(raw, dest)


class CircuitDialer(Dialer):
    """The dialer, with circuit addresses dialled through the relay transport."""

    def __init__(self, host: IHost, max_peers: int) -> None:
        super().__init__(host, max_peers)
        self.relays: Relays | None = None

    def due(self, peer_id: str) -> bool:
        """Redial at least every REDIAL_CAP_S: a private peer that failed on its direct
        addresses gains circuit ones once it holds a reservation."""
        next_try, delay = self._backoff.get(peer_id, (0.0, 0.0))
        return next_try - delay + min(delay, REDIAL_CAP_S) <= trio.current_time()

    async def dial(self, addrs: list[str]) -> bool:
        direct = [a for a in addrs if not is_circuit(a)]
        circuit = [a for a in addrs if is_circuit(a)]
        network: Any = self._host.get_network()
        try:
            # The swarm refuses every dial for 60 s after one failure (its "negative
            # cache"): a bootstrap peer that was not up yet stays unreachable that long.
            # Our own backoff decides when to retry.
            network.unblock_peer(ID.from_base58(peer_id_of(addrs[0])))
        except (IndexError, ValueError):
            return False
        if direct and await super().dial(direct):
            return True
        if not circuit or self.relays is None or not addrs:
            return False
        pid = peer_id_of(addrs[0])
        if self.connected(pid):
            return True
        ok = await self.relays.dial(circuit)
        if ok:
            self._backoff.pop(pid, None)
        elif not direct:
            self._backoff[pid] = (trio.current_time() + CIRCUIT_BACKOFF_S, CIRCUIT_BACKOFF_S)
        return ok


class AddressPush:
    """Tell connected peers our new address list (after a reservation changed)."""

    def __init__(
        self, host: IHost, peers: PeerTable, addrs: Callable[[], list[str]], version: str
    ) -> None:
        self._host = host
        self._peers = peers
        self._addrs = addrs
        self._version = version
        self._send, self._receive = trio.open_memory_channel[None](1)

    def changed(self) -> None:
        with contextlib.suppress(trio.WouldBlock):  # one pending push carries the newest list
            self._send.send_nowait(None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._host.set_stream_handler(ADDRS_PROTOCOL, self._serve)
        task_status.started()
        async for _ in self._receive:
            addrs = self._addrs()
            async with trio.open_nursery() as nursery:
                for peer in self._peers.snapshot():
                    nursery.start_soon(self._push, peer.peer_id, addrs)

    async def _push(self, pid: str, addrs: list[str]) -> None:
        try:
            with trio.fail_after(PUSH_TIMEOUT_S):
                stream = await self._host.new_stream(ID.from_base58(pid), [ADDRS_PROTOCOL])
                try:
                    await write_frame(stream, AddrsPush(tuple(addrs)).to_wire())
                finally:
                    await stream.close()
        except Exception as exc:  # noqa: BLE001 - the next heartbeat decides if it is gone
            log.debug("address push failed", peer=pid, error=repr(exc)[:200])

    async def _serve(self, stream: INetStream) -> None:
        sender = stream.muxed_conn.peer_id.to_string()
        try:
            with trio.fail_after(PUSH_TIMEOUT_S):
                addrs = AddrsPush.from_wire(await read_frame(stream, 16 * 1024)).addrs
            known = self._peers.get(sender)
            if known is not None:
                own = tuple(a for a in addrs if a.endswith(f"/p2p/{sender}"))
                self._peers.hello(sender, own, known.version)
        except Exception as exc:  # noqa: BLE001 - a bad push is ignored, the peer keeps its hello
            log.debug("address push dropped", peer=sender, reason=repr(exc)[:200])
        finally:
            with trio.move_on_after(1) as scope:
                scope.shield = True
                with contextlib.suppress(Exception):
                    await stream.close()
