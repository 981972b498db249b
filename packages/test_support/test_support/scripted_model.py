"""A model whose replies a test scripts, served over HTTP as OpenAI's ``POST /v1/chat/completions``.

A script is a list of steps, one per request: ``text`` (finishing with ``stop`` or a finish reason of its own),
``tool_call`` (arguments as an object, or as a raw string that may not be JSON at all), ``tool_calls`` (several in
one reply), ``delay`` (wait, then take another step), ``error`` (an HTTP error status) and ``broken`` (a 200 whose
body isn't a chat completion). Each request belongs to a session, by default its body's ``user`` or else its bearer
token, so concurrent episodes that say who they are each walk their own script, or their own run of the default
one. Every request is recorded for the test to read.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from .loopback import LoopbackServer, Received

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str


@dataclass(frozen=True)
class Reply:
    """A chat completion: ``content``, and the tool calls that make its finish reason ``tool_calls``. The scripted
    model sends ``finish_reason`` when one is set, in place of ``tool_calls`` or ``stop``."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None


@dataclass(frozen=True)
class Delay:
    seconds: float
    then: Step


@dataclass(frozen=True)
class Error:
    status: int
    body: str | dict[str, Any]


@dataclass(frozen=True)
class Broken:
    body: str


Step = Reply | Delay | Error | Broken


def text(content: str, *, finish_reason: str | None = None) -> Reply:
    """A plain reply, finishing with ``stop``, or with ``finish_reason`` (``length``: cut at the token limit,
    ``abort``: aborted by the server)."""
    return Reply(content, finish_reason=finish_reason)


def tool_call(name: str, arguments: Mapping[str, Any] | str | None = None, *, content: str | None = None) -> Reply:
    """A reply calling the tool ``name``. ``arguments`` is sent as JSON when it is a mapping, and as it is when it
    is a string, which lets a script send arguments that are not an object, or not JSON."""
    encoded = arguments if isinstance(arguments, str) else json.dumps(dict(arguments or {}))
    return Reply(content, (ToolCall(name, encoded),))


def tool_calls(*calls: Reply, content: str | None = None) -> Reply:
    """One reply making every tool call of ``calls``, each made with ``tool_call``."""
    return Reply(content, tuple(call for reply in calls for call in reply.tool_calls))


def delay(seconds: float, then: Step) -> Delay:
    """Wait ``seconds`` before answering with ``then``, as a slow model would."""
    return Delay(seconds, then)


def error(status: int, body: str | dict[str, Any] | None = None) -> Error:
    """Answer with the HTTP ``status`` (429, 500, 503, ...) and ``body``, by default an OpenAI-style error."""
    if body is None:
        body = {"error": {"message": f"scripted error {status}", "type": "scripted_error", "code": status}}
    return Error(status, body)


def broken(body: str = '{"id": "chatcmpl-broken", "choices": [') -> Broken:
    """Answer 200 with ``body``, by default JSON cut short, which no client can read as a chat completion."""
    return Broken(body)


@dataclass(frozen=True)
class Request:
    """One request the model received: its ``session``, path, headers (names lower-cased) and body (None when it
    isn't JSON)."""

    session: str
    path: str
    headers: dict[str, str]
    body: Any

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body.get("messages", []) if isinstance(self.body, dict) else []

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.body.get("tools") if isinstance(self.body, dict) else None

    @property
    def extra(self) -> dict[str, Any]:
        """The body's keys other than ``model``, ``messages`` and ``tools``: sampling settings and the like."""
        if not isinstance(self.body, dict):
            return {}
        return {key: value for key, value in self.body.items() if key not in ("model", "messages", "tools")}


def session_of(headers: Mapping[str, str], body: Any) -> str:
    """The session a request belongs to: its body's ``user``, else its bearer token, else ``""``."""
    if isinstance(body, dict) and isinstance(body.get("user"), str) and body["user"]:
        return body["user"]
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


@dataclass
class _Session:
    steps: tuple[Step, ...]
    taken: int = 0


@dataclass
class _State:
    default: tuple[Step, ...] = ()
    scripts: dict[str, tuple[Step, ...]] = field(default_factory=dict)
    sessions: dict[str, _Session] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    unscripted: list[Request] = field(default_factory=list)


class ScriptedModel(LoopbackServer):
    """The scripted model, listening on a free loopback port from construction until ``close()``; use it as a
    context manager. Its ``base_url`` is what an OpenAI client takes."""

    def __init__(self, *, session_of: Callable[[Mapping[str, str], Any], str] = session_of):
        self._session_of = session_of
        self._lock = threading.Lock()
        self._state = _State()
        self._ids = itertools.count(1)
        super().__init__(name="scripted-model")

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def script(self, steps: Iterable[Step], *, session: str | None = None) -> None:
        """Answer ``session``'s requests with ``steps``, one each, in order, starting over if it had begun another
        script. Without ``session``, make ``steps`` the default, which each session without a script of its own
        walks through on its own; a session already walking the old default goes on with it."""
        with self._lock:
            if session is None:
                self._state.default = tuple(steps)
            else:
                self._state.scripts[session] = tuple(steps)
                self._state.sessions.pop(session, None)

    @property
    def requests(self) -> list[Request]:
        """Every request received, in arrival order."""
        with self._lock:
            return list(self._state.requests)

    def requests_of(self, session: str) -> list[Request]:
        return [request for request in self.requests if request.session == session]

    @property
    def unscripted(self) -> list[Request]:
        """The requests that found their session's script used up, each answered with a 500."""
        with self._lock:
            return list(self._state.unscripted)

    def respond(self, received: Received) -> tuple[int, Any]:
        if received.method != "POST" or received.route != CHAT_PATH:
            return HTTPStatus.NOT_FOUND, _error_body(f"the scripted model serves only POST {CHAT_PATH}")
        body = received.body
        request = Request(self._session_of(received.headers, body), received.path, received.headers, body)
        if not isinstance(body, dict):
            self._record(request)
            return HTTPStatus.BAD_REQUEST, _error_body("the request body is not a JSON object")
        if body.get("stream"):
            self._record(request)
            return HTTPStatus.BAD_REQUEST, _error_body("the scripted model doesn't stream")
        if (step := self._take(request)) is None:
            message = f"the script of session {request.session!r} is used up"
            return HTTPStatus.INTERNAL_SERVER_ERROR, _error_body(message, "script_used_up")
        return answer(step, lambda reply: self._completion(reply, body), sleep=self.sleep)

    def _record(self, request: Request) -> None:
        with self._lock:
            self._state.requests.append(request)

    def _take(self, request: Request) -> Step | None:
        """Record ``request`` and take its session's next step: None once the script is used up."""
        with self._lock:
            self._state.requests.append(request)
            if (session := self._state.sessions.get(request.session)) is None:
                steps = self._state.scripts.get(request.session, self._state.default)
                session = self._state.sessions[request.session] = _Session(steps)
            if session.taken == len(session.steps):
                self._state.unscripted.append(request)
                return None
            session.taken += 1
            return session.steps[session.taken - 1]

    def _completion(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{next(self._ids)}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in reply.tool_calls
            ]
        return {
            "id": f"chatcmpl-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or "scripted",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop"),
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }


def answer(step: Step, reply: Callable[[Reply], Any], *, sleep: Callable[[float], object]) -> tuple[int, Any]:
    """The status and payload answering ``step``, once ``sleep`` has waited out its delays: ``reply``'s rendering of a
    reply, an error's status and body, or a broken body with 200. Every stand-in model walks its steps with it."""
    while isinstance(step, Delay):
        sleep(step.seconds)
        step = step.then
    if isinstance(step, Reply):
        return HTTPStatus.OK, reply(step)
    if isinstance(step, Error):
        return step.status, step.body
    return HTTPStatus.OK, step.body


def _error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}
