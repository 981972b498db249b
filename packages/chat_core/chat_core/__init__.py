"""The part of the trainer helpers that slime's and Miles' glue share: rows for a server's tasks
(``python -m chat_core.prepare``); ``play``, which plays a row's episode with the trainer's model and returns its
reward or the flags that say why it has none; the episode's outcome as both helpers keep it in a sample
(``EpisodeOutcome``), and the rules their filters and metrics share (``chat_core.filters``, ``chat_core.metrics``).
It needs only orjson and tqdm, so it installs into a trainer's environment without the env
server's packages."""

from chat_core.episode import FATAL, ChatEndpoint, EpisodeResult, EpisodeTrace, Flag, FlagKind, Limits, play
from chat_core.errors import (
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
from chat_core.filters import MissingFilter
from chat_core.outcome import OUTCOME_KEY, EpisodeOutcome
from chat_core.pool import ENV_SERVERS_VARIABLE

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
