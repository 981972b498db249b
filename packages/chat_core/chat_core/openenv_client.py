"""A client for an OpenEnv server of agentenv tasks: its Task API over HTTP, and one episode per WebSocket session.

It speaks only the wire (JSON over HTTP and ``/ws``), so it runs in a trainer's environment without the server's
packages. Every way the server can fail a caller is one of ``chat_core.errors``, so a caller can tell a server that
isn't there from one that is full or one that answered outside the protocol."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from chat_core._http import HttpError, Route
from chat_core._net import park, unpark
from chat_core._websocket import Closed, HandshakeRefused, WebSocket, open_session
from chat_core._wire import described, encoded, parse_json, wire_text
from chat_core.errors import (
    CapacityExhausted,
    EnvCallTimeout,
    EpisodeProtocolError,
    InvalidServerUrl,
    NotAnOpenEnvServer,
    ServerError,
    ServerUnreachable,
    SessionDropped,
)

_CAPACITY_REACHED = "CAPACITY_REACHED"
_OPEN_TIMEOUT_S = 30.0
_HTTP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TaskInfo:
    """A task as the Task API describes it: where it is served (``split``, ``index``), what it is (``id``,
    ``name``) and its first turn's prompts."""

    split: str
    index: int
    id: str
    name: str
    prompt: str
    system_prompt: str | None


@dataclass(frozen=True)
class Tool:
    """A tool the env offers in the current turn, as MCP describes it."""

    name: str
    description: str
    input_schema: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The tool as an OpenAI chat-completions function tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.input_schema},
        }


@dataclass(frozen=True)
class Observation:
    """What the server answered a reset or a step with: whether the episode is over and its reward, the step's own
    answer (``body``) and the episode's metadata (prompts, task, scores, or the error that ended it)."""

    done: bool
    reward: float | int | None
    body: dict[str, Any]
    metadata: dict[str, Any]

    @property
    def error(self) -> str | None:
        """The server's account of why the episode ended in an error, or None when it didn't."""
        if self.metadata.get("status") != "error":
            return None
        return str(self.metadata.get("error") or "the server gave no reason")

    @property
    def task(self) -> dict[str, Any] | None:
        return self.metadata.get("task")

    @property
    def tools(self) -> list[Tool]:
        """The tools a ``list_tools`` step answered with; refuses with EpisodeProtocolError when one isn't
        described as MCP describes tools."""
        return [_tool_of(each) for each in self.body.get("tools") or []]


@dataclass(frozen=True)
class CapacityWait:
    """How long a new session waits for a free one when the server is full: retries start after ``first_delay_s``
    and double up to ``max_delay_s``, each shortened or lengthened at random by up to a quarter so waiting clients
    spread out, until ``total_s`` have passed."""

    total_s: float = 600.0
    first_delay_s: float = 0.25
    max_delay_s: float = 8.0

    def __post_init__(self) -> None:
        if self.total_s < 0 or self.first_delay_s <= 0 or self.max_delay_s < self.first_delay_s:
            raise ValueError(f"{self} can't bound a wait: give total_s >= 0 and 0 < first_delay_s <= max_delay_s")


def server_url(url: str) -> str:
    """``url`` as the base every request is made under: an absolute http(s) URL without a trailing slash. Raises
    InvalidServerUrl when it has another scheme, no host, a query or a fragment."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidServerUrl(
            f"{url!r} isn't a server URL: give the server's http(s) address, e.g. http://127.0.0.1:8000"
        )
    if parts.query or parts.fragment:
        raise InvalidServerUrl(f"{url!r} isn't a server URL: it has a query or a fragment")
    try:
        parts.port  # noqa: B018 -- urlsplit checks the port only when it is read
    except ValueError as e:
        raise InvalidServerUrl(f"{url!r} isn't a server URL: {e}") from None
    return url.strip().rstrip("/")


class OpenEnvServer:
    """The Task API of the OpenEnv server at ``url``: its env's name, splits and tasks, asked over the event loop's
    kept connections (``chat_core._http``), each request bounded by ``timeout_s``. Every method raises
    ServerUnreachable when nothing answers, NotAnOpenEnvServer when what answers isn't an OpenEnv server, and
    ServerError when the server refuses or fails the request."""

    def __init__(self, url: str, *, timeout_s: float = _HTTP_TIMEOUT_S):
        """Raises InvalidServerUrl when ``url`` isn't an absolute http(s) URL."""
        self.url = server_url(url)
        self._timeout_s = timeout_s
        self._env_name: str | None = None

    async def env_name(self) -> str:
        """The name of the one env the server serves (``GET /list_environments``)."""
        if self._env_name is None:
            names = await self._json("GET", "/list_environments", what="its environments")
            if not (isinstance(names, list) and len(names) == 1 and isinstance(names[0], str) and names[0]):
                raise NotAnOpenEnvServer(
                    f"{self.url} answered GET /list_environments with {_excerpt(names)}, not "
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
            raise NotAnOpenEnvServer(f"{self.url} listed its splits as {_excerpt(answer)}")
        return [each["name"] for each in answer]

    async def tasks(self, split: str) -> list[TaskInfo]:
        """Every task of ``split``, by index; ServerError (400) when the server has no such split."""
        answer = await self._json(
            "POST", f"/{await self.env_name()}/tasks", {"split": split}, what=f"the tasks of split {split!r}"
        )
        listed = answer.get("tasks") if isinstance(answer, dict) else None
        if not isinstance(listed, list):
            raise NotAnOpenEnvServer(f"{self.url} listed the tasks of split {split!r} as {_excerpt(answer)}")
        tasks = [_task_of(split, each) for each in listed]
        if [task.index for task in tasks] != list(range(len(tasks))):
            raise NotAnOpenEnvServer(f"{self.url} listed the tasks of split {split!r} out of index order")
        return tasks

    async def _json(self, method: str, path: str, body: dict[str, Any] | None = None, *, what: str) -> Any:
        route = Route(method, self.url + path, {} if body is None else {"Content-Type": "application/json"})
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = await route.send(b"" if body is None else encoded(body))
        except TimeoutError as e:
            raise ServerUnreachable(f"{self.url} didn't answer in time when asked for {what}: {described(e)}") from None
        except HttpError as e:
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
                f"{self.url} answered {method} {path} with something that isn't JSON ({e}): {_excerpt(wire_text(raw))}"
            ) from None


class EpisodeSession:
    """One WebSocket session on the server at ``url``, playing one episode: ``reset`` starts it, ``list_tools`` and
    ``call_tool`` play it, and ``close`` ends the session, which abandons the episode if it is still open (the
    server tears it down and runs none of its verifiers). Use it with ``async with`` so the session always closes.
    Not safe for concurrent use: each call waits for its answer before the next may be sent.

    The connection under it may have played an episode before: ``reset`` starts on a session the event loop has
    parked on the same server when it has one, and ``close`` parks the session for the next episode once the server
    has ended this one (``done``; ``chat_core._net``). A session whose episode is still open, or whose last call
    failed or went unanswered, is closed instead, so no episode is ever carried into another.

    ``capacity_wait_s`` is how long ``reset`` waited for a free session, and ``max_sessions`` the server's limit on
    sessions when a refusal told it. ``call_deadline_s`` bounds each call's wait for its answer (each of reset's
    attempts counts as one call); past it the call raises EnvCallTimeout, after which only ``close`` is of use."""

    def __init__(self, url: str, *, capacity_wait: CapacityWait | None = None, call_deadline_s: float | None = None):
        """Raises InvalidServerUrl when ``url`` isn't an absolute http(s) URL. Nothing is connected until
        ``reset``."""
        self.url = server_url(url)
        self._ws_url = "ws" + self.url.removeprefix("http") + "/ws"
        self._capacity_wait = capacity_wait or CapacityWait()
        self._call_deadline_s = call_deadline_s
        self._connection: WebSocket | None = None
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
        protocol, EnvCallTimeout when an attempt goes unanswered past ``call_deadline_s``, and RuntimeError when the
        session has already reset or closed: a session plays one episode."""
        if self._started or self._closed:
            raise RuntimeError("this session has already played an episode; open a new EpisodeSession for another")
        self._started = True
        message = {"type": "reset", "data": {"split": split, "index": index}}
        began = time.monotonic()
        delay = self._capacity_wait.first_delay_s
        refused = False
        while True:
            attempt = time.monotonic()
            try:
                async with asyncio.timeout(self._call_deadline_s):
                    frame = await self._start(message)
            except TimeoutError:
                raise self._timed_out("reset") from None
            if not _is_capacity_refusal(frame):
                if refused:
                    self.capacity_wait_s += attempt - began
                return self._observation(frame, "reset")
            await self._drop_connection()
            refused, self.max_sessions = True, _max_sessions(frame)
            waited = time.monotonic() - began
            if waited >= self._capacity_wait.total_s:
                self.capacity_wait_s += waited
                raise CapacityExhausted(_capacity_message(self.url, frame, waited), self.max_sessions)
            pause = min(delay * random.uniform(0.75, 1.25), self._capacity_wait.total_s - waited)
            await asyncio.sleep(pause)
            delay = min(delay * 2, self._capacity_wait.max_delay_s)

    async def list_tools(self) -> Observation:
        """The tools of the current turn in ``tools``, or an observation that is ``done`` when the episode can't go
        on. Raises EpisodeProtocolError and EnvCallTimeout as ``reset`` does, and RuntimeError before ``reset`` or
        after ``close``."""
        return await self._exchange({"type": "step", "data": {"type": "list_tools"}}, "list_tools")

    async def call_tool(self, name: str, arguments: Mapping[str, Any]) -> Observation:
        """Call the turn's tool ``name``: its answer in ``body["result"]``, or its failure in ``body["error"]``
        (the episode goes on). Calling ``end_turn`` with ``{"response": reply}`` hands the turn back: the next
        turn's prompts in ``body["result"]``, or ``done`` with the reward once the last turn ends. Raises TypeError
        when ``arguments`` isn't a mapping (the server would refuse it), EpisodeProtocolError and EnvCallTimeout as
        ``reset`` does, and RuntimeError before ``reset`` or after ``close``."""
        if not isinstance(arguments, Mapping):
            raise TypeError(f"tool arguments must be a JSON object, not {type(arguments).__name__}")
        data = {"type": "call_tool", "tool_name": name, "arguments": dict(arguments)}
        return await self._exchange({"type": "step", "data": data}, f"call_tool {name!r}")

    async def close(self) -> None:
        """End the session: park it when the server has ended its episode, else close it, which abandons an
        episode still open. Safe to call at any time, more than once, and while being cancelled: the connection is
        dropped even when the closing handshake can't finish."""
        self._closed = True
        if self._ended and self._connection is not None:
            connection, self._connection = self._connection, None
            await park(self.url, connection)
            return
        await self._drop_connection()

    async def _start(self, message: dict[str, Any]) -> dict[str, Any]:
        """The first answer to the reset ``message``, on a parked session when one answers it, else on a new one. A
        parked session can have been closed by the server while it waited; it is dropped for the next."""
        while (connection := unpark(self.url)) is not None:
            self._connection = connection
            try:
                return await self._first_answer(message)
            except SessionDropped:
                await self._drop_connection()
        self._connection = await self._connect()
        return await self._first_answer(message)

    async def _connect(self) -> WebSocket:
        try:
            async with asyncio.timeout(_OPEN_TIMEOUT_S):
                return await open_session(self._ws_url)
        except HandshakeRefused as e:
            raise NotAnOpenEnvServer(
                f"{self._ws_url} doesn't take WebSocket sessions as an OpenEnv server does: {e}"
            ) from None
        except (HttpError, TimeoutError) as e:
            raise ServerUnreachable(f"can't open a session at {self._ws_url}: {described(e)}") from None

    async def _first_answer(self, message: dict[str, Any]) -> dict[str, Any]:
        """The server's first frame: a full server sends its refusal as soon as the connection opens, possibly
        before the reset is even sent, and then closes."""
        assert self._connection is not None
        self._ended = False
        with contextlib.suppress(ConnectionError):
            self._connection.send_text(encoded(message))
        return _frame_of(await self._connection.next_message(None), "reset")

    async def _exchange(self, message: dict[str, Any], what: str) -> Observation:
        """Send ``message`` and read the server's answer to it as an observation."""
        connection = self._connection
        if connection is None:
            raise RuntimeError(f"{what} needs an open episode: call reset first, and not after close")
        self._ended = False
        try:
            connection.send_text(encoded(message))
        except ConnectionError as e:
            raise SessionDropped(f"the session closed before {what} could be sent: {described(e)}") from None
        try:
            answer = await connection.next_message(self._call_deadline_s)
        except TimeoutError:
            raise self._timed_out(what) from None
        return self._observation(_frame_of(answer, what), what)

    def _timed_out(self, what: str) -> EnvCallTimeout:
        return EnvCallTimeout(f"{self.url} didn't answer {what} within {self._call_deadline_s:g} s")

    def _observation(self, frame: dict[str, Any], what: str) -> Observation:
        data = frame.get("data")
        if frame.get("type") == "error":
            detail = data if isinstance(data, dict) else {}
            raise EpisodeProtocolError(
                f"the server refused {what}: {detail.get('code', 'error')}: {detail.get('message', _excerpt(data))}"
            )
        if frame.get("type") != "observation" or not isinstance(data, dict):
            raise EpisodeProtocolError(f"the answer to {what} isn't an observation: {_excerpt(frame)}")
        body = data.get("observation")
        body = body if isinstance(body, dict) else {}
        metadata = data.get("metadata")
        if not isinstance(metadata, dict):
            metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        reward = data.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise EpisodeProtocolError(f"the answer to {what} has a reward that isn't a number: {_excerpt(reward)}")
        observation = Observation(done=bool(data.get("done")), reward=reward, body=body, metadata=metadata)
        self._ended = observation.done
        return observation

    async def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()


class ProbeSession(EpisodeSession):
    """A session that starts tasks one after another on one connection, for what each one's first turn offers, and
    plays none. Each ``reset`` after the first abandons the episode before it: the server tears it down and runs
    none of its verifiers, as when a session closes, so a probe costs no connection of its own (connecting and
    closing were most of a probe's cost). ``close`` abandons the last one."""

    async def reset(self, split: str, index: int) -> Observation:
        """Start task ``index`` of ``split``, abandoning the task started before it; raises as
        ``EpisodeSession.reset`` does, except that a session may reset again until it closes."""
        if self._connection is None or self._closed:
            return await super().reset(split, index)
        return await self._exchange({"type": "reset", "data": {"split": split, "index": index}}, "reset")


def _frame_of(message: bytes | Closed, what: str) -> dict[str, Any]:
    """The frame a WebSocket message holds, as the answer to ``what``; raises SessionDropped when the session
    ended instead, and EpisodeProtocolError when the message holds no JSON object."""
    if isinstance(message, Closed):
        raise SessionDropped(f"the session closed while waiting for the answer to {what}: {message}")
    try:
        frame = parse_json(message)
    except ValueError as e:
        raise EpisodeProtocolError(f"the answer to {what} isn't JSON ({e}): {_excerpt(wire_text(message))}") from None
    if not isinstance(frame, dict):
        raise EpisodeProtocolError(f"the answer to {what} isn't a frame: {_excerpt(frame)}")
    return frame


def _task_of(split: str, described: Any) -> TaskInfo:
    if not isinstance(described, dict):
        raise NotAnOpenEnvServer(f"a task of split {split!r} is described as {_excerpt(described)}")
    index, task_id, name, prompt = (described.get(key) for key in ("index", "id", "name", "prompt"))
    system_prompt = described.get("system_prompt")
    if not (
        isinstance(index, int)
        and isinstance(task_id, str)
        and isinstance(name, str)
        and isinstance(prompt, str)
        and (system_prompt is None or isinstance(system_prompt, str))
    ):
        raise NotAnOpenEnvServer(f"a task of split {split!r} lacks an index, id, name or prompt: {_excerpt(described)}")
    return TaskInfo(split=split, index=index, id=task_id, name=name, prompt=prompt, system_prompt=system_prompt)


def _tool_of(described: Any) -> Tool:
    if not (isinstance(described, dict) and isinstance(described.get("name"), str)):
        raise EpisodeProtocolError(f"a listed tool isn't described as MCP describes tools: {_excerpt(described)}")
    schema = described.get("input_schema")
    return Tool(
        name=described["name"],
        description=str(described.get("description") or ""),
        input_schema=schema if isinstance(schema, dict) else {"type": "object"},
    )


def _is_capacity_refusal(frame: dict[str, Any]) -> bool:
    data = frame.get("data")
    return frame.get("type") == "error" and isinstance(data, dict) and data.get("code") == _CAPACITY_REACHED


def _max_sessions(frame: dict[str, Any]) -> int | None:
    limit = frame["data"].get("max_sessions")
    return limit if isinstance(limit, int) else None


def _capacity_message(url: str, frame: dict[str, Any], waited: float) -> str:
    limit = _max_sessions(frame)
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
    return str(detail) if detail else _excerpt(wire_text(raw))


def _excerpt(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return repr(text[:limit] + "…") if len(text) > limit else repr(text)
