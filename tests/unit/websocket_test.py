"""chat_core's WebSocket client (``chat_core._websocket``) against a raw server writing the frames RFC 6455 allows
and some it forbids: fragments with a ping between them, long messages both ways, close frames, dropped
connections, refused handshakes. The episode loop's tests play whole episodes through it on the real env server."""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import chat_core._http
import chat_core._net
import chat_core._websocket
import pytest
from chat_core._websocket import Closed, HandshakeRefused, open_session
from test_support.proxy import started_proxy
from test_support.raw_servers import BOUND_S, Opened, played
from test_support.waits import free_port

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


@dataclass
class Peer:
    """The server's side of one session: what the client sent, frame by frame, as (opcode, payload)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    received: list[tuple[int, bytes]] = field(default_factory=list)

    def send(self, opcode: int, payload: bytes, *, final: bool = True, mask: bytes | None = None) -> None:
        size = len(payload)
        second = 0x80 if mask else 0
        if size < 126:
            head = bytes((final << 7 | opcode, second | size))
        elif size < 1 << 16:
            head = bytes((final << 7 | opcode, second | 126)) + size.to_bytes(2, "big")
        else:
            head = bytes((final << 7 | opcode, second | 127)) + size.to_bytes(8, "big")
        self.writer.write(head + (mask or b"") + payload)

    async def frame(self) -> tuple[int, bytes]:
        """The client's next frame, unmasked; every client frame must be masked."""
        first, second = await self.reader.readexactly(2)
        assert second & 0x80, "a client frame came unmasked"
        size = second & 0x7F
        if size == 126:
            size = int.from_bytes(await self.reader.readexactly(2), "big")
        elif size == 127:
            size = int.from_bytes(await self.reader.readexactly(8), "big")
        mask = await self.reader.readexactly(4)
        data = await self.reader.readexactly(size)
        frame = (first & 0x0F, bytes(byte ^ mask[i % 4] for i, byte in enumerate(data)))
        self.received.append(frame)
        return frame


Serving = Callable[[Peer], Awaitable[None]]


async def served(serving: Serving, *, answer: Callable[[str], bytes] | None = None) -> tuple[str, list[Peer]]:
    """A WebSocket server in the running loop: each session's handshake answered by ``answer`` (the key's proper
    101 when None), then played by ``serving``; its URL, and its sessions as they open."""
    peers: list[Peer] = []
    port = free_port()

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _opened.append(writer)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        key = next(line.split(":", 1)[1].strip() for line in head.split("\r\n") if line.startswith("Sec-WebSocket-Key"))
        accept = base64.b64encode(hashlib.sha1(key.encode() + GUID).digest()).decode()
        writer.write(
            answer(accept)
            if answer
            else (
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Accept: {accept}\r\n\r\n"
            ).encode()
        )
        peer = Peer(reader, writer)
        peers.append(peer)
        try:
            await serving(peer)
            await writer.drain()
            await reader.read()
        finally:
            writer.close()

    _opened.append(await asyncio.start_server(connected, "127.0.0.1", port))
    return f"ws://127.0.0.1:{port}/ws", peers


_opened: list[Opened] = []
pytest_plugins = ["test_support.pytest_plugin"]
pytestmark = pytest.mark.usefixtures("nothing_left_unclosed")


def test_a_fragmented_message_is_read_whole_and_a_ping_between_its_fragments_answered_at_once() -> None:
    async def serving(peer: Peer) -> None:
        peer.send(0x1, b'{"type": ', final=False)
        peer.send(0x9, b"are you there")
        peer.send(0x0, b'"observation", ', final=False)
        peer.send(0x0, b'"data": {}}')
        assert await peer.frame() == (0xA, b"are you there")

    async def run() -> tuple[bytes | Closed, list[Peer]]:
        url, peers = await served(serving)
        session = await open_session(url)
        message = await session.next_message(BOUND_S)
        await session.close()
        return message, peers

    message, peers = played(run(), _opened)

    assert message == b'{"type": "observation", "data": {}}'
    assert peers[0].received[0] == (0xA, b"are you there")


@pytest.mark.parametrize("size", [5, 125, 126, 65_535, 65_536, 300_000])
def test_messages_of_any_length_go_both_ways_intact(size: int) -> None:
    text = bytes(ord("a") + position % 26 for position in range(size))

    async def serving(peer: Peer) -> None:
        opcode, payload = await peer.frame()
        peer.send(opcode, payload[::-1])

    async def run() -> bytes | Closed:
        url, _ = await served(serving)
        session = await open_session(url)
        session.send_text(text)
        echoed = await session.next_message(BOUND_S)
        await session.close()
        return echoed

    assert played(run(), _opened) == text[::-1]


def test_a_message_that_comes_with_the_handshakes_answer_is_kept() -> None:
    refusal = b'{"type": "error", "data": {"code": "CAPACITY_REACHED"}}'

    def answer(accept: str) -> bytes:
        head = (
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Accept: {accept}\r\n\r\n"
        ).encode()
        return head + bytes((0x81, len(refusal))) + refusal

    async def closes(peer: Peer) -> None:
        peer.send(0x8, (1013).to_bytes(2, "big"))

    async def run() -> tuple[bytes | Closed, bytes | Closed]:
        url, _ = await served(closes, answer=answer)
        session = await open_session(url)
        first = await session.next_message(BOUND_S)
        then = await session.next_message(BOUND_S)
        await session.close()
        return first, then

    first, then = played(run(), _opened)

    assert first == refusal
    assert then == Closed(1013, "")


def test_the_servers_close_frame_ends_the_session_with_its_code_and_reason_and_is_answered() -> None:
    async def serving(peer: Peer) -> None:
        peer.send(0x8, (1011).to_bytes(2, "big") + b"keepalive ping timeout")
        assert (await peer.frame())[0] == 0x8

    async def run() -> tuple[bytes | Closed, bytes | Closed, list[Peer]]:
        url, peers = await served(serving)
        session = await open_session(url)
        ended = await session.next_message(BOUND_S)
        again = await session.next_message(BOUND_S)
        with pytest.raises(ConnectionError, match="close code 1011"):
            session.send_text(b"{}")
        await session.close()
        while not peers[0].received:
            await asyncio.sleep(0.01)
        return ended, again, peers

    ended, again, peers = played(run(), _opened)

    assert ended == again == Closed(1011, "keepalive ping timeout")
    assert str(ended) == "close code 1011 (keepalive ping timeout)"
    assert peers[0].received == [(0x8, (1011).to_bytes(2, "big"))]


def first_message(serving: Serving) -> bytes | Closed:
    """The first message of a session the server plays with ``serving``; the session closed after it."""

    async def run() -> bytes | Closed:
        url, _ = await served(serving)
        session = await open_session(url)
        message = await session.next_message(BOUND_S)
        await session.close()
        return message

    return played(run(), _opened)


def test_a_connection_dropped_without_a_close_frame_ends_the_session_saying_so() -> None:
    async def serving(peer: Peer) -> None:
        peer.writer.transport.abort()

    ended = first_message(serving)

    assert isinstance(ended, Closed) and ended.code is None
    assert "dropped without a close frame" in str(ended)


def test_a_dropped_session_is_freed_at_once_though_its_deadline_is_far_off() -> None:
    async def serving(peer: Peer) -> None:
        await peer.frame()
        peer.send(0x1, b"answer")
        await peer.frame()
        peer.writer.transport.abort()

    async def run() -> tuple[bytes | Closed, bool]:
        url, _ = await served(serving)
        session = await open_session(url)
        session.send_text(b"call")
        answer = await session.next_message(600)
        session.send_text(b"call")
        ended = await session.next_message(600)
        await asyncio.sleep(0)
        left = weakref.ref(session)
        del session
        gc.collect()
        return answer, isinstance(ended, Closed) and left() is None

    assert played(run(), _opened) == (b"answer", True)


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        (bytes((0x81, 0x82)) + b"abcd" + b"xy", "masked frame"),
        (bytes((0xC1, 0x02)) + b"xy", "extension that wasn't agreed"),
        (bytes((0x80, 0x02)) + b"xy", "opcode 0x0 out of place"),
        (bytes((0x83, 0x00)), "opcode 0x3 out of place"),
    ],
    ids=["masked", "compressed", "stray-continuation", "reserved-opcode"],
)
def test_a_frame_outside_the_protocol_ends_the_session_saying_why(frame: bytes, says: str) -> None:
    async def serving(peer: Peer) -> None:
        peer.writer.write(frame)

    ended = first_message(serving)

    assert isinstance(ended, Closed) and says in str(ended)


def test_closing_sends_a_normal_close_and_waits_for_the_servers_then_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_core._websocket, "_CLOSE_WAIT_S", 0.3)

    async def answers_close(peer: Peer) -> None:
        opcode, payload = await peer.frame()
        peer.send(opcode, payload)

    async def ignores_close(peer: Peer) -> None:
        await peer.frame()

    async def run(serving: Serving) -> tuple[float, list[Peer]]:
        url, peers = await served(serving)
        session = await open_session(url)
        began = asyncio.get_running_loop().time()
        await session.close()
        return asyncio.get_running_loop().time() - began, peers

    answered_in, answered = played(run(answers_close), _opened)
    ignored_in, ignored = played(run(ignores_close), _opened)

    assert answered[0].received == ignored[0].received == [(0x8, (1000).to_bytes(2, "big"))]
    assert answered_in < 0.25 <= ignored_in


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (lambda accept: b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nNot Found", "HTTP 404"),
        (
            lambda accept: (
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Accept: bm90IHRoZSBrZXk=\r\n\r\n"
            ),
            "didn't accept this client's key",
        ),
    ],
    ids=["not-found", "wrong-accept"],
)
def test_a_handshake_that_doesnt_open_a_session_is_refused(answer: Callable[[str], bytes], says: str) -> None:
    async def run() -> None:
        url, _ = await served(lambda peer: asyncio.sleep(0), answer=answer)
        await open_session(url)

    with pytest.raises(HandshakeRefused) as raised:
        played(run(), _opened)

    assert says in str(raised.value)


def test_waiting_past_the_deadline_raises_timeout_and_a_later_message_still_comes() -> None:
    async def serving(peer: Peer) -> None:
        await asyncio.sleep(0.3)
        peer.send(0x1, b"late")

    async def run() -> bytes | Closed:
        url, _ = await served(serving)
        session = await open_session(url)
        with pytest.raises(TimeoutError):
            await session.next_message(0.05)
        late = await session.next_message(BOUND_S)
        await session.close()
        return late

    assert played(run(), _opened) == b"late"


def test_each_wait_keeps_its_own_deadline_whatever_the_waits_before_it_asked() -> None:
    """The session's one alarm is set by earlier waits: it must neither hold a shorter deadline back, nor end a
    wait that began after it was set, nor end a wait that has no deadline."""

    async def serving(peer: Peer) -> None:
        while True:
            opcode, asked = await peer.frame()
            if opcode != 0x1:
                return
            if asked != b"never":
                await asyncio.sleep(float(asked))
                peer.send(0x1, asked)

    async def run() -> list[object]:
        url, _ = await served(serving)
        session = await open_session(url)

        async def answer(delay: str, deadline_s: float | None) -> object:
            session.send_text(delay.encode())
            try:
                return await session.next_message(deadline_s)
            except TimeoutError:
                return "timed out"

        loop = asyncio.get_running_loop()
        seen: list[object] = [await answer("0", 30)]
        began = loop.time()
        seen += [await answer("never", 0.2), loop.time() - began < 2]
        seen += [await answer("0", 0.3), await answer("0.6", None)]
        seen += [await answer("0.6", 1.0), await answer("0.6", 1.0)]
        await session.close()
        return seen

    assert played(run(), _opened) == [b"0", "timed out", True, b"0", b"0.6", b"0.6", b"0.6"]


def test_with_the_proxy_opted_in_a_session_is_tunnelled_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(chat_core._net.PROXY_FROM_ENV, "1")
    for name in ("http_proxy", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    for cached in (chat_core._net.proxy_from_env, chat_core._http._environment_proxies):
        cached.cache_clear()

    async def echoes(peer: Peer) -> None:
        opcode, payload = await peer.frame()
        peer.send(opcode, payload)

    async def run() -> tuple[list[str], bytes | Closed, str]:
        proxy = await started_proxy(port)
        _opened.append(proxy)
        url, _ = await served(echoes)
        session = await open_session(url)
        session.send_text(b"through")
        echoed = await session.next_message(BOUND_S)
        await session.close()
        return proxy.asked, echoed, url

    try:
        asked, echoed, url = played(run(), _opened)
    finally:
        chat_core._net.proxy_from_env.cache_clear()
        chat_core._http._environment_proxies.cache_clear()

    assert echoed == b"through"
    assert [head.split("\r\n")[0] for head in asked] == [f"CONNECT {url.split('/')[2]} HTTP/1.1"]
