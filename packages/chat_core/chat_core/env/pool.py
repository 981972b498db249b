"""A pool of env servers serving one bundle, and the routing of episodes over them.

A launch names the pool (``play``'s ``env_servers``, else the environment variable ``TRAINER_HELPERS_ENV_SERVERS``);
its rows are then played on the pool instead of the server each row was prepared from. Before a server gets its
first episode it is checked to serve the rows' env with the same task ids per split as the others; a server that
doesn't is a ``ServerMismatch`` for every later episode, since the launch names the wrong server (the check is
``chat_core.env.bundle``'s).

Routing: each episode starts on the server with the fewest episodes in flight from this process, within the session
limit a server's ``CAPACITY_REACHED`` refusal told. A full server is skipped for another; one that can't be reached,
or drops the session before the episode has started, is left out for a while (``REST``: about a second, doubling
with each failure in a row), and tried again when its rest is over; both are logged. Once an episode has started
it stays on its server: a server dying mid-episode ends that episode flagged. The pool's state lives in the process,
shared by every episode that names the same servers."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from chat_core.env.bundle import Catalogue, Served, served_by
from chat_core.env.protocol import Observation
from chat_core.env.session import CapacityWait, EpisodeSession
from chat_core.episode_ref import EpisodeRef, server_url
from chat_core.errors import CapacityExhausted, ServerMismatch, ServerUnreachable, SessionDropped
from chat_core.limits import Limits
from chat_core.retry import Backoff

logger = logging.getLogger(__name__)
ENV_SERVERS_VARIABLE = "TRAINER_HELPERS_ENV_SERVERS"
"""The environment variable naming a launch's pool of env servers when the launch itself names none."""
REST = Backoff(first_s=1.0, max_s=30.0)
"""How long a failing server is left out: a second or so after its first failure, twice as long after each further
failure in a row, up to half a minute."""
_FULL_PAUSE_S = 0.25
_POLL_S = 0.05


def named_pool(named: Sequence[str]) -> tuple[str, ...]:
    """The pool a launch names: ``named`` (the launch's own setting) when it names any server, else the
    comma-separated URLs of ``TRAINER_HELPERS_ENV_SERVERS``, else none, and each row plays on its own server. Raises
    InvalidServerUrl when a URL isn't an absolute http(s) URL, and ValueError when ``named`` is one string."""
    if isinstance(named, str):
        raise ValueError(f"env_servers is a list of server URLs, not the one string {named!r}")
    if named:
        return tuple(server_url(url) for url in named)
    listed = os.environ.get(ENV_SERVERS_VARIABLE, "")
    return tuple(server_url(url) for url in listed.split(",") if url.strip())


@dataclass
class _Server:
    """What the pool knows of one server: its task ids once checked, the episodes this process plays on it, the
    session limit it told, and until when it is skipped (full, or rested after failing)."""

    url: str
    catalogue: Catalogue | None = None
    in_flight: int = 0
    max_sessions: int | None = None
    full_until: float = 0.0
    rested_until: float = 0.0
    failures: int = 0
    failure: str | None = None
    chosen: int = 0

    def has_room(self, now: float) -> bool:
        return (
            self.catalogue is not None
            and self.rested_until <= now
            and self.full_until <= now
            and (self.max_sessions is None or self.in_flight < self.max_sessions)
        )

    def failed(self, why: str, now: float) -> None:
        rest = REST.wait(self.failures)
        self.failures += 1
        self.rested_until = now + rest
        self.failure = why
        logger.warning("[chat_core] env server %s left out of the pool for %.1f s: %s", self.url, rest, why)

    def answered(self) -> None:
        if self.failures:
            logger.info("[chat_core] env server %s is back in the pool", self.url)
        self.failures, self.failure = 0, None


class EnvPool:
    """The servers of one pool and what the process knows of each. ``EnvPool.of(urls)`` is the process's one pool
    of those servers; ``session(...)`` gives an episode's session on it."""

    _pools: ClassVar[dict[tuple[str, ...], EnvPool]] = {}

    def __init__(self, urls: tuple[str, ...]):
        self._servers = [_Server(url) for url in urls]
        self._refusal: ServerMismatch | None = None
        self._reference: Served | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock: asyncio.Lock | None = None
        self._picks = 0

    @classmethod
    def of(cls, urls: tuple[str, ...]) -> EnvPool:
        if urls not in cls._pools:
            cls._pools[urls] = cls(urls)
        return cls._pools[urls]

    def in_flight(self) -> dict[str, int]:
        """How many episodes this process plays on each server now."""
        return {server.url: server.in_flight for server in self._servers}

    async def check(self, episode: EpisodeRef) -> None:
        """Check the servers not checked yet that aren't resting, then ``episode``'s row against the pool. Raises
        ServerMismatch when a server serves another env, other splits or other task ids than the pool's first
        checked one (then at every later call too), or doesn't serve the row's task at the row's place."""
        await self._check_due()
        reference = self._reference
        if reference is None:
            return
        if reference.env_name != episode.env_name:
            raise ServerMismatch(
                f"the env servers {', '.join(self._urls())} serve env {reference.env_name!r}, but the row is of env "
                f"{episode.env_name!r}: name this env's servers to the launch"
            )
        served = reference.catalogue.get(episode.split, ())
        task = served[episode.index] if episode.index < len(served) else None
        if task != episode.task_id:
            raise ServerMismatch(
                f"{reference.url} serves {task!r} as task #{episode.index} of split {episode.split!r}, but the row is "
                f"for {episode.task_id!r}: prepare the rows again from the pool's bundle"
            )

    async def _check_due(self) -> None:
        """Check the servers not checked yet whose rest is over; raises the pool's ServerMismatch if it has one."""
        if self._refusal is None:
            async with self._lock():
                now = time.monotonic()
                due = [s for s in self._servers if s.catalogue is None and s.rested_until <= now]
                for server, served in zip(due, await asyncio.gather(*map(self._served_by, due)), strict=True):
                    if served is not None:
                        self._admit(server, served)
        if self._refusal is not None:
            raise self._refusal

    def session(self, limits: Limits) -> PooledSession:
        """An episode's session on the pool, waiting for a free session and bounding its calls as ``limits`` says."""
        return PooledSession(self, limits)

    async def _served_by(self, server: _Server) -> Served | None:
        """What ``server`` serves, or None when it can't be reached (it is rested) or can't serve the pool (the
        pool's refusal)."""
        try:
            return await served_by(server.url)
        except ServerUnreachable as e:
            server.failed(str(e), time.monotonic())
        except ServerMismatch as e:
            self._refusal = self._refusal or e
        return None

    def _admit(self, server: _Server, served: Served) -> None:
        """Take ``server`` into the routing when it serves what the pool's first checked server does."""
        if self._reference is None:
            self._reference = served
        elif mismatch := served.mismatch(self._reference):
            self._refusal = self._refusal or mismatch
            return
        server.catalogue = served.catalogue
        server.answered()

    def _pick(self, now: float) -> _Server | None:
        """The server with room that has the fewest episodes in flight, the least recently chosen of those."""
        open_ = [server for server in self._servers if server.has_room(now)]
        if not open_:
            return None
        chosen = min(open_, key=lambda server: (server.in_flight, server.chosen))
        self._picks += 1
        chosen.chosen = self._picks
        return chosen

    def _all_failing(self, now: float) -> bool:
        return all(server.rested_until > now for server in self._servers)

    def _failures(self) -> str:
        return "; ".join(f"{server.url}: {server.failure}" for server in self._servers)

    def _urls(self) -> list[str]:
        return [server.url for server in self._servers]

    def _lock(self) -> asyncio.Lock:
        """The lock that lets one episode at a time check servers, made anew for each event loop that asks."""
        loop = asyncio.get_running_loop()
        if self._lock_loop is not loop or self._loop_lock is None:
            self._lock_loop, self._loop_lock = loop, asyncio.Lock()
        return self._loop_lock


class PooledSession:
    """An episode's session on whichever server of ``pool`` has room when ``reset`` is called, and on that server
    until ``close``: the calls of ``EpisodeSession``, with ``url`` the server's once the episode has started."""

    def __init__(self, pool: EnvPool, limits: Limits):
        self._pool = pool
        self._capacity_wait_s = limits.capacity_wait_s
        self._limits = limits
        self._server: _Server | None = None
        self._session: EpisodeSession | None = None
        self.url: str | None = None
        self.capacity_wait_s = 0.0

    async def reset(self, split: str, index: int) -> Observation:
        """Start task ``index`` of ``split`` on the server with room and the fewest episodes in flight, skipping
        full and failing servers (unreachable, or dropping the session before the episode starts) for others. Waits
        up to ``capacity_wait_s`` while every server is full, then raises CapacityExhausted; raises
        ServerUnreachable at once when every server is resting after failing, ServerMismatch when a server checked
        meanwhile serves something else, and otherwise as ``EpisodeSession.reset`` does."""
        began = time.monotonic()
        while True:
            now = time.monotonic()
            server = self._pool._pick(now)
            if server is None:
                if self._pool._all_failing(now):
                    raise ServerUnreachable(f"no env server of the pool can be reached: {self._pool._failures()}")
                if now - began >= self._capacity_wait_s:
                    self.capacity_wait_s = now - began
                    raise CapacityExhausted(_full_message(self._pool, now - began), None)
                await asyncio.sleep(min(_POLL_S, self._capacity_wait_s - (now - began)))
                await self._pool._check_due()
                continue
            session = EpisodeSession(
                server.url,
                capacity_wait=CapacityWait(total_s=0),
                call_deadline_s=self._limits.env_call_deadline_s,
                max_message_bytes=self._limits.max_env_message_bytes,
            )
            server.in_flight += 1
            try:
                started = await session.reset(split, index)
            except CapacityExhausted as e:
                server.max_sessions = e.max_sessions
                server.full_until = time.monotonic() + _FULL_PAUSE_S
            except (ServerUnreachable, SessionDropped) as e:
                server.failed(str(e), time.monotonic())
            except BaseException:
                server.in_flight -= 1
                await session.close()
                raise
            else:
                server.answered()
                self._server, self._session, self.url = server, session, server.url
                self.capacity_wait_s = now - began
                return started
            server.in_flight -= 1
            await session.close()

    async def list_tools(self) -> Observation:
        return await self._started().list_tools()

    async def call_tool(self, name: str, arguments: Mapping[str, Any]) -> Observation:
        return await self._started().call_tool(name, arguments)

    async def close(self) -> None:
        """End the session and free its place on its server. Safe to call at any time and more than once."""
        session, server = self._session, self._server
        self._session = self._server = None
        if server is not None:
            server.in_flight -= 1
        if session is not None:
            await session.close()

    def _started(self) -> EpisodeSession:
        if self._session is None:
            raise RuntimeError("the pooled session has no episode: call reset first, and not after close")
        return self._session


def _full_message(pool: EnvPool, waited: float) -> str:
    limits = ", ".join(
        f"{server.url} ({server.max_sessions if server.max_sessions is not None else '?'} sessions)"
        for server in pool._servers
    )
    return (
        f"every env server of the pool stayed full for {waited:.1f} s: {limits}; run fewer episodes at once, wait "
        "longer, or serve more replicas"
    )
