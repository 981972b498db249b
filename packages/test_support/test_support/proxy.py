"""An HTTP proxy for the client tests, in the test's own event loop: an absolute-form request is passed on to its
origin in origin form, and ``CONNECT`` opens a tunnel, as a corporate proxy does. It keeps the head of what it
was asked, so a test can tell that a connection went through it and with which credentials."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


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
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        proxy.asked.append(head)
        method, target, _ = head.split("\r\n")[0].split(" ")
        authority = target if method == "CONNECT" else target.removeprefix("http://").split("/", 1)[0]
        to_reader, to_writer = await asyncio.open_connection("127.0.0.1", int(authority.rsplit(":", 1)[1]))
        proxy._writers.append(to_writer)
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            to_writer.write(head.replace(target, target.removeprefix(f"http://{authority}"), 1).encode("latin-1"))
        await asyncio.gather(relay(reader, to_writer), relay(to_reader, writer))

    proxy._server = await asyncio.start_server(connected, "127.0.0.1", port)
    return proxy
