"""``kvasird service install``: run this checkout as a hardened systemd service.

Creates the system user, writes the unit (pointing at this installation's ``kvasird``,
its first start running ``kvasird init`` with the options given here: model, budget,
bootstrap, ports) and a sysctl drop-in that turns TCP's slow start after idle off (SYSCTL:
far peers' first tokens wait fewer round trips), reloads systemd and enables the service.
``--dry-run`` prints what it would do, and what would stop it. It refuses an installation
the service could not reach, which would never start: one that the unit's ProtectHome hides
(a venv whose python links into a home directory, as pyenv's do), or one behind a directory
its user may not enter.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from kvasird.cli.init import add_node_options, node_argv, node_values
from kvasird.config import default_text, load_text, render
from kvasird.errors import KvasirError
from kvasird.home import SERVICE_HOME

UNIT_TEMPLATE = Path(__file__).resolve().parents[2] / "systemd" / "kvasird.service"
TEMPLATE_BIN = "/opt/kvasird/.venv/bin/kvasird"
HOMES = ("/home", "/root", "/run/user")
"""What ProtectHome=yes (or tmpfs) hides from the service; read-only and no hide nothing."""
SYSCTL = (
    "# kvasird: a ring's hops send a burst (a prompt's hidden rows) after seconds of quiet.\n"
    "# With slow start after idle, TCP shrinks its window back to 10 packets meanwhile, and\n"
    "# each burst to a far peer waits one or two more round trips: 0.21 s instead of 0.10 s\n"
    "# more to the first token on a 3-hop ring 40 ms a link apart (bench/bench_wan.py).\n"
    "net.ipv4.tcp_slow_start_after_idle = 0\n"
)
"""The sysctl drop-in ``service install`` writes (``--no-sysctl``: leave the kernel's)."""
INSTALL_ELSEWHERE = (
    "install kvasird under /opt with a python outside any home directory "
    "(e.g. /usr/bin/python3 -m venv /opt/kvasird/.venv)"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("service", help="install kvasird as a systemd service")
    cmds = p.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    inst = cmds.add_parser("install", help="create the user and state directory, install the unit")
    inst.add_argument("--user", default="kvasird", help="system user to run as (default kvasird)")
    inst.add_argument("--unit-dir", type=Path, default=Path("/etc/systemd/system"))
    inst.add_argument("--dry-run", action="store_true", help="print the steps and the unit only")
    inst.add_argument("--sysctl-dir", type=Path, default=Path("/etc/sysctl.d"))
    inst.add_argument(
        "--no-sysctl",
        action="store_true",
        help="leave TCP's slow start after idle on (by default a drop-in turns it off: far "
        "peers' first tokens come one or two round trips sooner)",
    )
    inst.add_argument(
        "--no-start", action="store_true", help="install and enable, but do not start"
    )
    inst.add_argument(
        "--protect-home",
        choices=("yes", "read-only"),
        default="yes",
        help="ProtectHome= of the unit: read-only lets the service run a kvasird "
        "installed in a home directory (default yes: homes are hidden)",
    )
    add_node_options(inst)
    inst.set_defaults(func=_install)


def render_unit(
    user: str, binary: str, protect_home: str = "yes", init_args: list[str] | None = None
) -> str:
    """The repository's unit with this installation's binary, the chosen user and
    ProtectHome, and ``init_args`` for the `kvasird init` of its first start."""
    text = UNIT_TEMPLATE.read_text().replace(TEMPLATE_BIN, binary)
    if init_args:
        init = f"{binary} init"
        text = text.replace(f'{init}"', f'{init} {_for_systemd(shlex.join(init_args))}"')
    text = text.replace("ProtectHome=yes", f"ProtectHome={protect_home}")
    return text.replace("User=kvasird", f"User={user}").replace("Group=kvasird", f"Group={user}")


def _for_systemd(command: str) -> str:
    """``command`` inside a double-quoted word of an Exec line: systemd reads backslashes
    and double quotes there, and expands % specifiers and $ variables in every word."""
    for raw, escaped in (("\\", "\\\\"), ('"', '\\"'), ("%", "%%"), ("$", "$$")):
        command = command.replace(raw, escaped)
    return command


def installation() -> dict[str, Path]:
    """What the service runs of this installation: each must be visible in its sandbox."""
    import kvasird

    return {
        "kvasird": Path(sys.prefix) / "bin" / "kvasird",
        "its python": Path(sys.executable),
        "the python's standard library": Path(sys.base_prefix),
        "the kvasird package": Path(kvasird.__file__).parent,
    }


def unreachable_by_service(unit: str, paths: dict[str, Path]) -> str | None:
    """Why the service could not use one of ``paths`` (symlinks followed), or None: the
    unit's ProtectHome= hides it, or a directory on the way is closed to the unit's user."""
    protect = _setting(unit, "ProtectHome", "no")
    hidden = HOMES if protect in ("yes", "tmpfs") else ()
    user = _setting(unit, "User", "root")
    for what, path in paths.items():
        real = os.path.realpath(path)
        shown = str(path) if real == str(path) else f"{path} -> {real}"
        closed = _closed_directory(real) if user != "root" else None
        top = next((h for h in hidden if real == h or real.startswith(h + "/")), None)
        if top is not None:
            also = "" if closed else ", or rerun with --protect-home read-only"
            return (
                f"the service could not start: {what} ({shown}) is in {top}, which "
                f"ProtectHome={protect} hides from it; {INSTALL_ELSEWHERE}{also}"
            )
        if closed is not None:
            return (
                f"the service could not start: {what} ({shown}) is in {closed}, which "
                f"user {user} may not enter; {INSTALL_ELSEWHERE}"
            )
    return None


def _setting(unit: str, key: str, default: str) -> str:
    return next(
        (
            line.split("=", 1)[1].strip()
            for line in reversed(unit.splitlines())
            if line.startswith(f"{key}=")
        ),
        default,
    )


def _closed_directory(real: str) -> str | None:
    """The first directory above ``real`` that users other than its owner cannot enter."""
    for parent in reversed(Path(real).parents):
        try:
            if not parent.stat().st_mode & stat.S_IXOTH:
                return str(parent)
        except OSError:
            return None
    return None


def _install(args: argparse.Namespace) -> int:
    runs = installation()
    # The first start's init must not fail on what could be checked now (a bad model, a
    # bootstrap without a peer id): the same config, validated here.
    load_text(render(default_text(), node_values(args)), source="the service's kvasird.toml")
    unit = render_unit(args.user, str(runs["kvasird"]), args.protect_home, node_argv(args))
    hidden = unreachable_by_service(unit, runs)
    target = args.unit_dir / "kvasird.service"
    sysctl = None if args.no_sysctl else args.sysctl_dir / "60-kvasird.conf"
    steps = [
        [
            "useradd",
            "--system",
            "--home-dir",
            "/var/lib/kvasird",
            "--shell",
            "/usr/sbin/nologin",
            args.user,
        ],
        *([["sysctl", "-q", "-p", str(sysctl)]] if sysctl is not None else []),
        ["systemctl", "daemon-reload"],
        # --no-block: READY=1 waits until the gateway can serve, which a first download
        # may make long; `systemctl status kvasird` shows what it waits for meanwhile.
        ["systemctl", "enable", "kvasird"] + ([] if args.no_start else ["--now", "--no-block"]),
    ]
    if args.dry_run:
        print(f"# would write {target}:\n{unit}")
        if sysctl is not None:
            print(f"# would write {sysctl}:\n{SYSCTL}")
        for step in steps:
            print("# would run: " + " ".join(step))
        print(
            f"# its state directory: {SERVICE_HOME} (commands run as root find it by "
            "themselves, e.g. `sudo kvasird status`)"
        )
        if hidden is not None:
            print(f"# but it would refuse to install: {hidden}")
        return 0
    if hidden is not None:
        raise KvasirError(hidden)
    if os.geteuid() != 0:
        raise KvasirError("installing a service needs root: run it with sudo, or use --dry-run")
    if shutil.which("systemctl") is None:
        raise KvasirError("systemctl is not available: this system does not run systemd")
    if subprocess.run(["id", "-u", args.user], capture_output=True).returncode != 0:
        subprocess.run(steps[0], check=True)
    target.write_text(unit)
    if sysctl is not None:
        sysctl.write_text(SYSCTL)
    for step in steps[1:]:
        subprocess.run(step, check=True)
    print(
        f"installed {target}; follow it with: journalctl -u kvasird -f "
        "(systemctl status kvasird says what it waits for); `sudo kvasird status` finds "
        f"its home, {SERVICE_HOME}"
    )
    return 0
