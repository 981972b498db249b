"""A stand-in for SGLang's ``POST /generate``, the upstream of slime's adapter in the slime tier and the demo.

Each session (the adapter's ``X-SMG-Routing-Key``) walks a script of test_support's steps on test_support's
``ScriptCursor``. A request without a routing key (the adapter sends none for its ``"default"`` session, where every
client that names no session lands) is placed by its chat instead: the text before the chat's first assistant turn
names its script, and the assistant turns the prompt already holds say which step answers it, so chats that start
alike get the same replies whatever order their requests come in. A reply is test_support's Qwen3 rendering of it,
tokenized and closed with ``<|im_end|>`` as a model stops (or the token ids ``writes`` gives it: a test of another
model family writes its replies with that family's chat template), answered in SGLang's shape: ``text`` and
``meta_info`` with ``output_token_logprobs`` (``[logprob, token_id, None]`` per token) and ``finish_reason``.
``max_new_tokens`` cuts a reply short with finish reason ``length``; a reply scripted to finish with ``abort`` comes
without its stop token and with finish reason ``abort``, as SGLang answers a generation it aborted. ``delay`` steps
wait, ``error`` steps answer their status, and ``POST /abort_request`` records the request ids it is asked to abort.
``generated`` keeps each reply it answered with, beside the prompt it answered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any

from test_support import SCRIPTS, ServedBundle
from test_support.loopback import LoopbackServer, Request
from test_support.qwen3 import output_token_logprobs
from test_support.script import Reply, ScriptCursor, ScriptUsedUp, Step, answer

ASSISTANT_TURN = "<|im_start|>assistant"
"""What opens an assistant turn in Qwen3's chat template, the generation prompt's included."""


def by_task(served: ServedBundle) -> Callable[[str], Sequence[Step]]:
    """A ``script_of`` giving a session test_support's script for the task whose prompt its first prompt holds."""
    prompts = {task["prompt"]: task["name"] for task in served.tasks()}

    def script_of(prompt: str) -> Sequence[Step]:
        found = [name for text, name in prompts.items() if text in prompt]
        if len(found) != 1:
            raise LookupError(f"no single task's prompt is in this one (found {found}): …{prompt[-300:]}")
        return SCRIPTS[found[0]]

    return script_of


@dataclass(frozen=True)
class Generated:
    """A reply the stand-in answered: its request's routing key (``""`` without one), the prompt's token ids, and
    the reply's token ids and logprobs."""

    routing_key: str
    prompt: list[int]
    output: list[int]
    logprobs: list[float]


class StandInSGLang(LoopbackServer):
    """The stand-in, listening on a free loopback port until ``close()``; use it as a context manager. ``script_of``
    (which a test may replace) gives a new session its steps from the text of its first prompt. Its ``host`` and
    ``port`` are what slime's ``--sglang-router-ip`` and ``--sglang-router-port`` take. ``writes`` (which a test
    may set) gives a reply's token ids in place of the Qwen3 rendering."""

    def __init__(self, tokenizer: Any, script_of: Callable[[str], Sequence[Step]]):
        self._tokenizer = tokenizer
        self.script_of = script_of
        self.writes: Callable[[Reply], list[int]] | None = None
        self._cursor = ScriptCursor(default=self._script_of_first_prompt)
        self._lock = threading.Lock()
        self._aborted: list[str] = []
        self._generated: list[Generated] = []
        super().__init__(name="sglang-stand-in")

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every ``/generate`` body received, with its routing key under ``"routing_key"``, in arrival order."""
        return [
            {**request.body, "routing_key": request.headers.get("x-smg-routing-key", "")}
            for request in self._cursor.requests
        ]

    @property
    def aborted(self) -> list[str]:
        """The request ids ``/abort_request`` was asked to abort."""
        with self._lock:
            return list(self._aborted)

    @property
    def generated(self) -> list[Generated]:
        """Each reply answered, in the order they were answered."""
        with self._lock:
            return list(self._generated)

    def clear(self) -> None:
        """Forget every request, every abort, every reply and every session's walk, so that a chat placed by its
        text in one test starts its script afresh in the next."""
        self._cursor.clear()
        with self._lock:
            self._aborted.clear()
            self._generated.clear()

    def respond(self, request: Request) -> tuple[int, Any]:
        body = request.body
        if not isinstance(body, dict):
            return HTTPStatus.BAD_REQUEST, {"error": "the body is not a JSON object"}
        if request.route == "/abort_request":
            with self._lock:
                self._aborted.append(str(body.get("rid")))
            return HTTPStatus.OK, {}
        if request.route != "/generate":
            return HTTPStatus.NOT_FOUND, {"error": f"the stand-in serves /generate, not {request.route}"}
        try:
            if routing_key := request.headers.get("x-smg-routing-key"):
                step = self._cursor.take(replace(request, session=routing_key))
            else:
                chat, position = self._place_in_chat(body)
                step = self._cursor.take(replace(request, session=chat), position=position)
        except ScriptUsedUp as used_up:
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(used_up)}
        routing_key = request.headers.get("x-smg-routing-key", "")
        return answer(step, lambda reply: self._answered(reply, body, routing_key), sleep=self.sleep)

    def _place_in_chat(self, body: dict[str, Any]) -> tuple[str, int]:
        """The opening of the chat whose prompt ``body`` holds, up to its first assistant turn, and the number of
        assistant turns the prompt already holds before the one it asks for."""
        prompt = self._tokenizer.decode(body.get("input_ids") or [], skip_special_tokens=False)
        opening, *assistant_turns = prompt.split(ASSISTANT_TURN)
        return opening, max(len(assistant_turns) - 1, 0)

    def _script_of_first_prompt(self, request: Request) -> Sequence[Step]:
        """``script_of`` the text of a new session's first prompt."""
        return self.script_of(self._tokenizer.decode(request.body.get("input_ids") or [], skip_special_tokens=False))

    def _answered(self, reply: Reply, body: dict[str, Any], routing_key: str) -> dict[str, Any]:
        if self.writes is None:
            logprobs = output_token_logprobs(self._tokenizer, reply)
        else:
            logprobs = [[-0.01 * (at % 50 + 1), token, None] for at, token in enumerate(self.writes(reply))]
        finish: dict[str, Any] = {"type": "stop", "matched": logprobs[-1][1]}
        if reply.finish_reason == "abort":
            logprobs = logprobs[:-1]
            finish = {"type": "abort", "message": "Abort in waiting queue"}
        limit = (body.get("sampling_params") or {}).get("max_new_tokens")
        if limit is not None and len(logprobs) > limit:
            logprobs = logprobs[:limit]
            finish = {"type": "length", "length": limit}
        ids = [token for _, token, _ in logprobs]
        with self._lock:
            self._generated.append(
                Generated(routing_key, list(body.get("input_ids") or []), ids, [logprob for logprob, _, _ in logprobs])
            )
        return {
            **({} if self.writes else {"text": self._tokenizer.decode(ids, skip_special_tokens=False)}),
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
