"""slime launched as a user would, for the slime tier and the demo: slime's own ``parse_args`` over a realistic
command line naming this project's generate function, filter and reward post-processing.

The model flags are Qwen3-0.6B's, so the ``--hf-checkpoint`` folder is a weightless one holding
``test_support.checkpoint.QWEN3_0_6B`` (slime's argument check requires the two to match).
"""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

QWEN3_0_6B_FLAGS = [
    "--num-layers", "28", "--hidden-size", "1024", "--ffn-hidden-size", "3072", "--num-attention-heads", "16",
    "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--use-rotary-position-embeddings",
    "--disable-bias-linear", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "1000000",
    "--vocab-size", "151936", "--kv-channels", "128", "--qk-layernorm",
]  # fmt: skip
HELPER_FLAGS = [
    "--custom-generate-function-path", "slime_helper.generate.generate",
    "--dynamic-sampling-filter-path", "slime_helper.keep_scored_groups",
    "--custom-reward-post-process-path", "slime_helper.rewards.normalize_per_episode",
    "--input-key", "messages",
    "--metadata-key", "metadata",
]  # fmt: skip
EVAL_SPLIT = "happy"
THINKING_OFF = ["--apply-chat-template-kwargs", '{"enable_thinking": false}']


def slime_command(
    checkpoint: Path, router: tuple[str, int], train: Path, evals: dict[str, Path], *extra: str
) -> list[str]:
    """The command line of a rollout-only slime run of Qwen3-0.6B on the rows ``train`` and the eval rows
    ``evals`` (name → file), with the SGLang router at ``router`` and this project's generate function and
    filter."""
    eval_data = [item for name, path in evals.items() for item in (name, str(path))]
    return [
        "train.py",
        *QWEN3_0_6B_FLAGS,
        "--hf-checkpoint", str(checkpoint),
        *HELPER_FLAGS,
        "--prompt-data", str(train),
        *(["--eval-prompt-data", *eval_data] if eval_data else []),
        "--sglang-router-ip", router[0],
        "--sglang-router-port", str(router[1]),
        "--rollout-max-context-len", "8192",
        "--rollout-max-response-len", "1024",
        "--rollout-temperature", "0.8",
        "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2",
        "--global-batch-size", "8",
        "--num-rollout", "1",
        "--rollout-num-gpus-per-engine", "1",
        "--rollout-num-gpus", "1",
        "--actor-num-nodes", "1",
        "--actor-num-gpus-per-node", "1",
        "--debug-rollout-only",
        *extra,
    ]  # fmt: skip


def parse_slime_args(command: list[str]) -> Namespace:
    """slime's own ``parse_args`` over ``command`` (argv, program name first), as ``train.py`` runs it."""
    from slime.utils.arguments import parse_args

    saved = sys.argv
    sys.argv = list(command)
    try:
        return parse_args()
    finally:
        sys.argv = saved
