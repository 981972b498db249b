"""What every stand-in model answers with: the steps of a script, and each session's walk through its own.

A script is a list of steps, one per request: ``text``, ``tool_call`` (arguments as an object, or as a raw string
that may not be JSON at all), ``tool_calls`` (several in one reply), ``delay`` (wait, then take another step),
``error`` (an HTTP error status, with headers such as ``Retry-After``) and ``broken`` (a 200 whose body isn't the
wire format's answer). A stand-in names the session of each request, walks that session's script with a
``ScriptCursor``, and turns the step into its wire format's answer with ``answer``; the steps and the walk are the
same for the OpenAI and the SGLang stand-ins.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from .loopback import Request


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
    headers: Mapping[str, str] = field(default_factory=dict)


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


def error(status: int, body: str | dict[str, Any] | None = None, *, headers: Mapping[str, str] | None = None) -> Error:
    """Answer with the HTTP ``status`` (429, 500, 503, ...), ``body``, by default an OpenAI-style error, and
    ``headers`` (e.g. ``{"Retry-After": "1"}``)."""
    if body is None:
        body = {"error": {"message": f"scripted error {status}", "type": "scripted_error", "code": status}}
    return Error(status, body, dict(headers or {}))


def broken(body: str = '{"id": "chatcmpl-broken", "choices": [') -> Broken:
    """Answer 200 with ``body``, by default JSON cut short, which no client can read as a chat completion."""
    return Broken(body)


def answer(
    step: Step, reply: Callable[[Reply], Any], *, sleep: Callable[[float], object]
) -> tuple[int, Any] | tuple[int, Any, Mapping[str, str]]:
    """The status and payload answering ``step``, once ``sleep`` has waited out its delays: ``reply``'s rendering of a
    reply, an error's status, body and headers, or a broken body with 200."""
    while isinstance(step, Delay):
        sleep(step.seconds)
        step = step.then
    if isinstance(step, Reply):
        return HTTPStatus.OK, reply(step)
    if isinstance(step, Error):
        return step.status, step.body, step.headers
    return HTTPStatus.OK, step.body


class ScriptUsedUp(LookupError):
    """A request asked its session's script for a step past its last; each stand-in answers it with a 500 in its own
    wire format, the message saying which session and step."""

    def __init__(self, session: str, position: int, length: int):
        super().__init__(
            f"the script of session {session!r} is used up: it has {length} step(s), and this request asks for step "
            f"{position + 1}"
        )


@dataclass
class _Walk:
    steps: tuple[Step, ...]
    taken: int = 0


class ScriptCursor:
    """Where each session is in its script, shared by the threads a stand-in answers requests on, and the requests
    that got there.

    A session's walk begins at its first request, with the steps ``script`` gave the session or else those
    ``default`` gives for that request, and keeps those steps until the session is scripted again, so a default that
    gives other steps later leaves the sessions already walking alone. ``requests`` holds every request taken or
    recorded, in arrival order, and ``used_up`` those that found their script used up."""

    def __init__(self, default: Callable[[Request], Iterable[Step]] = lambda request: ()):
        self._default = default
        self._lock = threading.Lock()
        self._scripts: dict[str, tuple[Step, ...]] = {}
        self._walks: dict[str, _Walk] = {}
        self._requests: list[Request] = []
        self._used_up: list[Request] = []

    def script(self, session: str, steps: Iterable[Step]) -> None:
        """Walk ``steps`` for ``session`` from its next request on, starting over if it had begun another script."""
        with self._lock:
            self._scripts[session] = tuple(steps)
            self._walks.pop(session, None)

    def clear(self) -> None:
        """Forget every session's script and walk, and every request."""
        with self._lock:
            self._scripts.clear()
            self._walks.clear()
            self._requests.clear()
            self._used_up.clear()

    def record(self, request: Request) -> None:
        """Keep ``request``, which its stand-in answers without a step."""
        with self._lock:
            self._requests.append(request)

    def take(self, request: Request, *, position: int | None = None) -> Step:
        """Keep ``request`` and take its session's next step; or, given ``position``, the step at that position
        without moving the walk, for a stand-in whose requests say how far their session has come (as a chat does by
        the replies it holds). Raises ScriptUsedUp, keeping ``request`` in ``used_up`` too, when there is no such
        step, and whatever ``default`` raises for a session it can't give a script."""
        with self._lock:
            self._requests.append(request)
            if (walk := self._walks.get(request.session)) is None:
                steps = self._scripts.get(request.session)
                walk = _Walk(tuple(self._default(request)) if steps is None else steps)
                self._walks[request.session] = walk
            at = walk.taken if position is None else position
            if at >= len(walk.steps):
                self._used_up.append(request)
                raise ScriptUsedUp(request.session, at, len(walk.steps))
            if position is None:
                walk.taken += 1
            return walk.steps[at]

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    @property
    def used_up(self) -> list[Request]:
        with self._lock:
            return list(self._used_up)
