"""JSON and text as chat_core reads them from the wire and writes them to it.

orjson does the work (SGLang depends on it, so both trainers' images have it): the standard library's ``json`` is
several times slower, and every env answer and chat reply is parsed. What orjson refuses is handed to ``json``, so a
reply carrying ``NaN`` or ``Infinity`` (which Python's own encoder writes) still reads, and text nested too deeply
for ``json`` (it recurses once per level) raises the ValueError of any other text that can't be read.

Integers round-trip exactly whatever their size, as Python's ``json`` reads and writes them: orjson would read an
integer past 64 bits as the nearest float without a word, so text holding 19 digits in a row (the fewest such an
integer has) is read by ``json``, and orjson's refusal to write one hands it to ``json`` too."""

from __future__ import annotations

import json
from typing import Any

import orjson

MIB = 1 << 20
"""A mebibyte, the unit of chat_core's limits on what it reads."""
FLAG_EXCERPT = 500
"""How many characters of what a model or a server sent an episode's flag quotes, enough to see what is wrong in a
reply."""


def wire_text(raw: bytes) -> str:
    """What a server or a model sent, as text for an error message: undecodable bytes replaced, never refused."""
    return raw.decode("utf-8", errors="replace")


def excerpt(value: Any, limit: int = 200) -> str:
    """``value`` quoted for an error message, its text cut to ``limit`` characters: what a server or a model sent can
    be megabytes long."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return repr(text[:limit] + "…") if len(text) > limit else repr(text)


def described(error: BaseException) -> str:
    """An exception as text for an error message: its type, and what it says when it says anything."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
_PAST_64_BITS = b"0" * 19
"""19 digits in a row, as ``_DIGITS_AS_ZEROS`` shows them: -9223372036854775809 is the shortest integer orjson
can't hold."""


def parse_json(text: str | bytes) -> Any:
    """``text`` parsed as JSON, its integers as written. Raises ValueError when it isn't JSON or is nested too deeply
    to parse."""
    raw = text if isinstance(text, bytes) else text.encode(errors="surrogatepass")
    if _PAST_64_BITS not in raw.translate(_DIGITS_AS_ZEROS):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it is nested too deeply to parse") from None


def encoded(value: Any) -> bytes:
    """``value`` as UTF-8 JSON. What orjson refuses (an integer past 64 bits, a key that isn't a string) is encoded
    by ``json``, which raises TypeError for what isn't JSON at all."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value).encode()
