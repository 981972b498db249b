"""The slime tier: this project's generate function and filter driven by slime's own code (``parse_args``,
``Dataset``, ``generate_and_rm_group``, the eval rollout, ``call_dynamic_filter``, the fully-async worker) and slime's
real ``OpenAIAdapter`` with Qwen3's tokenizer, against agent-env's real env server and a stand-in for SGLang's
``/generate``.

It runs inside the slime environment, with the packages on the path:

    PYTHONPATH=third_party python3.11 tools/envs/build_env.py slime
    PYTHONPATH=packages/chat_core:packages/slime_helper:packages/test_support:third_party:tools/envs:tests/gpu \\
        .venvs/slime/bin/python -m pytest tests/slime

The env server runs on the Python that ``ENV_SERVER_PYTHON`` names, by default the development virtualenv's
(``.venv/bin/python``), which has agent-env; slime's environment doesn't. Without slime's pin, outside the slime
environment of the current spec, or without that Python, the tier fails at once saying how to fix it.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_support.trainer_env import TierUnready, require_tier

try:
    SERVER_PYTHON = require_tier("slime", ["slime", "megatron-lm"])
except TierUnready as unready:
    raise pytest.UsageError(str(unready)) from None

import rollout_hooks
from async_rollout import FULLY_ASYNC, WatchedDataSource
from chat_core.prepare import write_rows
from launch import EVAL_SPLIT, THINKING_OFF, parse_slime_args, slime_command
from sglang_stand_in import StandInSGLang, by_task
from slime.observability.logging_utils import configure_logger
from slime.rollout import fully_async_rollout
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.processing_utils import load_tokenizer
from slime_helper import AdapterService
from test_support import ServedBundle, serve_bundle
from test_support.checkpoint import QWEN3_0_6B, family_checkpoint, weightless_checkpoint
from test_support.families import Family


@pytest.fixture(scope="session", autouse=True)
def slime_logging() -> None:
    """slime's logging, configured as its ``parse_args`` configures it, before any test captures logs: configuring
    it replaces the root logger's handlers, pytest's capture among them, once per process."""
    configure_logger()


@pytest.fixture(scope="session")
def env_server() -> Iterator[ServedBundle]:
    """The sample bundle served by agent-env's real server, on the Python that has agent-env."""
    with serve_bundle(python=SERVER_PYTHON) as served:
        yield served


@pytest.fixture(autouse=True)
def nothing_left_open(env_server: ServedBundle) -> Iterator[None]:
    """Each test ends with no episode or session left open on the server, and this process's adapter stopped."""
    yield
    AdapterService.reset()
    env_server.wait_until_closed()


@pytest.fixture(scope="session")
def rows(env_server: ServedBundle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of rows ``chat_core.prepare`` wrote from the server: ``all.jsonl`` and one file per eval."""
    out = tmp_path_factory.mktemp("rows") / "rows"
    asyncio.run(write_rows(env_server.url, out, progress=False))
    return out


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return weightless_checkpoint(tmp_path_factory.mktemp("hf") / "Qwen3-0.6B", QWEN3_0_6B)


@pytest.fixture(scope="session")
def tokenizer(checkpoint: Path):
    return load_tokenizer(str(checkpoint), trust_remote_code=True)


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Family], tuple[Path, Any]]:
    """Each model family's weightless checkpoint folder and its tokenizer as slime loads it, made once a session
    (GLM's takes seconds to load)."""
    made: dict[str, tuple[Path, Any]] = {}

    def checkpoint_of(family: Family) -> tuple[Path, Any]:
        if family.name not in made:
            folder = family_checkpoint(tmp_path_factory.mktemp("families") / family.name, family)
            made[family.name] = folder, load_tokenizer(str(folder), trust_remote_code=True)
        return made[family.name]

    return checkpoint_of


@pytest.fixture(scope="session")
def sglang_server(tokenizer, env_server: ServedBundle) -> Iterator[StandInSGLang]:
    with StandInSGLang(tokenizer, script_of=by_task(env_server)) as stand_in:
        yield stand_in


@pytest.fixture
def sglang(sglang_server: StandInSGLang, env_server: ServedBundle) -> Iterator[StandInSGLang]:
    """The stand-in for SGLang, playing each task's test_support script unless a test sets ``script_of``, in Qwen3's
    writing unless it sets ``writes``, with no walk, request or abort left from an earlier test."""
    yield sglang_server
    sglang_server.script_of = by_task(env_server)
    sglang_server.writes = None
    sglang_server.clear()


@pytest.fixture(scope="session")
def launch(
    checkpoint: Path, rows: Path, sglang_server: StandInSGLang, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Namespace]:
    """slime's arguments for a launch with this project's hooks, parsed once per variant: ``thinking=False`` adds
    ``--apply-chat-template-kwargs '{"enable_thinking": false}'``, ``tool_parser=False`` leaves out
    ``--sglang-tool-call-parser qwen25``, ``config`` (YAML text) is passed as ``--custom-config-path``, and ``extra``
    flags come last."""
    parsed: dict[tuple[bool, bool, str, tuple[str, ...]], Namespace] = {}

    def args(*, thinking: bool = True, tool_parser: bool = True, config: str = "", extra: tuple[str, ...] = ()):
        variant = (thinking, tool_parser, config, extra)
        if variant not in parsed:
            flags = [*([] if thinking else THINKING_OFF), *(["--sglang-tool-call-parser", "qwen25"] * tool_parser)]
            if config:
                path = tmp_path_factory.mktemp("config") / "custom.yaml"
                path.write_text(config)
                flags += ["--custom-config-path", str(path)]
            command = slime_command(
                checkpoint,
                (sglang_server.host, sglang_server.port),
                rows / "all.jsonl",
                {EVAL_SPLIT: rows / f"{EVAL_SPLIT}.jsonl"},
                *flags,
                *extra,
            )
            parsed[variant] = parse_slime_args(command)
        return parsed[variant]

    return args


@pytest.fixture
def own_generate_state() -> Iterator[None]:
    """slime's ``GenerateState`` is one per process, keeping the arguments it was first made with: the test sets aside
    the one the tier's other tests made, so that the rollout it runs makes its own, as in a training run, and puts it
    back at the end."""
    instances = type(GenerateState)._instances
    before = instances.pop(GenerateState, None)
    yield
    instances.pop(GenerateState, None)
    if before is not None:
        instances[GenerateState] = before


@pytest.fixture
def fully_async(launch, sglang, own_generate_state) -> Iterator[Callable[..., tuple]]:
    """A fully-async launch with the extra flags given, and slime's data source for it.

    slime's fully-async worker is one per process and outlives a rollout call: the test's end stops it, once the
    episodes it still has in flight have ended, so that the next test starts one afresh. The worker makes its own
    ``GenerateState`` (``own_generate_state``), as in a training run: its semaphore as large as the groups the worker
    keeps in flight, each of several episodes, so it fills and binds to the worker's event loop. What
    ``rollout_hooks`` kept is cleared first."""
    rollout_hooks.clear()

    def launched(*extra: str, config: str = "", thinking: bool = True) -> tuple:
        args = launch(extra=(*FULLY_ASYNC, *extra), config=config, thinking=thinking)
        return args, WatchedDataSource(args)

    yield launched
    worker = fully_async_rollout._global_worker
    fully_async_rollout._stop_global_worker()
    if worker is not None and worker.worker_thread is not None:
        worker.worker_thread.join(timeout=60)
        assert not worker.worker_thread.is_alive(), "slime's fully-async worker didn't stop"
