"""Where ``play`` reports the stretches of an episode as they happen, for a trainer's trace viewer (slime's helper
passes one that records them on the sample's trace), and the trace of an episode nobody traces."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class EpisodeTrace(Protocol):
    """Where ``play`` reports the stretches of an episode: ``reset``, ``list_tools``, ``model_call`` (attrs
    ``turn``), ``tool_call`` (``turn``, ``tool``; on return ``error``) and ``end_turn`` (``turn``; on return
    ``episode_ended``, true when the env ran the verifiers and ended the episode). ``span`` opens one with
    ``attrs``; the loop adds to the dict it yields what it learns by the end."""

    def span(self, name: str, attrs: dict[str, Any]) -> AbstractContextManager[dict[str, Any]]: ...


class _NoTrace:
    """The trace of an episode nobody traces: its spans cost no more than a ``with`` block."""

    def span(self, name: str, attrs: dict[str, Any]) -> _NoSpan:
        return _NO_SPAN


class _NoSpan:
    def __enter__(self) -> dict[str, Any]:
        return {}

    def __exit__(self, *exc_info: object) -> None:
        return None


_NO_SPAN = _NoSpan()
NO_TRACE: EpisodeTrace = _NoTrace()
