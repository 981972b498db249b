"""test_support against agent-env's real env server: the sample bundle is served whole, the serve fixture counts
what is held open, each episode's tool server comes and goes with it, the shared scripts earn the rewards they
promise, the script cursor walks each session's script, and the scripted model answers and records as scripted."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from test_support import (
    REWARDS,
    SAMPLE_BUNDLE,
    SAMPLE_ENV,
    SCRIPTS,
    TASKS,
    LeftOpen,
    ScriptedModel,
    ServedBundle,
    ServerFailed,
    broken,
    delay,
    error,
    serve,
    serve_bundle,
    text,
    tool_call,
    tool_calls,
)
from test_support.loopback import Request
from test_support.script import ScriptCursor, ScriptUsedUp
from websockets.asyncio.client import ClientConnection, connect

pytest_plugins = ["test_support.pytest_plugin"]


async def _ask(ws: ClientConnection, message: dict) -> dict:
    await ws.send(json.dumps(message))
    return json.loads(await ws.recv())


def _reset(index: int) -> dict:
    return {"type": "reset", "data": {"split": "all", "index": index}}


def _call(name: str, arguments: dict) -> dict:
    return {"type": "step", "data": {"type": "call_tool", "tool_name": name, "arguments": arguments}}


def test_the_sample_bundle_is_served_whole(sample_env: ServedBundle) -> None:
    files = sorted(path.stem for path in (SAMPLE_BUNDLE / "tasks").glob("*.json"))
    assert files == sorted(TASKS) == sorted(SCRIPTS) == sorted(REWARDS)
    assert sorted(task["name"] for task in sample_env.tasks()) == files
    assert sorted(task["name"] for task in sample_env.tasks("happy")) == sorted(
        name for name, reward in REWARDS.items() if reward == 1.0
    )
    assert sample_env.env_name == SAMPLE_ENV


def test_an_open_episode_is_counted_until_its_socket_closes(sample_env: ServedBundle) -> None:
    async def play() -> None:
        async with connect(sample_env.ws_url) as ws:
            reset = await _ask(ws, _reset(sample_env.index_of("played")))
            assert reset["data"]["done"] is False
            held = await asyncio.to_thread(sample_env.held_open)
            assert (held.episodes, held.sessions, held.sandboxes) == (1, 1, 1)
            with pytest.raises(LeftOpen, match="1 episode"):
                await asyncio.to_thread(sample_env.wait_until_closed, 0.2)

    asyncio.run(play())
    sample_env.wait_until_closed()
    assert sample_env.open_episodes() == 0 and sample_env.open_sessions() == 0 and not sample_env.live_sandboxes()


def test_an_episode_gets_its_own_tool_server_and_loses_it_at_the_end(sample_env: ServedBundle) -> None:
    async def play() -> tuple[dict, dict, dict, int]:
        async with connect(sample_env.ws_url) as ws:
            await _ask(ws, _reset(sample_env.index_of("adds_a_crate")))
            [sandbox] = sample_env.live_sandboxes()
            port = int((sandbox / "port").read_text())
            tools = await _ask(ws, {"type": "step", "data": {"type": "list_tools"}})
            added = await _ask(ws, _call("add_crate", {"name": "oranges"}))
            ended = await _ask(ws, _call("end_turn", {"response": "Added."}))
            return tools, added, ended, port

    tools, added, ended, port = asyncio.run(play())
    names = [tool["name"] for tool in tools["data"]["observation"]["tools"]]
    assert names == ["list_crates", "find_crate", "add_crate", "wait_for_truck", "end_turn"]
    assert "holds 3 crates" in added["data"]["observation"]["result"]["data"]
    assert (ended["data"]["done"], ended["data"]["reward"]) == (True, 1.0)
    sample_env.wait_until_closed()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_each_task_earns_its_reward_with_its_script(sample_env: ServedBundle, scripted_model: ScriptedModel) -> None:
    """Plays every task at once, each through the scripted model's session named after it, as a trainer would."""
    for name, steps in SCRIPTS.items():
        scripted_model.script(steps, session=name)

    async def play(client: httpx.AsyncClient, name: str) -> float | None:
        async with connect(sample_env.ws_url) as ws:
            reset = await _ask(ws, _reset(sample_env.index_of(name)))
            messages = [{"role": "user", "content": reset["data"]["observation"]["metadata"]["prompt"]}]
            while True:
                answer = await client.post(
                    f"{scripted_model.base_url}/chat/completions",
                    json={"model": "m", "messages": messages, "user": name},
                )
                message = answer.raise_for_status().json()["choices"][0]["message"]
                messages.append(message)
                for call in message.get("tool_calls") or []:
                    function = call["function"]
                    result = await _ask(ws, _call(function["name"], json.loads(function["arguments"])))
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
                if message.get("tool_calls"):
                    continue
                ended = (await _ask(ws, _call("end_turn", {"response": message["content"]})))["data"]
                if ended["done"]:
                    return ended["reward"]
                messages.append({"role": "user", "content": ended["observation"]["result"]["prompt"]})

    async def play_all() -> dict[str, float | None]:
        async with httpx.AsyncClient(timeout=30) as client:
            rewards = await asyncio.gather(*(play(client, name) for name in TASKS))
        return dict(zip(TASKS, rewards, strict=True))

    assert asyncio.run(play_all()) == dict(REWARDS)
    assert not scripted_model.unscripted
    assert {name: len(scripted_model.requests_of(name)) for name in TASKS} == {
        name: len(steps) for name, steps in SCRIPTS.items()
    }


def test_a_server_not_ready_in_time_is_stopped_and_reported() -> None:
    with pytest.raises(ServerFailed, match=r"wasn't ready in 0\.5s"), serve_bundle(startup_timeout=0.5):
        pass


def test_a_missing_bundle_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError), serve_bundle(tmp_path / "nowhere"):
        pass
    assert serve.main([str(tmp_path / "nowhere")]) == 1
    assert "there is no bundle folder" in capsys.readouterr().err


@pytest.fixture
def chat(scripted_model: ScriptedModel) -> Iterator[Callable[..., httpx.Response]]:
    """Posts a body, and any headers, to the scripted model's chat endpoint."""
    with httpx.Client(base_url=scripted_model.base_url, timeout=10) as client:
        yield lambda body, **headers: client.post("/chat/completions", json=body, headers=headers)


def test_the_scripted_model_replies_in_order_and_records_each_request(
    scripted_model: ScriptedModel, chat: Callable[..., httpx.Response]
) -> None:
    scripted_model.script(
        [
            tool_call("find_crate", {"name": "pears"}),
            tool_call("add_crate", '{"name": "oranges"'),
            tool_calls(tool_call("list_crates"), tool_call("find_crate", {"name": "apples"}), content="Two at once."),
            text("Shelf 9C."),
        ]
    )
    tools = [{"type": "function", "function": {"name": "find_crate", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "Where?"}], "tools": tools, "temperature": 0.5}
    replies = [chat(body, authorization="Bearer s1").json() for _ in range(4)]

    first, malformed, both, last = (reply["choices"][0] for reply in replies)
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["tool_calls"][0]["type"] == "function"
    assert first["message"]["tool_calls"][0]["function"] == {"name": "find_crate", "arguments": '{"name": "pears"}'}
    assert malformed["message"]["tool_calls"][0]["function"]["arguments"] == '{"name": "oranges"'
    assert [call["function"]["name"] for call in both["message"]["tool_calls"]] == ["list_crates", "find_crate"]
    assert both["message"]["content"] == "Two at once."
    assert len({call["id"] for reply in replies[:3] for call in reply["choices"][0]["message"]["tool_calls"]}) == 4
    assert (last["finish_reason"], last["message"]) == ("stop", {"role": "assistant", "content": "Shelf 9C."})
    assert replies[0]["object"] == "chat.completion" and replies[0]["model"] == "m"

    [request, *_] = scripted_model.requests
    assert (request.session, request.path) == ("s1", "/v1/chat/completions")
    assert request.headers["authorization"] == "Bearer s1"
    assert request.messages == body["messages"] and request.tools == tools
    assert request.extra == {"temperature": 0.5}

    used_up = chat(body, authorization="Bearer s1")
    assert used_up.status_code == 500 and "used up" in used_up.json()["error"]["message"]
    assert len(scripted_model.requests) == 5 and len(scripted_model.unscripted) == 1


def test_the_scripted_model_fails_as_scripted(
    scripted_model: ScriptedModel, chat: Callable[..., httpx.Response]
) -> None:
    scripted_model.script(
        [
            error(429),
            error(503, "busy", headers={"Retry-After": "2"}),
            broken(),
            delay(0.3, then=error(500)),
            text("Fine."),
        ]
    )
    body = {"model": "m", "messages": []}
    assert chat(body).status_code == 429
    busy = chat(body)
    assert (busy.status_code, busy.text, busy.headers["retry-after"]) == (503, "busy", "2")
    cut_short = chat(body)
    assert cut_short.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        cut_short.json()
    started = time.monotonic()
    assert chat(body).status_code == 500
    assert time.monotonic() - started >= 0.3
    assert chat(body).json()["choices"][0]["message"]["content"] == "Fine."
    not_json = httpx.post(f"{scripted_model.base_url}/chat/completions", content=b"{", timeout=10)
    assert not_json.status_code == 400 and scripted_model.requests[-1].body is None


def test_each_session_walks_its_own_script(scripted_model: ScriptedModel, chat: Callable[..., httpx.Response]) -> None:
    scripted_model.script([text("first"), text("second")])
    scripted_model.script([text("mine")], session="special")
    replies: dict[str, list[str]] = {}

    def converse(session: str) -> None:
        body = {"model": "m", "messages": [], "user": session}
        replies[session] = [
            chat(body).json()["choices"][0]["message"]["content"] for _ in range(2 if session != "special" else 1)
        ]

    threads = [threading.Thread(target=converse, args=(f"episode-{n}",)) for n in range(16)]
    threads.append(threading.Thread(target=converse, args=("special",)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert replies.pop("special") == ["mine"]
    assert replies == {f"episode-{n}": ["first", "second"] for n in range(16)}
    assert not scripted_model.unscripted
    scripted_model.script([text("again")], session="special")
    assert chat({"model": "m", "messages": [], "user": "special"}).json()["choices"][0]["message"]["content"] == "again"


def test_the_cursor_walks_a_session_step_by_step_or_at_the_position_its_request_gives() -> None:
    cursor = ScriptCursor(default=lambda request: [text(f"default for {request.path}")])
    cursor.script("a", [text("one"), text("two")])
    a = Request("POST", "/a", {}, None, session="a")
    b = Request("POST", "/b", {}, None, session="b")

    assert [cursor.take(a), cursor.take(b), cursor.take(a)] == [text("one"), text("default for /b"), text("two")]
    with pytest.raises(ScriptUsedUp, match=r"session 'a' is used up: it has 2 step\(s\), and this .* step 3"):
        cursor.take(a)
    assert cursor.take(a, position=0) == text("one")
    with pytest.raises(ScriptUsedUp):
        cursor.take(a, position=2)
    assert cursor.requests == [a, b, a, a, a, a] and cursor.used_up == [a, a]

    cursor.script("a", [text("again")])
    assert cursor.take(a) == text("again")
    cursor.clear()
    assert cursor.requests == [] and cursor.take(a) == text("default for /a")
