"""chat_core's rows, written by ``python -m chat_core.prepare`` from agent-env's real server of the sample bundle: a
row per task of every split, with the first turn's tools, the same bytes every time, and nothing at OUT unless every
file was written. The refusals (OUT exists, a bad URL, nothing listening, a server that isn't OpenEnv, a server with
no task) each say why on stderr and write nothing."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import io
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from chat_core import ServerError
from chat_core.env.task_api import OpenEnvServer
from chat_core.episode_ref import EpisodeRef
from chat_core.prepare import write_rows
from chat_core.prepare.command import main
from test_support import SAMPLE_ENV, ServedBundle
from test_support.loopback import LoopbackServer, Request

pytest_plugins = ["test_support.pytest_plugin"]

WAREHOUSE_TOOLS = ["list_crates", "find_crate", "add_crate", "wait_for_truck", "end_turn"]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _prepare(url: str, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main([url, str(out)])
    return code, capsys.readouterr().err


@dataclass(frozen=True)
class Prepared:
    out: Path
    code: int
    err: str


@pytest.fixture(scope="module")
def prepared(sample_env_server: ServedBundle, tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    """The sample server's rows, written once for the module's tests to read."""
    out = tmp_path_factory.mktemp("prepared") / "rows"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([sample_env_server.url, str(out)])
    return Prepared(out, code, err.getvalue())


def test_a_row_per_task_of_every_split(sample_env: ServedBundle, prepared: Prepared) -> None:
    out = prepared.out

    assert prepared.code == 0, prepared.err
    assert sorted(path.name for path in out.iterdir()) == ["all.jsonl", "happy.jsonl"]
    for split in ("all", "happy"):
        rows, tasks = _rows(out / f"{split}.jsonl"), sample_env.tasks(split)
        assert f"split {split!r}: {len(tasks)} rows" in prepared.err
        assert [row["metadata"]["episode"] for row in rows] == [
            {"split": split, "index": task["index"], "task_id": task["id"], "task_name": task["name"]} for task in tasks
        ]
        for row, task in zip(rows, tasks, strict=True):
            assert row["messages"] == [
                {"role": "system", "content": task["system_prompt"]},
                {"role": "user", "content": task["prompt"]},
            ]
            assert row["metadata"]["server"] == {"url": sample_env.url, "env_name": SAMPLE_ENV}
            for tool in row["metadata"]["tools"]:
                assert tool["type"] == "function"
                assert sorted(tool["function"]) == ["description", "name", "parameters"]
                assert tool["function"]["parameters"]["type"] == "object"
    tools = {row["metadata"]["episode"]["task_name"]: row["metadata"]["tools"] for row in _rows(out / "all.jsonl")}
    names = {task: [tool["function"]["name"] for tool in listed] for task, listed in tools.items()}
    assert names == {
        "adds_a_crate": WAREHOUSE_TOOLS,
        "fails_after_the_turn": ["end_turn"],
        "played": WAREHOUSE_TOOLS,
        "reply_only": ["end_turn"],
        "scores_zero": ["end_turn"],
        "two_turns": ["end_turn"],
    }
    find_crate = tools["played"][1]["function"]
    assert find_crate["parameters"]["required"] == ["name"]
    assert find_crate["description"] == "The shelf a crate is on."


def test_rows_lead_back_to_their_episode(sample_env: ServedBundle, prepared: Prepared) -> None:
    row = _rows(prepared.out / "happy.jsonl")[0]

    episode = EpisodeRef.from_metadata(row["metadata"])

    assert (episode.split, episode.index, episode.server_url) == ("happy", 0, sample_env.url)
    assert episode.task_id == sample_env.tasks("happy")[0]["id"]


def test_the_same_server_gives_the_same_bytes(
    sample_env: ServedBundle, prepared: Prepared, tmp_path: Path, capsys
) -> None:
    again = tmp_path / "again"
    assert _prepare(sample_env.url, again, capsys)[0] == 0

    for name in ("all.jsonl", "happy.jsonl"):
        assert (again / name).read_bytes() == (prepared.out / name).read_bytes()


def test_one_session_probing_every_task_in_turn_writes_the_same_rows(
    sample_env: ServedBundle, prepared: Prepared, tmp_path: Path
) -> None:
    """A probe session resets task after task, each reset abandoning the episode before it: the rows are the same as
    with a session per worker, and the server holds nothing open afterwards (the fixture checks)."""
    asyncio.run(write_rows(sample_env.url, tmp_path / "rows", concurrency=1, progress=False))

    for name in ("all.jsonl", "happy.jsonl"):
        assert (tmp_path / "rows" / name).read_bytes() == (prepared.out / name).read_bytes()


def test_the_task_api_client_reads_the_server(sample_env: ServedBundle) -> None:
    async def read() -> tuple[Any, ...]:
        server = OpenEnvServer(sample_env.url + "/")
        with pytest.raises(ServerError) as refused:
            await server.tasks("nightly")
        return (
            await server.env_name(),
            await server.splits(),
            await server.tasks("all"),
            refused.value,
        )

    env_name, splits, tasks, refused = asyncio.run(read())

    assert (env_name, splits) == (SAMPLE_ENV, ["all", "happy"])
    assert [(task.index, task.name, task.id, task.prompt) for task in tasks] == [
        (task["index"], task["name"], task["id"], task["prompt"]) for task in sample_env.tasks()
    ]
    assert refused.status_code == 400


def test_an_existing_out_is_refused_and_left_alone(sample_env: ServedBundle, tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows"
    out.mkdir()
    (out / "all.jsonl").write_text("mine\n")

    code, err = _prepare(sample_env.url, out, capsys)

    assert code == 1
    assert "already exists" in err
    assert [path.name for path in out.iterdir()] == ["all.jsonl"]
    assert (out / "all.jsonl").read_text() == "mine\n"


def test_a_missing_parent_folder_is_refused(sample_env: ServedBundle, tmp_path: Path, capsys) -> None:
    code, err = _prepare(sample_env.url, tmp_path / "missing" / "rows", capsys)

    assert code == 1
    assert "isn't a folder" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://127.0.0.1/", "http://", "http://127.0.0.1:port"])
def test_a_bad_url_is_refused(url: str, tmp_path: Path, capsys) -> None:
    code, err = _prepare(url, tmp_path / "rows", capsys)

    assert code == 1
    assert "isn't a server URL" in err
    assert list(tmp_path.iterdir()) == []


def test_nothing_listening_is_refused(tmp_path: Path, capsys) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    code, err = _prepare(f"http://127.0.0.1:{port}", tmp_path / "rows", capsys)

    assert code == 1
    assert f"can't reach http://127.0.0.1:{port}" in err
    assert list(tmp_path.iterdir()) == []


def test_a_server_that_isnt_openenv_is_refused(tmp_path: Path, capsys) -> None:
    site = tmp_path / "site"
    site.mkdir()
    with _serving(functools.partial(SimpleHTTPRequestHandler, directory=site)) as url:
        code, err = _prepare(url, tmp_path / "rows", capsys)

    assert code == 1
    assert "isn't an OpenEnv server" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["site"]


def test_a_server_with_no_task_is_refused(tmp_path: Path, capsys) -> None:
    # build_app refuses a bundle that serves no task, so a stand-in Task API with empty splits plays that server.
    with _TaskApi(tasks=[]) as server:
        code, err = _prepare(server.url, tmp_path / "rows", capsys)

    assert code == 1
    assert "serves no task" in err
    assert list(tmp_path.iterdir()) == []


def test_a_failure_after_the_task_api_leaves_nothing(tmp_path: Path, capsys) -> None:
    # The stand-in lists a task but takes no WebSocket session, so the tools can't be probed after the listing.
    task = {"id": "@local/stub/one", "name": "one", "index": 0, "prompt": "Hi.", "system_prompt": None}
    with _TaskApi(tasks=[task]) as server:
        code, err = _prepare(server.url, tmp_path / "rows", capsys)

    assert code == 1
    assert "/ws" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("route", "status"), [("/list_environments", 200), ("/stub/splits", 500)])
def test_an_answer_nested_too_deeply_is_refused(route: str, status: int, tmp_path: Path, capsys) -> None:
    # Python's JSON parser raises RecursionError on this, where other text that isn't JSON gets a ValueError.
    with _TaskApi(tasks=[], deep=(route, status)) as server:
        code, err = _prepare(server.url, tmp_path / "rows", capsys)

    assert code == 1
    assert err.startswith(f"prepare: {server.url} answered GET {route}") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_a_concurrency_below_one_is_a_usage_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["http://127.0.0.1:1", str(tmp_path / "rows"), "--concurrency", "0"])

    assert exited.value.code == 2
    assert "isn't at least 1" in capsys.readouterr().err


def test_chat_core_loads_nothing_of_the_server() -> None:
    # chat_core runs in the trainer's environment, which has none of the env server's packages.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, chat_core, chat_core.prepare.command; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    roots = {name.split(".")[0] for name in ast.literal_eval(loaded)}
    assert roots & {"agent_env", "openenv", "openai", "fastapi", "uvicorn", "test_support"} == set()
    assert {"chat_core", "aiohttp", "websockets", "orjson", "tqdm"} <= roots


def test_the_episode_record_filters_and_metrics_load_no_network_client() -> None:
    # A trainer's filter and log functions run in processes that play no episode.
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, chat_core.record.filters, chat_core.record.metrics, chat_core.prepare.rows; "
            "print(sorted(sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    modules = set(ast.literal_eval(loaded))
    assert {name for name in modules if name.startswith("chat_core.")} == {
        "chat_core._wire",
        "chat_core.env",
        "chat_core.errors",
        "chat_core.env.protocol",
        "chat_core.episode_ref",
        "chat_core.prepare",
        "chat_core.prepare.rows",
        "chat_core.record",
        "chat_core.record.filters",
        "chat_core.record.metrics",
        "chat_core.record.outcome",
        "chat_core.record.results",
    }
    assert {name.split(".")[0] for name in modules} & {"aiohttp", "websockets", "ssl", "asyncio"} == set()


class _TaskApi(LoopbackServer):
    """A stand-in for an OpenEnv server's Task API, serving ``tasks`` as its only split, ``all``. ``deep``, a GET
    route and a status, makes the route answer with that status and JSON nested too deeply to parse."""

    def __init__(self, tasks: list[dict[str, Any]], deep: tuple[str, int] | None = None):
        self._answers = {
            ("GET", "/list_environments"): (200, ["stub"]),
            ("GET", "/stub/splits"): (200, [{"name": "all", "type": "validation"}]),
            ("POST", "/stub/tasks"): (200, {"tasks": tasks, "env_name": "stub"}),
        }
        if deep is not None:
            route, status = deep
            self._answers["GET", route] = (status, "[" * 100_000 + "]" * 100_000)
        super().__init__(name="task-api")

    def respond(self, request: Request) -> tuple[int, Any]:
        return self._answers.get((request.method, request.path), (404, {"detail": "Not Found"}))


@contextlib.contextmanager
def _serving(handler: Any) -> Iterator[str]:
    """An HTTP server with ``handler`` on a free loopback port for the ``with`` body, which gets its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
