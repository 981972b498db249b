"""slime's side of the trainer helpers: a generate function that plays a row's episode through slime's own
``OpenAIAdapter`` and returns the adapter's training samples with the episode's reward, and the dynamic-sampling
filter that keeps unscored episodes out of training, and the reward post-processing that gives GRPO one advantage
per episode however many samples it comes back as. Rows and the episode loop are ``chat_core``'s, shared with
Miles' helper.

Launch flags: ``--custom-generate-function-path slime_helper.generate.generate --dynamic-sampling-filter-path
slime_helper.generate.keep_scored_groups --custom-reward-post-process-path
slime_helper.rewards.normalize_per_episode --input-key messages --metadata-key metadata --sglang-tool-call-parser
qwen25`` (the parser that fits the model). It imports slime, so it runs in slime's environment.
"""

from slime_helper.adapter import AdapterService, TemplateKwargsTokenizer
from slime_helper.errors import (
    MissingEpisodeNormalization,
    MissingFilter,
    MissingToolParser,
    SlimeSetupError,
    UnsupportedSlime,
)
from slime_helper.generate import generate, keep_scored_groups
from slime_helper.rewards import EpisodeRewardMismatch, normalize_per_episode

__all__ = [
    "AdapterService",
    "EpisodeRewardMismatch",
    "MissingEpisodeNormalization",
    "MissingFilter",
    "MissingToolParser",
    "SlimeSetupError",
    "TemplateKwargsTokenizer",
    "UnsupportedSlime",
    "generate",
    "keep_scored_groups",
    "normalize_per_episode",
]
