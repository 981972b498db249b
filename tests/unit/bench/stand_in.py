"""The benchmark's fast stand-ins, each served from a process of its own so the driver's CPU is the loop's alone: an
OpenEnv server replaying the frames recorded from agent-env's real server (``frames.json``), and a model that
answers at once (or after a fixed delay) without a script to keep.

The env stand-in speaks the real wire: the Task API (``GET /list_environments``, ``GET /{env}/splits``, ``POST
/{env}/tasks``) and one episode per WebSocket session on ``/ws``, answering each message with the frame the real
server answered it with, and an error frame when the message isn't the one recorded; a reset starts the recording
over, as a reset on the real server abandons the episode before it. It serves the recorded task
``--tasks`` times over (``split all``, index ``i``), each reset's frame naming its own task. The model replies to a
turn's first request with ``TOOL_CALLS[turn]`` and to the next with ``REPLIES[turn]``: 2 turns x 3 tool calls.

Run: ``python stand_in.py env FRAMES [--tasks N] --port-file F`` or ``python stand_in.py model [--delay S] --port-file
F``; each writes its port to F once it listens, and serves until killed. ``served`` does that for a caller."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

FRAMES = Path(__file__).resolve().with_name("frames.json")
BUNDLE = Path(__file__).resolve().with_name("bundle") / "bench-env"
BUNDLE_PLACEHOLDER = "<bench bundle>"
"""How ``frames.json`` writes the bundle's absolute path, which the real server puts in task ids: the recording
plays the same wherever the checkout lies."""


def load_frames(path: Path) -> dict[str, Any]:
    """The recorded frames at ``path``, with this checkout's bundle path in place of ``BUNDLE_PLACEHOLDER``."""
    return json.loads(path.read_text().replace(BUNDLE_PLACEHOLDER, str(BUNDLE)))


HOST = "127.0.0.1"
TOOL_CALLS = (
    (("find_crate", {"name": "pears"}), ("list_crates", {}), ("find_crate", {"name": "apples"})),
    (("find_crate", {"name": "pears"}), ("find_crate", {"name": "apples"}), ("list_crates", {})),
)
REPLIES = ("There are apples and pears; the pears are on shelf 9C.", "The pears are on 9C, the apples on 4B.")
_READY_S = 30.0
_ID, _NAME, _INDEX = "\u0000id", "\u0000name", -987654321


def task_of(recorded: dict[str, Any], index: int, count: int) -> dict[str, Any]:
    """Task ``index`` of ``count`` as the stand-in's Task API lists it: the recorded task itself when it serves one,
    else the recorded task under an id and name of its own."""
    if count == 1:
        return {**recorded, "index": 0}
    return {**recorded, "index": index, "id": f"{recorded['id']}.{index}", "name": f"{recorded['name']}.{index}"}


def env_app(frames: dict[str, Any], tasks: int) -> web.Application:
    """The stand-in OpenEnv server of ``tasks`` copies of the recorded task."""
    env, recorded = frames["env_name"], frames["task"]
    listed = [task_of(recorded, index, tasks) for index in range(tasks)]
    exchange = frames["exchange"]
    reset_frame = copy.deepcopy(exchange[0][1])
    reset_frame["data"]["metadata"]["task"] = {"id": _ID, "name": _NAME, "split": "all", "index": _INDEX}
    reset_template = json.dumps(reset_frame)
    steps = [(message, json.dumps(frame)) for message, frame in exchange[1:]]

    def reset_answer(index: int) -> str:
        task = listed[index]
        return (
            reset_template.replace(json.dumps(_ID), json.dumps(task["id"]))
            .replace(json.dumps(_NAME), json.dumps(task["name"]))
            .replace(str(_INDEX), str(index))
        )

    async def environments(request: web.Request) -> web.Response:
        return web.json_response([env])

    async def splits(request: web.Request) -> web.Response:
        return web.json_response([{"name": "all", "type": "validation"}])

    async def task_list(request: web.Request) -> web.Response:
        return web.json_response({"tasks": listed, "env_name": env})

    async def episode(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        position = -1
        async for message in ws:
            if message.type != WSMsgType.TEXT:
                break
            sent = json.loads(message.data)
            if sent.get("type") == "close":
                break
            if sent.get("type") == "reset":
                await ws.send_str(reset_answer(sent["data"]["index"]))
                position = 0
            elif 0 <= position < len(steps) and sent == steps[position][0]:
                await ws.send_str(steps[position][1])
                position += 1
            else:
                expected = steps[position][0] if 0 <= position < len(steps) else "a reset"
                await ws.send_json(
                    {"type": "error", "data": {"code": "STAND_IN", "message": f"recorded {expected}, got {sent}"}}
                )
                break
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/list_environments", environments)
    app.router.add_get(f"/{env}/splits", splits)
    app.router.add_post(f"/{env}/tasks", task_list)
    app.router.add_get("/ws", episode)
    return app


def model_reply(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The completion answering ``messages``: the turn's tool calls when the turn has none answered yet, else its
    reply."""
    turn = sum(message["role"] == "user" for message in messages) - 1
    last = messages[-1]["role"]
    if last == "user":
        calls = [
            {"id": f"call_{turn}_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for n, (name, args) in enumerate(TOOL_CALLS[turn % len(TOOL_CALLS)])
        ]
        message, finish = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    else:
        message, finish = {"role": "assistant", "content": REPLIES[turn % len(REPLIES)]}, "stop"
    return {"id": "bench", "object": "chat.completion", "choices": [{"index": 0, "message": message,
                                                                      "finish_reason": finish}]}  # fmt: skip


def model_app(delay_s: float) -> web.Application:
    """The model at ``/v1/chat/completions``, answering after ``delay_s`` seconds."""

    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        if delay_s:
            await asyncio.sleep(delay_s)
        return web.json_response(model_reply(body["messages"]))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    return app


@contextmanager
def served(*arguments: str) -> Iterator[str]:
    """A stand-in (``env FRAMES`` or ``model``, with its options) in a process of its own; yields its base URL and
    stops it on leaving. Raises RuntimeError when it isn't listening within 30 s."""
    port_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"stand-in-{os.getpid()}-{time.monotonic_ns()}.port"
    process = subprocess.Popen(
        [sys.executable, __file__, *arguments, "--port-file", str(port_file)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        deadline = time.monotonic() + _READY_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {arguments[0]} stand-in didn't start (exit status {process.poll()})")
            time.sleep(0.02)
        yield f"http://{HOST}:{port_file.read_text().strip()}"
    finally:
        process.kill()
        process.wait()
        port_file.unlink(missing_ok=True)


async def _serve(app: web.Application, port_file: Path) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, HOST, 0, backlog=4096).start()
    port = runner.addresses[0][1]
    port_file.with_suffix(".tmp").write_text(str(port))
    port_file.with_suffix(".tmp").rename(port_file)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    env = kinds.add_parser("env")
    env.add_argument("frames", type=Path)
    env.add_argument("--tasks", type=int, default=1)
    model = kinds.add_parser("model")
    model.add_argument("--delay", type=float, default=0.0)
    for each in (env, model):
        each.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    app = env_app(load_frames(args.frames), args.tasks) if args.kind == "env" else model_app(args.delay)
    asyncio.run(_serve(app, args.port_file))


if __name__ == "__main__":
    main()
