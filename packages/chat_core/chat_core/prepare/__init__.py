"""The rows: a trainer's dataset rows for an env server's tasks (``rows``, plain data that loads no client) and
``python -m chat_core.prepare``, which writes them. ``write_rows`` (``chat_core.prepare.write``) is the same from
Python: ``await chat_core.prepare.write_rows(URL, OUT)``; it is loaded when first used, so that importing ``rows``
loads no network client."""

from __future__ import annotations

from typing import Any

__all__ = ["write_rows"]


def __getattr__(name: str) -> Any:
    if name != "write_rows":
        raise AttributeError(f"module 'chat_core.prepare' has no attribute {name!r}")
    from chat_core.prepare.write import write_rows

    return write_rows
