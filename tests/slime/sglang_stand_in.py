"""A stand-in for SGLang's ``POST /generate``, the upstream of slime's adapter in the slime tier and the demo.

Each session (the adapter's ``X-SMG-Routing-Key``) walks a script of test_support's model steps. A reply is written
the way Qwen3 writes it (its text, then each tool call as ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``),
encoded with the Qwen3 tokenizer and closed with ``<|im_end|>``, as a model stops, and answered in SGLang's shape:
``text`` and ``meta_info`` with ``output_token_logprobs`` (``[logprob, token_id, None]`` per token) and
``finish_reason``. ``max_new_tokens`` cuts a reply short with finish reason ``length``. ``delay`` steps wait,
``error`` steps answer their status, and ``POST /abort_request`` records the request ids it is asked to abort.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from test_support import SCRIPTS, ServedBundle
from test_support.scripted_model import Broken, Delay, Error, Reply, Step

END_OF_TURN = "<|im_end|>"


def qwen3_text(reply: Reply) -> str:
    """What Qwen3 writes for ``reply``, up to the end-of-turn token: the form its chat template renders it in."""
    parts = [reply.content] if reply.content else []
    parts += [
        '<tool_call>\n{"name": "' + call.name + '", "arguments": ' + call.arguments + "}\n</tool_call>"
        for call in reply.tool_calls
    ]
    return "\n".join(parts)


def by_task(served: ServedBundle) -> Callable[[str], Sequence[Step]]:
    """A ``script_of`` giving a session test_support's script for the task whose prompt its first prompt holds."""
    prompts = {task["prompt"]: task["name"] for task in served.tasks()}

    def script_of(prompt: str) -> Sequence[Step]:
        found = [name for text, name in prompts.items() if text in prompt]
        if len(found) != 1:
            raise LookupError(f"no single task's prompt is in this one (found {found}): …{prompt[-300:]}")
        return SCRIPTS[found[0]]

    return script_of


@dataclass
class _Session:
    steps: Sequence[Step]
    taken: int = 0


@dataclass
class _State:
    sessions: dict[str, _Session] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)


class StandInSGLang:
    """The stand-in, listening on a free loopback port until ``close()``; use it as a context manager. ``script_of``
    (which a test may replace) gives a new session its steps from the text of its first prompt. Its ``host`` and
    ``port`` are what slime's ``--sglang-router-ip`` and ``--sglang-router-port`` take."""

    def __init__(self, tokenizer: Any, script_of: Callable[[str], Sequence[Step]]):
        self._tokenizer = tokenizer
        self.script_of = script_of
        self._end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        self._lock = threading.Lock()
        self._state = _State()
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="sglang-stand-in", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> StandInSGLang:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every ``/generate`` body received, with its routing key under ``"routing_key"``, in arrival order."""
        with self._lock:
            return list(self._state.requests)

    @property
    def aborted(self) -> list[str]:
        """The request ids ``/abort_request`` was asked to abort."""
        with self._lock:
            return list(self._state.aborted)

    def _take(self, body: dict[str, Any], routing_key: str) -> Step | None:
        """Record ``body`` and take its session's next step: None once its script is used up."""
        with self._lock:
            self._state.requests.append({**body, "routing_key": routing_key})
            session = self._state.sessions.get(routing_key)
        if session is None:
            prompt = self._tokenizer.decode(body.get("input_ids") or [], skip_special_tokens=False)
            session = _Session(self.script_of(prompt))
            with self._lock:
                session = self._state.sessions.setdefault(routing_key, session)
        with self._lock:
            if session.taken == len(session.steps):
                return None
            session.taken += 1
            return session.steps[session.taken - 1]

    def _abort(self, rid: str) -> None:
        with self._lock:
            self._state.aborted.append(rid)

    def _generated(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        ids = [*self._tokenizer.encode(qwen3_text(reply), add_special_tokens=False), self._end_of_turn]
        finish: dict[str, Any] = {"type": "stop", "matched": self._end_of_turn}
        limit = (body.get("sampling_params") or {}).get("max_new_tokens")
        if limit is not None and len(ids) > limit:
            ids = ids[:limit]
            finish = {"type": "length", "length": limit}
        logprobs = [[-0.01 * (position % 50 + 1), token, None] for position, token in enumerate(ids)]
        return {
            "text": self._tokenizer.decode(ids, skip_special_tokens=False),
            "output_ids": ids,
            "meta_info": {
                "id": body.get("rid"),
                "finish_reason": finish,
                "prompt_tokens": len(body.get("input_ids") or []),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "output_token_logprobs": logprobs,
            },
        }


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


def _handler(stand_in: StandInSGLang) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            path = self.path.split("?")[0]
            if not isinstance(body, dict):
                self._send(HTTPStatus.BAD_REQUEST, {"error": "the body is not a JSON object"})
            elif path == "/abort_request":
                stand_in._abort(str(body.get("rid")))
                self._send(HTTPStatus.OK, {})
            elif path != "/generate":
                self._send(HTTPStatus.NOT_FOUND, {"error": f"the stand-in serves /generate, not {path}"})
            elif (step := stand_in._take(body, self.headers.get("X-SMG-Routing-Key") or "")) is None:
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "this session's script is used up"})
            else:
                self._answer(step, body)

        def _answer(self, step: Step, body: dict[str, Any]) -> None:
            while isinstance(step, Delay):
                time.sleep(step.seconds)
                step = step.then
            if isinstance(step, Reply):
                self._send(HTTPStatus.OK, stand_in._generated(step, body))
            elif isinstance(step, Error):
                self._send(step.status, step.body)
            elif isinstance(step, Broken):
                self._send(HTTPStatus.OK, step.body)

        def _send(self, status: int, payload: Any) -> None:
            data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except ConnectionError:
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
