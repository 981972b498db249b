"""chat_core against servers that answer as a broken or hostile one would: a chat endpoint, an env server's session and
its Task API writing bad framing, odd status lines, endless, huge or compressed bodies, floods, frames the protocol
forbids, bad TLS; and a server that stops. Each case ends flagged (``play``: never scored off a bad answer, never an
exception) or refused (``write_rows`` and ``prepare``'s command: one line, nothing in OUT), within a bound, with the
client's event loop never frozen and its memory bounded by the limit it was given.

The raw servers run in an event loop of their own (``test_support.raw_servers``), and each client runs in a loop of
its own watched from outside, so a client that froze would fail the test rather than hang it."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import chat_core.net.settings
import pytest
from chat_core import ChatEndpoint, EpisodeResult, FlagKind, Limits, OpenEnvError, play
from chat_core.net.env_socket import PING_INTERVAL_S, SEND_TIMEOUT_S, open_session
from chat_core.prepare.write import PrepareError, write_rows
from test_support import SCRIPTS, ScriptedModel, ServedBundle, delay, serve_bundle, text, tool_call
from test_support.raw_servers import (
    CLOSE,
    CONTINUATION,
    PING,
    TEXT,
    ServerThread,
    Watched,
    accept_websocket,
    frame,
    read_frame,
    watched,
)
from websockets.asyncio.server import ServerConnection, serve

pytest_plugins = ["test_support.pytest_plugin"]

MIB = 1 << 20
LIMIT = MIB
"""The answer and message limit the cases run with, so that memory bounded by the limit is told apart from memory
that grows with what the server sends."""
BOUND_S = 20.0
LIMITS = Limits(max_chat_answer_bytes=LIMIT, max_env_message_bytes=LIMIT)
MAX_STALL_S = 3.0
MAX_PEAK_BYTES = 24 * MIB
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(scope="module")
def played_row(sample_env_server: ServedBundle, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The metadata of the sample server's row ``played``."""
    out = tmp_path_factory.mktemp("hostile") / "rows"
    asyncio.run(write_rows(sample_env_server.url, out, progress=False))
    for line in (out / "all.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["metadata"]["episode"]["task_name"] == "played":
            return row["metadata"]
    raise AssertionError("the sample bundle has no task 'played'")


def bounded(result: Watched[Any]) -> None:
    """The client was never frozen and held no more than its limit's worth of memory."""
    assert result.longest_stall_s < MAX_STALL_S, f"the event loop stalled for {result.longest_stall_s:.2f} s"
    assert result.peak_bytes < MAX_PEAK_BYTES, f"the client held {result.peak_bytes / MIB:.0f} MiB at once"


def kinds(result: EpisodeResult) -> list[FlagKind]:
    return [flag.kind for flag in result.flags]


# The chat endpoint ------------------------------------------------------------------------------------------------


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """A request's head and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    return head + await reader.readexactly(length)


async def written(writer: asyncio.StreamWriter, parts: tuple[bytes, ...], then_forever: bytes | None) -> None:
    """Write ``parts``, then ``then_forever`` again and again for as long as the client reads."""
    for part in parts:
        writer.write(part)
        await writer.drain()
    while then_forever is not None:
        writer.write(then_forever)
        await writer.drain()


def answering(*parts: bytes, then_forever: bytes | None = None) -> Handler:
    """A server answering each request with ``parts``, then writing ``then_forever`` for as long as it is read."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await written(writer, parts, then_forever)

    return handler


def gzip_bomb(inflated: int) -> bytes:
    return gzip.compress(b"\0" * inflated, compresslevel=9)


BOMB = gzip_bomb(256 * MIB)
OK = b"HTTP/1.1 200 OK\r\n"
CHUNKED = OK + b"Transfer-Encoding: chunked\r\n\r\n"
GZIPPED = OK + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(BOMB)
NOT_ASCII = "HTTP/1.1 \uff12\uff10\uff10 OK\r\nContent-Length: 2\r\n\r\n{}".encode()
CHAT_CASES = {
    "a chunk size of -6": (answering(CHUNKED + b"-6\r\nhello\r\n0\r\n\r\n"), "chunk size"),
    "a chunk size that isn't hex": (answering(CHUNKED + b"zz\r\nhi\r\n"), "chunk size"),
    "status digits that aren't ASCII": (answering(NOT_ASCII), "status"),
    "a status line that isn't one": (answering(b"HELLO THERE\r\n\r\n"), "status"),
    "a head that never ends": (answering(OK, then_forever=b"X-Filler: " + b"a" * 100 + b"\r\n"), "MAX_HEADERS=128"),
    "a header line that never ends": (answering(OK + b"X-Filler: ", then_forever=b"a" * 4096), "MAX_HEAD_LINE_BYTES"),
    # Refused by its announced length alone: no byte of the body ever comes.
    "a body announced at 1 TiB": (
        answering(OK + b"Content-Length: 1099511627776\r\n\r\n"),
        "announced a body of 1099511627776 bytes, over max_chat_answer_bytes",
    ),
    "a body without end": (
        answering(OK + b"Connection: close\r\n\r\n", then_forever=b"a" * 4096),
        "max_chat_answer_bytes",
    ),
    "chunks without end": (
        answering(CHUNKED, then_forever=b"1000\r\n" + b"a" * 4096 + b"\r\n"),
        "max_chat_answer_bytes",
    ),
    "a gzip bomb": (answering(GZIPPED, BOMB), "max_chat_answer_bytes"),
}


@pytest.mark.parametrize("case", CHAT_CASES)
def test_a_chat_endpoint_answering_outside_http_fails_the_episodes_chat_at_once(
    case: str, raw_server_thread: ServerThread, sample_env: ServedBundle, played_row: dict[str, Any]
) -> None:
    handler, says = CHAT_CASES[case]
    chat = ChatEndpoint(f"http://127.0.0.1:{raw_server_thread.serve(handler)}/v1/chat/completions", "policy")

    result = watched(lambda: play(played_row, chat, {}, LIMITS), BOUND_S)

    assert kinds(result.value) == [FlagKind.SESSION_FAILED] and result.value.reward is None
    assert says in result.value.flags[0].message
    bounded(result)


def test_a_whole_answer_in_one_byte_chunks_is_read_without_stalling_the_loop(
    raw_server_thread: ServerThread, sample_env: ServedBundle, played_row: dict[str, Any]
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "find_crate", "arguments": '{"name": "pears"}'}}
    replies = [
        {"role": "assistant", "content": "a" * 1_000_000, "tool_calls": [call]},
        {"role": "assistant", "content": "The crate of pears is on shelf 9C."},
    ]
    bodies = [json.dumps({"choices": [{"message": reply, "finish_reason": "stop"}]}).encode() for reply in replies]
    chunked = iter(
        [b"".join(b"1\r\n" + body[i : i + 1] + b"\r\n" for i in range(len(body))) + b"0\r\n\r\n" for body in bodies]
    )

    async def one_byte_chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + next(chunked))
            await writer.drain()

    chat = ChatEndpoint(f"http://127.0.0.1:{raw_server_thread.serve(one_byte_chunks)}/v1/chat/completions", "policy")

    result = watched(lambda: play(played_row, chat, {}, LIMITS), BOUND_S, memory=False)

    assert result.value.scored and result.value.reward == 1.0, result.value.flags
    assert result.longest_stall_s < MAX_STALL_S, f"the event loop stalled for {result.longest_stall_s:.2f} s"


def test_a_chat_request_whose_kept_connection_closes_unanswered_is_not_sent_again(
    raw_server_thread: ServerThread, sample_env: ServedBundle, played_row: dict[str, Any]
) -> None:
    # slime's adapter may have recorded a turn whose answer was lost; sending it again would record it twice.
    received: list[bytes] = []
    first = {"id": "c1", "type": "function", "function": {"name": "find_crate", "arguments": '{"name": "pears"}'}}

    async def answers_once_then_hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await read_request(reader))
        body = json.dumps({"choices": [{"message": {"role": "assistant", "tool_calls": [first]}}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        received.append(await read_request(reader))

    chat = ChatEndpoint(
        f"http://127.0.0.1:{raw_server_thread.serve(answers_once_then_hangs_up)}/v1/chat/completions", "p"
    )

    result = watched(lambda: play(played_row, chat, {}, LIMITS), BOUND_S).value

    assert kinds(result) == [FlagKind.SESSION_FAILED] and result.model_retries == 0
    assert len(received) == 2


@pytest.mark.parametrize(
    ("host", "trusted", "says"),
    [("localhost", False, "CERTIFICATE_VERIFY_FAILED"), ("127.0.0.1", True, "IP address mismatch")],
    ids=["untrusted", "another host's certificate"],
)
def test_a_chat_endpoint_whose_tls_cant_be_trusted_fails_the_episodes_chat(
    host: str,
    trusted: bool,
    says: str,
    raw_server_thread: ServerThread,
    trusted_tls: ssl.SSLContext,
    monkeypatch: pytest.MonkeyPatch,
    sample_env: ServedBundle,
    played_row: dict[str, Any],
) -> None:
    if not trusted:
        monkeypatch.delenv("SSL_CERT_FILE")
        chat_core.net.settings.tls_context.cache_clear()
    port = raw_server_thread.serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"), tls=trusted_tls)
    chat = ChatEndpoint(f"https://{host}:{port}/v1/chat/completions", "policy")

    result = watched(lambda: play(played_row, chat, {}, LIMITS), BOUND_S).value

    assert kinds(result) == [FlagKind.SESSION_FAILED]
    assert says in result.flags[0].message


def test_a_chat_endpoint_whose_host_name_resolves_nowhere_fails_the_episodes_chat(
    sample_env: ServedBundle, played_row: dict[str, Any]
) -> None:
    chat = ChatEndpoint("http://model.invalid/v1/chat/completions", "policy")

    result = watched(lambda: play(played_row, chat, {}, LIMITS), BOUND_S).value

    assert kinds(result) == [FlagKind.SESSION_FAILED]
    assert "model.invalid" in result.flags[0].message


# The env server's session -----------------------------------------------------------------------------------------

FAKE_TASK = {"id": "fake", "name": "fake", "split": "all", "index": 0}


def fake_row(url: str) -> dict[str, Any]:
    return {
        "episode": {"split": "all", "index": 0, "task_id": "fake", "task_name": "fake"},
        "server": {"url": url, "env_name": "fake"},
        "tools": [],
    }


def observation(metadata: dict[str, Any] | None = None, **body: Any) -> bytes:
    data = {"observation": body, "reward": None, "done": False, "metadata": metadata or {}}
    return json.dumps({"type": "observation", "data": data}).encode()


STARTED = observation({"prompt": "Hi.", "system_prompt": None, "task": FAKE_TASK})
END_TURN_TOOL = {"name": "end_turn", "description": "End the turn.", "input_schema": {"type": "object"}}
TOOLS = observation(tools=[END_TURN_TOOL])


def env_session(then: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> Handler:
    """A raw env server: the handshake, a proper answer to the reset, then ``then`` for the rest."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accept_websocket(reader, writer)
        await read_frame(reader)
        writer.write(frame(TEXT, STARTED))
        await writer.drain()
        await then(reader, writer)
        await reader.read()

    return handler


def after_list_tools(*frames: bytes, then_forever: bytes | None = None) -> Handler:
    """An env session answering the first turn's ``list_tools`` with ``frames``, then writing ``then_forever`` for
    as long as it is read."""

    async def then(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader)
        await written(writer, frames, then_forever)

    return env_session(then)


PONGS_UNREAD = "pings while the model thinks, their pongs unread"
ENV_CASES = {
    "a frame announcing 2**63 - 1 bytes": (
        after_list_tools(frame(TEXT, b"", length=2**63 - 1)), "max_env_message_bytes"
    ),
    "fragments without end": (
        after_list_tools(frame(TEXT, b"[", final=False), then_forever=frame(CONTINUATION, b" " * 65536, final=False)),
        "max_env_message_bytes",
    ),
    "a ping over 125 bytes": (after_list_tools(frame(PING, b"p" * 200)), "close code 1002"),
    "a fragmented ping": (after_list_tools(frame(PING, b"p", final=False)), "close code 1002"),
    "text that isn't UTF-8": (after_list_tools(frame(TEXT, b'{"type": "\xff\xfe"}')), "close code 1007"),
    "a close code outside the protocol": (after_list_tools(frame(CLOSE, (999).to_bytes(2, "big"))), "close code 1002"),
    "a compressed frame no extension was agreed for": (
        after_list_tools(frame(TEXT, gzip_bomb(64 * MIB), rsv1=True)), "close code 1002"
    ),
    "a frame of an opcode outside the protocol": (after_list_tools(frame(0x3, b"{}")), "close code 1002"),
    "messages flooding in while the model thinks": (
        after_list_tools(frame(TEXT, TOOLS), then_forever=frame(TEXT, b'{"type": "noise"}' + b" " * 65536)),
        "isn't an observation",
    ),
    PONGS_UNREAD: (
        after_list_tools(frame(TEXT, TOOLS), then_forever=frame(PING, b"p" * 125)), "read nothing of the session"
    ),
    "a reset answered for another task": (
        after_list_tools(),
        "isn't this reset's answer",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ENV_CASES)
def test_an_env_session_answering_outside_the_protocol_ends_the_episode_flagged(
    case: str, raw_server_thread: ServerThread, scripted_model: ScriptedModel
) -> None:
    handler, says = ENV_CASES[case]
    if case == "a reset answered for another task":
        handler = _reset_answered_for(dict(FAKE_TASK, index=1))
    scripted_model.script([delay(3, text("Hello."))], session="fake")
    chat = ChatEndpoint(scripted_model.base_url + "/chat/completions", "policy", {"Authorization": "Bearer fake"})
    row = fake_row(f"http://127.0.0.1:{raw_server_thread.serve(handler)}")

    result = watched(lambda: play(row, chat, {}, LIMITS), 40.0)

    assert kinds(result.value) == [FlagKind.PROTOCOL_ERROR] and result.value.reward is None
    assert says in result.value.flags[0].message
    bounded(result)
    # Each case ends by chat_core's own bound for it (the close deadline once the protocol is broken, SEND_TIMEOUT_S
    # for pongs left unread), not by the keepalive ping that ends any stuck session after PING_INTERVAL_S.
    assert result.seconds < PING_INTERVAL_S + (SEND_TIMEOUT_S if case == PONGS_UNREAD else 0)


def _reset_answered_for(task: dict[str, Any]) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accept_websocket(reader, writer)
        await read_frame(reader)
        writer.write(frame(TEXT, observation({"prompt": "Hi.", "task": task})))
        await writer.drain()
        await reader.read()

    return handler


@pytest.mark.parametrize(
    ("url", "kind"),
    [("http://env.invalid:8000", FlagKind.ENV_UNREACHABLE), ("http://127.0.0.1:{port}", FlagKind.PROTOCOL_ERROR)],
    ids=["a host name that resolves nowhere", "an HTTP server that isn't an env server"],
)
def test_an_env_server_that_cant_open_a_session_ends_the_episode_flagged(
    url: str, kind: FlagKind, raw_server_thread: ServerThread, scripted_model: ScriptedModel
) -> None:
    port = raw_server_thread.serve(answering(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
    chat = ChatEndpoint(scripted_model.base_url + "/chat/completions", "policy")

    result = watched(lambda: play(fake_row(url.format(port=port)), chat, {}, LIMITS), BOUND_S).value

    assert kinds(result) == [kind]
    assert scripted_model.requests == []


def test_an_env_server_whose_tls_cant_be_trusted_is_unreachable(
    raw_server_thread: ServerThread, trusted_tls: ssl.SSLContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE")
    chat_core.net.settings.tls_context.cache_clear()
    port = raw_server_thread.serve(env_session(after_list_tools()), tls=trusted_tls)
    chat = ChatEndpoint("http://127.0.0.1:9/v1/chat/completions", "policy")

    result = watched(lambda: play(fake_row(f"https://localhost:{port}"), chat, {}, LIMITS), BOUND_S).value

    assert kinds(result) == [FlagKind.ENV_UNREACHABLE]
    assert "CERTIFICATE_VERIFY_FAILED" in result.flags[0].message


def test_an_env_server_that_never_answers_the_reset_ends_the_episode_at_the_call_deadline(
    raw_server_thread: ServerThread, scripted_model: ScriptedModel
) -> None:
    # The session opens and the reset is read, then nothing: without the deadline on the reset, only the client's
    # keepalive pings (unanswered for PING_INTERVAL_S + PING_TIMEOUT_S, 40 s) would end the wait.
    received: list[bytes] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accept_websocket(reader, writer)
        while True:
            received.append((await read_frame(reader))[1])

    chat = ChatEndpoint(scripted_model.base_url + "/chat/completions", "policy")
    row = fake_row(f"http://127.0.0.1:{raw_server_thread.serve(silent)}")

    result = watched(lambda: play(row, chat, {}, Limits(env_call_deadline_s=1)), 10.0).value

    assert kinds(result) == [FlagKind.ENV_DEADLINE] and result.reward is None
    assert "didn't answer reset within 1 s" in result.flags[0].message
    assert json.loads(received[0])["type"] == "reset"
    assert scripted_model.requests == []


def test_a_stopped_env_server_ends_its_episodes_within_a_minute(tmp_path: Path, scripted_model: ScriptedModel) -> None:
    # A paused VM or a partitioned node: the connection stays up and nothing answers, not even the client's pings.
    scripted_model.script([tool_call("wait_for_truck", {"seconds": 5}), *SCRIPTS["played"]], session="stopped")
    chat = ChatEndpoint(scripted_model.base_url + "/chat/completions", "policy", {"Authorization": "Bearer stopped"})

    with serve_bundle() as server:
        out = tmp_path / "rows"
        asyncio.run(write_rows(server.url, out, progress=False))
        row = next(
            json.loads(line)["metadata"]
            for line in (out / "all.jsonl").read_text().splitlines()
            if json.loads(line)["metadata"]["episode"]["task_name"] == "played"
        )

        async def stopped_mid_episode() -> EpisodeResult:
            playing = asyncio.create_task(play(row, chat, {}, Limits()))
            while len(scripted_model.requests_of("stopped")) < 1:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            os.killpg(server.process.pid, signal.SIGSTOP)
            try:
                return await playing
            finally:
                os.killpg(server.process.pid, signal.SIGCONT)

        result = watched(stopped_mid_episode, 60.0)

    assert kinds(result.value) == [FlagKind.PROTOCOL_ERROR]
    assert "stopped answering pings" in result.value.flags[0].message
    assert result.seconds < 60 < Limits().env_call_deadline_s


def test_a_session_whose_server_sent_more_than_asked_is_never_handed_to_the_next_episode(
    scripted_model: ScriptedModel,
) -> None:
    # The server ends the episode, then sends a stray frame: were the session parked and taken by the next episode,
    # that frame would be read as its reset's answer, and the episode scored without the model playing it.
    stray = json.dumps({"type": "observation", "data": {"observation": {}, "reward": 1.0, "done": True,
                                                         "metadata": {"task": FAKE_TASK}}})  # fmt: skip
    sessions = 0

    async def session(ws: ServerConnection) -> None:
        nonlocal sessions
        sessions += 1
        async for message in ws:
            kind = json.loads(message)["data"].get("type", "reset")
            if kind == "reset":
                await ws.send(STARTED.decode())
            elif kind == "list_tools":
                await ws.send(TOOLS.decode())
            else:
                ended = {"observation": {}, "reward": 0.0, "done": True, "metadata": {"task": FAKE_TASK}}
                await ws.send(json.dumps({"type": "observation", "data": ended}))
                await ws.send(stray)

    for name in ("first", "second"):
        scripted_model.script([text("Hello.")], session=name)

    async def two_episodes() -> list[EpisodeResult]:
        async with serve(session, "127.0.0.1", 0) as server:
            row = fake_row(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
            played = []
            for name in ("first", "second"):
                chat = ChatEndpoint(
                    scripted_model.base_url + "/chat/completions", "p", {"Authorization": f"Bearer {name}"}
                )
                played.append(await play(row, chat, {}, Limits()))
                await asyncio.sleep(0.2)
            return played

    first, second = watched(two_episodes, BOUND_S).value

    assert (first.reward, second.reward) == (0.0, 0.0)
    assert [len(scripted_model.requests_of(name)) for name in ("first", "second")] == [1, 1]
    assert sessions == 2


def test_reading_stays_paused_for_unread_messages_when_the_sessions_own_writes_drain(
    raw_server_thread: ServerThread,
) -> None:
    # The server floods messages nobody asked for, so the session stops reading at its queue's limit; meanwhile what
    # the session writes backs up (the server reads nothing for a second) and then drains. Reading must still wait
    # for the queue, or the flood pours into the process's memory while the episode waits on the model.
    flood = frame(TEXT, b" " * 65536)
    flooded_cap = 256 * MIB
    sent = 8 * MIB

    async def flooding_and_reading_late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accept_websocket(reader, writer)

        async def read_late() -> None:
            await asyncio.sleep(1.0)
            with contextlib.suppress(ConnectionError):
                while await reader.read(MIB):
                    pass

        reading = asyncio.create_task(read_late())
        for _ in range(flooded_cap // len(flood)):
            writer.write(flood)
            await writer.drain()
        await reading

    async def sends_while_flooded(port: int) -> None:
        session = await open_session(f"ws://127.0.0.1:{port}/ws", max_message_bytes=LIMIT)
        await asyncio.sleep(0.5)
        await session.send(b'"' + b"a" * (sent - 2) + b'"')
        await asyncio.sleep(1.5)
        await session.close()

    port = raw_server_thread.serve(flooding_and_reading_late)
    result = watched(lambda: sends_while_flooded(port), BOUND_S)

    # The message is held a few times over while it is framed and written; the flood would add up to 256 MiB.
    assert result.peak_bytes < MAX_PEAK_BYTES + 4 * sent, f"the client held {result.peak_bytes / MIB:.0f} MiB at once"


# The Task API, through prepare ------------------------------------------------------------------------------------

TASK_API_CASES = {
    "a chunk size of -6": answering(CHUNKED + b"-6\r\nhello\r\n0\r\n\r\n"),
    "status digits that aren't ASCII": answering(NOT_ASCII),
    "a body without end": answering(OK + b"Connection: close\r\n\r\n", then_forever=b"[" * 4096),
    "a gzip bomb": answering(GZIPPED, BOMB),
}


@pytest.mark.parametrize("case", TASK_API_CASES)
def test_a_task_api_answering_outside_http_stops_prepare_with_nothing_written(
    case: str, raw_server_thread: ServerThread, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{raw_server_thread.serve(TASK_API_CASES[case])}"

    async def prepared() -> OpenEnvError:
        with pytest.raises(OpenEnvError) as refused:
            await write_rows(url, tmp_path / "rows", progress=False, max_answer_bytes=LIMIT)
        return refused.value

    result = watched(prepared, BOUND_S)

    assert "\n" not in str(result.value) and url in str(result.value)
    assert not (tmp_path / "rows").exists() and list(tmp_path.iterdir()) == []
    bounded(result)


def test_prepares_command_refuses_a_task_api_answering_outside_http_in_one_line(
    raw_server_thread: ServerThread, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{raw_server_thread.serve(TASK_API_CASES['a gzip bomb'])}"

    done = subprocess.run(
        [sys.executable, "-m", "chat_core.prepare", url, str(tmp_path / "rows")],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("prepare: ")
    assert "max_answer_bytes" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_env_session_answering_a_probe_outside_the_protocol_stops_prepare_with_nothing_written(
    raw_server_thread: ServerThread, tmp_path: Path
) -> None:
    task = {"id": "fake", "name": "fake", "index": 0, "prompt": "Hi.", "system_prompt": None, "agent": "agent"}
    routes = {
        b"GET /list_environments": ["fake"],
        b"GET /fake/splits": [{"name": "all", "type": "validation"}],
        b"POST /fake/tasks": {"tasks": [task], "env_name": "fake"},
    }
    port = raw_server_thread.serve(_openenv(routes, after_list_tools(frame(TEXT, b"", length=2**40))))
    url = f"http://127.0.0.1:{port}"

    async def prepared() -> OpenEnvError:
        with pytest.raises(OpenEnvError) as refused:
            await write_rows(url, tmp_path / "rows", progress=False)
        return refused.value

    result = watched(prepared, BOUND_S)

    assert "max_env_message_bytes" in str(result.value) and "\n" not in str(result.value)
    assert list(tmp_path.iterdir()) == []
    bounded(result)


@pytest.mark.parametrize("name", ["{tmp}/escaped", "../escaped", ".hidden", ""])
def test_a_split_whose_name_isnt_a_file_name_in_out_stops_prepare_with_nothing_written(
    name: str, raw_server_thread: ServerThread, tmp_path: Path
) -> None:
    # Written as OUT/<split>.jsonl, an absolute name or one climbing out of OUT would write outside what the user
    # asked to create, and a hidden one where nobody looks.
    split = name.format(tmp=tmp_path)
    task = {"id": "fake", "name": "fake", "index": 0, "prompt": "Hi.", "system_prompt": None, "agent": "agent"}
    routes = {
        b"GET /list_environments": ["fake"],
        b"GET /fake/splits": [{"name": split, "type": "validation"}],
        b"POST /fake/tasks": {"tasks": [task], "env_name": "fake"},
    }

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accept_websocket(reader, writer)
        while True:
            asked = json.loads((await read_frame(reader))[1])["data"]
            started = {"prompt": "Hi.", "task": {"id": "fake", "split": asked.get("split"), "index": 0}}
            writer.write(frame(TEXT, TOOLS if asked.get("type") == "list_tools" else observation(started)))
            await writer.drain()

    url = f"http://127.0.0.1:{raw_server_thread.serve(_openenv(routes, session))}"
    out = tmp_path / "out" / "rows"
    out.parent.mkdir()

    with pytest.raises(PrepareError, match="can't be a file name"):
        asyncio.run(write_rows(url, out, progress=False))
    assert [path.relative_to(tmp_path) for path in tmp_path.rglob("*")] == [Path("out")]


def _openenv(routes: dict[bytes, Any], session: Handler) -> Handler:
    """A raw OpenEnv server: the Task API answering ``routes`` (method and path to JSON), and its sessions played
    by ``session``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            route = b" ".join(request.split(b" ")[:2])
            if route == b"GET /ws":
                reader.feed_data(request)
                await session(reader, writer)
                return
            body = json.dumps(routes[route]).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    return handler
