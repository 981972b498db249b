"""The part of the trainer helpers that slime's and Miles' glue share: rows for a server's tasks
(``python -m chat_core.prepare``), and ``play``, which plays a row's episode with the trainer's model and returns its
reward or the flags that say why it has none. It needs only aiohttp, httpx, websockets and tqdm, so it installs into a
trainer's environment without the env server's packages."""

from chat_core.episode import FATAL, ChatEndpoint, EpisodeResult, Flag, FlagKind, Limits, play
from chat_core.errors import (
    CapacityExhausted,
    EpisodeProtocolError,
    InvalidServerUrl,
    NotAnOpenEnvServer,
    OpenEnvError,
    ServerError,
    ServerUnreachable,
)

__all__ = [
    "FATAL",
    "CapacityExhausted",
    "ChatEndpoint",
    "EpisodeProtocolError",
    "EpisodeResult",
    "Flag",
    "FlagKind",
    "InvalidServerUrl",
    "Limits",
    "NotAnOpenEnvServer",
    "OpenEnvError",
    "ServerError",
    "ServerUnreachable",
    "play",
]
