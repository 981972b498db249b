"""Dataset rows for a server's tasks: the chat a trainer's dataset reads as the prompt, and the metadata that lets
the episode loop find the task again. slime and Miles read a row with ``--input-key messages --metadata-key
metadata`` and hand the metadata to the rollout, which gives it to ``play``.

A row is ``{"messages": [...], "metadata": {"episode": ..., "tools": [...], "server": ...}}``: the first turn's
system prompt (when it has one) and prompt, the task's place on the server, the first turn's tools as OpenAI function
tools (``end_turn`` included), and the server's URL and env name."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from chat_core.env.protocol import TaskInfo, Tool


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
