"""Delegations: a gateway's signed word that a stage computes rows of its sessions.

An expert worker computes rows for a stage, and is paid for them by the gateway whose
session the rows belong to. Naming that gateway proves nothing (anyone can name a staked
gateway, or the worker itself), so the gateway signs, when it opens a session on a hop, a
short-lived delegation to that hop's peer; the hop sends it with every expert request made
for the session, and the worker checks it before anything else:

    gateway ── Open {…, delegation} ──▶ stage ── Expert {for: [[delegation, rows]]} ──▶ worker
             signed with the gateway's node key:    the worker checks the signature (the key
             {network, gateway, delegate, expires}  is in the gateway's peer id), the network,
                                                    delegate == caller and the expiry; then
                                                    admission, for the units of its rows

    wire: bin = msgpack [network, gateway peer id, delegate peer id, expires (unix s)]
                ‖ Ed25519 signature (64 bytes) over DOMAIN ‖ that msgpack

A delegation lives as long as the session may: a few minutes, and longer for sessions
that may generate more (``life_s``); a worker refuses one that claims to live longer than
MAX_LIFE_S. A stage computing for itself (no gateway's session) signs its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from kvasird.errors import WireError
from kvasird.inference.errors import Refusal
from kvasird.wire import pack, unpack

DOMAIN = b"kvasir-delegation-v1\n"
"""Signed before the body: a delegation's signature is never another message's."""
SIGNATURE_BYTES = 64
MAX_BYTES = 512
"""Longest delegation on the wire (two peer ids, a network name, a time and a signature)."""
BASE_LIFE_S = 300.0
"""How long a session's delegation lives at least."""
TOKEN_LIFE_S = 1.0
"""And how much longer per position the session may reach: a long generation keeps its
delegation to the end (at one token a second, a rate no route serves slower than)."""
MAX_LIFE_S = 86400.0
"""Longest a worker believes a delegation lives (from now: a longer one is refused)."""
OWN_RENEW_S = 60.0
"""A node's delegation to itself is renewed once it has less than this left."""
CACHE = 4096
"""Verified delegations a worker remembers (a stage sends one with every request)."""


@dataclass(frozen=True, slots=True)
class Delegation:
    """What a gateway signed: `delegate` computes rows of its sessions until `expires`."""

    network: str
    """The network it was signed on (never valid on another)."""
    gateway: str
    """The signer's peer id: the gateway whose sessions the rows belong to, which pays."""
    delegate: str
    """The peer id of the stage that may send rows for it."""
    expires: float
    """Unix time past which it is worth nothing."""

    def body(self) -> bytes:
        return pack([self.network, self.gateway, self.delegate, self.expires])


def life_s(max_tokens: int) -> float:
    """How long a session that may reach `max_tokens` positions has its delegation live."""
    return min(BASE_LIFE_S + TOKEN_LIFE_S * max_tokens, MAX_LIFE_S)


class Issuer:
    """This node's delegations, signed with its node key (the gateway's side, and a stage's
    for itself)."""

    def __init__(self, key: KeyPair, network: str, clock: Callable[[], float] = time.time) -> None:
        self.key, self.network, self.clock = key, network, clock
        self.peer_id = ID.from_pubkey(key.public_key).to_string()
        self._own: tuple[float, bytes] | None = None

    def issue(self, delegate: str, life: float) -> bytes:
        """A delegation to `delegate`, live for `life` seconds from now."""
        d = Delegation(self.network, self.peer_id, delegate, self.clock() + life)
        body = d.body()
        return body + self.key.private_key.sign(DOMAIN + body)

    def own(self) -> bytes:
        """This node's delegation to itself: what its stages send when they compute outside
        any gateway's session (reused until it is close to its end)."""
        now = self.clock()
        if self._own is None or self._own[0] - now < OWN_RENEW_S:
            self._own = (now + BASE_LIFE_S, self.issue(self.peer_id, BASE_LIFE_S))
        return self._own[1]


class Verifier:
    """A worker's check of the delegations requests carry: signature, network, delegate and
    expiry, each answered by a Refusal ("unpaid") that says what is wrong. A signature is
    verified once per delegation (a stage sends the same one with every request)."""

    def __init__(self, network: str, clock: Callable[[], float] = time.time) -> None:
        self.network, self.clock = network, clock
        self._verified: dict[bytes, Delegation] = {}

    def check(self, wire: bytes, caller: str) -> Delegation:
        """The delegation `wire` holds, if it lets `caller` send rows now."""
        d = self._verified.get(wire)
        if d is None:
            d = self._verify(wire)
            if len(self._verified) >= CACHE:
                self._verified.pop(next(iter(self._verified)))
            self._verified[wire] = d
        if d.delegate != caller:
            raise Refusal(
                "unpaid",
                f"the delegation of gateway {d.gateway} names another "
                f"stage ({d.delegate}), not the caller",
            )
        now = self.clock()
        if d.expires < now:
            raise Refusal(
                "unpaid",
                f"the delegation of gateway {d.gateway} expired "
                f"{now - d.expires:.0f} s ago: the gateway must open the "
                "session again",
            )
        if d.expires > now + MAX_LIFE_S:
            raise Refusal(
                "unpaid",
                f"the delegation of gateway {d.gateway} claims to live "
                f"longer than {MAX_LIFE_S:.0f} s",
            )
        return d

    def _verify(self, wire: bytes) -> Delegation:
        body, signature = wire[:-SIGNATURE_BYTES], wire[-SIGNATURE_BYTES:]
        try:
            fields = unpack(body, MAX_BYTES) if len(wire) > SIGNATURE_BYTES else None
        except WireError:
            fields = None
        if (
            type(fields) is not list
            or len(fields) != 4
            or not all(type(f) is str and len(f) <= 128 for f in fields[:3])
            or type(fields[3]) is not float
        ):
            raise Refusal(
                "unpaid",
                "the delegation is malformed: expected a gateway's signed "
                "[network, gateway, delegate, expires]",
            )
        d = Delegation(*fields)
        if d.network != self.network:
            raise Refusal(
                "unpaid",
                f"the delegation was signed for network {d.network!r:.40}, not {self.network!r}",
            )
        if not _signed_by(d.gateway, DOMAIN + body, signature):
            raise Refusal(
                "unpaid",
                f"the delegation is not signed by gateway {d.gateway}: "
                "forged, or altered on the way",
            )
        return d


def _signed_by(peer: str, data: bytes, signature: bytes) -> bool:
    """Whether `signature` over `data` is by the key `peer`'s id embeds (Ed25519)."""
    try:
        key = ID.from_base58(peer).extract_public_key()
    except Exception:  # noqa: BLE001 - not a peer id at all
        return False
    return key is not None and key.verify(data, signature)
