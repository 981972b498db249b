"""A stand-in for the SGLang server behind Miles' session server: ``POST /v1/chat/completions`` answered from
test_support's per-task scripts, in SGLang's shape, with Qwen3's token ids.

Miles' session server renders the chat itself and sends its token ids as ``input_ids``; what it needs back is the
reply's message and ``choices[0].meta_info.output_token_logprobs`` (``[logprob, token id, ...]`` per output token),
which it stitches into the training sample. Those are test_support's Qwen3 tokens for the reply, tokenized with the
checkpoint's tokenizer; a reply longer than the request's ``max_tokens`` is cut there, its text whatever the cut
tokens say and its finish reason ``length``, as SGLang answers. Nothing in a request says which of Miles' sessions
sent it, and a group's episodes share their prompt, so the session of a request on test_support's ``ScriptCursor``
is its episode's first user prompt, and its step the one at the position of how many replies the chat already holds.
It also answers what Miles' abort step asks of SGLang's router and workers (``GET /workers``,
``POST /abort_request``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from http import HTTPStatus
from typing import Any

from test_support.loopback import LoopbackServer, Request
from test_support.qwen3 import output_token_logprobs
from test_support.script import Reply, ScriptCursor, ScriptUsedUp, Step, answer


class SGLangChat(LoopbackServer):
    """The stand-in, listening on a free loopback port until ``close()``. ``scripts`` maps an episode's first user
    prompt to the steps that answer its requests, one per reply."""

    def __init__(self, tokenizer: Any, scripts: Mapping[str, Sequence[Step]]):
        self._tokenizer = tokenizer
        self._cursor = ScriptCursor()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.aborts = 0
        self._turns: dict[str, Iterator[Step]] = {}
        self.reset(scripts)
        super().__init__(name="sglang-chat")

    def reset(self, scripts: Mapping[str, Sequence[Step]]) -> None:
        """Answer with ``scripts`` from now on, and forget the requests and aborts received so far."""
        self._cursor.clear()
        for prompt, steps in scripts.items():
            self._cursor.script(prompt, steps)
        with self._lock:
            self.aborts = 0
            self._turns = {}

    def script(self, prompt: str, steps: Sequence[Step]) -> None:
        """Answer the episodes whose first user prompt is ``prompt`` with ``steps`` from now on."""
        self._cursor.script(prompt, steps)

    def take_turns(self, prompt: str, replies: Sequence[Step]) -> None:
        """Answer the episodes whose first user prompt is ``prompt`` with one reply each, taking ``replies`` in turn:
        the only way to give sibling episodes of a group different replies, since their requests are alike."""
        with self._lock:
            self._turns[prompt] = itertools.cycle(replies)

    def requests_for(self, prompt: str) -> list[dict[str, Any]]:
        """The bodies of the chat requests of episodes whose first user prompt is ``prompt``."""
        return [request.body for request in self._cursor.requests if request.session == prompt]

    def respond(self, request: Request) -> tuple[int, Any]:
        body = request.body
        if request.method == "GET":
            if request.route == "/workers":
                return HTTPStatus.OK, {"workers": [{"url": self.url}]}
            return HTTPStatus.NOT_FOUND, {"error": f"no GET {request.path}"}
        if request.route == "/abort_request":
            with self._lock:
                self.aborts += 1
            return HTTPStatus.OK, {}
        if request.route != "/v1/chat/completions" or not isinstance(body, dict):
            return HTTPStatus.NOT_FOUND, {"error": f"no POST {request.path} with a JSON object"}
        replies = sum(1 for message in body.get("messages", []) if message.get("role") == "assistant")
        session = replace(request, session=_first_prompt(body) or "")
        with self._lock:
            turns = self._turns.get(session.session)
            step = next(turns) if turns is not None and replies == 0 else None
        if step is not None:
            self._cursor.record(session)
            return answer(step, lambda reply: self._completion(reply, body), sleep=self.sleep)
        try:
            step = self._cursor.take(session, position=replies)
        except ScriptUsedUp as used_up:
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(used_up)}
        return answer(step, lambda reply: self._completion(reply, body), sleep=self.sleep)

    def _completion(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        logprobs = output_token_logprobs(self._tokenizer, reply)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or "", "reasoning_content": None}
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{next(self._ids)}",
                    "index": position,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for position, call in enumerate(reply.tool_calls)
            ]
        finish_reason = reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")
        limit = body.get("max_tokens")
        if limit is not None and len(logprobs) > limit:
            logprobs = logprobs[:limit]
            cut = self._tokenizer.decode([token for _, token, _ in logprobs], skip_special_tokens=True)
            message = {"role": "assistant", "content": cut, "reasoning_content": None}
            finish_reason = "length"
        meta_info = {
            "id": f"req-{next(self._ids)}",
            "prompt_tokens": len(body.get("input_ids") or ()),
            "completion_tokens": len(logprobs),
            "cached_tokens": 0,
            "output_token_logprobs": logprobs,
        }
        return {
            "id": meta_info["id"],
            "object": "chat.completion",
            "model": body.get("model", "default"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "meta_info": meta_info}],
            "usage": {
                "prompt_tokens": meta_info["prompt_tokens"],
                "completion_tokens": len(logprobs),
                "total_tokens": meta_info["prompt_tokens"] + len(logprobs),
            },
        }


def _first_prompt(body: Mapping[str, Any]) -> str | None:
    for message in body.get("messages", []):
        if message.get("role") == "user":
            return message.get("content")
    return None
