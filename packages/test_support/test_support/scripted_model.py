"""A model whose replies a test scripts, served over HTTP as OpenAI's ``POST /v1/chat/completions``.

Each request belongs to a session, by default its body's ``user`` or else its bearer token, so concurrent episodes
that say who they are each walk their own script (``test_support.script``), or their own run of the default one.
Every request is recorded for the test to read.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from http import HTTPStatus
from typing import Any

from .loopback import LoopbackServer, Request
from .script import Reply, ScriptCursor, ScriptUsedUp, Step, answer

CHAT_PATH = "/v1/chat/completions"


def session_of(headers: Mapping[str, str], body: Any) -> str:
    """The session a request belongs to: its body's ``user``, else its bearer token, else ``""``."""
    if isinstance(body, dict) and isinstance(body.get("user"), str) and body["user"]:
        return body["user"]
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class ScriptedModel(LoopbackServer):
    """The scripted model, listening on a free loopback port from construction until ``close()``; use it as a
    context manager. Its ``base_url`` is what an OpenAI client takes."""

    def __init__(self, *, session_of: Callable[[Mapping[str, str], Any], str] = session_of):
        self._session_of = session_of
        self._default: tuple[Step, ...] = ()
        self._cursor = ScriptCursor(default=lambda request: self._default)
        self._ids = itertools.count(1)
        super().__init__(name="scripted-model")

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def script(self, steps: Iterable[Step], *, session: str | None = None) -> None:
        """Answer ``session``'s requests with ``steps``, one each, in order, starting over if it had begun another
        script. Without ``session``, make ``steps`` the default, which each session without a script of its own
        walks through on its own; a session already walking the old default goes on with it."""
        if session is None:
            self._default = tuple(steps)
        else:
            self._cursor.script(session, steps)

    @property
    def requests(self) -> list[Request]:
        """Every request received, in arrival order."""
        return self._cursor.requests

    def requests_of(self, session: str) -> list[Request]:
        return [request for request in self.requests if request.session == session]

    @property
    def unscripted(self) -> list[Request]:
        """The requests that found their session's script used up, each answered with a 500."""
        return self._cursor.used_up

    def respond(self, request: Request) -> tuple[int, Any] | tuple[int, Any, Mapping[str, str]]:
        if request.method != "POST" or request.route != CHAT_PATH:
            return HTTPStatus.NOT_FOUND, _error_body(f"the scripted model serves only POST {CHAT_PATH}")
        request = replace(request, session=self._session_of(request.headers, request.body))
        body = request.body
        if not isinstance(body, dict):
            self._cursor.record(request)
            return HTTPStatus.BAD_REQUEST, _error_body("the request body is not a JSON object")
        if body.get("stream"):
            self._cursor.record(request)
            return HTTPStatus.BAD_REQUEST, _error_body("the scripted model doesn't stream")
        try:
            step = self._cursor.take(request)
        except ScriptUsedUp as used_up:
            return HTTPStatus.INTERNAL_SERVER_ERROR, _error_body(str(used_up), "script_used_up")
        return answer(step, lambda reply: self._completion(reply, body), sleep=self.sleep)

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


def _error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}
