"""Every family's format by name, and which one a chat template points to."""

from __future__ import annotations

from kvasird.text.toolcalls.harmony import Harmony
from kvasird.text.toolcalls.hermes import Format
from kvasird.text.toolcalls.llama3 import Llama3
from kvasird.text.toolcalls.mistral import Mistral
from kvasird.text.toolcalls.qwen_xml import QwenXML
from kvasird.text.toolcalls.think import thinks

FORMATS: dict[str, Format] = {
    "hermes": Format(),
    "llama3": Llama3(),
    "harmony": Harmony(),
    "qwen_xml": QwenXML(),
    "mistral": Mistral(listed=False),
    "mistral_list": Mistral(listed=True),
}
THINKING = {name: f if f.reasons else f.thinking() for name, f in FORMATS.items()}
"""Each format for a template with a think-tag reasoning mode (harmony reasons on a
channel of its own)."""


def format_of(template: str | None) -> Format:
    """The tool format a chat template's text points to (Hermes unless it is another's),
    reading a think block first where the template has a think-tag reasoning mode."""
    family = _family(template or "")
    return THINKING[family] if thinks(template) else FORMATS[family]


def _family(source: str) -> str:
    if "<|start|>" in source and "<|channel|>" in source:
        return "harmony"
    if "<function=" in source and "<parameter=" in source:
        return "qwen_xml"
    if "[TOOL_CALLS]" in source:
        return "mistral" if "[ARGS]" in source else "mistral_list"
    if (
        "<|python_tag|>" in source
        or "<|eom_id|>" in source
        or ("<|start_header_id|>" in source and "ipython" in source)
    ):
        return "llama3"  # 3.2 has neither tag, but its tool role is "ipython"
    return "hermes"


def reads_tools(template: str | None) -> bool:
    """Whether a template renders ``tools`` and tool messages itself."""
    return bool(template) and "tools" in template and "tool_calls" in template  # type: ignore[operator]
