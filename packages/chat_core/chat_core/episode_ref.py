"""Where an episode is served: a server's base URL (``server_url``) and the episode a row plays (``EpisodeRef``), plain
data shared by every stage from the env server's client to the episode's record, so each reads them from below
itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from chat_core.errors import InvalidServerUrl


def server_url(url: str) -> str:
    """``url`` as the base every request is made under: an absolute http(s) URL without a trailing slash. Raises
    InvalidServerUrl when it has another scheme, no host, a query or a fragment."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidServerUrl(
            f"{url!r} isn't a server URL: give the server's http(s) address, e.g. http://127.0.0.1:8000"
        )
    if parts.query or parts.fragment:
        raise InvalidServerUrl(f"{url!r} isn't a server URL: it has a query or a fragment")
    try:
        parts.port  # noqa: B018 -- urlsplit checks the port only when it is read
    except ValueError as e:
        raise InvalidServerUrl(f"{url!r} isn't a server URL: {e}") from None
    return url.strip().rstrip("/")


@dataclass(frozen=True)
class EpisodeRef:
    """Which episode a row plays: task ``index`` of ``split`` on the server at ``server_url``, which must still be
    the task ``task_id``."""

    split: str
    index: int
    task_id: str
    task_name: str
    server_url: str
    env_name: str

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> EpisodeRef:
        """The episode of a row's metadata, as ``prepare`` writes it and slime or Miles hand it over (extra keys
        are ignored). Raises ValueError naming what is missing or mistyped when the metadata isn't a row's."""
        if not isinstance(metadata, Mapping):
            raise ValueError(f"a row's metadata is a mapping, not {type(metadata).__name__}")
        episode, server = metadata.get("episode"), metadata.get("server")
        if not isinstance(episode, Mapping) or not isinstance(server, Mapping):
            raise ValueError(
                "this metadata has no 'episode' or 'server': it isn't a row written by "
                f"python -m chat_core.prepare (its keys are {sorted(metadata)})"
            )
        fields = {
            "split": episode.get("split"),
            "index": episode.get("index"),
            "task_id": episode.get("task_id"),
            "task_name": episode.get("task_name"),
            "server_url": server.get("url"),
            "env_name": server.get("env_name"),
        }
        wrong = [
            name
            for name, value in fields.items()
            if not (
                isinstance(value, int) and not isinstance(value, bool)
                if name == "index"
                else isinstance(value, str) and value
            )
        ]
        if wrong:
            raise ValueError(
                f"this row's metadata lacks a valid {', '.join(wrong)}: it isn't a row written by "
                "python -m chat_core.prepare"
            )
        fields["server_url"] = server_url(fields["server_url"])
        return cls(**fields)
