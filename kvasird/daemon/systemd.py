"""sd_notify over the datagram socket systemd names in $NOTIFY_SOCKET (no libsystemd)."""

from __future__ import annotations

import os
import socket

import trio


def notify(message: str) -> bool:
    """Send one notification; False when not run by systemd (no NOTIFY_SOCKET)."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]  # abstract socket namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(message.encode(), path)
        except OSError:
            return False
    return True


def watchdog_interval_s() -> float | None:
    """Half the watchdog period systemd asks for, or None when the watchdog is off."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6 / 2


async def keep_watchdog_fed(interval_s: float) -> None:
    """WATCHDOG=1 every ``interval_s``, from a task of the node's nursery: the pings stop
    when the trio loop stalls (a blocking call, a livelock), and systemd restarts the daemon
    after WatchdogSec=. systemd arms the watchdog at READY=1; until then the node's
    EXTEND_TIMEOUT_USEC= lines, sent from the loop as well, play its part."""
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval_s)
