"""Every family's format by name, and which one a chat template points to."""

from __future__ import annotations

from kvasird.text.toolcalls.harmony import Harmony
from kvasird.text.toolcalls.hermes import Format
from kvasird.text.toolcalls.llama3 import Llama3
from kvasird.text.toolcalls.mistral import Mistral
from kvasird.text.toolcalls.qwen_xml import QwenXML

FORMATS: dict[str, Format] = {
    "hermes": Format(),
    "llama3": Llama3(),
    "harmony": Harmony(),
    "qwen_xml": QwenXML(),
    "mistral": Mistral(listed=False),
    "mistral_list": Mistral(listed=True),
}


def format_of(template: str | None) -> Format:
    """The tool format a chat template's text points to (Hermes unless it is another's)."""
    source = template or ""
    if "<|start|>" in source and "<|channel|>" in source:
        return FORMATS["harmony"]
    if "<function=" in source and "<parameter=" in source:
        return FORMATS["qwen_xml"]
    if "[TOOL_CALLS]" in source:
        return FORMATS["mistral" if "[ARGS]" in source else "mistral_list"]
    if (
        "<|python_tag|>" in source
        or "<|eom_id|>" in source
        or ("<|start_header_id|>" in source and "ipython" in source)
    ):
        return FORMATS["llama3"]  # 3.2 has neither tag, but its tool role is "ipython"
    return FORMATS["hermes"]


def reads_tools(template: str | None) -> bool:
    """Whether a template renders ``tools`` and tool messages itself."""
    return bool(template) and "tools" in template and "tool_calls" in template  # type: ignore[operator]
