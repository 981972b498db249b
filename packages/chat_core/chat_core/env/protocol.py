"""The OpenEnv wire's plain types: a task as the Task API describes it, a tool as a turn offers it, and an
observation as an episode's session answers. Each is read from JSON here, with no network code, so the
rows, the episode record, the filters and the metrics use them without loading a client.

What the server sends that isn't one of these raises the ``chat_core.errors`` case that says so: the Task API's
``NotAnOpenEnvServer``, a session's ``EpisodeProtocolError``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chat_core._wire import excerpt
from chat_core.errors import EpisodeProtocolError, NotAnOpenEnvServer

CAPACITY_REACHED = "CAPACITY_REACHED"


@dataclass(frozen=True)
class TaskInfo:
    """A task as the Task API describes it: where it is served (``split``, ``index``), what it is (``id``,
    ``name``) and its first turn's prompts."""

    split: str
    index: int
    id: str
    name: str
    prompt: str
    system_prompt: str | None

    @classmethod
    def of(cls, split: str, described: Any) -> TaskInfo:
        """The task of ``split`` the Task API ``described``; NotAnOpenEnvServer when it isn't described as one."""
        if not isinstance(described, dict):
            raise NotAnOpenEnvServer(f"a task of split {split!r} is described as {excerpt(described)}")
        index, task_id, name, prompt = (described.get(key) for key in ("index", "id", "name", "prompt"))
        system_prompt = described.get("system_prompt")
        if not (
            isinstance(index, int)
            and isinstance(task_id, str)
            and isinstance(name, str)
            and isinstance(prompt, str)
            and (system_prompt is None or isinstance(system_prompt, str))
        ):
            raise NotAnOpenEnvServer(
                f"a task of split {split!r} lacks an index, id, name or prompt: {excerpt(described)}"
            )
        return cls(split=split, index=index, id=task_id, name=name, prompt=prompt, system_prompt=system_prompt)


@dataclass(frozen=True)
class Tool:
    """A tool the env offers in the current turn, as MCP describes it."""

    name: str
    description: str
    input_schema: dict[str, Any]

    @classmethod
    def of(cls, described: Any) -> Tool:
        """The tool a ``list_tools`` answer ``described``; EpisodeProtocolError when it isn't described as MCP
        describes tools."""
        if not (isinstance(described, dict) and isinstance(described.get("name"), str)):
            raise EpisodeProtocolError(f"a listed tool isn't described as MCP describes tools: {excerpt(described)}")
        schema = described.get("input_schema")
        return cls(
            name=described["name"],
            description=str(described.get("description") or ""),
            input_schema=schema if isinstance(schema, dict) else {"type": "object"},
        )

    def as_openai(self) -> dict[str, Any]:
        """The tool as an OpenAI chat-completions function tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.input_schema},
        }


@dataclass(frozen=True)
class Observation:
    """What the server answered a reset or a step with: whether the episode is over and its reward, the step's own
    answer (``body``) and the episode's metadata (prompts, task, scores, or the error that ended it)."""

    done: bool
    reward: float | int | None
    body: dict[str, Any]
    metadata: dict[str, Any]

    @classmethod
    def of(cls, frame: dict[str, Any], what: str) -> Observation:
        """The observation a session's ``frame`` holds as the answer to ``what``. Raises EpisodeProtocolError when
        the frame is the server's error, isn't an observation, or carries a reward that isn't a number."""
        data = frame.get("data")
        if frame.get("type") == "error":
            detail = data if isinstance(data, dict) else {}
            raise EpisodeProtocolError(
                f"the server refused {what}: {detail.get('code', 'error')}: {detail.get('message', excerpt(data))}"
            )
        if frame.get("type") != "observation" or not isinstance(data, dict):
            raise EpisodeProtocolError(f"the answer to {what} isn't an observation: {excerpt(frame)}")
        body = data.get("observation")
        body = body if isinstance(body, dict) else {}
        metadata = data.get("metadata")
        if not isinstance(metadata, dict):
            metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        reward = data.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise EpisodeProtocolError(f"the answer to {what} has a reward that isn't a number: {excerpt(reward)}")
        return cls(done=bool(data.get("done")), reward=reward, body=body, metadata=metadata)

    @property
    def error(self) -> str | None:
        """The server's account of why the episode ended in an error, or None when it didn't."""
        if self.metadata.get("status") != "error":
            return None
        return str(self.metadata.get("error") or "the server gave no reason")

    @property
    def task(self) -> dict[str, Any] | None:
        task = self.metadata.get("task")
        return task if isinstance(task, dict) else None

    @property
    def tools(self) -> list[Tool]:
        """The tools a ``list_tools`` step answered with; refuses with EpisodeProtocolError when one isn't
        described as MCP describes tools."""
        listed = self.body.get("tools") or []
        if not isinstance(listed, list):
            raise EpisodeProtocolError(f"list_tools answered with tools that aren't a list: {excerpt(listed)}")
        return [Tool.of(each) for each in listed]


@dataclass(frozen=True)
class CapacityRefusal:
    """The server's refusal of a session because all its sessions are taken, and its limit when the refusal names
    it."""

    max_sessions: int | None

    @classmethod
    def of(cls, frame: dict[str, Any]) -> CapacityRefusal | None:
        """The refusal ``frame`` is, or None when it is something else."""
        data = frame.get("data")
        if frame.get("type") != "error" or not isinstance(data, dict) or data.get("code") != CAPACITY_REACHED:
            return None
        limit = data.get("max_sessions")
        return cls(limit if isinstance(limit, int) and not isinstance(limit, bool) else None)
