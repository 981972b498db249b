"""Dataset rows for a server's tasks: the chat a trainer's dataset reads as the prompt, and the metadata that lets
the episode loop find the task again. slime and Miles read a row with ``--input-key messages --metadata-key
metadata`` and hand the metadata to the rollout, which gives it to ``play``.

A row is ``{"messages": [...], "metadata": {"episode": ..., "tools": [...], "server": ...}}``: the first turn's
system prompt (when it has one) and prompt, the task's place on the server, the first turn's tools as OpenAI function
tools (``end_turn`` included), and the server's URL and env name."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from chat_core.env.protocol import TaskInfo, Tool, server_url


@dataclass(frozen=True)
class EpisodeRef:
    """Which episode a row plays: task ``index`` of ``split`` on the server at ``server_url``, which must still be
    the task ``task_id``."""

    split: str
    index: int
    task_id: str
    task_name: str
    server_url: str
    env_name: str

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> EpisodeRef:
        """The episode of a row's metadata, as ``prepare`` writes it and slime or Miles hand it over (extra keys
        are ignored). Raises ValueError naming what is missing or mistyped when the metadata isn't a row's."""
        if not isinstance(metadata, Mapping):
            raise ValueError(f"a row's metadata is a mapping, not {type(metadata).__name__}")
        episode, server = metadata.get("episode"), metadata.get("server")
        if not isinstance(episode, Mapping) or not isinstance(server, Mapping):
            raise ValueError(
                "this metadata has no 'episode' or 'server': it isn't a row written by "
                f"python -m chat_core.prepare (its keys are {sorted(metadata)})"
            )
        fields = {
            "split": episode.get("split"),
            "index": episode.get("index"),
            "task_id": episode.get("task_id"),
            "task_name": episode.get("task_name"),
            "server_url": server.get("url"),
            "env_name": server.get("env_name"),
        }
        wrong = [
            name
            for name, value in fields.items()
            if not (
                isinstance(value, int) and not isinstance(value, bool)
                if name == "index"
                else isinstance(value, str) and value
            )
        ]
        if wrong:
            raise ValueError(
                f"this row's metadata lacks a valid {', '.join(wrong)}: it isn't a row written by "
                "python -m chat_core.prepare"
            )
        fields["server_url"] = server_url(fields["server_url"])
        return cls(**fields)


def task_row(task: TaskInfo, tools: list[Tool], *, server: str, env_name: str) -> dict[str, Any]:
    """The row of ``task``, whose first turn offers ``tools``, served by ``env_name`` at ``server``."""
    messages = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
    messages.append({"role": "user", "content": task.prompt})
    return {
        "messages": messages,
        "metadata": {
            "episode": {"split": task.split, "index": task.index, "task_id": task.id, "task_name": task.name},
            "tools": [tool.as_openai() for tool in tools],
            "server": {"url": server, "env_name": env_name},
        },
    }


def row_line(row: Mapping[str, Any]) -> str:
    """``row`` as one JSONL line, keys sorted, so the same row is always the same bytes."""
    return json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n"
