"""The slime GPU run's command line (``tests/gpu/launches.py``) parsed on CPU by slime's own ``parse_args``, as its
``train.py`` parses it, against a weightless Qwen3-4B checkpoint, with every function it names resolved by slime's
own loader: what a GPU box would refuse at start-up, or after minutes of loading the model, fails here instead."""

from __future__ import annotations

from argparse import Namespace

import pytest
from launch import parse_slime_args
from launches import MAX_TURNS, TRAIN_SPLIT, Run, function_paths, slime_args, write_slime_config
from slime.utils.misc import load_function
from slime_helper import AdapterService, keep_scored_nonzero_std_groups, log_eval_rollout, log_rollout
from slime_helper.generate import episode_limits, generate
from slime_helper.rewards import normalize_per_episode
from test_support.gpu_launch import check_evals, check_functions, ready_to_parse

EVAL = "happy"
GPUS = 4


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Namespace]:
    """The launch's arguments for a 4-GPU run whose rows hold a training split and one eval, and slime's parse."""
    folder = tmp_path_factory.mktemp("slime-gpu-run")
    run = Run(model=folder / "Qwen3-4B", folder=folder, gpus=GPUS)
    ready_to_parse(run.model, run.rows, [TRAIN_SPLIT, EVAL])
    write_slime_config(run)
    argv = slime_args(run)
    return argv, parse_slime_args(["train.py", *argv])


def test_slime_takes_the_reference_grpo_settings(launch):
    _, args = launch

    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size) == (4, 8, 32)
    assert args.rollout_temperature == 1.1
    assert args.apply_chat_template_kwargs == {"enable_thinking": False}
    assert (args.lr, args.lr_decay_style) == (1e-6, "constant")
    assert args.advantage_estimator == "grpo" and not args.use_kl_loss
    assert args.sglang_tool_call_parser == "qwen25"
    assert args.colocate and args.max_tokens_per_gpu == 4096 and args.use_dynamic_batch_size
    assert (args.actor_num_gpus_per_node, args.rollout_num_gpus) == (GPUS, GPUS)


def test_the_sft_checkpoint_loads_from_its_hugging_face_folder(launch):
    _, args = launch

    assert args.load == args.hf_checkpoint
    assert args.ref_load is None


def test_each_eval_split_is_evaluated_once_per_task_every_n_steps(launch):
    _, args = launch

    check_evals(args, [EVAL], Run.eval_every)


def test_the_adapter_renders_each_episode_append_only_so_an_episode_is_one_sample(launch):
    _, args = launch

    service = AdapterService.of(args)
    tokenizer = service.adapter.tokenizer
    assert service.append_only
    prompt = tokenizer.decode(tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}]))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_an_episode_plays_at_most_max_turns(launch):
    _, args = launch

    assert episode_limits(args).max_turns == MAX_TURNS


def test_slimes_loader_resolves_every_function_the_launch_names(launch):
    argv, args = launch
    paths = function_paths(argv)

    check_functions(args, paths, load_function)
    assert load_function(paths["--custom-generate-function-path"]) is generate
    assert load_function(paths["--dynamic-sampling-filter-path"]) is keep_scored_nonzero_std_groups
    assert load_function(paths["--custom-rollout-log-function-path"]) is log_rollout
    assert load_function(paths["--custom-eval-rollout-log-function-path"]) is log_eval_rollout
    assert load_function(paths["--custom-reward-post-process-path"]) is normalize_per_episode
