"""Shared fixtures. Subsystem fixtures live in their own conftest files."""

from __future__ import annotations

import os

# ggml asserts abort the process; never let them also dump a backtrace via gdb.
os.environ.setdefault("GGML_NO_BACKTRACE", "1")
