"""An HTTP proxy for the client tests, in the test's own event loop: an absolute-form request is passed on to its
origin in origin form, and ``CONNECT`` opens a tunnel, as a corporate proxy does. It keeps the head of what it
was asked, so a test can tell that a connection went through it and with which credentials. h11 reads the request
head and writes the heads it sends on; what follows a head is relayed as it comes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11


@dataclass
class Proxy:
    """A running proxy: its port, and the heads it was asked, each as it came."""

    port: int
    asked: list[str] = field(default_factory=list)
    _server: asyncio.Server | None = None
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def close(self) -> None:
        """Stop listening and close every connection it relays."""
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def started_proxy(port: int) -> Proxy:
    """A proxy listening on 127.0.0.1 at ``port``, relaying to origins on 127.0.0.1."""
    proxy = Proxy(port)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        proxy._writers.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        proxy.asked.append(head.decode("latin-1"))
        asked = h11.Connection(h11.SERVER)
        asked.receive_data(head)
        request = asked.next_event()
        tunnel = request.method == b"CONNECT"
        target = urlsplit(b"//" + request.target if tunnel else request.target)
        to_reader, to_writer = await asyncio.open_connection("127.0.0.1", target.port)
        proxy._writers.append(to_writer)
        if tunnel:
            writer.write(asked.send(h11.Response(status_code=200, headers=[], reason=b"Connection established")))
        else:
            in_origin_form = target.path + (b"?" + target.query if target.query else b"")
            sent = h11.Request(method=request.method, target=in_origin_form, headers=request.headers.raw_items())
            to_writer.write(h11.Connection(h11.CLIENT).send(sent))
        await asyncio.gather(relay(reader, to_writer), relay(to_reader, writer))

    proxy._server = await asyncio.start_server(connected, "127.0.0.1", port)
    return proxy
