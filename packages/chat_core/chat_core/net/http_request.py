"""chat_core's HTTP requests (chat completions and the env server's Task API), made with aiohttp on the event loop's
one client session (``chat_core.net.http_session``), each answer's body read no further than its caller's limit.

aiohttp parses the answers (its C parser refuses malformed heads, bad chunk framing and over-long lines), undoes a
content coding in bounded steps, keeps connections, speaks TLS and goes through a proxy. What it leaves to the
caller is how much of a body to take: ``request`` reads it as it arrives and stops at ``max_body_bytes``, counted
after decompression, so a huge or endless answer, or a small compressed one that inflates, costs at most that.

A request is sent once. aiohttp sends a POST again on no condition, and neither does this module: a request whose
connection broke after it was written may have reached the endpoint (slime's adapter may have recorded the turn),
so only a connection refused before anything was sent (``ConnectionRefused``) is the caller's to retry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from chat_core._wire import described
from chat_core.net.http_session import MAX_HEAD_LINE_BYTES, MAX_HEADERS, http_session
from chat_core.net.settings import check_proxies, tls_context


class HttpError(Exception):
    """A request that got no whole HTTP answer: no connection, a connection lost midway, an answer that isn't
    HTTP/1.1, or one longer than its limit."""


class ConnectionRefused(HttpError):
    """The endpoint refused the connection, so the request was never sent: worth sending again, since a server that
    is starting or restarting does this for a moment."""


class MalformedAnswer(HttpError):
    """What answered isn't HTTP/1.1: a malformed head or body framing, or a head past the limits of one."""


class AnswerTooLong(MalformedAnswer):
    """The answer's body ran past the caller's limit, or announced it would; it was read no further."""


class Redirected(HttpError):
    """The endpoint answered with a redirect, which chat_core doesn't follow: the request's body and headers, the
    model's key among them, would go wherever the answer points."""


@dataclass(frozen=True)
class Answer:
    """An endpoint's answer: its status, its headers (case-insensitive), and its body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


def check_url(url: str, headers: Mapping[str, str]) -> None:
    """Raise ValueError when requests to ``url`` with ``headers`` can't be sent: ``url`` isn't an absolute http(s)
    URL, holds credentials, a header holds a line break, or a proxy the environment names (when
    ``CHAT_CORE_PROXY_FROM_ENV=1``) isn't an http:// URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the URL {url!r} isn't an absolute http(s) URL")
    if "@" in parts.netloc:
        raise ValueError(f"the URL {url!r} holds credentials; send them in a header instead")
    if any("\r" in text or "\n" in text for pair in headers.items() for text in pair):
        raise ValueError(f"a header for {url} holds a line break")
    check_proxies()


async def request(
    method: str, url: str, headers: Mapping[str, str], body: bytes | None, *, max_body_bytes: int, limit_name: str
) -> Answer:
    """The answer to one ``method`` request to ``url`` carrying ``body`` (None for none), its body read up to
    ``max_body_bytes`` (the limit called ``limit_name`` in the message when it is passed). The caller bounds the
    time. Raises ConnectionRefused when the endpoint refused the connection, Redirected when it answered with a
    redirect (3xx), AnswerTooLong when the body is longer than the limit, MalformedAnswer when what answered isn't
    HTTP/1.1, and HttpError when the request got no whole answer otherwise (its message says why: the certificate, a
    connection lost midway)."""
    session = await http_session()
    try:
        async with session.request(
            method,
            url,
            data=body,
            headers=headers,
            allow_redirects=False,
            ssl=tls_context() if url.startswith("https:") else True,
        ) as response:
            if 300 <= response.status < 400:
                raise Redirected(
                    f"answered HTTP {response.status}, a redirect to {response.headers.get('Location', 'nowhere')}, "
                    "which chat_core doesn't follow: give the URL it points to"
                )
            return Answer(response.status, response.headers, await _body(response, max_body_bytes, limit_name))
    except aiohttp.ClientConnectorError as e:
        if isinstance(e.os_error, ConnectionRefusedError):
            raise ConnectionRefused(f"{e.host}:{e.port} refused the connection") from None
        raise HttpError(f"can't connect to {e.host}:{e.port}: {_one_line(described(e.os_error))}") from None
    except (aiohttp.ClientResponseError, aiohttp.ClientPayloadError) as e:
        why = e.message if isinstance(e, aiohttp.ClientResponseError) else str(e)
        raise MalformedAnswer(
            f"answered with something that isn't HTTP/1.1 (heads are read up to MAX_HEAD_LINE_BYTES="
            f"{MAX_HEAD_LINE_BYTES} a line and MAX_HEADERS={MAX_HEADERS} lines): {_one_line(why)}"
        ) from None
    except aiohttp.ClientError as e:
        raise HttpError(_one_line(described(e))) from None


async def _body(response: aiohttp.ClientResponse, limit: int, limit_name: str) -> bytes:
    """``response``'s body as it arrives, decoded from its content coding; AnswerTooLong as soon as it passes
    ``limit`` bytes, or before any is read when its announced length (``Content-Length``) does."""
    if response.content_length is not None and response.content_length > limit:
        raise AnswerTooLong(
            f"the answer announced a body of {response.content_length} bytes, over {limit_name}={limit}; none of it "
            "was read"
        )
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise AnswerTooLong(f"the answer's body passed {limit_name}={limit} bytes; it was read no further")
    return bytes(body)


def _one_line(text: str) -> str:
    """A library's message on one line, as a flag's or a command's message is read."""
    return " ".join(text.split())
