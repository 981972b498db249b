"""The part of the trainer helpers that slime's and Miles' glue share: rows for a server's tasks
(``python -m chat_core.prepare``); ``play``, which plays a row's episode with the trainer's model and returns its
reward or the flags that say why it has none; the episode's outcome as both helpers keep it in a sample
(``EpisodeOutcome``), and the rules their filters and metrics share (``chat_core.record.filters``,
``chat_core.record.metrics``). It needs only aiohttp, websockets, orjson and tqdm, so it installs into a trainer's
environment without the env server's packages.

The public names below are each loaded from its module when first used, so a module that needs only the plain
records (``chat_core.record``, ``chat_core.prepare.rows``) loads no network client."""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "chat_core.episode.loop": ("play",),
    "chat_core.episode.tracing": ("EpisodeTrace",),
    "chat_core.episode.chat": ("ChatEndpoint",),
    "chat_core.limits": ("Limits",),
    "chat_core._wire": ("parse_json",),
    "chat_core.env.pool": ("ENV_SERVERS_VARIABLE",),
    "chat_core.record.results": ("FATAL", "EpisodeResult", "Flag", "FlagKind"),
    "chat_core.record.outcome": ("OUTCOME_KEY", "EpisodeOutcome"),
    "chat_core.record.filters": ("MissingFilter",),
    "chat_core.errors": (
        "CapacityExhausted",
        "EnvCallTimeout",
        "EpisodeProtocolError",
        "InvalidServerUrl",
        "NotAnOpenEnvServer",
        "OpenEnvError",
        "ServerError",
        "ServerMismatch",
        "ServerUnreachable",
    ),
}
"""Each public name, by the module it is defined in."""
_HOMES = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'chat_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
