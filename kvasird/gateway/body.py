"""Request bodies: read within the size limit, decode strictly, check every field's type.

Nothing a client sends reaches tokenizer or generator before it passed here, so bad
input ends as a 4xx naming the field (``messages[1].content``), never as a 500.
The gateway and the admin API's /v0/generate read their bodies here alike.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from starlette.requests import Request

from kvasird.gateway.errors import BadRequest, BodyTooLarge, UnsupportedMediaType

MAX_DEPTH = 400
"""Deepest nesting of arrays and objects a body may have: far past any real request, and
well within what json.loads and the code after it may recurse through."""

_MISSING: Any = object()
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEPS = bytes.maketrans(b"[]{}", b"\x01\xff\x01\xff")
"""Openers to +1, closers to -1 (as signed bytes)."""
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""An escape of a UTF-16 surrogate: only a body with one may hold a lone one."""


async def read_json(request: Request, limit: int) -> Fields:
    """The body as a JSON object; 413 past ``limit`` bytes; 400 (a malformed body, saying what
    to fix) when it is not UTF-8, not JSON, holds NaN or Infinity or a lone surrogate, or is
    nested deeper than MAX_DEPTH; 415 when it is declared another type than JSON.

    A body declared as nothing, or as a form (what ``curl -d`` declares), is read as JSON, as
    llama-server and the OpenAI API read it. What keeps a web page from posting to a gateway
    is the Origin check (kvasird.http.HostGuard), not the type: a page's POST carries its
    Origin whatever type it declares. Read once per request (a quote reads the body it
    quotes for, then hands the request to that API's parser)."""
    read: Fields | None = getattr(request.state, "kvasird_json", None)
    if read is not None:
        return read
    request.state.kvasird_json = read = await _read_json(request, limit)
    return read


async def _read_json(request: Request, limit: int) -> Fields:
    _require_json_type(request.headers.get("content-type", ""))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(_too_large(int(declared), limit))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(_too_large(len(body), limit))
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"the request body is not valid UTF-8 (bad byte at offset {exc.start})"
        ) from None
    if _depth(text) > MAX_DEPTH:
        raise BadRequest(
            f"the request body is nested deeper than {MAX_DEPTH} levels of arrays "
            "and objects: flatten it"
        )
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if _SURROGATE_ESCAPE.search(text):
        _unicode(value, "")
    if not isinstance(value, dict):
        raise BadRequest("the request body must be a JSON object")
    return Fields(value)


READ_AS_JSON = frozenset({"", "application/x-www-form-urlencoded"})
"""Declared media types a body is read as JSON under besides JSON's own: none, and the form
type ``curl -d`` declares by itself."""


def _require_json_type(content_type: str) -> None:
    """application/json or application/<anything>+json, with any parameters, or READ_AS_JSON."""
    media = content_type.partition(";")[0].strip().lower()
    if (
        media not in READ_AS_JSON
        and media != "application/json"
        and not (media.startswith("application/") and media.endswith("+json"))
    ):
        raise UnsupportedMediaType(
            "the request body must be JSON, sent with the header Content-Type: "
            f"application/json (got {content_type!r}): set that header"
        )


def _unicode(value: Any, where: str) -> None:
    """400 naming the first string of ``value`` (at ``where``) that holds half a UTF-16
    surrogate pair: JSON lets ``\\ud800`` be written alone, but no text can hold it, so no
    tokenizer can read it (``text``). Checked for the whole body, fields no handler reads
    as text included."""
    if isinstance(value, str):
        text(value, where or "the request body")
    elif isinstance(value, dict):
        for key, item in value.items():
            text(key, f"a key of {where}" if where else "a key of the request body")
            _unicode(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _unicode(item, f"{where}[{i}]")


def _depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text``, found without recursion (json.loads
    recurses once a level: 100k "[" end in RecursionError). Strings are cut out, the brackets
    left become +1/-1 steps, and the depth is their largest running sum; all of it in C loops,
    so even 1 MiB of nothing but brackets is judged in about a tenth of a second."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    steps = memoryview(brackets.encode("ascii").translate(_STEPS)).cast("b")
    return max(accumulate(steps), default=0)


def _too_large(n: int, limit: int) -> str:
    return (
        f"the request body of {n} bytes exceeds this node's limit of {limit} bytes "
        "([gateway] max_body_bytes)"
    )


def _no_constant(name: str) -> None:
    raise BadRequest(
        f"the request body is not valid JSON: it contains {name}, which JSON has no "
        "number for: send a finite number, or null"
    )


class Fields:
    """A JSON object whose fields are taken by name and type; errors name the full path."""

    def __init__(self, value: dict[str, Any], path: str = "") -> None:
        self.value = value
        self.path = path

    def where(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def has(self, name: str) -> bool:
        return self.value.get(name) is not None

    def string(self, name: str, default: Any = _MISSING) -> Any:
        return text(self._get(name, default, str, "a string"), self.where(name))

    def integer(
        self, name: str, default: Any = _MISSING, lo: float = -math.inf, hi: float = math.inf
    ) -> Any:
        value = self._get(name, default, int, "an integer")
        return _in_range(value, lo, hi, self.where(name))

    def number(
        self, name: str, default: Any = _MISSING, lo: float = -math.inf, hi: float = math.inf
    ) -> Any:
        value = self._get(name, default, (int, float), "a number")
        return _in_range(float(value) if value is not None else None, lo, hi, self.where(name))

    def boolean(self, name: str, default: Any = _MISSING) -> Any:
        return self._get(name, default, bool, "true or false")

    def array(self, name: str, default: Any = _MISSING) -> Any:
        return self._get(name, default, list, "an array")

    def obj(self, name: str) -> Fields:
        value = self._get(name, {}, dict, "an object")
        return Fields(value, self.where(name))

    def _get(self, name: str, default: Any, kind: type | tuple[type, ...], what: str) -> Any:
        value = self.value.get(name)
        if value is None:
            if default is _MISSING:
                raise BadRequest(f"`{self.where(name)}` is required", self.where(name))
            return default
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise BadRequest(
                f"`{self.where(name)}` must be {what}, got {_json_type(value)}", self.where(name)
            )
        return value


def objects(values: list[Any], path: str) -> list[Fields]:
    """Each item of a JSON array as Fields; 400 naming the first that is not an object."""
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, dict):
            where = f"{path}[{i}]"
            raise BadRequest(f"`{where}` must be an object, got {_json_type(v)}", where)
        out.append(Fields(v, f"{path}[{i}]"))
    return out


def text(value: Any, where: str) -> Any:
    """``value`` unchanged if it is encodable text (JSON allows lone surrogates; we do not)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(
                f"`{where}` contains a lone UTF-16 surrogate (\\ud800-\\udfff): "
                "send valid Unicode text",
                where,
            ) from None
    return value


def _in_range(value: Any, lo: float, hi: float, where: str) -> Any:
    if value is not None and not lo <= value <= hi:
        bounds = (
            f"between {_n(lo)} and {_n(hi)}"
            if math.isfinite(lo) and math.isfinite(hi)
            else f">= {_n(lo)}"
            if math.isfinite(lo)
            else f"<= {_n(hi)}"
        )
        raise BadRequest(f"`{where}` must be {bounds}, got {_n(value)}", where)
    return value


def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _json_type(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)
