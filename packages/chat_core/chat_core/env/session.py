"""One episode on an OpenEnv server of agentenv tasks, per WebSocket session (``EpisodeSession``; ``ProbeSession``
for ``prepare``'s probes): the episode's calls (reset, list_tools, call_tool) and their answers read as
``chat_core.env.protocol``'s observations, a full server waited out before the episode starts, and the session
parked or closed at the end (its connection is ``chat_core.env.connection``'s).

Every way the server can fail a caller is one of ``chat_core.errors``, so a caller can tell a server that isn't
there from one that is full or one that answered outside the protocol."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from chat_core._wire import encoded
from chat_core.env.connection import SessionConnection
from chat_core.env.protocol import CapacityRefusal, Observation
from chat_core.episode_ref import server_url
from chat_core.errors import CapacityExhausted, EpisodeProtocolError
from chat_core.limits import Limits
from chat_core.retry import Backoff

logger = logging.getLogger(__name__)
_DEFAULT_MESSAGE_BYTES = Limits.max_env_message_bytes


CAPACITY_BACKOFF = Backoff(first_s=0.25, max_s=8.0)
"""How often a full server is asked again for a free session."""


@dataclass(frozen=True)
class CapacityWait:
    """How long a new session waits for a free one when the server is full: up to ``total_s`` in all, asking again
    as ``CAPACITY_BACKOFF`` says."""

    total_s: float = Limits.capacity_wait_s

    def __post_init__(self) -> None:
        if self.total_s < 0:
            raise ValueError(f"{self} can't bound a wait: give total_s >= 0")


class EpisodeSession:
    """One WebSocket session on the server at ``url``, playing one episode: ``reset`` starts it, ``list_tools`` and
    ``call_tool`` play it, and ``close`` ends the session, which abandons the episode if it is still open (the
    server tears it down and runs none of its verifiers). Use it with ``async with`` so the session always closes.
    Not safe for concurrent use: each call waits for its answer before the next is sent.

    The connection under it may have played an episode before: ``reset`` starts on a session the event loop has
    parked on the same server when it has one, and ``close`` parks the session for the next episode once the server
    has ended this one (``done``) and nothing is left unread on it (``chat_core.net.parking``). A session whose
    episode is still open, whose last call failed or went unanswered, or on which the server sent more than it was
    asked, is closed instead, so nothing of one episode is ever carried into another. ``reset``'s answer must be for
    the task it asked for.

    ``capacity_wait_s`` is how long ``reset`` waited for a free session, and ``max_sessions`` the server's limit on
    sessions when a refusal told it. ``call_deadline_s`` bounds each call's wait for its answer (each of reset's
    attempts counts as one call); past it the call raises EnvCallTimeout, after which only ``close`` is of use.
    ``max_message_bytes`` bounds each message the server sends."""

    def __init__(
        self,
        url: str,
        *,
        capacity_wait: CapacityWait | None = None,
        call_deadline_s: float | None = None,
        max_message_bytes: int = _DEFAULT_MESSAGE_BYTES,
    ):
        """Raises InvalidServerUrl when ``url`` isn't an absolute http(s) URL. Nothing is connected until
        ``reset``."""
        self.url = server_url(url)
        self._capacity_wait = capacity_wait or CapacityWait()
        self._call_deadline_s = call_deadline_s
        self._connection = SessionConnection(
            self.url, call_deadline_s=call_deadline_s, max_message_bytes=max_message_bytes
        )
        self._started = False
        self._closed = False
        self._ended = False
        self.capacity_wait_s = 0.0
        self.max_sessions: int | None = None

    async def __aenter__(self) -> EpisodeSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def reset(self, split: str, index: int) -> Observation:
        """Start task ``index`` of ``split``: the first turn's prompts in ``metadata``, or, when the server couldn't
        start it, an observation that is ``done`` with its ``error``. While the server is at capacity it asks again for
        up to ``capacity_wait``, then raises CapacityExhausted; the time spent is added to ``capacity_wait_s``.
        Raises ServerUnreachable when the server can't be reached, EpisodeProtocolError when it answers outside the
        protocol (an answer for another task among them), EnvCallTimeout when an attempt goes unanswered past
        ``call_deadline_s``, and RuntimeError when the session has already reset or closed: a session plays one
        episode."""
        if self._started or self._closed:
            raise RuntimeError("this session has already played an episode; open a new EpisodeSession for another")
        self._started = True
        self._ended = False
        message = encoded({"type": "reset", "data": {"split": split, "index": index}})
        began = time.monotonic()
        attempt = 0
        while True:
            tried = time.monotonic()
            try:
                async with asyncio.timeout(self._call_deadline_s):
                    frame = await self._connection.start(message)
            except TimeoutError:
                raise self._connection.timed_out("reset") from None
            refusal = CapacityRefusal.of(frame)
            if refusal is None:
                if attempt:
                    self.capacity_wait_s += tried - began
                    logger.info("[chat_core] %s had a free session after %.1f s", self.url, tried - began)
                return self._started_observation(frame, split, index)
            await self._connection.close()
            self.max_sessions = refusal.max_sessions
            waited = time.monotonic() - began
            if waited >= self._capacity_wait.total_s:
                self.capacity_wait_s += waited
                raise CapacityExhausted(_capacity_message(self.url, refusal.max_sessions, waited), self.max_sessions)
            if not attempt:
                logger.info(
                    "[chat_core] %s is full (%s sessions); waiting up to %g s for a free one",
                    self.url,
                    refusal.max_sessions if refusal.max_sessions is not None else "all its",
                    self._capacity_wait.total_s,
                )
            pause = min(CAPACITY_BACKOFF.wait(attempt), self._capacity_wait.total_s - waited)
            attempt += 1
            await asyncio.sleep(pause)

    async def list_tools(self) -> Observation:
        """The tools of the current turn in ``tools``, or an observation that is ``done`` when the episode can't go
        on. Raises EpisodeProtocolError and EnvCallTimeout as ``reset`` does, and RuntimeError before ``reset`` or
        after ``close``."""
        return await self._exchange(encoded({"type": "step", "data": {"type": "list_tools"}}), "list_tools")

    async def call_tool(self, name: str, arguments: Mapping[str, Any]) -> Observation:
        """Call the turn's tool ``name``: its answer in ``body["result"]``, or its failure in ``body["error"]``
        (the episode goes on). Calling ``end_turn`` with ``{"response": reply}`` hands the turn back: the next
        turn's prompts in ``body["result"]``, or ``done`` with the reward once the last turn ends. Raises TypeError
        when ``arguments`` isn't a mapping (the server would refuse it), EpisodeProtocolError and EnvCallTimeout as
        ``reset`` does, and RuntimeError before ``reset`` or after ``close``."""
        if not isinstance(arguments, Mapping):
            raise TypeError(f"tool arguments must be a JSON object, not {type(arguments).__name__}")
        data = {"type": "call_tool", "tool_name": name, "arguments": dict(arguments)}
        return await self._exchange(encoded({"type": "step", "data": data}), f"call_tool {name!r}")

    async def close(self) -> None:
        """End the session: park it when the server has ended its episode and nothing is unread, else close it,
        which abandons an episode still open. Safe to call at any time, more than once, and while being cancelled:
        the connection is dropped even when the closing handshake can't finish."""
        self._closed = True
        await self._connection.park_or_close(episode_ended=self._ended)

    async def _exchange(self, message: bytes, what: str) -> Observation:
        """Send ``message`` and read the server's answer to it as an observation."""
        self._ended = False
        return self._observation(await self._connection.exchange(message, what), what)

    def _started_observation(self, frame: dict[str, Any], split: str, index: int) -> Observation:
        """The observation a reset's answer holds, checked to be for task ``index`` of ``split`` where it names the
        task's place (agent-env's server does)."""
        observation = self._observation(frame, "reset")
        task = observation.task or {}
        if "split" in task and "index" in task and (task["split"], task["index"]) != (split, index):
            raise EpisodeProtocolError(
                f"the answer to the reset of task #{index} of split {split!r} is for task #{task.get('index')} of "
                f"split {task.get('split')!r}: it isn't this reset's answer; the session was closed"
            )
        return observation

    def _observation(self, frame: dict[str, Any], what: str) -> Observation:
        observation = Observation.of(frame, what)
        self._ended = observation.done
        return observation


class ProbeSession(EpisodeSession):
    """A session that starts tasks one after another on one connection, for what each one's first turn offers, and
    plays none. Each ``reset`` after the first abandons the episode before it: the server tears it down and runs
    none of its verifiers, as when a session closes, so a probe costs no connection of its own. ``close`` abandons
    the last one."""

    async def reset(self, split: str, index: int) -> Observation:
        """Start task ``index`` of ``split``, abandoning the task started before it; raises as
        ``EpisodeSession.reset`` does, except that a session may reset again until it closes."""
        if not self._connection.connected or self._closed:
            return await super().reset(split, index)
        self._ended = False
        message = encoded({"type": "reset", "data": {"split": split, "index": index}})
        return self._started_observation(await self._connection.exchange(message, "reset"), split, index)


def _capacity_message(url: str, limit: int | None, waited: float) -> str:
    held = f"all {limit} of its sessions" if limit is not None else "all its sessions"
    return (
        f"{url} kept {held} taken for {waited:.1f} s: run fewer episodes at once, wait longer, or serve "
        "with a higher max_concurrent_envs"
    )
