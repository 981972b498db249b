"""A stand-in for the SGLang server behind Miles' session server: ``POST /v1/chat/completions`` answered from
test_support's per-task scripts, in SGLang's shape, with Qwen3's token ids.

Miles' session server renders the chat itself and sends its token ids as ``input_ids``; what it needs back is the
reply's message and ``choices[0].meta_info.output_token_logprobs`` (``[logprob, token id, ...]`` per output token),
which it stitches into the training sample. Those are test_support's Qwen3 tokens for the reply, tokenized with the
checkpoint's tokenizer. The script of a request is chosen by its episode's first user prompt, and its step by how
many replies the chat already holds, so the stand-in keeps no state per session. It also answers what Miles' abort
step asks of SGLang's router and workers (``GET /workers``, ``POST /abort_request``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from test_support.loopback import LoopbackServer, Received
from test_support.qwen3 import output_token_logprobs
from test_support.scripted_model import Error, Reply, Step, answer


class SGLangChat(LoopbackServer):
    """The stand-in, listening on a free loopback port until ``close()``. ``scripts`` maps an episode's first user
    prompt to the steps that answer its requests, one per reply."""

    def __init__(self, tokenizer: Any, scripts: Mapping[str, Sequence[Step]]):
        self._tokenizer = tokenizer
        self._scripts: dict[str, tuple[Step, ...]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.requests: list[dict[str, Any]] = []
        self.aborts = 0
        self.reset(scripts)
        super().__init__(name="sglang-chat")

    def reset(self, scripts: Mapping[str, Sequence[Step]]) -> None:
        """Answer with ``scripts`` from now on, and forget the requests and aborts received so far."""
        with self._lock:
            self._scripts = {prompt: tuple(steps) for prompt, steps in scripts.items()}
            self.requests = []
            self.aborts = 0

    def script(self, prompt: str, steps: Sequence[Step]) -> None:
        """Answer the episodes whose first user prompt is ``prompt`` with ``steps`` from now on."""
        with self._lock:
            self._scripts[prompt] = tuple(steps)

    def requests_for(self, prompt: str) -> list[dict[str, Any]]:
        """The bodies of the chat requests of episodes whose first user prompt is ``prompt``."""
        with self._lock:
            return [body for body in self.requests if _first_prompt(body) == prompt]

    def respond(self, received: Received) -> tuple[int, Any]:
        body = received.body
        if received.method == "GET":
            if received.route == "/workers":
                return HTTPStatus.OK, {"workers": [{"url": self.url}]}
            return HTTPStatus.NOT_FOUND, {"error": f"no GET {received.path}"}
        if received.route == "/abort_request":
            with self._lock:
                self.aborts += 1
            return HTTPStatus.OK, {}
        if received.route != "/v1/chat/completions" or not isinstance(body, dict):
            return HTTPStatus.NOT_FOUND, {"error": f"no POST {received.path} with a JSON object"}
        return answer(self._step(body), lambda reply: self._completion(reply, body), sleep=self.sleep)

    def _step(self, body: dict[str, Any]) -> Step:
        with self._lock:
            self.requests.append(body)
            steps = self._scripts.get(_first_prompt(body), ())
        taken = sum(1 for message in body.get("messages", []) if message.get("role") == "assistant")
        if taken >= len(steps):
            return Error(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"no scripted reply #{taken + 1} for {body}"})
        return steps[taken]

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
        meta_info = {
            "id": f"req-{next(self._ids)}",
            "prompt_tokens": len(body.get("input_ids") or ()),
            "completion_tokens": len(logprobs),
            "cached_tokens": 0,
            "output_token_logprobs": logprobs,
        }
        finish_reason = "tool_calls" if reply.tool_calls else "stop"
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
