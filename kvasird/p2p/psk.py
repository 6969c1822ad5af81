"""The pre-shared key of a private swarm (libp2p "private network", pnet).

With a key, every connection is wrapped in XSalsa20 keyed by it before Noise even
starts: a node without the key (or with another one) cannot complete a handshake, so
private swarms, test networks and the public network never mix below the hello.

The file format is go-libp2p's ``swarm.key``, so a key can be shared with other tools:

    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits>

A file holding only the 64 hex digits is accepted too. Generate one with
``python -c "import secrets; print(secrets.token_hex(32))"``.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from kvasird.errors import ConfigError

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_HEADER = ("/key/swarm/psk/1.0.0/", "/base16/")


def load_psk(path: str) -> str | None:
    """The key as 64 lowercase hex digits, or None when ``path`` is "" (no private swarm)."""
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(
            f"p2p.psk_file {path!r} cannot be read ({exc.strerror}): fix the path "
            'or set psk_file = "" to join the open network'
        ) from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines[:2] == list(_HEADER):
        lines = lines[2:]
    if len(lines) != 1 or not _HEX64.fullmatch(lines[0]):
        raise ConfigError(
            f"p2p.psk_file {path!r} must hold 64 hex digits (32 bytes), alone or "
            "after the '/key/swarm/psk/1.0.0/' and '/base16/' header lines"
        )
    return lines[0].lower()


def fingerprint(psk: str | None) -> str:
    """A short public name of the key (for logs and mDNS service names); "" without one."""
    return hashlib.sha256(bytes.fromhex(psk)).hexdigest()[:12] if psk else ""
