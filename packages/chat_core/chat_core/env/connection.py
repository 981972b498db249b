"""The connection under an episode's session: a WebSocket to the env server's ``/ws`` carrying JSON frames, one
answer read for each message sent, taken from the event loop's parked sessions when one is there and parked again
when the episode it played ended cleanly (``chat_core.net.parking``).

Each message is sent once the one before is answered, though the server answers a session's messages in order:
uvicorn stops reading a session while a message it received waits for the app, so a message sent behind a slow one
(a long tool, the verifiers) would leave the server's pings unanswered, and past its ping timeout it drops the
session."""

from __future__ import annotations

import contextlib
from typing import Any

from chat_core._wire import excerpt, parse_json
from chat_core.errors import (
    EnvCallTimeout,
    EpisodeProtocolError,
    NotAnOpenEnvServer,
    ServerUnreachable,
    SessionDropped,
)
from chat_core.net.env_socket import EnvSocket, HandshakeRefused, SessionEnded, Unreachable, open_session
from chat_core.net.parking import park, unpark


class SessionConnection:
    """The connection of a session on the server at ``url`` (a checked base URL): none until ``start``, then one
    whose messages are JSON frames. ``call_deadline_s`` bounds each answer's wait (None: no bound), past which a
    call raises EnvCallTimeout; ``max_message_bytes`` bounds each message the server sends."""

    def __init__(self, url: str, *, call_deadline_s: float | None, max_message_bytes: int):
        self.url = url
        self._ws_url = "ws" + url.removeprefix("http") + "/ws"
        self._call_deadline_s = call_deadline_s
        self._max_message_bytes = max_message_bytes
        self._socket: EnvSocket | None = None

    @property
    def connected(self) -> bool:
        return self._socket is not None

    async def start(self, message: bytes) -> dict[str, Any]:
        """The first frame answering ``message`` (a reset), on a parked session when one answers it, else on a new
        one. A parked session the server closed, or sent something to, while it waited is closed for the next. The
        caller bounds the time. Raises ServerUnreachable when no session can be opened, NotAnOpenEnvServer when what
        answers doesn't open one, and as ``exchange`` does."""
        while (socket := unpark(self.url)) is not None:
            self._socket = socket
            if await socket.idle():
                try:
                    return await self._first_answer(message)
                except SessionDropped:
                    pass
            await self.close()
        self._socket = await self._connect()
        return await self._first_answer(message)

    async def exchange(self, message: bytes, what: str) -> dict[str, Any]:
        """The frame the server answers ``message`` with, ``what`` naming the call in errors. Raises SessionDropped
        when the session ended first, EpisodeProtocolError when the answer isn't a JSON object, EnvCallTimeout past
        the call deadline, and RuntimeError when no session is open."""
        if self._socket is None:
            raise RuntimeError(f"{what} needs an open episode: call reset first, and not after close")
        try:
            await self._socket.send(message)
        except SessionEnded as e:
            raise SessionDropped(f"the session ended before {what} could be sent: {e}") from None
        return await self._frame(what, self._call_deadline_s)

    async def park_or_close(self, *, episode_ended: bool) -> None:
        """Park the session when the server ended its episode (``episode_ended``) and nothing is left unread on it,
        else close it."""
        if episode_ended and self._socket is not None and await self._socket.idle():
            socket, self._socket = self._socket, None
            await park(self.url, socket)
            return
        await self.close()

    async def close(self) -> None:
        """Close the session, if one is open: its closing handshake, and the connection dropped however that ends,
        cancelled included."""
        socket, self._socket = self._socket, None
        if socket is not None:
            await socket.close()

    def timed_out(self, what: str) -> EnvCallTimeout:
        """The error of a call ``what`` the server didn't answer within the call deadline."""
        return EnvCallTimeout(f"{self.url} didn't answer {what} within {self._call_deadline_s:g} s")

    async def _connect(self) -> EnvSocket:
        try:
            return await open_session(self._ws_url, max_message_bytes=self._max_message_bytes)
        except HandshakeRefused as e:
            raise NotAnOpenEnvServer(
                f"{self._ws_url} doesn't take WebSocket sessions as an OpenEnv server does: {e}"
            ) from None
        except (Unreachable, ValueError) as e:
            raise ServerUnreachable(f"can't open a session at {self._ws_url}: {e}") from None

    async def _first_answer(self, message: bytes) -> dict[str, Any]:
        """The server's first frame: a full server sends its refusal as soon as the connection opens, possibly
        before the reset is even sent, and then closes, so a failed send is left for the answer to explain."""
        assert self._socket is not None
        with contextlib.suppress(SessionEnded):
            await self._socket.send(message)
        return await self._frame("reset", None)

    async def _frame(self, what: str, deadline_s: float | None) -> dict[str, Any]:
        """The server's next message as the frame answering ``what``; raises SessionDropped when the session ended
        instead, EpisodeProtocolError when the message holds no JSON object, and EnvCallTimeout past
        ``deadline_s``."""
        assert self._socket is not None
        try:
            message = await self._socket.receive(deadline_s)
        except TimeoutError:
            raise self.timed_out(what) from None
        except SessionEnded as e:
            raise SessionDropped(f"the session ended while waiting for the answer to {what}: {e}") from None
        try:
            frame = parse_json(message)
        except ValueError as e:
            raise EpisodeProtocolError(f"the answer to {what} isn't JSON ({e}): {excerpt(message)}") from None
        if not isinstance(frame, dict):
            raise EpisodeProtocolError(f"the answer to {what} isn't a frame: {excerpt(frame)}")
        return frame
