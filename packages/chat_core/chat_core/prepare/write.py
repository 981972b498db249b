"""``write_rows`` writes every split of an OpenEnv server as ``OUT/<split>.jsonl``, one row per task (see
``chat_core.prepare.rows``), for a trainer's dataset to read.

Pipeline: Task API (env name, splits, tasks) → one probe episode per distinct task for its first turn's tools →
rows → a temporary folder beside OUT, renamed to OUT once every file is written, so OUT is whole or absent.

Tools exist only inside an episode, so each task is reset, its tools listed, and the episode abandoned before any
verifier runs. Tasks aren't grouped to share a probe: the Task API names a task's agent but not the envs it deploys
or whether it works in a sandbox, so two tasks playing the same agent can offer different tools (one deploys an env,
the other none), and an env's tools come from the server deployed for that episode; only the task itself says which
tools it offers. A task served in several splits (an eval's tasks are also in
``all``) is probed once. Probes run at most ``concurrency`` at a time, fewer once the server reports a smaller
limit; each worker probes its tasks one after another in one session (``ProbeSession``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import uuid
from collections import deque
from pathlib import Path

from tqdm import tqdm

from chat_core.env.protocol import TaskInfo, Tool
from chat_core.env.session import ProbeSession
from chat_core.env.task_api import MAX_TASK_API_ANSWER_BYTES, OpenEnvServer
from chat_core.prepare.rows import row_line, task_row

DEFAULT_CONCURRENCY = 8


class PrepareError(Exception):
    """The server's tasks can't be written as rows: it serves none, a split's name can't be a file name, or a task
    can't start its first turn."""


async def write_rows(
    url: str,
    out: Path,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: bool = True,
    max_answer_bytes: int = MAX_TASK_API_ANSWER_BYTES,
) -> dict[str, int]:
    """Write every split of the server at ``url`` as ``out/<split>.jsonl`` and return each split's row count, in
    the server's split order. Probes run at most ``concurrency`` at a time, each waiting up to
    ``Limits.capacity_wait_s`` for a free session; ``progress`` shows a progress bar on stderr. A Task API answer
    longer than ``max_answer_bytes`` and a session message longer than ``Limits.max_env_message_bytes`` are refused
    as the server breaking the protocol.

    Nothing is left at ``out`` unless every file was written. Raises FileExistsError when ``out`` exists,
    FileNotFoundError when its parent folder doesn't, ValueError when ``concurrency`` is below 1, the
    ``OpenEnvError`` of a server that is unreachable, isn't an OpenEnv server, fails a request, stays full or breaks
    the protocol, and PrepareError when it serves no task, names a split that can't be a file name, or a task can't
    start its first turn."""
    out = Path(out)
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    _check_free(out)
    server = OpenEnvServer(url, max_answer_bytes=max_answer_bytes)
    env_name = await server.env_name()
    splits = {split: await server.tasks(split) for split in await server.splits()}
    for split in splits:
        if not split or "/" in split or "\0" in split or split.startswith("."):
            raise PrepareError(f"the server has a split named {split!r}, which can't be a file name in {out}")
    if not any(splits.values()):
        raise PrepareError(f"{server.url} serves no task: its splits ({', '.join(splits) or 'none'}) are empty")
    distinct = list({task.id: task for tasks in splits.values() for task in tasks}.values())
    tools = await _first_turn_tools(server.url, distinct, concurrency, progress)
    _check_free(out)
    staging = out.with_name(f".{out.name}.{uuid.uuid4().hex}.partial")
    staging.mkdir()
    try:
        for split, tasks in splits.items():
            with open(staging / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as file:
                file.writelines(
                    row_line(task_row(task, tools[task.id], server=server.url, env_name=env_name)) for task in tasks
                )
        _check_free(out)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {split: len(tasks) for split, tasks in splits.items()}


async def _first_turn_tools(url: str, tasks: list[TaskInfo], concurrency: int, progress: bool) -> dict[str, list[Tool]]:
    """Each task's first-turn tools by task id, probed by workers, each in one session, that stop, beyond the
    server's session limit once a refusal reports it, after their current probe. The first failure cancels the
    other probes and is raised."""
    pending = deque(tasks)
    found: dict[str, list[Tool]] = {}
    allowed = min(concurrency, len(tasks))

    async def work(slot: int) -> None:
        nonlocal allowed
        async with ProbeSession(url) as session:
            while pending and slot < allowed:
                task = pending.popleft()
                found[task.id] = await _probed(session, task)
                if session.max_sessions is not None:
                    allowed = max(1, min(allowed, session.max_sessions))
                bar.update()

    with tqdm(
        total=len(tasks), desc="probing first-turn tools", unit="task", file=sys.stderr, disable=not progress
    ) as bar:
        try:
            async with asyncio.TaskGroup() as group:
                for slot in range(allowed):
                    group.create_task(work(slot))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
    return found


async def _probed(session: ProbeSession, task: TaskInfo) -> list[Tool]:
    """The tools ``task``'s first turn offers, from an episode the session's next reset or close abandons."""
    where = f"task {task.name!r} ({task.split} #{task.index})"
    started = await session.reset(task.split, task.index)
    if started.done:
        raise PrepareError(f"{where} can't start its first turn on the server: {started.error}")
    if (started.task or {}).get("id") != task.id:
        raise PrepareError(
            f"{where} is {task.id!r} in the Task API but the episode started "
            f"{(started.task or {}).get('id')!r}: did the server change while prepare ran?"
        )
    listed = await session.list_tools()
    if listed.done:
        raise PrepareError(f"{where} ended before its tools could be listed: {listed.error}")
    return listed.tools


def _check_free(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise FileExistsError(f"{out} already exists; give a folder that doesn't, so no rows are mixed or lost")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent} isn't a folder; create it first, then write the rows into {out}")
