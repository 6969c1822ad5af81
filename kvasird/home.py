"""The state directory (``--home``, ``$KVASIRD_HOME``, else ``~/.kvasird``).

<home>/kvasird.toml     configuration (from config/kvasird.toml at init)
<home>/node.key         Ed25519 node key, mode 0600; peer id = node id
<home>/state.db         SQLite: peers, and every subsystem's durable state
<home>/admin.json       where the running daemon's admin API listens (removed on exit)
<home>/kvasird.lock     flock held by the one daemon running on this home; holds its pid
<home>/shards/          model shard store (model subsystem)
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvasird.errors import HomeError

SERVICE_HOME = Path("/var/lib/kvasird")
"""The state directory of the service that `kvasird service install` sets up."""


def default_home() -> Path:
    env = os.environ.get("KVASIRD_HOME")
    return Path(env).expanduser() if env else Path.home() / ".kvasird"


def find_home(command: str) -> Path:
    """The home a command that needs one works on, given no --home: the default home, or,
    when that does not exist and $KVASIRD_HOME is unset, the service's, so that `sudo
    kvasird status` on a machine running the service just works. Where the service's home
    is closed to this user, the error says how to run ``command`` as its user."""
    own = default_home()
    if os.environ.get("KVASIRD_HOME") or own.exists() or not SERVICE_HOME.is_dir():
        return own
    if os.access(SERVICE_HOME, os.R_OK | os.X_OK):
        return SERVICE_HOME if (SERVICE_HOME / "kvasird.toml").is_file() else own
    user = pwd.getpwuid(SERVICE_HOME.stat().st_uid).pw_name
    raise HomeError(
        f"there is no kvasird home at {own}; the service's home {SERVICE_HOME} is "
        f"readable by its user only: run `sudo -u {user} KVASIRD_HOME={SERVICE_HOME} "
        f"kvasird {command}` (or pass --home)"
    )


@dataclass(frozen=True)
class Home:
    root: Path
    """The state directory itself."""

    @property
    def config(self) -> Path:
        return self.root / "kvasird.toml"

    @property
    def node_key(self) -> Path:
        return self.root / "node.key"

    @property
    def db(self) -> Path:
        return self.root / "state.db"

    @property
    def admin_file(self) -> Path:
        return self.root / "admin.json"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def lock_file(self) -> Path:
        return self.root / "kvasird.lock"

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the home's lock for the body: two daemons on one home would share one
        ledger, and claims through both could be paid twice.

        The kernel drops an flock when its holder exits, crashed or not, so a stale lock
        file never blocks a restart; the file is left in place, since unlinking it would
        let a third process lock a new file while a second still holds the old one.
        """
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                raise HomeError(
                    f"another kvasird (pid {holder}) is running on {self.root}: "
                    f"stop it first (`kvasird --home {self.root} status`)"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)

    def require_initialised(self) -> None:
        if not self.node_key.exists() or not self.config.exists():
            raise HomeError(
                f"{self.root} is not a kvasird home: run `kvasird --home {self.root} init`"
            )

    def write_admin_address(self, url: str, pid: int) -> None:
        """Publish where the admin API listens, atomically (CLI commands read it)."""
        tmp = self.admin_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": url, "pid": pid}))
        tmp.replace(self.admin_file)

    def admin_address(self) -> str | None:
        try:
            return str(json.loads(self.admin_file.read_text())["url"])
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def clear_admin_address(self) -> None:
        self.admin_file.unlink(missing_ok=True)
