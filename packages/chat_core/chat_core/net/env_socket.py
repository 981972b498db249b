"""chat_core's env sessions: WebSocket connections made with the websockets library, one per episode at a time.

websockets reads each connection in its protocol's callback, so the server's pings are answered the moment they
arrive, while the episode waits on the model and while the session is parked (uvicorn drops a session whose pong is
late), with no task per session. It also keeps what a session must: a message no longer than the caller's limit
(refused from its frame's announced length, fragments counted together), control frames of at most 125 bytes and
never fragmented, text that is UTF-8, valid close codes, masks from ``secrets``. It pings the server every
``PING_INTERVAL_S`` and ends the session when a pong is ``PING_TIMEOUT_S`` late, so a server that stopped (a paused
VM, a partitioned node) ends its episodes in under a minute rather than at the env call deadline. Messages the
episode hasn't read wait in a queue of ``QUEUED_FRAMES`` frames; past it, and while what the session writes backs up
(a server pinging without reading the pongs), the connection stops reading: backpressure, so a server sending
unasked can't fill the process's memory; backed up for ``SEND_TIMEOUT_S``, the session is dropped.
No compression is asked for, so frames come as sent.

The session counts the messages that arrive and those read, so chat_core can tell a session with nothing unread
(``idle``): only such a session is parked for another episode."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, ProxyError, WebSocketException
from websockets.frames import DATA_OPCODES, CloseCode, Frame
from websockets.protocol import State

from chat_core._wire import described
from chat_core.net.settings import proxy_for, tls_context

PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 20.0
OPEN_TIMEOUT_S = 30.0
"""How long connecting and the opening handshake may take, a proxy's tunnel included."""
CLOSE_TIMEOUT_S = 2.0
"""How long closing waits for the server's close frame before dropping the connection."""
QUEUED_FRAMES = 4
"""Frames of messages not yet read that a session holds before it stops reading the connection."""
SEND_TIMEOUT_S = 20.0
"""How long what the session writes may stay backed up, the server reading none of it, before the session is
dropped."""


class HandshakeRefused(Exception):
    """What answered at the URL didn't open a WebSocket session."""


class Unreachable(Exception):
    """No session could be opened: nothing answered, the connection was refused or timed out, TLS failed, or the
    proxy refused the tunnel."""


class SessionEnded(Exception):
    """The session ended while the caller used it: the server closed it, the connection dropped, or this client
    closed it because the server broke the protocol, sent a message past the limit or stopped answering pings."""


class _Connection(ClientConnection):
    """websockets' client connection, counting the whole messages that arrive, and reading nothing while what it
    writes backs up. websockets answers each ping as it reads it; a server that pings without reading the pongs
    would otherwise have them pile up in this process's memory."""

    arrived = 0
    unread_by_server = False
    _dropping: asyncio.TimerHandle | None = None
    _stuck: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.recv_messages.resume = self._resume_reading

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # websockets answers a server that broke the protocol with a close frame and waits for it to close the
        # connection, but enforces how long only when something is next sent: drop it at that deadline.
        if self.close_deadline is not None and self._dropping is None:
            self._dropping = self.loop.call_at(self.close_deadline, self.transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for timer in (self._dropping, self._stuck):
            if timer is not None:
                timer.cancel()

    def process_event(self, event: object) -> None:
        super().process_event(event)
        if isinstance(event, Frame) and event.fin and event.opcode in DATA_OPCODES:
            self.arrived += 1

    def pause_writing(self) -> None:
        super().pause_writing()
        self.transport.pause_reading()
        self._stuck = self.loop.call_later(SEND_TIMEOUT_S, self._drop_unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stuck is not None:
            self._stuck.cancel()
        self._resume_reading()

    def _drop_unread(self) -> None:
        """Drop a connection whose server has read nothing of it for ``SEND_TIMEOUT_S``: neither a message, nor a
        pong, nor this client's keepalive ping gets through to it, so websockets' own timeouts can't run out."""
        self.unread_by_server = True
        self.transport.abort()

    def _resume_reading(self) -> None:
        """Read again, unless the queue of unread messages or the backed-up writes still say not to."""
        if not self.paused and not self.recv_messages.paused:
            self.transport.resume_reading()


class EnvSocket:
    """An open env session: ``send`` a message, ``receive`` the next, ``close``. Messages are text."""

    def __init__(self, connection: _Connection, max_message_bytes: int):
        self._connection = connection
        self._max_message_bytes = max_message_bytes
        self._read = 0

    @property
    def idle(self) -> bool:
        """Whether the session is open with nothing unread: the one state in which another episode may use it."""
        return self._connection.state is State.OPEN and self._connection.arrived == self._read

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
                message = await self._connection.recv(decode=True)
        except ConnectionClosed as e:
            raise SessionEnded(self._why(e)) from None
        self._read += 1
        return message

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
        """Close the connection at once, without the closing handshake and whatever is left unwritten."""
        self._connection.transport.abort()

    def close_now(self) -> None:
        """Write a close frame (1000) and close the connection once it is written, without waiting for the
        server's: the close for an event loop's end, which takes no more waiting."""
        protocol = self._connection.protocol
        if protocol.state is State.OPEN:
            protocol.send_close(CloseCode.NORMAL_CLOSURE)
            for data in protocol.data_to_send():
                if data:
                    self._connection.transport.write(data)
        self._connection.transport.close()

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
            if sent.code == CloseCode.INTERNAL_ERROR and "keepalive" in sent.reason:
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
    """A WebSocket session at ``url`` (ws:// or wss://), through the environment's proxy when
    ``CHAT_CORE_PROXY_FROM_ENV=1`` names one for its host, reading messages of at most ``max_message_bytes``.
    Raises HandshakeRefused when what answers doesn't open a session, and Unreachable when nothing answers as a
    server, or not within ``OPEN_TIMEOUT_S``."""
    parts = urlsplit(url)
    proxy = proxy_for(parts.scheme, parts.hostname or "")
    try:
        connection = await connect(
            url,
            ssl=tls_context() if parts.scheme == "wss" else None,
            proxy=proxy.url if proxy else None,
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
    return EnvSocket(connection, max_message_bytes)
