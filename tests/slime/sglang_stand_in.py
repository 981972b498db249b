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
without its stop token and with finish reason ``abort``. ``delay`` steps wait, ``error`` steps answer their status.
``generated`` keeps each reply it answered with, beside the prompt it answered.

Like SGLang's engines, it generates for a while (``seconds_per_token``, 0 by default: at once) and is paused and
aborted as slime pauses them: ``POST /pause_generation`` (SGLang's default mode, ``abort``) answers every generation
in flight at once with the tokens generated so far and finish reason ``abort``, and holds new requests until ``POST
/continue_generation``; ``POST /abort_request`` aborts one request (``rid``) or all in flight (``abort_all``) without
holding any; ``/flush_cache``, ``/update_weight_version`` and ``/get_weight_version`` are SGLang's, and every answer's
``meta_info`` carries the ``weight_version`` it was generated with. A token generated with weight version v has its
position's logprob less v, so which weights sampled a token shows in its logprob. A request whose prompt is a cut
generation's prompt followed by the tokens it had generated, in the same session, gets the rest of that reply, as a
model sampling the same reply would give. For slime's standard rollout's abort it also serves the router's ``GET
/workers`` (itself) and ``GET /v1/loads``. ``WeightUpdates`` is the trainer's side: slime's weight update, through
these endpoints.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
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
    """A reply the stand-in answered: its request's routing key (``""`` without one), the prompt's token ids, the
    reply's token ids and logprobs, its finish reason and the weight version that generated it."""

    routing_key: str
    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    finish: str = "stop"
    weight_version: int = 0


@dataclass(frozen=True)
class _Rest:
    """What a cut generation would have gone on to generate: ``[logprob, token id, None]`` for each token, and the
    finish reason had it not been cut."""

    logprobs: list[list[Any]]
    finish: dict[str, Any]


class StandInSGLang(LoopbackServer):
    """The stand-in, listening on a free loopback port until ``close()``; use it as a context manager. ``script_of``
    (which a test may replace) gives a new session its steps from the text of its first prompt. Its ``host`` and
    ``port`` are what slime's ``--sglang-router-ip`` and ``--sglang-router-port`` take. ``writes`` (which a test
    may set) gives a reply's token ids in place of the Qwen3 rendering, and ``seconds_per_token`` (which a test may
    set) how long generating each token takes."""

    def __init__(self, tokenizer: Any, script_of: Callable[[str], Sequence[Step]]):
        self._tokenizer = tokenizer
        self.script_of = script_of
        self.writes: Callable[[Reply], list[int]] | None = None
        self.seconds_per_token = 0.0
        self._cursor = ScriptCursor(default=self._script_of_first_prompt)
        self._lock = threading.Lock()
        self._aborted: list[str] = []
        self._generated: list[Generated] = []
        self._engine = threading.Condition()
        self._paused = False
        self._aborts = 0
        self._aborted_rids: set[str] = set()
        self._generating: set[str] = set()
        self._weight_version = 0
        self._cuts: dict[tuple[str, tuple[int, ...]], _Rest] = {}
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
        """Forget every request, every abort, every reply, every cut generation and every session's walk, so that a
        chat placed by its text in one test starts its script afresh in the next; and generate at once again, with
        weight version 0."""
        self._cursor.clear()
        self.seconds_per_token = 0.0
        with self._lock:
            self._aborted.clear()
            self._generated.clear()
            self._cuts.clear()
        with self._engine:
            self._aborted_rids.clear()
            self._weight_version = 0

    def generating(self) -> int:
        """How many requests are generating now."""
        with self._engine:
            return len(self._generating)

    def respond(self, request: Request) -> tuple[int, Any]:
        if request.method == "GET":
            return self._served_get(request.route)
        body = request.body
        if not isinstance(body, dict):
            return HTTPStatus.BAD_REQUEST, {"error": "the body is not a JSON object"}
        if request.route in _CONTROLS:
            return getattr(self, _CONTROLS[request.route])(body)
        if request.route != "/generate":
            return HTTPStatus.NOT_FOUND, {"error": f"the stand-in serves /generate, not {request.route}"}
        epoch = self._admitted()
        routing_key = request.headers.get("x-smg-routing-key", "")
        prompt = list(body.get("input_ids") or [])
        with self._lock:
            rest = self._cuts.pop((routing_key, tuple(prompt)), None)
        if rest is not None:
            self._cursor.record(request)
            return HTTPStatus.OK, self._served(body, routing_key, epoch, rest.logprobs, rest.finish)
        try:
            if routing_key:
                step = self._cursor.take(replace(request, session=routing_key))
            else:
                chat, position = self._place_in_chat(body)
                step = self._cursor.take(replace(request, session=chat), position=position)
        except ScriptUsedUp as used_up:
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(used_up)}
        return answer(step, lambda reply: self._answered(reply, body, routing_key, epoch), sleep=self.sleep)

    def _served_get(self, route: str) -> tuple[int, Any]:
        """The router's and the engine's state, as slime reads it."""
        if route == "/workers":
            return HTTPStatus.OK, {"workers": [{"url": self.url}]}
        if route == "/v1/loads":
            return HTTPStatus.OK, {"num_reqs": self.generating()}
        if route == "/get_weight_version":
            with self._engine:
                return HTTPStatus.OK, {"weight_version": str(self._weight_version)}
        return HTTPStatus.NOT_FOUND, {"error": f"the stand-in serves no GET {route}"}

    def _pause_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        """Abort every generation in flight and hold new requests, returning once none generates (SGLang's
        ``abort`` mode, its default)."""
        if body.get("mode", "abort") != "abort":
            return HTTPStatus.BAD_REQUEST, {"error": f"the stand-in pauses in abort mode only, not {body['mode']!r}"}
        with self._engine:
            self._paused = True
            self._aborts += 1
            self._engine.notify_all()
            while self._generating:
                self._engine.wait(0.05)
        return HTTPStatus.OK, {}

    def _continue_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self._engine:
            self._paused = False
            self._engine.notify_all()
        return HTTPStatus.OK, {}

    def _abort_request(self, body: dict[str, Any]) -> tuple[int, Any]:
        """Abort request ``rid``, or every request in flight with ``abort_all``; hold none."""
        with self._lock:
            self._aborted.append(str(body.get("rid")))
        with self._engine:
            if body.get("abort_all"):
                self._aborts += 1
            else:
                self._aborted_rids.add(str(body.get("rid")))
            self._engine.notify_all()
        return HTTPStatus.OK, {}

    def _flush_cache(self, body: dict[str, Any]) -> tuple[int, Any]:
        return HTTPStatus.OK, {}

    def _update_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self._engine:
            self._weight_version = int(body["new_version"])
        return HTTPStatus.OK, {"success": True}

    def _admitted(self) -> int:
        """Hold a new request while generation is paused; then how many aborts of everything in flight came before
        it, which a later one cuts it."""
        with self._engine:
            while self._paused and not self._closing.is_set():
                self._engine.wait(0.05)
            return self._aborts

    def _generated_before_end(self, rid: str, epoch: int, tokens: int) -> tuple[int, int, bool]:
        """Generate ``tokens`` tokens for request ``rid``, admitted at abort ``epoch``: how many were generated, with
        which weight version, and whether an abort cut them."""
        with self._engine:
            version = self._weight_version
            began = time.monotonic()
            self._generating.add(rid)
            try:
                while True:
                    if self._aborts != epoch or rid in self._aborted_rids:
                        done = int((time.monotonic() - began) / self.seconds_per_token) if self.seconds_per_token else 0
                        return min(done, tokens), version, True
                    left = began + tokens * self.seconds_per_token - time.monotonic()
                    if left <= 0:
                        return tokens, version, False
                    self._engine.wait(left)
            finally:
                self._generating.discard(rid)
                self._engine.notify_all()

    def _place_in_chat(self, body: dict[str, Any]) -> tuple[str, int]:
        """The opening of the chat whose prompt ``body`` holds, up to its first assistant turn, and the number of
        assistant turns the prompt already holds before the one it asks for."""
        prompt = self._tokenizer.decode(body.get("input_ids") or [], skip_special_tokens=False)
        opening, *assistant_turns = prompt.split(ASSISTANT_TURN)
        return opening, max(len(assistant_turns) - 1, 0)

    def _script_of_first_prompt(self, request: Request) -> Sequence[Step]:
        """``script_of`` the text of a new session's first prompt."""
        return self.script_of(self._tokenizer.decode(request.body.get("input_ids") or [], skip_special_tokens=False))

    def _answered(self, reply: Reply, body: dict[str, Any], routing_key: str, epoch: int) -> dict[str, Any]:
        if self.writes is None:
            logprobs = output_token_logprobs(self._tokenizer, reply)
        else:
            logprobs = [[-0.01 * (at % 50 + 1), token, None] for at, token in enumerate(self.writes(reply))]
        if reply.finish_reason == "abort":
            return self._answer(
                body, routing_key, logprobs[:-1], {"type": "abort", "message": "Abort in waiting queue"}
            )
        return self._served(body, routing_key, epoch, logprobs, {"type": "stop", "matched": logprobs[-1][1]})

    def _served(
        self, body: dict[str, Any], routing_key: str, epoch: int, logprobs: list[list[Any]], finish: dict[str, Any]
    ) -> dict[str, Any]:
        """The answer generating the reply ``logprobs``, which ends with ``finish`` unless the token limit or an
        abort cuts it; a cut generation is kept for a request that asks it to go on."""
        whole = (logprobs, finish)
        limit = (body.get("sampling_params") or {}).get("max_new_tokens")
        if limit is not None and len(logprobs) > limit:
            logprobs, finish = logprobs[:limit], {"type": "length", "length": limit}
        done, version, cut = self._generated_before_end(str(body.get("rid")), epoch, len(logprobs))
        if cut:
            logprobs, finish = logprobs[:done], {"type": "abort", "message": "Abort before weight update"}
            prompt = [*(body.get("input_ids") or []), *(token for _, token, _ in logprobs)]
            with self._lock:
                self._cuts[(routing_key, tuple(prompt))] = _Rest(whole[0][done:], whole[1])
        versioned = [[logprob - version, token, None] for logprob, token, _ in logprobs]
        return self._answer(body, routing_key, versioned, finish, version)

    def _answer(
        self,
        body: dict[str, Any],
        routing_key: str,
        logprobs: list[list[Any]],
        finish: dict[str, Any],
        version: int = 0,
    ) -> dict[str, Any]:
        ids = [token for _, token, _ in logprobs]
        with self._lock:
            self._generated.append(
                Generated(
                    routing_key,
                    list(body.get("input_ids") or []),
                    ids,
                    [logprob for logprob, _, _ in logprobs],
                    finish["type"],
                    version,
                )
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
                "weight_version": str(version),
            },
        }


_CONTROLS = {
    "/pause_generation": "_pause_generation",
    "/continue_generation": "_continue_generation",
    "/abort_request": "_abort_request",
    "/flush_cache": "_flush_cache",
    "/update_weight_version": "_update_weight_version",
}
"""The engine's control endpoints, by the method that serves each."""


class WeightUpdates:
    """The trainer's side of a weight update, as slime's ``update_weights`` drives each engine
    (``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py``): pause generation in SGLang's
    default mode, ``abort``; flush the cache; send the weights, which takes ``transfer_s``, under the next weight
    version; continue generation. Each through the SGLang at ``url``'s HTTP endpoints, as slime's engines call them.
    ``versions`` counts the updates done."""

    def __init__(self, url: str, transfer_s: float = 0.2):
        self._url = url
        self._transfer_s = transfer_s
        self.versions = 0

    def update(self) -> None:
        self.versions += 1
        self._post("/pause_generation", {})
        self._post("/flush_cache", {})
        self._post("/update_weight_version", {"new_version": str(self.versions), "abort_all_requests": False})
        time.sleep(self._transfer_s)
        self._post("/continue_generation", {})

    def _post(self, route: str, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            self._url + route, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as answered:
            answered.read()
