"""The shipped wheels in Miles' environment, installed as a user installs them into Miles' image: ``pip install
chat-core[miles]`` adds ``chat_core`` and ``miles_helper`` to a copy of the Miles environment and moves none of its
packages, Miles' own loader finds the agent, its abort hook, the reward and the filter in the installed wheels
without pulling in anything of the env server or of the tests, and the GPU command (``tests/gpu/run.py miles``) runs
from them up to the Ray job it submits. ``pip install env-replicas`` adds ``env_replicas`` and ``chat_core`` only, and
its command runs from them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from launches import Run, eval_splits, miles_args
from test_support.checkpoint import QWEN3_4B, weightless_checkpoint
from test_support.trainer_env import Installed, installed_wheels

GPU = Path(__file__).resolve().parents[1] / "gpu"

FUNCTIONS = {
    "miles_helper.agent.run": "miles_helper.agent.make_agent.<locals>.agent",
    "miles_helper.agent.abort": "miles_helper.agent.abort",
    "miles_helper.reward": "miles_helper.scoring.reward",
    "miles_helper.keep_scored_nonzero_std_groups": "miles_helper.scoring.keep_scored_nonzero_std_groups",
    "miles_helper.log_rollout": "miles_helper.observability.log_rollout",
}
GPUS = 4


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    with installed_wheels("chat-core[miles]", tmp_path_factory.mktemp("miles") / "env") as installed:
        yield installed


def test_the_miles_extra_adds_chat_core_and_miles_helper_only_and_moves_none_of_miles_packages(installed):
    installed.check_adds_only(["chat-core", "miles-helper"])


def test_the_wheels_need_only_chat_core_and_what_it_talks_to_the_env_server_with(installed):
    installed.check_requirements("miles-helper")


def test_env_replicas_adds_itself_and_chat_core_only_and_its_command_runs_from_the_wheels(tmp_path: Path):
    with installed_wheels("env-replicas", tmp_path / "env") as replicas:
        replicas.check_adds_only(["chat-core", "env-replicas"])
        replicas.check_requirements("env-replicas")
        replicas.env.run("-m", "env_replicas", "up", "--help")


def test_miles_loader_finds_the_agent_abort_reward_and_filter_in_the_installed_wheels(installed):
    loaded = installed.load_from_wheels("miles.utils.misc", FUNCTIONS, ["chat_core", "miles_helper"])

    assert loaded == FUNCTIONS


def test_the_gpu_command_writes_the_rows_and_submits_miles_train_py_with_the_launch_arguments(
    installed, tmp_path: Path
):
    model = weightless_checkpoint(tmp_path / "Qwen3-4B", QWEN3_4B).resolve()
    out = tmp_path / "run"
    runtime_env, train = installed.gpu_job(
        "miles", tmp_path, GPUS, "--model", str(model), "--out", str(out),
        "--trainer-dir", "/opt/miles",
    )  # fmt: skip

    assert runtime_env["env_vars"]["PYTHONPATH"] == str(GPU.resolve())
    run = Run(model=model, folder=out, gpus=GPUS)
    assert train == [str(installed.env.python), "/opt/miles/train.py", *miles_args(run)]
    assert eval_splits(run.rows) == ["happy"]
