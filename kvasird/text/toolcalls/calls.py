"""Tools a caller offers and the calls a model makes of them, as every format reads and
writes them.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 128
"""The most tools a request may offer."""

MAX_PARALLEL_CALLS = 8
"""The most calls a forced reply may hold when the client asked for parallel calls. A bound,
so that a model repeating itself ends with its calls rather than at the token limit with a
call cut off; eight covers the fan-out an agent asks for in one turn (a few cities, a few
files) at some 20 to 40 tokens a call."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON Schema of the arguments object."""

    def openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments object as JSON text."""

    @staticmethod
    def new(name: str, arguments: Any) -> ToolCall:
        return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_arguments(text: str) -> Any:
    """A call's arguments as a value ({} where they are no JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return {}


def is_object(text: str) -> bool:
    """Whether ``text`` is a JSON object, as a call's arguments must be."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
