"""What chat_core's connections take from the process's environment, read once per process: the TLS certificates
to trust, and the proxy, when ``CHAT_CORE_PROXY_FROM_ENV=1`` opts in.

Connections go direct unless ``CHAT_CORE_PROXY_FROM_ENV=1``: then they take their proxy from ``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY``, read once per process, because looking it up scans the whole
environment, which costs a connection more than the rest of it. Only http:// proxies are taken: an https endpoint
and every env session are tunnelled through them with ``CONNECT``."""

from __future__ import annotations

import base64
import functools
import os
import ssl
import urllib.request
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

PROXY_FROM_ENV = "CHAT_CORE_PROXY_FROM_ENV"


@functools.cache
def proxy_from_env() -> bool:
    """Whether connections take their proxy from the environment: ``CHAT_CORE_PROXY_FROM_ENV=1``, read once."""
    return os.environ.get(PROXY_FROM_ENV) == "1"


@dataclass(frozen=True)
class Proxy:
    """An http:// proxy: its URL as the environment names it (credentials included), the URL without credentials,
    and the header its credentials go in."""

    url: str
    address: str
    headers: dict[str, str]


def proxy_for(scheme: str, host: str) -> Proxy | None:
    """The proxy connections to ``host`` over ``scheme`` (http, https; ws and wss take http's and https') go
    through: the one the environment names when ``CHAT_CORE_PROXY_FROM_ENV=1`` and ``NO_PROXY`` doesn't leave
    ``host`` out, else None. Raises ValueError when that proxy isn't an http:// URL."""
    if not proxy_from_env():
        return None
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    proxies = _environment_proxies()
    url = proxies.get(scheme) or proxies.get("all")
    if not url or urllib.request.proxy_bypass_environment(host, proxies):
        return None
    url = url if "://" in url else f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the proxy {url!r} for {scheme}:// URLs isn't an http:// URL, the one kind chat_core takes")
    headers = {}
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials).decode()
    address = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return Proxy(url, address, headers)


@functools.cache
def _environment_proxies() -> dict[str, str]:
    return urllib.request.getproxies_environment()


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The system's trusted certificates (``SSL_CERT_FILE`` names others), loaded once per process, checking each
    server's certificate and host name."""
    return ssl.create_default_context()
