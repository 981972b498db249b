"""JSON, and text, read from the wire. Python's parser recurses once per level of nesting, so text nested deeper
than the interpreter's recursion limit allows (``[[[[…]]]]`` about a thousand deep) raises RecursionError instead of the
ValueError of any other text that can't be read; everything chat_core reads from a server or a model is parsed here,
so both fail alike."""

from __future__ import annotations

import json
from typing import Any


def wire_text(raw: bytes) -> str:
    """What a server or a model sent, as text for an error message: undecodable bytes replaced, never refused."""
    return raw.decode("utf-8", errors="replace")


def parse_json(text: str | bytes) -> Any:
    """``text`` parsed as JSON. Raises ValueError when it isn't JSON or is nested too deeply to parse."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it is nested too deeply to parse") from None
