"""The part of the trainer helpers that slime's and Miles' glue share: rows for a server's tasks
(``python -m chat_core.prepare``); ``play``, which plays a row's episode with the trainer's model and returns its
reward or the flags that say why it has none; the episode's outcome as both helpers keep it in a sample
(``EpisodeOutcome``), and the rules their filters and metrics share (``chat_core.record.filters``,
``chat_core.record.metrics``). It needs only aiohttp, websockets, orjson and tqdm, so it installs into a trainer's
environment without the env server's packages.

The names below are loaded when first used, so a module that needs only the plain records (``chat_core.record.filters``,
``chat_core.record.metrics``, ``chat_core.record.outcome``, ``chat_core.prepare.rows``) loads no network client."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "play": "chat_core.episode.loop",
    "EpisodeTrace": "chat_core.episode.tracing",
    "ChatEndpoint": "chat_core.episode.chat",
    "Limits": "chat_core.limits",
    "FATAL": "chat_core.record.results",
    "EpisodeResult": "chat_core.record.results",
    "Flag": "chat_core.record.results",
    "FlagKind": "chat_core.record.results",
    "OUTCOME_KEY": "chat_core.record.outcome",
    "EpisodeOutcome": "chat_core.record.outcome",
    "MissingFilter": "chat_core.record.filters",
    "ENV_SERVERS_VARIABLE": "chat_core.limits",
    "CapacityExhausted": "chat_core.env.errors",
    "EnvCallTimeout": "chat_core.env.errors",
    "EpisodeProtocolError": "chat_core.env.errors",
    "InvalidServerUrl": "chat_core.env.errors",
    "NotAnOpenEnvServer": "chat_core.env.errors",
    "OpenEnvError": "chat_core.env.errors",
    "ServerError": "chat_core.env.errors",
    "ServerMismatch": "chat_core.env.errors",
    "ServerUnreachable": "chat_core.env.errors",
}
__all__ = [
    "ENV_SERVERS_VARIABLE",
    "FATAL",
    "OUTCOME_KEY",
    "CapacityExhausted",
    "ChatEndpoint",
    "EnvCallTimeout",
    "EpisodeOutcome",
    "EpisodeProtocolError",
    "EpisodeResult",
    "EpisodeTrace",
    "Flag",
    "FlagKind",
    "InvalidServerUrl",
    "Limits",
    "MissingFilter",
    "NotAnOpenEnvServer",
    "OpenEnvError",
    "ServerError",
    "ServerMismatch",
    "ServerUnreachable",
    "play",
]

if TYPE_CHECKING:
    from chat_core.env.errors import (
        CapacityExhausted,
        EnvCallTimeout,
        EpisodeProtocolError,
        InvalidServerUrl,
        NotAnOpenEnvServer,
        OpenEnvError,
        ServerError,
        ServerMismatch,
        ServerUnreachable,
    )
    from chat_core.episode.chat import ChatEndpoint
    from chat_core.episode.loop import play
    from chat_core.episode.tracing import EpisodeTrace
    from chat_core.limits import ENV_SERVERS_VARIABLE, Limits
    from chat_core.record.filters import MissingFilter
    from chat_core.record.outcome import OUTCOME_KEY, EpisodeOutcome
    from chat_core.record.results import FATAL, EpisodeResult, Flag, FlagKind


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'chat_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
