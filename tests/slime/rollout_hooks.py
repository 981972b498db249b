"""slime's rollout hooks as a launch names them by import path (``--rollout-sample-filter-path
rollout_hooks.note_kept``, ``--rollout-all-samples-process-path rollout_hooks.note_drawn``), each keeping what
slime's rollout handed it, for a test to read and ``clear``."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

KEPT: list[list[list[Any]]] = []
"""The kept groups of each rollout, as ``--rollout-sample-filter-path`` got them."""
DRAWN: list[tuple[list[list[Any]], Any]] = []
"""Every group of each rollout, kept or dropped, and the data source, as ``--rollout-all-samples-process-path`` got
them."""


def note_kept(args: Namespace, data: list[list[Any]]) -> None:
    KEPT.append(list(data))


def note_drawn(args: Namespace, all_samples: list[list[Any]], data_source: Any) -> None:
    DRAWN.append((list(all_samples), data_source))


def clear() -> None:
    KEPT.clear()
    DRAWN.clear()
