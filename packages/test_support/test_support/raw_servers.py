"""What the client tests' raw servers run in and write: servers that answer with exactly the bytes a test gives, as a
broken or hostile server would, in an event loop of their own (``ServerThread``), and the client's work watched from
outside its own loop (``watched``), so a client that freezes its loop or fills its memory fails the test instead of
hanging it.

``accept_websocket``, ``frame`` and ``read_frame`` are the WebSocket bytes such a server reads and writes (the
handshake and the client's frames through websockets' own server protocol, the server's frames written as a test
gives them, well-formed or not);
``nothing_left_unclosed`` fails a test whose sockets or transports the garbage collector finds unclosed (a fixture
of ``pytest_plugin``)."""

from __future__ import annotations

import asyncio
import gc
import ssl
import threading
import time
import tracemalloc
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from weakref import WeakKeyDictionary

from websockets.frames import Frame
from websockets.server import ServerProtocol

T = TypeVar("T")
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TEXT, BINARY, CONTINUATION, CLOSE, PING, PONG = 0x1, 0x2, 0x0, 0x8, 0x9, 0xA


class ServerThread:
    """An event loop in a daemon thread of its own, where a test's raw servers (and proxies) run. Use it with
    ``with``: leaving closes every server and connection it started."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="raw-servers", daemon=True)
        self._servers: list[asyncio.Server] = []
        self._writers: list[asyncio.StreamWriter] = []

    def __enter__(self) -> ServerThread:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.run(self._close_all())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """What ``work`` gives, run in the servers' loop."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=30)

    def serve(self, handler: Handler, *, tls: ssl.SSLContext | None = None) -> int:
        """The loopback port of a new server whose every connection ``handler`` plays, over TLS when given."""

        async def started() -> int:
            async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                self._writers.append(writer)
                try:
                    await handler(reader, writer)
                except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                    pass
                finally:
                    writer.close()

            server = await asyncio.start_server(connected, "127.0.0.1", 0, ssl=tls)
            self._servers.append(server)
            return server.sockets[0].getsockname()[1]

        return self.run(started())

    async def _close_all(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        for server in self._servers:
            server.close()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()


@dataclass(frozen=True)
class Watched(Generic[T]):
    """How a client's work went: what it gave, how long it took, the longest its event loop went without running
    a callback, and the most memory it held at once (what ``tracemalloc`` traces, above what it held before)."""

    value: T
    seconds: float
    longest_stall_s: float
    peak_bytes: int


def watched(work: Callable[[], Awaitable[T]], bound_s: float, *, memory: bool = True) -> Watched[T]:
    """``work()`` run in a new event loop in a daemon thread, watched; its memory traced unless ``memory`` is off
    (tracing makes allocating several times slower; ``peak_bytes`` is then 0). Raises AssertionError when it isn't
    done within ``bound_s``: its loop froze or it waits for ever (the thread is left behind, stuck)."""
    outcome: list[Any] = []
    stalls = [0.0]

    async def ticking() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            stalls[0] = max(stalls[0], now - last - 0.01)
            last = now

    async def main() -> T:
        ticker = asyncio.create_task(ticking())
        try:
            return await work()
        finally:
            ticker.cancel()

    def run() -> None:
        try:
            outcome.append(("value", asyncio.run(main())))
        except BaseException as e:
            outcome.append(("error", e))

    if memory:
        tracemalloc.start()
        tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    began = time.monotonic()
    thread = threading.Thread(target=run, name="watched-client", daemon=True)
    thread.start()
    thread.join(bound_s)
    seconds = time.monotonic() - began
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert outcome, f"the client wasn't done within {bound_s:g} s: its event loop froze or it waits for ever"
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return Watched(value, seconds, stalls[0], peak - base)


@dataclass
class _ClientFrames:
    """A raw server's side of one WebSocket connection: websockets' server protocol, which reads the client's frames,
    and the frames read and not yet asked for."""

    protocol: ServerProtocol
    unread: deque[Frame]


_CONNECTIONS: WeakKeyDictionary[asyncio.StreamReader, _ClientFrames] = WeakKeyDictionary()
"""Each accepted connection's client frames, by the reader ``accept_websocket`` accepted it on."""


async def accept_websocket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
    """Read a WebSocket handshake and accept it with 101, no extension taken; its request head."""
    head = await reader.readuntil(b"\r\n\r\n")
    protocol = ServerProtocol(max_size=None)
    protocol.receive_data(head)
    [request] = protocol.events_received()
    protocol.send_response(protocol.accept(request))
    writer.write(b"".join(protocol.data_to_send()))
    _CONNECTIONS[reader] = _ClientFrames(protocol, deque())
    return head.decode("latin-1")


def frame(opcode: int, payload: bytes, *, final: bool = True, length: int | None = None, rsv1: bool = False) -> bytes:
    """A server's frame of ``opcode`` carrying ``payload``, unmasked; ``length`` announces another length than the
    payload's, ``rsv1`` sets the bit a compression extension would."""
    size = len(payload) if length is None else length
    first = final << 7 | rsv1 << 6 | opcode
    if size < 126:
        head = bytes((first, size))
    elif size < 1 << 16:
        head = bytes((first, 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((first, 127)) + size.to_bytes(8, "big")
    return head + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The client's next frame on the connection ``accept_websocket`` accepted on ``reader``, as (opcode, payload)."""
    frames = _CONNECTIONS[reader]
    while not frames.unread:
        data = await reader.read(65536)
        if not data:
            raise asyncio.IncompleteReadError(b"", None)
        frames.protocol.receive_data(data)
        frames.unread.extend(frames.protocol.events_received())
    read = frames.unread.popleft()
    return int(read.opcode), bytes(read.data)


@contextmanager
def nothing_left_unclosed() -> Iterator[None]:
    """Fail when a socket or transport made inside the block is found unclosed by the garbage collector."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    assert [str(each.message) for each in warned if issubclass(each.category, ResourceWarning)] == []
