"""A stand-in for the SGLang server behind Miles' session server: ``POST /v1/chat/completions`` answered from
test_support's per-task scripts, in SGLang's shape, with Qwen3's token ids.

Miles' session server renders the chat itself and sends its token ids as ``input_ids``; what it needs back is the
reply's message and ``choices[0].meta_info.output_token_logprobs`` (``[logprob, token id, ...]`` per output token),
which it stitches into the training sample. A reply is the text Qwen3 would emit for it (its ``<tool_call>`` blocks
included) followed by ``<|im_end|>``, tokenized with the checkpoint's tokenizer. The script of a request is chosen by
its episode's first user prompt, and its step by how many replies the chat already holds, so the stand-in keeps no
state per session. It also answers what Miles' abort step asks of SGLang's router and workers (``GET /workers``,
``POST /abort_request``).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from test_support.scripted_model import Broken, Delay, Error, Reply, Step

IM_END = "<|im_end|>"


class SGLangChat:
    """The stand-in, listening on a free loopback port until ``close()``. ``scripts`` maps an episode's first user
    prompt to the steps that answer its requests, one per reply."""

    def __init__(self, tokenizer: Any, scripts: Mapping[str, Sequence[Step]]):
        self._tokenizer = tokenizer
        self._scripts: dict[str, tuple[Step, ...]] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._ids = itertools.count(1)
        self.requests: list[dict[str, Any]] = []
        self.aborts = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="sglang-chat", daemon=True)
        self._thread.start()
        self.reset(scripts)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _step(self, body: dict[str, Any]) -> Step:
        with self._lock:
            self.requests.append(body)
            steps = self._scripts.get(_first_prompt(body), ())
        taken = sum(1 for message in body.get("messages", []) if message.get("role") == "assistant")
        if taken >= len(steps):
            return Error(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"no scripted reply #{taken + 1} for {body}"})
        return steps[taken]

    def _wait(self, seconds: float) -> None:
        self._closing.wait(seconds)

    def _completion(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        ids = self._tokenizer.encode(_qwen3_text(reply), add_special_tokens=False)
        ids.append(self._tokenizer.convert_tokens_to_ids(IM_END))
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
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.01 * (position + 1), token, None] for position, token in enumerate(ids)],
        }
        finish_reason = "tool_calls" if reply.tool_calls else "stop"
        return {
            "id": meta_info["id"],
            "object": "chat.completion",
            "model": body.get("model", "default"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "meta_info": meta_info}],
            "usage": {
                "prompt_tokens": meta_info["prompt_tokens"],
                "completion_tokens": len(ids),
                "total_tokens": meta_info["prompt_tokens"] + len(ids),
            },
        }


def _first_prompt(body: Mapping[str, Any]) -> str | None:
    for message in body.get("messages", []):
        if message.get("role") == "user":
            return message.get("content")
    return None


def _qwen3_text(reply: Reply) -> str:
    """What Qwen3 emits for ``reply`` before its ``<|im_end|>``: the text, then one ``<tool_call>`` block per call,
    laid out as its chat template renders them."""
    blocks = [
        "<tool_call>\n"
        + json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}, ensure_ascii=False)
        + "\n</tool_call>"
        for call in reply.tool_calls
    ]
    return "\n".join(([reply.content] if reply.content else []) + blocks)


def _handler(chat: SGLangChat) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path == "/workers":
                self._send(HTTPStatus.OK, {"workers": [{"url": chat.url}]})
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no GET {self.path}"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/abort_request":
                with chat._lock:
                    chat.aborts += 1
                self._send(HTTPStatus.OK, {})
                return
            if self.path != "/v1/chat/completions":
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no POST {self.path}"})
                return
            step = chat._step(body)
            while isinstance(step, Delay):
                chat._wait(step.seconds)
                step = step.then
            if isinstance(step, Reply):
                self._send(HTTPStatus.OK, chat._completion(step, body))
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
