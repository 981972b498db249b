"""What chat_core's connections take from the process's environment: the TLS certificates to trust, and whether
they take the environment's proxy.

Connections go direct unless ``CHAT_CORE_PROXY_FROM_ENV=1``: then each library takes its proxy from the environment
itself, aiohttp for HTTP requests (its session's ``trust_env``: ``HTTP_PROXY``, ``HTTPS_PROXY``, ``NO_PROXY``,
credentials in the proxy's URL or ``~/.netrc``) and websockets for env sessions (``connect``'s ``proxy=True``: the
same variables, ``HTTPS_PROXY`` first). chat_core takes http:// proxies only, through which an https endpoint and
every env session are tunnelled with ``CONNECT``; any other is refused before the first request."""

from __future__ import annotations

import functools
import os
import ssl
import urllib.request
from urllib.parse import urlsplit

PROXY_FROM_ENV = "CHAT_CORE_PROXY_FROM_ENV"
_PROXIED_SCHEMES = ("http", "https", "ws", "wss", "socks")
"""The schemes whose proxy one of the two libraries takes from the environment."""


@functools.cache
def proxy_from_env() -> bool:
    """Whether connections take their proxy from the environment: ``CHAT_CORE_PROXY_FROM_ENV=1``, read once."""
    return os.environ.get(PROXY_FROM_ENV) == "1"


@functools.cache
def check_proxies() -> None:
    """Raise ValueError when connections take the environment's proxy and it names one that isn't an http:// URL,
    which neither library would tunnel through as chat_core expects. Read once per process."""
    if not proxy_from_env():
        return
    proxies = urllib.request.getproxies()
    for scheme in _PROXIED_SCHEMES:
        proxy = proxies.get(scheme)
        if proxy is not None and (urlsplit(proxy).scheme != "http" or not urlsplit(proxy).hostname):
            raise ValueError(
                f"the environment names the proxy {proxy!r} for {scheme}:// URLs, which isn't an http:// URL, the "
                "one kind chat_core takes: write it as http://HOST:PORT"
            )


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The system's trusted certificates (``SSL_CERT_FILE`` names others), loaded once per process, checking each
    server's certificate and host name."""
    return ssl.create_default_context()
