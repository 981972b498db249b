"""slime's side of the trainer helpers: a generate function that plays a row's episode through slime's own
``OpenAIAdapter`` and returns the adapter's training samples with the episode's reward; dynamic-sampling filters that
keep unscored episodes (and, for GRPO, groups that all earned the same reward) out of training; the reward
post-processing that gives GRPO one advantage per episode however many samples it comes back as; and rollout-log
functions that put per-episode metrics into slime's own logger. Rows, the episode loop and the episode's outcome are
``chat_core``'s, shared with Miles' helper. It imports slime, so it runs in slime's environment.

Launch flags: ``--custom-generate-function-path slime_helper.generate.generate``, ``--dynamic-sampling-filter-path
slime_helper.keep_scored_nonzero_std_groups`` (or ``slime_helper.keep_scored_groups``),
``--custom-reward-post-process-path slime_helper.rewards.normalize_per_episode``,
``--custom-rollout-log-function-path slime_helper.log_rollout``, ``--custom-eval-rollout-log-function-path
slime_helper.log_eval_rollout``, ``--input-key messages --metadata-key metadata`` and ``--sglang-tool-call-parser
qwen25`` (the parser that fits the model); with slime's fully-async rollout (``train_async.py``), also
``--rollout-function-path slime_helper.generate_rollout_fully_async``.
"""

from chat_core import MissingFilter

from slime_helper.adapter import AdapterService
from slime_helper.errors import (
    AppendOnlyChatNeeded,
    FullyAsyncEvaluation,
    MissingEpisodeNormalization,
    MissingToolParser,
    PartialRolloutRefused,
    RolloutStarved,
    SlimeSetupError,
    UnappendableChat,
    UnfilteredFullyAsync,
    UnreadableToolCalls,
    UnsupportedSlime,
    UnsupportedTransformers,
)
from slime_helper.filters import keep_scored_groups, keep_scored_nonzero_std_groups
from slime_helper.fully_async import generate_rollout_fully_async
from slime_helper.generate import generate
from slime_helper.observability import log_eval_rollout, log_rollout
from slime_helper.rewards import EpisodeRewardMismatch, normalize_per_episode
from slime_helper.tokenizers import AppendOnlyTokenizer, WholeChatTokenizer

__all__ = [
    "AdapterService",
    "AppendOnlyChatNeeded",
    "AppendOnlyTokenizer",
    "EpisodeRewardMismatch",
    "FullyAsyncEvaluation",
    "MissingEpisodeNormalization",
    "MissingFilter",
    "MissingToolParser",
    "PartialRolloutRefused",
    "RolloutStarved",
    "SlimeSetupError",
    "UnappendableChat",
    "UnfilteredFullyAsync",
    "UnreadableToolCalls",
    "UnsupportedSlime",
    "UnsupportedTransformers",
    "WholeChatTokenizer",
    "generate",
    "generate_rollout_fully_async",
    "keep_scored_groups",
    "keep_scored_nonzero_std_groups",
    "log_eval_rollout",
    "log_rollout",
    "normalize_per_episode",
]
