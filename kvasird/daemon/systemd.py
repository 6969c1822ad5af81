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
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval_s)
