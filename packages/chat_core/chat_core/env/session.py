"""A client for an OpenEnv server of agentenv tasks: its Task API over HTTP (``OpenEnvServer``), and one episode per
WebSocket session (``EpisodeSession``; ``ProbeSession`` for ``prepare``'s probes).

It speaks only the wire (JSON over HTTP and ``/ws``, read into ``chat_core.env.protocol``'s types), so it runs in a
trainer's environment without the server's packages. Every way the server can fail a caller is one of
``chat_core.env.errors``, so a caller can tell a server that isn't there from one that is full or one that answered
outside the protocol."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chat_core._wire import described, encoded, excerpt, parse_json, wire_text
from chat_core.env.errors import (
    CapacityExhausted,
    EnvCallTimeout,
    EpisodeProtocolError,
    NotAnOpenEnvServer,
    ServerError,
    ServerUnreachable,
    SessionDropped,
)
from chat_core.env.protocol import CapacityRefusal, Observation, TaskInfo, server_url
from chat_core.limits import MIB, Limits
from chat_core.net.env_socket import EnvSocket, HandshakeRefused, SessionEnded, Unreachable, open_session
from chat_core.net.http_request import HttpError, MalformedAnswer, check_url, request
from chat_core.net.parking import park, unpark
from chat_core.retry import Backoff

logger = logging.getLogger(__name__)
_TASK_API_TIMEOUT_S = 60.0
MAX_TASK_API_ANSWER_BYTES = 64 * MIB
"""The longest Task API answer read: a split's task list holds every task's prompts."""
_DEFAULT_MESSAGE_BYTES = Limits.max_env_message_bytes


@dataclass(frozen=True)
class CapacityWait:
    """How long a new session waits for a free one when the server is full: up to ``total_s`` in all, retrying as
    ``backoff`` says."""

    total_s: float = 600.0
    backoff: Backoff = field(default_factory=lambda: Backoff(first_s=0.25, max_s=8.0))

    def __post_init__(self) -> None:
        if self.total_s < 0:
            raise ValueError(f"{self} can't bound a wait: give total_s >= 0")


class OpenEnvServer:
    """The Task API of the OpenEnv server at ``url``: its env's name, splits and tasks, asked over the event loop's
    HTTP client session (``chat_core.net.http_request``), each request bounded by ``timeout_s`` and each answer's
    body by ``max_answer_bytes``. Every method raises ServerUnreachable when nothing answers, NotAnOpenEnvServer
    when what answers isn't an OpenEnv server (an answer past the limit among them), and ServerError when the server
    refuses or fails the request."""

    def __init__(
        self, url: str, *, timeout_s: float = _TASK_API_TIMEOUT_S, max_answer_bytes: int = MAX_TASK_API_ANSWER_BYTES
    ):
        """Raises InvalidServerUrl when ``url`` isn't an absolute http(s) URL."""
        self.url = server_url(url)
        self._timeout_s = timeout_s
        self._max_answer_bytes = max_answer_bytes
        self._env_name: str | None = None

    async def env_name(self) -> str:
        """The name of the one env the server serves (``GET /list_environments``)."""
        if self._env_name is None:
            names = await self._json("GET", "/list_environments", what="its environments")
            if not (isinstance(names, list) and len(names) == 1 and isinstance(names[0], str) and names[0]):
                raise NotAnOpenEnvServer(
                    f"{self.url} answered GET /list_environments with {excerpt(names)}, not "
                    "the one env name an agentenv OpenEnv server serves"
                )
            self._env_name = names[0]
        return self._env_name

    async def splits(self) -> list[str]:
        """The names of the server's splits, in the server's order."""
        answer = await self._json("GET", f"/{await self.env_name()}/splits", what="its splits")
        if not isinstance(answer, list) or not all(
            isinstance(each, dict) and isinstance(each.get("name"), str) for each in answer
        ):
            raise NotAnOpenEnvServer(f"{self.url} listed its splits as {excerpt(answer)}")
        return [each["name"] for each in answer]

    async def tasks(self, split: str) -> list[TaskInfo]:
        """Every task of ``split``, by index; ServerError (400) when the server has no such split."""
        answer = await self._json(
            "POST", f"/{await self.env_name()}/tasks", {"split": split}, what=f"the tasks of split {split!r}"
        )
        listed = answer.get("tasks") if isinstance(answer, dict) else None
        if not isinstance(listed, list):
            raise NotAnOpenEnvServer(f"{self.url} listed the tasks of split {split!r} as {excerpt(answer)}")
        tasks = [TaskInfo.of(split, each) for each in listed]
        if [task.index for task in tasks] != list(range(len(tasks))):
            raise NotAnOpenEnvServer(f"{self.url} listed the tasks of split {split!r} out of index order")
        return tasks

    async def _json(self, method: str, path: str, body: dict[str, Any] | None = None, *, what: str) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        url = self.url + path
        try:
            check_url(url, headers)
            async with asyncio.timeout(self._timeout_s):
                answer = await request(
                    method,
                    url,
                    headers,
                    None if body is None else encoded(body),
                    max_body_bytes=self._max_answer_bytes,
                    limit_name="max_answer_bytes",
                )
        except TimeoutError:
            raise ServerUnreachable(
                f"{self.url} didn't answer within {self._timeout_s:g} s when asked for {what}"
            ) from None
        except MalformedAnswer as e:
            raise NotAnOpenEnvServer(f"{self.url} {method} {path} for {what}: {e}") from None
        except (HttpError, ValueError) as e:
            raise ServerUnreachable(f"can't reach {self.url} to ask for {what}: {described(e)}") from None
        status, raw = answer.status, answer.body
        if self._env_name is None and 400 <= status < 500:
            raise NotAnOpenEnvServer(
                f"{self.url} answered {method} {path} with HTTP {status}: it isn't an OpenEnv server"
            )
        if status >= 400:
            raise ServerError(
                f"{self.url} answered {method} {path} for {what} with HTTP {status}: {_detail(raw)}", status
            )
        try:
            return parse_json(raw)
        except ValueError as e:
            raise NotAnOpenEnvServer(
                f"{self.url} answered {method} {path} with something that isn't JSON ({e}): {excerpt(wire_text(raw))}"
            ) from None


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
        self._ws_url = "ws" + self.url.removeprefix("http") + "/ws"
        self._capacity_wait = capacity_wait or CapacityWait()
        self._call_deadline_s = call_deadline_s
        self._max_message_bytes = max_message_bytes
        self._socket: EnvSocket | None = None
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
        start it, an observation that is ``done`` with its ``error``. While the server is at capacity it retries as
        ``capacity_wait`` says, then raises CapacityExhausted; the time spent is added to ``capacity_wait_s``.
        Raises ServerUnreachable when the server can't be reached, EpisodeProtocolError when it answers outside the
        protocol (an answer for another task among them), EnvCallTimeout when an attempt goes unanswered past
        ``call_deadline_s``, and RuntimeError when the session has already reset or closed: a session plays one
        episode."""
        if self._started or self._closed:
            raise RuntimeError("this session has already played an episode; open a new EpisodeSession for another")
        self._started = True
        message = encoded({"type": "reset", "data": {"split": split, "index": index}})
        began = time.monotonic()
        attempt = 0
        while True:
            tried = time.monotonic()
            try:
                async with asyncio.timeout(self._call_deadline_s):
                    frame = await self._start(message)
            except TimeoutError:
                raise self._timed_out("reset") from None
            refusal = CapacityRefusal.of(frame)
            if refusal is None:
                if attempt:
                    self.capacity_wait_s += tried - began
                    logger.info("[chat_core] %s had a free session after %.1f s", self.url, tried - began)
                return self._started_observation(frame, split, index)
            await self._drop_socket()
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
            pause = min(self._capacity_wait.backoff.wait(attempt), self._capacity_wait.total_s - waited)
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
        if self._ended and self._socket is not None and self._socket.idle:
            socket, self._socket = self._socket, None
            await park(self.url, socket)
            return
        await self._drop_socket()

    async def _start(self, message: bytes) -> dict[str, Any]:
        """The first answer to the reset ``message``, on a parked session when one answers it, else on a new one. A
        parked session the server closed, or sent something to, while it waited is closed for the next."""
        while (socket := unpark(self.url)) is not None:
            self._socket = socket
            if socket.idle:
                try:
                    return await self._first_answer(message)
                except SessionDropped:
                    pass
            await self._drop_socket()
        self._socket = await self._connect()
        return await self._first_answer(message)

    async def _connect(self) -> EnvSocket:
        try:
            return await open_session(self._ws_url, max_message_bytes=self._max_message_bytes)
        except HandshakeRefused as e:
            raise NotAnOpenEnvServer(
                f"{self._ws_url} doesn't take WebSocket sessions as an OpenEnv server does: {e}"
            ) from None
        except (Unreachable, ValueError) as e:
            raise ServerUnreachable(f"can't open a session at {self._ws_url}: {e}") from None

    async def _first_answer(self, message: bytes) -> dict[str, Any]:
        """The server's first frame: a full server sends its refusal as soon as the connection opens, possibly
        before the reset is even sent, and then closes, so a failed send is left for the answer to explain."""
        assert self._socket is not None
        self._ended = False
        with contextlib.suppress(SessionEnded):
            await self._socket.send(message)
        return await self._frame("reset", None)

    async def _exchange(self, message: bytes, what: str) -> Observation:
        """Send ``message`` and read the server's answer to it as an observation."""
        return self._observation(await self._answer(message, what), what)

    async def _answer(self, message: bytes, what: str) -> dict[str, Any]:
        """Send ``message`` and read the frame the server answers it with."""
        if self._socket is None:
            raise RuntimeError(f"{what} needs an open episode: call reset first, and not after close")
        self._ended = False
        try:
            await self._socket.send(message)
        except SessionEnded as e:
            raise SessionDropped(f"the session ended before {what} could be sent: {e}") from None
        return await self._frame(what, self._call_deadline_s)

    async def _frame(self, what: str, deadline_s: float | None) -> dict[str, Any]:
        """The server's next message as the frame answering ``what``; raises SessionDropped when the session ended
        instead, EpisodeProtocolError when the message holds no JSON object, and EnvCallTimeout past
        ``deadline_s``."""
        assert self._socket is not None
        try:
            message = await self._socket.receive(deadline_s)
        except TimeoutError:
            raise self._timed_out(what) from None
        except SessionEnded as e:
            raise SessionDropped(f"the session ended while waiting for the answer to {what}: {e}") from None
        try:
            frame = parse_json(message)
        except ValueError as e:
            raise EpisodeProtocolError(f"the answer to {what} isn't JSON ({e}): {excerpt(message)}") from None
        if not isinstance(frame, dict):
            raise EpisodeProtocolError(f"the answer to {what} isn't a frame: {excerpt(frame)}")
        return frame

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

    def _timed_out(self, what: str) -> EnvCallTimeout:
        return EnvCallTimeout(f"{self.url} didn't answer {what} within {self._call_deadline_s:g} s")

    def _observation(self, frame: dict[str, Any], what: str) -> Observation:
        observation = Observation.of(frame, what)
        self._ended = observation.done
        return observation

    async def _drop_socket(self) -> None:
        socket, self._socket = self._socket, None
        if socket is not None:
            await socket.close()


class ProbeSession(EpisodeSession):
    """A session that starts tasks one after another on one connection, for what each one's first turn offers, and
    plays none. Each ``reset`` after the first abandons the episode before it: the server tears it down and runs
    none of its verifiers, as when a session closes, so a probe costs no connection of its own. ``close`` abandons
    the last one."""

    async def reset(self, split: str, index: int) -> Observation:
        """Start task ``index`` of ``split``, abandoning the task started before it; raises as
        ``EpisodeSession.reset`` does, except that a session may reset again until it closes."""
        if self._socket is None or self._closed:
            return await super().reset(split, index)
        frame = await self._answer(encoded({"type": "reset", "data": {"split": split, "index": index}}), "reset")
        return self._started_observation(frame, split, index)


def _capacity_message(url: str, limit: int | None, waited: float) -> str:
    held = f"all {limit} of its sessions" if limit is not None else "all its sessions"
    return (
        f"{url} kept {held} taken for {waited:.1f} s: run fewer episodes at once, wait longer, or serve "
        "with a higher max_concurrent_envs"
    )


def _detail(raw: bytes) -> str:
    try:
        detail = parse_json(raw).get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail else excerpt(wire_text(raw))
