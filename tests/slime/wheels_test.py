"""The shipped wheels in slime's environment, installed as a user installs them into slime's image: ``pip install
chat-core[slime]`` adds ``chat_core`` and ``slime_helper`` to a copy of the slime environment and moves none of its
packages, slime's own loader finds the generate function and filter in the installed wheels without pulling in
anything of the env server or of the tests, and the GPU command (``tests/gpu/run.py slime``) runs from them up to the
Ray job it submits. ``pip install env-replicas`` adds ``env_replicas`` and ``chat_core`` only, and its command runs
from them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from launches import Run, eval_splits, slime_args
from test_support.checkpoint import QWEN3_4B, weightless_checkpoint
from test_support.trainer_env import Installed, installed_wheels

FUNCTIONS = {
    "slime_helper.generate.generate": "slime_helper.generate.generate",
    "slime_helper.keep_scored_nonzero_std_groups": "slime_helper.filters.keep_scored_nonzero_std_groups",
    "slime_helper.rewards.normalize_per_episode": "slime_helper.rewards.normalize_per_episode",
    "slime_helper.log_rollout": "slime_helper.observability.log_rollout",
    "slime_helper.generate_rollout_fully_async": "slime_helper.fully_async.generate_rollout_fully_async",
}
GPUS = 4


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    with installed_wheels("chat-core[slime]", tmp_path_factory.mktemp("slime") / "env") as installed:
        yield installed


def test_the_slime_extra_adds_chat_core_and_slime_helper_only_and_moves_none_of_slimes_packages(installed):
    installed.check_adds_only(["chat-core", "slime-helper"])


def test_the_wheels_need_only_chat_core_and_what_it_talks_to_the_env_server_with(installed):
    installed.check_requirements("slime-helper")


def test_env_replicas_adds_itself_and_chat_core_only_and_its_command_runs_from_the_wheels(tmp_path: Path):
    with installed_wheels("env-replicas", tmp_path / "env") as replicas:
        replicas.check_adds_only(["chat-core", "env-replicas"])
        replicas.check_requirements("env-replicas")
        replicas.env.run("-m", "env_replicas", "up", "--help")


def test_slimes_loader_finds_the_generate_function_and_filter_in_the_installed_wheels(installed):
    loaded = installed.load_from_wheels("slime.utils.misc", FUNCTIONS, ["chat_core", "slime_helper"])

    assert loaded == FUNCTIONS


def test_the_gpu_command_writes_the_rows_and_submits_slimes_train_py_with_the_launch_arguments(
    installed, tmp_path: Path
):
    model = weightless_checkpoint(tmp_path / "Qwen3-4B", QWEN3_4B).resolve()
    out = tmp_path / "run"
    runtime_env, train = installed.gpu_job(
        "slime", tmp_path, GPUS, "--model", str(model), "--out", str(out),
        "--trainer-dir", "/opt/slime", "--megatron-dir", "/opt/Megatron-LM", "--", "--attention-backend", "unfused",
    )  # fmt: skip

    assert runtime_env["env_vars"]["PYTHONPATH"] == "/opt/Megatron-LM"
    run = Run(model=model, folder=out, gpus=GPUS)
    assert train == [
        str(installed.env.python),
        "/opt/slime/train.py",
        *slime_args(run),
        "--attention-backend",
        "unfused",
    ]
    assert eval_splits(run.rows) == ["happy"]
    assert (out / "slime-episodes.yaml").read_text() == "episode_max_turns: 4\n"
