"""chat_core's env sessions: WebSocket connections made with the websockets library, one per episode at a time.

websockets reads each connection in its protocol's callback, so the server's pings are answered the moment they
arrive, while the episode waits on the model and while the session is parked (uvicorn drops a session whose pong is
late), with no task per session. It also keeps what a session must: a message no longer than the caller's limit
(refused from its frame's announced length, fragments counted together), control frames of at most 125 bytes and
never fragmented, text that is UTF-8, valid close codes, masks from ``secrets``. It pings the server every
``PING_INTERVAL_S`` and closes the session (code 1011) when a pong is ``PING_TIMEOUT_S`` late, so a server that
stopped (a paused VM, a partitioned node) ends its episodes in under a minute rather than at the env call deadline.
No compression is asked for, so frames come as sent.

What this module adds goes through documented hooks only: ``connect``'s ``create_connection`` (a subclass of the
client connection) and the asyncio protocol callbacks that connection receives (``connection_made``,
``data_received``, ``pause_writing``, ``resume_writing``, ``connection_lost``), each passed on to websockets first.

- Backpressure. Messages the episode hasn't read wait in websockets' queue of ``QUEUED_FRAMES`` frames, past which
  websockets pauses reading the connection. Reading also pauses while what the session writes backs up (a server
  pinging without reading the pongs, whose answers would otherwise pile up in this process's memory); backed up for
  ``SEND_TIMEOUT_S``, the session is dropped. Both pause through one gate on the transport websockets is given, so
  neither resumes reading while the other still holds it.
- The close deadline. Once the session is closing (the server broke the protocol and websockets answered with a
  close frame, or the server started the close), the connection is dropped ``CLOSE_TIMEOUT_S`` later if the server
  hasn't closed it, rather than when something is next sent.
- ``idle``: whether the session is open with nothing unread, the one state in which it is parked for another
  episode, asked of websockets' own ``recv`` with no time to wait.

websockets documents none of these as fixed behaviour of its internals, so chat_core's requirements pin the
websockets releases these hooks were checked against (``//tests/unit:wire_test`` fails on any other)."""

from __future__ import annotations

import asyncio
from typing import Any, cast
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, ProxyError, WebSocketException
from websockets.frames import CloseCode
from websockets.protocol import State

from chat_core._wire import described
from chat_core.net.settings import check_proxies, proxy_from_env, tls_context

PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 20.0
OPEN_TIMEOUT_S = 30.0
"""How long connecting and the opening handshake may take, a proxy's tunnel included."""
CLOSE_TIMEOUT_S = 2.0
"""How long closing waits for the server to finish the closing handshake before the connection is dropped."""
QUEUED_FRAMES = 4
"""Frames of messages not yet read that a session holds before it stops reading the connection."""
SEND_TIMEOUT_S = 20.0
"""How long what the session writes may stay backed up, the server reading none of it, before the session is
dropped."""
_UNREAD = "unread messages"
_UNSENT = "unsent writes"


class HandshakeRefused(Exception):
    """What answered at the URL didn't open a WebSocket session."""


class Unreachable(Exception):
    """No session could be opened: nothing answered, the connection was refused or timed out, TLS failed, or the
    proxy refused the tunnel."""


class SessionEnded(Exception):
    """The session ended while the caller used it: the server closed it, the connection dropped, or this client
    closed it because the server broke the protocol, sent a message past the limit or stopped answering pings."""


class _ReadingGate:
    """The connection's transport as websockets is given it: the real one, but for reading, which is paused while
    any reason holds it (websockets' full queue of unread frames, this module's backed-up writes) and resumed only
    once none does."""

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self._held: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def pause_reading(self) -> None:
        self.hold(_UNREAD)

    def resume_reading(self) -> None:
        self.release(_UNREAD)

    def is_reading(self) -> bool:
        return not self._held and self.transport.is_reading()

    def hold(self, reason: str) -> None:
        if not self._held:
            self.transport.pause_reading()
        self._held.add(reason)

    def release(self, reason: str) -> None:
        if reason in self._held:
            self._held.discard(reason)
            if not self._held:
                self.transport.resume_reading()


class _Connection(ClientConnection):
    """websockets' client connection, given a transport whose reading pauses for either reason, reading nothing
    while what it writes backs up, and dropped at the close deadline."""

    gate: _ReadingGate
    unread_by_server = False
    _closing: asyncio.TimerHandle | None = None
    _stuck: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.gate = _ReadingGate(cast(asyncio.Transport, transport))
        super().connection_made(cast(asyncio.Transport, self.gate))

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.state is State.CLOSING and self._closing is None:
            self._closing = asyncio.get_running_loop().call_later(CLOSE_TIMEOUT_S, self.gate.transport.abort)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.gate.hold(_UNSENT)
        self._stuck = asyncio.get_running_loop().call_later(SEND_TIMEOUT_S, self._drop_unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stuck is not None:
            self._stuck.cancel()
        self.gate.release(_UNSENT)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for timer in (self._closing, self._stuck):
            if timer is not None:
                timer.cancel()

    def _drop_unread(self) -> None:
        """Drop a connection whose server has read nothing of it for ``SEND_TIMEOUT_S``: neither a message, nor a
        pong, nor this client's keepalive ping gets through to it, so websockets' own timeouts can't run out."""
        self.unread_by_server = True
        self.gate.transport.abort()


class EnvSocket:
    """An open env session: ``send`` a message, ``receive`` the next, ``close``. Messages are text."""

    def __init__(self, connection: _Connection, max_message_bytes: int):
        self._connection = connection
        self._max_message_bytes = max_message_bytes

    async def idle(self) -> bool:
        """Whether the session is open with nothing unread: the one state in which another episode may use it."""
        if self._connection.state is not State.OPEN:
            return False
        try:
            async with asyncio.timeout(0):
                await self._connection.recv(decode=True)
        except TimeoutError:
            return True
        except ConnectionClosed:
            return False
        return False

    async def send(self, text: bytes) -> None:
        """Send ``text`` (UTF-8) as one message. Raises SessionEnded once the session has ended."""
        try:
            await self._connection.send(text, text=True)
        except ConnectionClosed as e:
            raise SessionEnded(self._why(e)) from None

    async def receive(self, deadline_s: float | None) -> str:
        """The server's next message. Raises TimeoutError when none comes within ``deadline_s`` (None: no limit),
        and SessionEnded when the session ends first."""
        try:
            async with asyncio.timeout(deadline_s):
                return await self._connection.recv(decode=True)
        except ConnectionClosed as e:
            raise SessionEnded(self._why(e)) from None

    async def close(self) -> None:
        """End the session: a close frame, then up to ``CLOSE_TIMEOUT_S`` in all for the server's before the
        connection is dropped; it is dropped however this ends, cancelled included."""
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self._connection.close()
        except TimeoutError:
            pass
        finally:
            if self._connection.state is not State.CLOSED:
                self.drop()

    def drop(self) -> None:
        """Close the connection at once, without the closing handshake and whatever is left unwritten: the server
        takes it as the client leaving."""
        self._connection.gate.transport.abort()

    def _why(self, closed: ConnectionClosed) -> str:
        """How the session ended, in the terms of chat_core's settings where one of them ended it."""
        if self._connection.unread_by_server:
            return f"the server read nothing of the session for {SEND_TIMEOUT_S:g} s; the session was dropped"
        sent, received = closed.sent, closed.rcvd
        if received is None and sent is not None:
            if sent.code == CloseCode.MESSAGE_TOO_BIG:
                return (
                    f"the server sent a message longer than max_env_message_bytes={self._max_message_bytes} "
                    f"({sent.reason}); the session was closed"
                )
            if sent.code == CloseCode.INTERNAL_ERROR:
                return (
                    f"the server stopped answering pings: no pong within {PING_TIMEOUT_S:g} s of a ping "
                    "(it is stopped, overloaded or cut off); the session was closed"
                )
            return f"this client closed the session: close code {sent.code} ({sent.reason})"
        if received is not None:
            return f"the server closed the session: close code {received.code}" + (
                f" ({received.reason})" if received.reason else ""
            )
        return "the connection dropped without a close frame"


async def open_session(url: str, *, max_message_bytes: int) -> EnvSocket:
    """A WebSocket session at ``url`` (ws:// or wss://), through the proxy the environment names when
    ``CHAT_CORE_PROXY_FROM_ENV=1`` (websockets reads it), reading messages of at most ``max_message_bytes``. Raises
    HandshakeRefused when what answers doesn't open a session, Unreachable when nothing answers as a server, or not
    within ``OPEN_TIMEOUT_S``, and ValueError when the environment's proxy isn't an http:// URL."""
    check_proxies()
    try:
        connection = await connect(
            url,
            ssl=tls_context() if urlsplit(url).scheme == "wss" else None,
            proxy=True if proxy_from_env() else None,
            compression=None,
            open_timeout=OPEN_TIMEOUT_S,
            ping_interval=PING_INTERVAL_S,
            ping_timeout=PING_TIMEOUT_S,
            close_timeout=CLOSE_TIMEOUT_S,
            max_size=max_message_bytes,
            max_queue=QUEUED_FRAMES,
            user_agent_header="chat_core",
            create_connection=_Connection,
        )
    except ProxyError as e:
        raise Unreachable(f"the proxy refused the tunnel: {described(e)}") from None
    except InvalidStatus as e:
        raise HandshakeRefused(f"it answered the WebSocket handshake with HTTP {e.response.status_code}") from None
    except InvalidHandshake as e:
        raise HandshakeRefused(f"its answer to the WebSocket handshake isn't one: {described(e)}") from None
    except (OSError, TimeoutError, UnicodeError, WebSocketException) as e:
        raise Unreachable(described(e)) from None
    return EnvSocket(cast(_Connection, connection), max_message_bytes)
