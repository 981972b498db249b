"""The Miles GPU run's command line (``tests/gpu/launches.py``) parsed on CPU by Miles' own ``parse_args``, as its
``train.py`` parses it, against a weightless Qwen3-4B checkpoint, with every function it names resolved by Miles' own
loader, the agent's abort hook included: what a GPU box would refuse at start-up, or after minutes of loading the
model, fails here instead."""

from __future__ import annotations

from argparse import Namespace
from unittest.mock import patch

import miles_helper
import pytest
from launches import MILES_AGENT, TRAIN_SPLIT, Run, function_paths, miles_args
from miles.utils.arguments import parse_args
from miles.utils.misc import load_function
from test_support.gpu_launch import check_evals, check_functions, ready_to_parse

EVAL = "happy"
GPUS = 4


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Namespace]:
    """The launch's arguments for a 4-GPU run whose rows hold a training split and one eval, and Miles' parse."""
    folder = tmp_path_factory.mktemp("miles-gpu-run")
    run = Run(model=folder / "Qwen3-4B", folder=folder, gpus=GPUS)
    ready_to_parse(run.model, run.rows, [TRAIN_SPLIT, EVAL])
    argv = miles_args(run)
    with patch("sys.argv", ["train.py", *argv]):
        return argv, parse_args()


def test_miles_takes_the_reference_grpo_settings(launch):
    _, args = launch

    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size) == (4, 8, 32)
    assert args.rollout_temperature == 1.1
    assert args.apply_chat_template_kwargs["enable_thinking"] is False
    assert (args.lr, args.lr_decay_style) == (1e-6, "constant")
    assert args.advantage_estimator == "grpo" and not args.use_kl_loss
    assert args.sglang_tool_call_parser == "qwen25"
    assert (args.use_session_server, args.tito_model) == (True, "qwen3")
    assert args.colocate and args.max_tokens_per_gpu == 4096 and args.use_dynamic_batch_size
    assert (args.actor_num_gpus_per_node, args.rollout_num_gpus) == (GPUS, GPUS)


def test_each_eval_split_is_evaluated_once_per_task_every_n_steps(launch):
    _, args = launch

    check_evals(args, [EVAL], Run.eval_every)


def test_miles_loader_resolves_every_function_the_launch_names_and_the_agents_abort_hook(launch):
    argv, args = launch
    paths = function_paths(argv)

    check_functions(args, paths, load_function)
    assert load_function(paths["--custom-rm-path"]) is miles_helper.reward
    assert load_function(paths["--dynamic-sampling-filter-path"]) is miles_helper.keep_scored_nonzero_std_groups
    assert load_function(paths["--custom-rollout-log-function-path"]) is miles_helper.log_rollout
    assert load_function(paths["--custom-eval-rollout-log-function-path"]) is miles_helper.log_eval_rollout
    assert paths["--custom-agent-function-path"] == MILES_AGENT
    assert load_function(f"{MILES_AGENT.rpartition('.')[0]}.abort") is miles_helper.abort
