"""``kvasird service install``: run this checkout as a hardened systemd service.

Creates the system user, writes the unit (pointing at this installation's ``kvasird``),
reloads systemd and enables the service. ``--dry-run`` prints what it would do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvasird.errors import KvasirError

UNIT_TEMPLATE = Path(__file__).resolve().parents[2] / "systemd" / "kvasird.service"
TEMPLATE_BIN = "/opt/kvasird/.venv/bin/kvasird"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("service", help="install kvasird as a systemd service")
    cmds = p.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    inst = cmds.add_parser("install", help="create the user and state directory, install the unit")
    inst.add_argument("--user", default="kvasird", help="system user to run as (default kvasird)")
    inst.add_argument("--unit-dir", type=Path, default=Path("/etc/systemd/system"))
    inst.add_argument("--dry-run", action="store_true", help="print the steps and the unit only")
    inst.add_argument("--no-start", action="store_true", help="install and enable, but do not start")
    inst.set_defaults(func=_install)


def render_unit(user: str, binary: str) -> str:
    """The repository's unit with this installation's binary and the chosen user."""
    text = UNIT_TEMPLATE.read_text().replace(TEMPLATE_BIN, binary)
    return text.replace("User=kvasird", f"User={user}").replace("Group=kvasird", f"Group={user}")


def _install(args: argparse.Namespace) -> int:
    binary = str(Path(sys.prefix) / "bin" / "kvasird")
    unit = render_unit(args.user, binary)
    target = args.unit_dir / "kvasird.service"
    steps = [
        ["useradd", "--system", "--home-dir", "/var/lib/kvasird", "--shell", "/usr/sbin/nologin",
         args.user],
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "kvasird"] + ([] if args.no_start else ["--now"]),
    ]
    if args.dry_run:
        print(f"# would write {target}:\n{unit}")
        for step in steps:
            print("# would run: " + " ".join(step))
        return 0
    if os.geteuid() != 0:
        raise KvasirError("installing a service needs root: run it with sudo, or use --dry-run")
    if shutil.which("systemctl") is None:
        raise KvasirError("systemctl is not available: this system does not run systemd")
    if subprocess.run(["id", "-u", args.user], capture_output=True).returncode != 0:
        subprocess.run(steps[0], check=True)
    target.write_text(unit)
    for step in steps[1:]:
        subprocess.run(step, check=True)
    print(f"installed {target}; follow it with: journalctl -u kvasird -f")
    return 0
