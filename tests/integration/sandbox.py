"""A systemd unit's seccomp sandbox around a command, for a machine where systemd is not PID 1.

systemd turns these [Service] settings into prctl(2) and seccomp filters that it loads just
before execve(2) (src/core/execute.c, src/shared/seccomp-util.c); this module loads the same
filters through libseccomp (ctypes), then execs the command:

    NoNewPrivileges=          prctl(PR_SET_NO_NEW_PRIVS), which systemd also implies for any
                              seccomp setting of a service without CAP_SYS_ADMIN
    SystemCallArchitectures=  native only: a call through another ABI (i386 or x32 on
                              x86-64) kills the process
    RestrictAddressFamilies=  socket(2) with another family fails with EAFNOSUPPORT
    RestrictNamespaces=yes    unshare/clone/setns for a namespace fail with EPERM, clone3 with
                              ENOSYS (libc falls back to clone)
    SystemCallFilter=         an allow list (@default added, ~ entries taken out) or a deny
                              list; a denied call gets SystemCallErrorNumber=, or kills the
                              process with SIGSYS when that is unset

Syscall groups are read from ``systemd-analyze syscall-filter``: those of the systemd on this
machine. Not modelled: what systemd does with mounts, users and capabilities (ProtectSystem,
ProtectHome, PrivateTmp, PrivateDevices, User, CapabilityBoundingSet), and the EPERM-only
filters of ProtectClock, ProtectHostname, ProtectKernelModules, ProtectKernelLogs and
PrivateDevices (their calls are outside @system-service, denied already), RestrictRealtime
(sched_setscheduler is in @resources), RestrictSUIDSGID and LockPersonality.

    python tests/integration/sandbox.py UNIT -- COMMAND [ARG...]

``NotifySocket`` is the other side of Type=notify: the datagram socket systemd names in
$NOTIFY_SOCKET, read as fast as systemd reads it (the kernel queues only a few datagrams
and then blocks the sender).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ANALYZE = "systemd-analyze"
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000,  # mnt cgroup uts ipc
                   0x10000000, 0x20000000, 0x40000000)  # user pid net
PR_SET_NO_NEW_PRIVS = 38

# libseccomp's <seccomp.h>
ACT_KILL_PROCESS = 0x80000000
ACT_ALLOW = 0x7FFF0000
ATTR_ACT_BADARCH = 2
ATTR_CTL_NNP = 3
CMP_LT, CMP_EQ, CMP_GT, CMP_MASKED_EQ = 2, 4, 6, 7


def act_errno(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)


class SandboxError(Exception):
    """The unit names a setting this model cannot reproduce, or seccomp refused a filter."""


@dataclass(frozen=True)
class Unit:
    """The [Service] section of a unit file: every assignment of each key, in order."""

    service: dict[str, list[str]]
    """Key -> values as written (an empty value is kept: it resets a list setting)."""

    @classmethod
    def read(cls, text: str) -> Unit:
        service: dict[str, list[str]] = {}
        section = ""
        for raw in text.replace("\\\n", " ").splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]")
            elif section == "Service" and "=" in line:
                key, _, value = line.partition("=")
                service.setdefault(key.strip(), []).append(value.strip())
        return cls(service)

    def last(self, key: str, default: str = "") -> str:
        return self.service.get(key, [default])[-1]

    def command(self, key: str) -> list[str]:
        """An Exec*= line as argv (the last one; systemd's '-' prefix dropped)."""
        return shlex.split(self.last(key).lstrip("-"))

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for value in self.service.get("Environment", []):
            env.update(item.partition("=")[::2] for item in shlex.split(value))
        return env


@dataclass(frozen=True)
class Sandbox:
    """The seccomp side of a unit's [Service] section, resolved to syscall names and numbers."""

    allow_list: bool
    """SystemCallFilter= lists what is allowed (else what is denied)."""
    syscalls: frozenset[str]
    """The allowed (or denied) system calls, groups expanded."""
    deny_errno: int | None
    """SystemCallErrorNumber=, or None: a denied call kills the process (SIGSYS)."""
    families_allowed: bool
    """RestrictAddressFamilies= lists what is allowed (else what is denied)."""
    families: frozenset[int] | None
    """The address families, or None when RestrictAddressFamilies= is not set."""
    restrict_namespaces: bool
    """RestrictNamespaces=yes."""
    native_only: bool
    """SystemCallArchitectures=native."""

    @classmethod
    def of(cls, unit: Unit) -> Sandbox:
        groups = syscall_groups()
        allow_list, syscalls = _syscall_filter(unit.service.get("SystemCallFilter", []), groups)
        families_allowed, families = _address_families(
            unit.service.get("RestrictAddressFamilies", []))
        archs = unit.last("SystemCallArchitectures").split()
        if archs not in ([], ["native"]):
            raise SandboxError(f"SystemCallArchitectures={' '.join(archs)} is not modelled")
        namespaces = unit.last("RestrictNamespaces", "no").lower()
        if namespaces not in ("yes", "no", "true", "false"):
            raise SandboxError(f"RestrictNamespaces={namespaces} is not modelled")
        errno_name = unit.last("SystemCallErrorNumber", "kill")
        deny_errno = None if errno_name in ("", "kill") else _errno(errno_name)
        return cls(allow_list, frozenset(syscalls), deny_errno, families_allowed, families,
                   namespaces in ("yes", "true"), archs == ["native"])

    def apply(self) -> None:
        """Load the filters into this process, in systemd's order (the call filter last)."""
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise SandboxError(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
        if self.families is not None:
            self._load_address_families()
        if self.restrict_namespaces:
            self._load_namespace_restriction()
        if self.native_only:
            with _Filter(ACT_ALLOW, badarch=None) as f:  # libseccomp kills calls of other ABIs
                f.load()
        if self.syscalls or self.allow_list:
            default, action = ((self._denied(), ACT_ALLOW) if self.allow_list
                               else (ACT_ALLOW, self._denied()))
            with _Filter(default) as f:
                for name in sorted(self.syscalls):
                    f.rule(action, name)
                f.load()

    def _denied(self) -> int:
        return ACT_KILL_PROCESS if self.deny_errno is None else act_errno(self.deny_errno)

    def _load_address_families(self) -> None:
        assert self.families is not None
        refuse = act_errno(errno.EAFNOSUPPORT)
        with _Filter(ACT_ALLOW) as f:
            if not self.families_allowed:
                for af in sorted(self.families):
                    f.rule(refuse, "socket", (0, CMP_EQ, af, 0))
            elif not self.families:
                f.rule(refuse, "socket")
            else:
                first, last = min(self.families), max(self.families)
                f.rule(refuse, "socket", (0, CMP_LT, first, 0))
                f.rule(refuse, "socket", (0, CMP_GT, last, 0))
                for af in range(first + 1, last):
                    if af not in self.families:
                        f.rule(refuse, "socket", (0, CMP_EQ, af, 0))
            f.load()

    def _load_namespace_restriction(self) -> None:
        with _Filter(ACT_ALLOW) as f:
            f.rule(act_errno(errno.ENOSYS), "clone3")
            f.rule(act_errno(errno.EPERM), "setns")
            for flag in NAMESPACE_FLAGS:
                f.rule(act_errno(errno.EPERM), "unshare", (0, CMP_MASKED_EQ, flag, flag))
                f.rule(act_errno(errno.EPERM), "clone", (0, CMP_MASKED_EQ, flag, flag))
            f.load()


def syscall_groups() -> dict[str, list[str]]:
    """``@group`` -> its members (names and nested groups), from systemd-analyze."""
    if shutil.which(ANALYZE) is None:
        raise SandboxError(f"{ANALYZE} is not installed: the syscall groups are unknown")
    text = subprocess.run([ANALYZE, "syscall-filter"], capture_output=True, text=True,
                          check=True).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.append(line.strip())
        elif not line.strip():
            current = None
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for name in names:
        if name.startswith("@"):
            if name not in groups:
                raise SandboxError(f"{ANALYZE} knows no syscall group {name}")
            out |= expand(groups[name], groups)
        else:
            out.add(name)
    return out


def _syscall_filter(values: list[str], groups: dict[str, list[str]]) -> tuple[bool, set[str]]:
    """config_parse_syscall_filter: the first assignment decides allow or deny list."""
    allow_list, calls, started = False, set[str](), False
    for value in values:
        if not value:
            allow_list, calls, started = False, set(), False
            continue
        invert = value.startswith("~")
        names = value.lstrip("~").split()
        if any(":" in n for n in names):
            raise SandboxError(f"SystemCallFilter={value}: per-call errno is not modelled")
        if not started:
            started, allow_list = True, not invert
            if allow_list:
                calls = expand(["@default"], groups)
        if invert == allow_list:
            calls -= expand(names, groups)
        else:
            calls |= expand(names, groups)
    return allow_list, calls


def _address_families(values: list[str]) -> tuple[bool, frozenset[int] | None]:
    """config_parse_address_families: the first assignment decides allow or deny list."""
    allowed = True
    families: frozenset[int] | None = None
    for value in values:
        if not value:
            allowed, families = True, None
            continue
        if value == "none":
            allowed, families = True, frozenset()
            continue
        invert = value.startswith("~")
        named = frozenset(int(getattr(socket, n)) for n in value.lstrip("~").split())
        if families is None:
            allowed, families = not invert, frozenset()
        families = families - named if invert == allowed else families | named
    return allowed, families


def _errno(name: str) -> int:
    number = getattr(errno, name, None)
    if not isinstance(number, int):
        raise SandboxError(f"SystemCallErrorNumber={name} is no errno name")
    return number


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _libseccomp() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_exact_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


class _Filter:
    """One seccomp filter for the native architecture, as seccomp_init_for_arch makes it."""

    def __init__(self, default: int, badarch: int | None = ACT_ALLOW) -> None:
        self.lib = _libseccomp()
        self.ctx = self.lib.seccomp_init(default)
        if not self.ctx:
            raise SandboxError("seccomp_init failed")
        if badarch is not None:
            self._check(self.lib.seccomp_attr_set(self.ctx, ATTR_ACT_BADARCH, badarch), "attr")
        self._check(self.lib.seccomp_attr_set(self.ctx, ATTR_CTL_NNP, 0), "attr")

    def __enter__(self) -> _Filter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.lib.seccomp_release(self.ctx)

    def rule(self, action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
        """Add a rule; a call this architecture does not have is skipped, as systemd does."""
        nr = self.lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return
        args = (_ArgCmp * len(cmps))(*(_ArgCmp(*c) for c in cmps)) if cmps else None
        rc = self.lib.seccomp_rule_add_exact_array(self.ctx, action, nr, len(cmps), args)
        if rc != -errno.EDOM:
            self._check(rc, f"rule for {name}")

    def load(self) -> None:
        self._check(self.lib.seccomp_load(self.ctx), "load")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc < 0:
            raise SandboxError(f"libseccomp {what}: {os.strerror(-rc)}")


def launcher(unit_file: Path, argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` in the sandbox of the unit in ``unit_file``."""
    return [sys.executable, __file__, str(unit_file), "--", *argv]


class NotifySocket:
    """A bound AF_UNIX datagram socket, drained by a thread into ``messages``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[tuple[float, str]] = []
        """(monotonic time of arrival, datagram) in order of arrival."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._open = True
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while self._open:
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def assignments(self, key: str) -> list[tuple[float, str]]:
        """Every ``KEY=value`` sent (a datagram may hold several, one a line)."""
        return [(at, line.split("=", 1)[1]) for at, message in list(self.messages)
                for line in message.splitlines() if line.startswith(key + "=")]

    def close(self) -> None:
        self._open = False
        self._thread.join()
        self._sock.close()


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: sandbox.py UNIT -- COMMAND [ARG...]")
    Sandbox.of(Unit.read(Path(argv[0]).read_text())).apply()
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
