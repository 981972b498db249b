"""Every way an OpenEnv server can fail a caller of chat_core, as one hierarchy, so a caller catches as precisely
as it needs: ``OpenEnvError`` for all of them, or one case. ``write_rows`` raises them; ``play`` turns the ones its
episode's server raises into flags.

    OpenEnvError
    ├── InvalidServerUrl      (also a ValueError) the URL isn't an absolute http(s) URL
    ├── ServerUnreachable     nothing answered at the address
    ├── NotAnOpenEnvServer    something answered, but not as an OpenEnv server
    ├── ServerError           the Task API refused or failed a request (HTTP 4xx, 5xx)
    ├── ServerMismatch        a server of a pool serves another env or other tasks than the rows
    ├── CapacityExhausted     every session stayed taken for as long as the caller would wait
    ├── EnvCallTimeout        an episode's call went unanswered for longer than the caller's deadline
    └── EpisodeProtocolError  an episode's session answered outside the protocol, or dropped
        └── SessionDropped    the session's connection closed while the episode was open
"""

from __future__ import annotations


class OpenEnvError(Exception):
    """Anything that stops a caller from using an OpenEnv server as asked."""


class InvalidServerUrl(OpenEnvError, ValueError):
    """A server URL that isn't an absolute http(s) URL."""


class ServerUnreachable(OpenEnvError):
    """Nothing answered at the server's address: refused, timed out or unresolvable."""


class NotAnOpenEnvServer(OpenEnvError):
    """Something answered, but not as an OpenEnv server's Task API does."""


class ServerError(OpenEnvError):
    """The Task API refused a request or failed serving it (an HTTP 4xx or 5xx)."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


class ServerMismatch(OpenEnvError):
    """A server named to serve the rows' env serves another env, or other tasks at the rows' places: the launch
    names the wrong server, or it serves another version of the bundle."""


class CapacityExhausted(OpenEnvError):
    """Every session the server allows stayed taken for as long as the caller agreed to wait."""

    def __init__(self, message: str, max_sessions: int | None):
        super().__init__(message)
        self.max_sessions = max_sessions


class EnvCallTimeout(OpenEnvError):
    """An episode's call (reset, list_tools, a tool call, end_turn) went unanswered for longer than the caller
    agreed to wait: the server is connected but stuck, in a tool or a verifier."""


class EpisodeProtocolError(OpenEnvError):
    """An episode's session answered outside the protocol: an error frame, a frame that isn't JSON or isn't the one
    asked for, or a connection that closed while the episode was open."""


class SessionDropped(EpisodeProtocolError):
    """The session's connection closed while a call waited for its answer: the server stopped, crashed or dropped
    it."""
