"""A stand-in for SGLang's ``POST /generate``, the upstream of slime's adapter in the slime tier and the demo.

Each session (the adapter's ``X-SMG-Routing-Key``) walks a script of test_support's model steps. A reply is
test_support's Qwen3 rendering of it, tokenized and closed with ``<|im_end|>`` as a model stops, and answered in
SGLang's shape: ``text`` and ``meta_info`` with ``output_token_logprobs`` (``[logprob, token_id, None]`` per token)
and ``finish_reason``. ``max_new_tokens`` cuts a reply short with finish reason ``length``. ``delay`` steps wait,
``error`` steps answer their status, and ``POST /abort_request`` records the request ids it is asked to abort.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from test_support import SCRIPTS, ServedBundle
from test_support.loopback import LoopbackServer, Received
from test_support.qwen3 import output_token_logprobs
from test_support.scripted_model import Reply, Step, answer


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


class StandInSGLang(LoopbackServer):
    """The stand-in, listening on a free loopback port until ``close()``; use it as a context manager. ``script_of``
    (which a test may replace) gives a new session its steps from the text of its first prompt. Its ``host`` and
    ``port`` are what slime's ``--sglang-router-ip`` and ``--sglang-router-port`` take."""

    def __init__(self, tokenizer: Any, script_of: Callable[[str], Sequence[Step]]):
        self._tokenizer = tokenizer
        self.script_of = script_of
        self._lock = threading.Lock()
        self._state = _State()
        super().__init__(name="sglang-stand-in")

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

    def respond(self, received: Received) -> tuple[int, Any]:
        body = received.body
        if not isinstance(body, dict):
            return HTTPStatus.BAD_REQUEST, {"error": "the body is not a JSON object"}
        if received.route == "/abort_request":
            with self._lock:
                self._state.aborted.append(str(body.get("rid")))
            return HTTPStatus.OK, {}
        if received.route != "/generate":
            return HTTPStatus.NOT_FOUND, {"error": f"the stand-in serves /generate, not {received.route}"}
        if (step := self._take(body, received.headers.get("x-smg-routing-key") or "")) is None:
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "this session's script is used up"}
        return answer(step, lambda reply: self._generated(reply, body), sleep=self.sleep)

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

    def _generated(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        logprobs = output_token_logprobs(self._tokenizer, reply)
        finish: dict[str, Any] = {"type": "stop", "matched": logprobs[-1][1]}
        limit = (body.get("sampling_params") or {}).get("max_new_tokens")
        if limit is not None and len(logprobs) > limit:
            logprobs = logprobs[:limit]
            finish = {"type": "length", "length": limit}
        ids = [token for _, token, _ in logprobs]
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
