"""What the installed ggml runtime offers: backends, devices, version, CPU features, threads.

This is the node's compute identity, advertised to peers (backend differences are
capabilities, not rejections) and printed by ``kvasird native info``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from kvasird.errors import NativeError

_CPU_FEATURES = ("avx", "avx2", "avx512", "f16c", "fma", "neon", "dotprod", "sve")


@dataclass(frozen=True)
class Device:
    name: str
    """ggml device name, e.g. "CPU", "CUDA0"."""
    description: str
    """Human description from the backend (GPU model, CPU brand)."""
    kind: str
    """"cpu", "gpu", "igpu" or "accel"."""


@dataclass(frozen=True)
class RuntimeInfo:
    ggml_python: str
    """ggml-python package version."""
    ggml_version: str
    """Version of the vendored ggml source."""
    ggml_commit: str
    """Commit of the vendored ggml source."""
    backends: tuple[str, ...]
    """Registered ggml backends, e.g. ("CPU",) or ("CUDA", "CPU")."""
    devices: tuple[Device, ...]
    """Devices those backends expose."""
    cpu_features: tuple[str, ...]
    """SIMD features the CPU backend was built with and detects."""
    threads: int
    """Compute threads the engine will use (config, else physical cores)."""
    openmp_wait_policy: str
    """OMP_WAIT_POLICY in effect ("" when unset; the build has OpenMP off)."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


_DEV_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


def default_threads() -> int:
    """One thread per physical core (hyper-threads slow ggml's matmuls down)."""
    cores = set()
    try:
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
    except OSError:
        pass
    return max(1, len(cores) or (os.cpu_count() or 1))


def probe(threads: int = 0) -> RuntimeInfo:
    """Load the runtime and report what it offers; raise NativeError when it is missing."""
    try:
        import ggml
    except (ImportError, OSError) as exc:
        raise NativeError(
            f"the ggml runtime is not installed or does not load ({exc}): run native/setup"
        ) from None
    devices = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        devices.append(
            Device(
                name=ggml.ggml_backend_dev_name(dev).decode(),
                description=ggml.ggml_backend_dev_description(dev).decode(),
                kind=_DEV_KINDS.get(int(ggml.ggml_backend_dev_type(dev)), "other"),
            )
        )
    backends = tuple(
        ggml.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i)).decode()
        for i in range(ggml.ggml_backend_reg_count())
    )
    features = tuple(f for f in _CPU_FEATURES if getattr(ggml, f"ggml_cpu_has_{f}")())
    commit = ggml.ggml_commit()
    return RuntimeInfo(
        ggml_python=ggml.__version__,
        ggml_version=ggml.ggml_version().decode(),  # the library's own, not the bindings'
        ggml_commit=commit.decode() if isinstance(commit, bytes) else str(commit),
        backends=backends,
        devices=tuple(devices),
        cpu_features=features,
        threads=threads or default_threads(),
        openmp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
    )


def compute_threads(configured: int) -> int:
    """Threads for the engine: `[compute] threads` when set, else one per physical core."""
    return configured if configured > 0 else default_threads()
