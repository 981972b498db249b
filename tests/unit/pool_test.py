"""A pool of env servers, played through real ``build_app`` servers on loopback and the scripted model: episodes
spread over the replicas within each one's session limit, each starting on the one with the fewest in flight, a
replica that dies is skipped and tried again once it is back, a server serving another bundle is refused before
anything plays, and rows prepared at one address play through the pool's addresses. ``check_same_bundle``, the
pool's check of a list of servers at once, passes servers of one bundle and names the first that serves another,
can't be reached or isn't an env server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from chat_core import (
    ENV_SERVERS_VARIABLE,
    ChatEndpoint,
    EpisodeResult,
    FlagKind,
    Limits,
    ServerMismatch,
    ServerUnreachable,
    play,
)
from chat_core.env.bundle import check_same_bundle
from chat_core.env.pool import EnvPool
from chat_core.prepare import write_rows
from test_support import SAMPLE_BUNDLE, SCRIPTS, ScriptedModel, ServedBundle, delay, serve_bundle, text
from test_support.waits import free_port, until

pytest_plugins = ["test_support.pytest_plugin"]

Rows = dict[str, dict[str, Any]]
SESSIONS = 2


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServedBundle]]:
    """Three servers of the sample bundle, two sessions each."""
    with ExitStack() as stack:
        yield [stack.enter_context(serve_bundle(max_concurrent_envs=SESSIONS)) for _ in range(3)]


@pytest.fixture
def pool(replicas: list[ServedBundle]) -> Iterator[list[ServedBundle]]:
    yield replicas
    for replica in replicas:
        replica.wait_until_closed()


@pytest.fixture(scope="module")
def rows(replicas: list[ServedBundle], tmp_path_factory: pytest.TempPathFactory) -> Rows:
    """The rows of the split ``all``, prepared through ``localhost``, an address the pool never names."""
    out = tmp_path_factory.mktemp("prepared") / "rows"
    asyncio.run(write_rows(replicas[0].url.replace("127.0.0.1", "localhost"), out, progress=False))
    lines = (out / "all.jsonl").read_text().splitlines()
    return {row["metadata"]["episode"]["task_name"]: row["metadata"] for row in map(json.loads, lines)}


@pytest.fixture
def other_bundle(tmp_path: Path) -> Path:
    """The sample bundle at another path with its first task renamed: another env version's task ids."""
    other = tmp_path / "sample-env"
    shutil.copytree(SAMPLE_BUNDLE, other)
    (other / "tasks" / "scores_zero.json").rename(other / "tasks" / "scores_nothing.json")
    return other


def _chat(model: ScriptedModel, session: str) -> ChatEndpoint:
    return ChatEndpoint(model.base_url + "/chat/completions", "policy", {"Authorization": f"Bearer {session}"})


def _urls(*servers: ServedBundle) -> list[str]:
    return [server.url for server in servers]


async def _played(
    metadata: dict[str, Any], model: ScriptedModel, steps: Any, session: str, servers: Sequence[str] = ()
) -> EpisodeResult:
    model.script(steps, session=session)
    return await play(metadata, _chat(model, session), {}, Limits(), env_servers=servers)


def test_episodes_spread_over_the_replicas_within_each_ones_sessions(
    pool: list[ServedBundle], rows: Rows, scripted_model: ScriptedModel
) -> None:
    servers = _urls(*pool)

    async def twelve_at_once() -> list[EpisodeResult]:
        return await asyncio.gather(
            *(_played(rows["reply_only"], scripted_model, SCRIPTS["reply_only"], f"e{n}", servers) for n in range(12))
        )

    results = asyncio.run(twelve_at_once())

    assert [(result.reward, result.flags) for result in results] == [(1.0, [])] * 12
    assert set(Counter(result.env_server for result in results)) == set(_urls(*pool))
    assert set(EnvPool.of(tuple(servers)).in_flight().values()) == {0}


def test_each_episode_starts_on_the_server_with_the_fewest_episodes_in_flight(
    pool: list[ServedBundle], rows: Rows, scripted_model: ScriptedModel
) -> None:
    # One episode stays in flight on one server while three play one after another: each of the three finds the
    # other server with none in flight, so all of them start there. Taking turns would send the second of them to the
    # busy server, and picking at random most likely one of them.
    servers = pool[:2]
    urls = _urls(*servers)

    async def three_beside_a_held_one() -> tuple[list[ServedBundle], list[EpisodeResult]]:
        held = asyncio.create_task(
            _played(rows["reply_only"], scripted_model, [delay(60, text("A banana."))], "held", urls)
        )
        await until(lambda: scripted_model.requests_of("held"), "the held episode asking the model")
        holding = [server for server in servers if server.open_episodes() == 1]
        later = [
            await _played(rows["reply_only"], scripted_model, SCRIPTS["reply_only"], f"next{n}", urls) for n in range(3)
        ]
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
        return holding, later

    holding, later = asyncio.run(three_beside_a_held_one())

    assert len(holding) == 1
    [free] = [server for server in servers if server is not holding[0]]
    assert [(result.reward, result.env_server) for result in later] == [(1.0, free.url)] * 3


def test_rows_prepared_at_another_address_play_through_the_pool(
    pool: list[ServedBundle], rows: Rows, scripted_model: ScriptedModel
) -> None:
    unreachable = {**rows["played"], "server": {**rows["played"]["server"], "url": f"http://127.0.0.1:{free_port()}"}}
    servers = _urls(*pool)

    for metadata, session in [(rows["played"], "localhost"), (unreachable, "elsewhere")]:
        result = asyncio.run(_played(metadata, scripted_model, SCRIPTS["played"], session, servers))

        assert (result.reward, result.flags) == (1.0, [])
        assert result.env_server in _urls(*pool)
    assert "localhost" in rows["played"]["server"]["url"]


def test_the_environment_variable_names_the_pool_unless_the_launch_does(
    pool: list[ServedBundle], rows: Rows, scripted_model: ScriptedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_SERVERS_VARIABLE, f"{pool[1].url}, {pool[2].url}")
    named = [pool[0].url]

    from_variable = asyncio.run(_played(rows["reply_only"], scripted_model, SCRIPTS["reply_only"], "var"))
    from_launch = asyncio.run(_played(rows["reply_only"], scripted_model, SCRIPTS["reply_only"], "launch", named))

    assert from_variable.scored and from_variable.env_server in _urls(pool[1], pool[2])
    assert from_launch.scored and from_launch.env_server == pool[0].url


def test_a_stale_row_is_refused_by_the_pool(
    pool: list[ServedBundle], rows: Rows, scripted_model: ScriptedModel
) -> None:
    stale = {**rows["played"], "episode": {**rows["played"]["episode"], "task_id": "@local/elsewhere/played"}}

    with pytest.raises(ServerMismatch, match="row is for '@local/elsewhere/played'"):
        asyncio.run(_played(stale, scripted_model, SCRIPTS["played"], "stale", _urls(*pool)))
    assert scripted_model.requests == []


def test_a_server_of_another_bundle_is_refused_at_start(
    pool: list[ServedBundle], rows: Rows, scripted_model: ScriptedModel, other_bundle: Path
) -> None:
    with serve_bundle(other_bundle) as served:
        servers = [pool[0].url, served.url]
        with pytest.raises(ServerMismatch) as refused:
            asyncio.run(_played(rows["played"], scripted_model, SCRIPTS["played"], "refused", servers))
        with pytest.raises(ServerMismatch):
            asyncio.run(_played(rows["reply_only"], scripted_model, SCRIPTS["reply_only"], "again", servers))

    assert served.url in str(refused.value) and pool[0].url in str(refused.value)
    assert "as task #0 of split 'all'" in str(refused.value)
    assert scripted_model.requests == []


def test_the_pools_check_passes_servers_of_one_bundle_and_names_the_first_that_differs(
    pool: list[ServedBundle], other_bundle: Path
) -> None:
    with serve_bundle(other_bundle) as served, pytest.raises(ServerMismatch) as differs:
        asyncio.run(check_same_bundle([*_urls(*pool), served.url]))

    asyncio.run(check_same_bundle(_urls(*pool)))
    theirs, ours = (f"'@local{bundle.resolve()}/adds_a_crate'" for bundle in (other_bundle, SAMPLE_BUNDLE))
    assert str(differs.value) == (
        f"{served.url} serves {theirs} as task #0 of split 'all', but {pool[0].url} serves {ours}: every server of "
        "the pool must serve the same bundle"
    )


def test_the_pools_check_names_a_server_that_cant_be_reached_or_isnt_an_env_server(
    pool: list[ServedBundle], scripted_model: ScriptedModel
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"

    with pytest.raises(ServerUnreachable, match=f"can't reach {nowhere}"):
        asyncio.run(check_same_bundle([pool[0].url, nowhere, scripted_model.url]))
    with pytest.raises(ServerMismatch, match=f"{scripted_model.url} can't serve the pool: .* isn't an OpenEnv server"):
        asyncio.run(check_same_bundle([pool[0].url, scripted_model.url]))


def test_a_replica_that_dies_is_skipped_and_tried_again_once_it_is_back(
    pool: list[ServedBundle], rows: Rows, scripted_model: ScriptedModel
) -> None:
    with ExitStack() as stack:
        doomed = stack.enter_context(serve_bundle(max_concurrent_envs=SESSIONS))
        servers = _urls(pool[0], doomed)

        async def killed_mid_run() -> tuple[list[EpisodeResult], list[EpisodeResult]]:
            slow = [delay(3, text("A banana."))]
            playing = [
                asyncio.create_task(_played(rows["reply_only"], scripted_model, slow, f"mid{n}", servers))
                for n in range(2)
            ]
            await until(lambda: all(scripted_model.requests_of(f"mid{n}") for n in range(2)), "both episodes playing")
            doomed.kill()
            during = await asyncio.gather(*playing)
            later = await asyncio.gather(
                *(
                    _played(rows["reply_only"], scripted_model, SCRIPTS["reply_only"], f"l{n}", servers)
                    for n in range(3)
                )
            )
            return during, later

        during, later = asyncio.run(killed_mid_run())
        back = stack.enter_context(serve_bundle(max_concurrent_envs=SESSIONS, port=doomed.port))
        again = asyncio.run(_played(rows["reply_only"], scripted_model, SCRIPTS["reply_only"], "again", servers))
        back.wait_until_closed()

    on_doomed = next(result for result in during if result.env_server == doomed.url)
    on_other = next(result for result in during if result.env_server == pool[0].url)
    assert not on_doomed.scored and [flag.kind for flag in on_doomed.flags] == [FlagKind.PROTOCOL_ERROR]
    assert "the session ended" in on_doomed.flags[0].message and "end_turn" in on_doomed.flags[0].message
    assert (on_other.reward, on_other.flags) == (1.0, [])
    assert [(result.reward, result.flags, result.env_server) for result in later] == [(1.0, [], pool[0].url)] * 3
    assert (again.reward, again.env_server) == (1.0, doomed.url)


@pytest.mark.parametrize(
    ("servers", "says"),
    [("http://node-a:8000", "a list of server URLs"), (["node-a:8000"], "isn't a server URL")],
)
def test_a_misnamed_pool_is_refused_up_front(nowhere_row: dict[str, Any], servers: Any, says: str) -> None:
    chat = ChatEndpoint("http://127.0.0.1:1/v1/chat/completions", "policy")

    with pytest.raises(ValueError, match=says):
        asyncio.run(play(nowhere_row, chat, {}, Limits(), env_servers=servers))


def test_a_deadline_out_of_range_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="env_call_deadline_s must be positive"):
        Limits(env_call_deadline_s=0)


def test_a_misnamed_server_in_the_variable_is_refused_up_front(
    nowhere_row: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_SERVERS_VARIABLE, "http://node-a:8000,node-b:8000")
    chat = ChatEndpoint("http://127.0.0.1:1/v1/chat/completions", "policy")

    with pytest.raises(ValueError, match="'node-b:8000' isn't a server URL"):
        asyncio.run(play(nowhere_row, chat, {}, Limits()))


@pytest.fixture
def nowhere_row() -> dict[str, Any]:
    """A row's metadata for a server that needn't exist, for what is refused before any server is asked."""
    return {
        "episode": {"split": "all", "index": 0, "task_id": "@local/x/played", "task_name": "played"},
        "server": {"url": "http://127.0.0.1:1", "env_name": "sample-env"},
        "tools": [],
    }
