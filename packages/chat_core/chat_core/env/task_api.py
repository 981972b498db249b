"""The Task API of an OpenEnv server of agentenv tasks, over HTTP: the one env it serves, its splits, and each
split's tasks. It speaks only the wire (JSON, read into ``chat_core.env.protocol``'s types), so it runs in a
trainer's environment without the server's packages; every way the server can fail a caller is one of
``chat_core.errors``."""

from __future__ import annotations

import asyncio
from typing import Any

from chat_core._wire import MIB, described, encoded, excerpt, parse_json, wire_text
from chat_core.env.protocol import TaskInfo
from chat_core.episode_ref import server_url
from chat_core.errors import NotAnOpenEnvServer, ServerError, ServerUnreachable
from chat_core.net.http_request import HttpError, MalformedAnswer, Redirected, check_url, request

TASK_API_TIMEOUT_S = 60.0
"""How long a Task API request may go unanswered."""
MAX_TASK_API_ANSWER_BYTES = 64 * MIB
"""The longest Task API answer read: a split's task list holds every task's prompts."""


class OpenEnvServer:
    """The Task API of the OpenEnv server at ``url``: its env's name, splits and tasks, asked over the event loop's
    HTTP client session (``chat_core.net.http_request``), each request bounded by ``TASK_API_TIMEOUT_S`` and each
    answer's body by ``max_answer_bytes``. Every method raises ServerUnreachable when nothing answers,
    NotAnOpenEnvServer when what answers isn't an OpenEnv server (an answer past the limit among them), and
    ServerError when the server refuses or fails the request."""

    def __init__(self, url: str, *, max_answer_bytes: int = MAX_TASK_API_ANSWER_BYTES):
        """Raises InvalidServerUrl when ``url`` isn't an absolute http(s) URL."""
        self.url = server_url(url)
        self._max_answer_bytes = max_answer_bytes
        self._env_name: str | None = None

    async def env_name(self) -> str:
        """The name of the one env the server serves (``GET /list_environments``)."""
        if self._env_name is None:
            names = await self._json("GET", "/list_environments", what="its environments")
            if not (isinstance(names, list) and len(names) == 1 and isinstance(names[0], str) and names[0]):
                raise NotAnOpenEnvServer(
                    f"{self.url} answered GET /list_environments with {excerpt(names)}, not "
                    "the one env name an agentenv OpenEnv server serves"
                )
            self._env_name = names[0]
        return self._env_name

    async def splits(self) -> list[str]:
        """The names of the server's splits, in the server's order."""
        answer = await self._json("GET", f"/{await self.env_name()}/splits", what="its splits")
        if not isinstance(answer, list) or not all(
            isinstance(each, dict) and isinstance(each.get("name"), str) for each in answer
        ):
            raise NotAnOpenEnvServer(f"{self.url} listed its splits as {excerpt(answer)}")
        return [each["name"] for each in answer]

    async def tasks(self, split: str) -> list[TaskInfo]:
        """Every task of ``split``, by index; ServerError (400) when the server has no such split."""
        answer = await self._json(
            "POST", f"/{await self.env_name()}/tasks", {"split": split}, what=f"the tasks of split {split!r}"
        )
        listed = answer.get("tasks") if isinstance(answer, dict) else None
        if not isinstance(listed, list):
            raise NotAnOpenEnvServer(f"{self.url} listed the tasks of split {split!r} as {excerpt(answer)}")
        tasks = [TaskInfo.of(split, each) for each in listed]
        if [task.index for task in tasks] != list(range(len(tasks))):
            raise NotAnOpenEnvServer(f"{self.url} listed the tasks of split {split!r} out of index order")
        return tasks

    async def _json(self, method: str, path: str, body: dict[str, Any] | None = None, *, what: str) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        url = self.url + path
        try:
            check_url(url, headers)
            async with asyncio.timeout(TASK_API_TIMEOUT_S):
                answer = await request(
                    method,
                    url,
                    headers,
                    None if body is None else encoded(body),
                    max_body_bytes=self._max_answer_bytes,
                    limit_name="max_answer_bytes",
                )
        except TimeoutError:
            raise ServerUnreachable(
                f"{self.url} didn't answer within {TASK_API_TIMEOUT_S:g} s when asked for {what}"
            ) from None
        except (MalformedAnswer, Redirected) as e:
            raise NotAnOpenEnvServer(f"{self.url} {method} {path} for {what}: {e}") from None
        except (HttpError, ValueError) as e:
            raise ServerUnreachable(f"can't reach {self.url} to ask for {what}: {described(e)}") from None
        status, raw = answer.status, answer.body
        if self._env_name is None and 400 <= status < 500:
            raise NotAnOpenEnvServer(
                f"{self.url} answered {method} {path} with HTTP {status}: it isn't an OpenEnv server"
            )
        if status >= 400:
            raise ServerError(
                f"{self.url} answered {method} {path} for {what} with HTTP {status}: {_detail(raw)}", status
            )
        try:
            return parse_json(raw)
        except ValueError as e:
            raise NotAnOpenEnvServer(
                f"{self.url} answered {method} {path} with something that isn't JSON ({e}): {excerpt(wire_text(raw))}"
            ) from None


def _detail(raw: bytes) -> str:
    try:
        detail = parse_json(raw).get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail else excerpt(wire_text(raw))
