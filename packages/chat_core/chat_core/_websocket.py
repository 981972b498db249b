"""chat_core's WebSocket client, for the env server's sessions: the opening handshake as an HTTP/1.1 exchange on
``chat_core._http``'s connection, then frames read in the protocol's callback.

Reading frames in the callback answers each of the server's pings the moment it arrives, while the episode waits
on the model and while the session is parked, without a task reading the connection; and an env call's answer
wakes the call waiting for it directly. With aiohttp's client, a reader task per session had to receive every
message and hand it on, and opening a session cost 0.4 ms more CPU than the handshake itself. No extension is
asked for, so frames come uncompressed, and a message may be of any size."""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
import os
import random
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

from chat_core._http import Answer, Connection, connect, origin_and_proxy

_ACCEPT_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_TEXT, _BINARY, _CONTINUATION, _CLOSE, _PING, _PONG = 0x1, 0x2, 0x0, 0x8, 0x9, 0xA
_CLOSE_WAIT_S = 2.0
_TIMER_CONTEXT = contextvars.Context()


class HandshakeRefused(Exception):
    """What answered at the URL didn't open a WebSocket session."""


@dataclass(frozen=True)
class Closed:
    """The session's end, as the next message: the server's close frame (``code`` and ``reason``), or the connection
    dropping without one (``code`` None, ``reason`` saying how)."""

    code: int | None
    reason: str

    def __str__(self) -> str:
        if self.code is None:
            return self.reason
        return f"close code {self.code}" + (f" ({self.reason})" if self.reason else "")


async def open_session(url: str) -> WebSocket:
    """A WebSocket session at ``url`` (ws:// or wss://), through the environment's proxy when
    ``CHAT_CORE_PROXY_FROM_ENV=1`` names one for its host. Raises HandshakeRefused when what answers doesn't open a
    session, and ``chat_core._http``'s HttpError when the server can't be reached."""
    parts = urlsplit(url)
    session = await connect(WebSocket, *origin_and_proxy(parts), tunnel=True)
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nUser-Agent: chat_core\r\n\r\n"
    )
    try:
        answer = await session.exchange(request.encode("latin-1"), head_only=True)
        expected = base64.b64encode(hashlib.sha1(key.encode() + _ACCEPT_GUID).digest()).decode()
        if answer.status != 101 or answer.headers.get("upgrade", "").lower() != "websocket":
            raise HandshakeRefused(f"it answered the WebSocket handshake with HTTP {answer.status}")
        if answer.headers.get("sec-websocket-accept") != expected:
            raise HandshakeRefused("its handshake answer didn't accept this client's key")
    except BaseException:
        session.drop()
        raise
    return session


class WebSocket(Connection):
    """A WebSocket session's connection once open: ``send_text`` writes a message, ``next_message`` waits for the
    server's next one (its bytes, or a ``Closed`` once the session has ended), ``close`` ends it. The server's
    messages wait in arrival order for the calls that ask for them."""

    def __init__(self) -> None:
        super().__init__()
        self._upgraded = False
        self._arrived: deque[bytes | Closed] = deque()
        self._message_waiter: asyncio.Future[bytes | Closed] | None = None
        self._fragments: list[bytes] | None = None
        self._ended: Closed | None = None
        self._gone: asyncio.Future[None] | None = None
        self._due: float | None = None
        self._alarm: asyncio.TimerHandle | None = None

    def send_text(self, payload: bytes) -> None:
        """Write ``payload`` (UTF-8 text) as one message. Raises ConnectionError once the session has ended."""
        if self._ended is not None or not self.open:
            raise ConnectionError(f"the session has ended: {self._ended or 'the connection closed'}")
        self._write(_TEXT, payload)

    async def next_message(self, deadline_s: float | None) -> bytes | Closed:
        """The server's next message, waiting for it if it hasn't come; a Closed once the session has ended.
        Raises TimeoutError when none comes within ``deadline_s`` (None: no limit).

        One alarm per session keeps the deadlines, rung no later than the current wait's and re-armed from there
        when that wait began after it was set: a timer per call cost more than reading the answer, and with a
        thousand episodes in flight those timers reached the garbage collector's oldest generation. An env call's
        answer comes in milliseconds and its deadline is seconds away, so the alarm rings about once a deadline."""
        if self._arrived:
            return self._arrived.popleft()
        if self._ended is not None:
            return self._ended
        loop = asyncio.get_running_loop()
        waiter = self._message_waiter = loop.create_future()
        if deadline_s is None:
            self._due = None
        else:
            self._due = due = loop.time() + deadline_s
            if self._alarm is None or self._alarm.when() > due:
                self._set_alarm(loop, due)
        return await waiter

    async def close(self) -> None:
        """End the session: a close frame (1000), then up to 2 s for the server's own before the connection is
        closed; it is closed however this ends, cancelled included."""
        try:
            if self.open and self._ended is None:
                self._write(_CLOSE, (1000).to_bytes(2, "big"))
                self._gone = asyncio.get_running_loop().create_future()
                async with asyncio.timeout(_CLOSE_WAIT_S):
                    await self._gone
        except TimeoutError:
            pass
        finally:
            self.drop()

    def answered(self, answer: Answer) -> None:
        self._upgraded = answer.status == 101
        super().answered(answer)
        if self._upgraded and self._buffer:
            self._read_frames()

    def received(self, data: memoryview) -> None:
        if not self._upgraded:
            super().received(data)
            return
        self._buffer += data
        self._read_frames()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._upgraded:
            super().connection_lost(exc)
            return
        self.open = False
        if self._alarm is not None:
            self._alarm.cancel()
        why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self._end(Closed(None, f"the connection dropped without a close frame{why}"))
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)

    def _read_frames(self) -> None:
        buffer = self._buffer
        while len(buffer) >= 2:
            first, second = buffer[0], buffer[1]
            size, start = second & 0x7F, 2
            if size == 126:
                if len(buffer) < 4:
                    return
                size, start = int.from_bytes(buffer[2:4], "big"), 4
            elif size == 127:
                if len(buffer) < 10:
                    return
                size, start = int.from_bytes(buffer[2:10], "big"), 10
            if second & 0x80 or first & 0x70:
                self._broken("the server sent a masked frame or one using an extension that wasn't agreed")
                return
            if len(buffer) < start + size:
                return
            payload = bytes(buffer[start : start + size])
            del buffer[: start + size]
            if not self._frame(first & 0x80, first & 0x0F, payload):
                return

    def _frame(self, final: int, opcode: int, payload: bytes) -> bool:
        """Act on one frame; False once the session has ended."""
        if opcode == _PING:
            self._write(_PONG, payload)
        elif opcode == _CLOSE:
            code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else None
            reason = payload[2:].decode("utf-8", errors="replace")
            if self._gone is None and self.open:
                self._write(_CLOSE, payload[:2])
            self._end(Closed(code if code is not None else 1005, reason))
            if self._gone is not None and not self._gone.done():
                self._gone.set_result(None)
            self.transport.close()
            return False
        elif opcode in (_TEXT, _BINARY) and self._fragments is None:
            if final:
                self._arrive(payload)
            else:
                self._fragments = [payload]
        elif opcode == _CONTINUATION and self._fragments is not None:
            self._fragments.append(payload)
            if final:
                whole, self._fragments = b"".join(self._fragments), None
                self._arrive(whole)
        elif opcode != _PONG:
            self._broken(f"the server sent a frame of opcode {opcode:#x} out of place")
            return False
        return True

    def _arrive(self, message: bytes | Closed) -> None:
        waiter, self._message_waiter = self._message_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(message)
        else:
            self._arrived.append(message)

    def _end(self, closed: Closed) -> None:
        if self._ended is None:
            self._ended = closed
            self._arrive(closed)

    def _broken(self, why: str) -> None:
        self._end(Closed(None, why))
        self.transport.close()

    def _set_alarm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        self._alarm = loop.call_at(when, self._ring, context=_TIMER_CONTEXT)

    def _ring(self) -> None:
        """Time the current wait out if its deadline has passed, else ring again at its deadline."""
        self._alarm = None
        waiter = self._message_waiter
        if waiter is None or waiter.done() or self._due is None:
            return
        loop = waiter.get_loop()
        if loop.time() >= self._due:
            self._message_waiter = None
            waiter.set_exception(TimeoutError())
        else:
            self._set_alarm(loop, self._due)

    def _write(self, opcode: int, payload: bytes) -> None:
        size = len(payload)
        if size < 126:
            head = bytes((0x80 | opcode, 0x80 | size))
        elif size < 1 << 16:
            head = bytes((0x80 | opcode, 0xFE)) + size.to_bytes(2, "big")
        else:
            head = bytes((0x80 | opcode, 0xFF)) + size.to_bytes(8, "big")
        mask = random.getrandbits(32).to_bytes(4, "big")
        key = (mask * (size // 4 + 1))[:size]
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(size, "big")
        self.transport.write(head + mask + masked)
