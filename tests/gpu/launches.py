"""The GPU runs' command lines, built only here: ``run.py`` launches them on a GPU box, and the slime and Miles tiers
parse them on CPU with each trainer's own ``parse_args`` and resolve every function they name, so a typo never
costs GPU time.

Both runs are GRPO on Qwen3-4B after an SFT warm start, on the rows ``python -m chat_core.prepare`` wrote from a served
bundle: 32 rollouts a step (4 prompts x 8), temperature 1.1, thinking off, lr 1e-6 constant, SGLang colocated with the
trainer, at most 4096 tokens per GPU in a training micro-batch, and an eval of each of the bundle's eval splits every
``eval_every`` steps with one sample per task, so the eval reward is a mean over episodes. slime trains with Megatron,
whose model flags are slime's ``scripts/models/qwen3-4B.sh``; Miles with its FSDP backend, whose arguments this
repository's Miles environment, which has no Megatron-LM, can parse. Neither loads a reference model (GRPO without a KL
term), so the SFT checkpoint is loaded straight from its Hugging Face folder, with no conversion to Megatron's format.

An episode plays at most ``MAX_TURNS`` env turns: slime's through the ``--custom-config-path`` YAML that
``slime_helper`` reads its episode bounds from, Miles' through the agent in ``miles_agent.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

TRAIN_SPLIT = "all"
MAX_TURNS = 4
"""Env turns an episode may play; one more ends it unscored (``chat_core.Limits.max_turns``)."""
MILES_AGENT = "miles_agent.run"
"""The Miles run's agent: ``miles_agent.py`` beside this module, which ``run.py`` puts on the job's path."""
SLIME_CONFIG = "slime-episodes.yaml"
_FILE_FLAGS = frozenset({"--custom-config-path"})

QWEN3_4B = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels", "128",
    "--qk-layernorm",
]  # fmt: skip
"""Qwen3-4B's shape as Megatron's model flags. slime checks them against the checkpoint's ``config.json``; the CPU
checks' weightless checkpoint holds ``test_support.checkpoint.QWEN3_4B``."""

THINKING_OFF = '{"enable_thinking": false}'


@dataclass(frozen=True)
class Run:
    """One GPU run: the SFT checkpoint ``model`` (a Hugging Face folder), the run's ``folder`` (``rows/`` as
    ``chat_core.prepare`` writes them, and the files the launch names), ``gpus`` on the one node, ``steps`` training
    steps and an eval every ``eval_every`` of them."""

    model: Path
    folder: Path
    gpus: int
    steps: int = 40
    eval_every: int = 10

    @property
    def rows(self) -> Path:
        return self.folder / "rows"


def write_slime_config(run: Run) -> Path:
    """Write the episode bounds that ``slime_args`` hands slime as ``--custom-config-path`` into the run's folder,
    and return the file."""
    config = run.folder / SLIME_CONFIG
    config.write_text(f"episode_max_turns: {MAX_TURNS}\n")
    return config


def eval_splits(rows: Path) -> list[str]:
    """The eval splits among the rows ``chat_core.prepare`` wrote: every split but the training one."""
    return sorted(path.stem for path in rows.glob("*.jsonl") if path.stem != TRAIN_SPLIT)


def slime_args(run: Run) -> list[str]:
    """The arguments of slime's ``train.py`` for ``run``, its generate function, filter and per-episode reward
    normalisation ``slime_helper``'s. The
    episode bounds file they name is ``write_slime_config``'s."""
    return [
        *QWEN3_4B,
        "--hf-checkpoint", str(run.model),
        "--load", str(run.model),
        "--custom-generate-function-path", "slime_helper.generate.generate",
        "--dynamic-sampling-filter-path", "slime_helper.keep_scored_nonzero_std_groups",
        "--custom-rollout-log-function-path", "slime_helper.log_rollout",
        "--custom-eval-rollout-log-function-path", "slime_helper.log_eval_rollout",
        "--custom-reward-post-process-path", "slime_helper.rewards.normalize_per_episode",
        "--custom-config-path", str(run.folder / SLIME_CONFIG),
        *_rollout(run),
        "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", "1",
        "--recompute-granularity", "full",
        "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        "--attention-softmax-in-fp32",
        "--sglang-mem-fraction-static", "0.7",
        *_placement(run),
    ]  # fmt: skip


def miles_args(run: Run) -> list[str]:
    """The arguments of Miles' ``train.py`` for ``run``: Miles' agentic generate function calling ``MILES_AGENT``,
    and ``miles_helper``'s reward and filter."""
    return [
        "--train-backend", "fsdp",
        "--hf-checkpoint", str(run.model),
        "--attn-implementation", "flash_attention_2",
        "--gradient-checkpointing",
        "--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate",
        "--custom-agent-function-path", MILES_AGENT,
        "--custom-rm-path", "miles_helper.reward",
        "--dynamic-sampling-filter-path", "miles_helper.keep_scored_nonzero_std_groups",
        "--custom-rollout-log-function-path", "miles_helper.log_rollout",
        "--custom-eval-rollout-log-function-path", "miles_helper.log_eval_rollout",
        "--use-session-server",
        "--tito-model", "qwen3",
        *_rollout(run),
        "--sglang-mem-fraction-static", "0.75",
        *_placement(run),
        "--num-gpus-per-node", str(run.gpus),
    ]  # fmt: skip


def function_paths(args: Sequence[str]) -> dict[str, str]:
    """The import path each ``--…-path`` flag in ``args`` gives, by flag, ``--custom-config-path`` (a file) aside:
    the functions the trainer will load."""
    return {
        flag: value
        for flag, value in pairwise(args)
        if flag.startswith("--") and flag.endswith("-path") and flag not in _FILE_FLAGS
    }


def _rollout(run: Run) -> list[str]:
    evals = [item for split in eval_splits(run.rows) for item in (split, str(run.rows / f"{split}.jsonl"))]
    return [
        "--prompt-data", str(run.rows / f"{TRAIN_SPLIT}.jsonl"),
        "--input-key", "messages",
        "--metadata-key", "metadata",
        "--rollout-shuffle",
        "--apply-chat-template-kwargs", THINKING_OFF,
        "--sglang-tool-call-parser", "qwen25",
        "--num-rollout", str(run.steps),
        "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "8",
        "--global-batch-size", "32",
        "--rollout-temperature", "1.1",
        "--rollout-max-context-len", "8192",
        "--rollout-max-response-len", "1024",
        *(["--eval-interval", str(run.eval_every), "--eval-prompt-data", *evals] if evals else []),
        "--n-samples-per-eval-prompt", "1",
        "--advantage-estimator", "grpo",
        "--entropy-coef", "0.0",
        "--eps-clip", "0.2",
        "--eps-clip-high", "0.28",
        "--optimizer", "adam",
        "--lr", "1e-6",
        "--lr-decay-style", "constant",
        "--weight-decay", "0.1",
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.98",
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", "4096",
    ]  # fmt: skip


def _placement(run: Run) -> list[str]:
    return [
        "--actor-num-nodes", "1",
        "--actor-num-gpus-per-node", str(run.gpus),
        "--rollout-num-gpus-per-engine", "1",
        "--colocate",
    ]  # fmt: skip
