"""What chat_core's two commands (``prepare``, ``evaluate``) share in reading their arguments."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1, or the message saying why ``text`` isn't one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} isn't a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} isn't at least 1")
    return value
